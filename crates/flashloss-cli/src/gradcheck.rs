//! `flashloss gradcheck`: one rank (text or `--json`), or a sharded run whose ranks
//! each print one JSON line. Exit 0 if every gate passed, 1 if one failed, 2 on error.

use crate::collective::{self, CollectiveKind, Ranks, with_threads};
use flashloss_tools::gradcheck::{self, GradcheckConfig};
use flashloss_tools::{Result, config_file, sharded_check};
use std::path::Path;
use std::process::ExitCode;

/// Runs the command; `device` is the same as `--set device=...`.
pub fn run(
    config: &Path,
    mut overrides: Vec<String>,
    json: bool,
    device: Option<String>,
    threads: Option<usize>,
    ranks: Option<usize>,
    collective: CollectiveKind,
) -> ExitCode {
    if let Some(device) = device {
        overrides.push(format!("device={device}"));
    }
    let ranks = match Ranks::new(collective, ranks) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let cfg = config_file::load::<GradcheckConfig>(config, &overrides);
    match ranks {
        Ranks::Single => single(cfg, json, threads),
        Ranks::InProcess(ranks) => in_process(cfg, ranks, threads),
        Ranks::Mpi => ExitCode::from(mpi(cfg, threads)),
        Ranks::Nccl => ExitCode::from(nccl(cfg, threads)),
    }
}

/// One rank: the report as text or one JSON object.
fn single(cfg: Result<GradcheckConfig>, json: bool, threads: Option<usize>) -> ExitCode {
    let mut note = |msg: &str| eprintln!("gradcheck: {msg}");
    let report = cfg.and_then(|cfg| with_threads(threads, || gradcheck::run_with(&cfg, &mut note)));
    let report = match report {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    if json {
        println!("{}", serde_json::to_string(&report).expect("serializable"));
    } else {
        println!("kernel         {}", report.kernel);
        println!("loss_ref       {:.9e}", report.loss_ref);
        println!("loss_kernel    {:.9e}", report.loss_kernel);
        println!("abs_diff_loss  {:.3e}", report.abs_diff_loss);
        println!("kernel_seconds {:.4}", report.kernel_seconds);
        if let Some(c) = &report.bf16_choice {
            println!("bf16_products  {}", crate::bench::bf16_choice_line(c));
        }
        for g in &report.gates {
            let verdict = if g.passed { "PASS" } else { "FAIL" };
            println!("{verdict} {:<8} {:.3e} <= {:.3e}", g.name, g.value, g.limit);
        }
    }
    if report.passed {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// `--ranks P` in-process ranks: every rank's line; the worst exit code.
fn in_process(cfg: Result<GradcheckConfig>, ranks: usize, threads: Option<usize>) -> ExitCode {
    let results = cfg.and_then(|cfg| with_threads(threads, || sharded_check::run(&cfg, ranks)));
    let results = match results {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let codes = results
        .iter()
        .enumerate()
        .map(|(rank, r)| print_rank(rank, r));
    ExitCode::from(codes.max().unwrap_or(0))
}

/// This process's rank of an `mpirun` job runs the sharded gradcheck.
fn mpi(cfg: Result<GradcheckConfig>, threads: Option<usize>) -> u8 {
    let timeout = cfg
        .as_ref()
        .map_or(std::time::Duration::ZERO, sharded_check::timeout);
    let world = match collective::mpi(timeout) {
        Ok(w) => w,
        Err(e) => {
            eprintln!("error: {e}");
            return 2;
        }
    };
    let comm = world.comm();
    let result = cfg.and_then(|cfg| with_threads(threads, || sharded_check::run_on(&cfg, comm)));
    print_rank(comm.rank(), &result)
}

/// A world of one NCCL rank on GPU 0 runs the sharded gradcheck.
fn nccl(cfg: Result<GradcheckConfig>, threads: Option<usize>) -> u8 {
    let timeout = cfg
        .as_ref()
        .map_or(std::time::Duration::ZERO, sharded_check::timeout);
    let world = match collective::nccl(timeout) {
        Ok(w) => w,
        Err(e) => {
            eprintln!("error: {e}");
            return 2;
        }
    };
    let result = world.map_err(Into::into).and_then(|world| {
        let comm = world.comm();
        cfg.and_then(|cfg| with_threads(threads, || sharded_check::run_on(&cfg, comm)))
    });
    print_rank(0, &result)
}

/// One rank's JSON line; the exit code it asks for (0 pass, 1 fail, 2 error).
fn print_rank(rank: usize, result: &Result<sharded_check::RankReport>) -> u8 {
    match result {
        Ok(report) => {
            println!("{}", serde_json::to_string(report).expect("serializable"));
            u8::from(!report.report.passed)
        }
        Err(e) => {
            let line = serde_json::json!({"rank": rank, "passed": false, "error": e.to_string()});
            println!("{line}");
            2
        }
    }
}
