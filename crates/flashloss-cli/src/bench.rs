//! `flashloss bench`: one run printed as a table (and optionally written as JSON), or
//! a sharded run whose ranks' numbers are printed as JSON lines.

use crate::collective::{self, CollectiveKind, Ranks, threads_per_rank, with_threads};
use flashloss_tools::bench::{self, BenchConfig, BenchReport};
use flashloss_tools::{Result, config_file, sharded_bench};
use indicatif::{ProgressBar, ProgressStyle};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// Runs the command.
pub fn run(
    config: &Path,
    overrides: &[String],
    json: Option<PathBuf>,
    threads: Option<usize>,
    ranks: Option<usize>,
    collective: CollectiveKind,
) -> ExitCode {
    if collective == CollectiveKind::Nccl {
        eprintln!(
            "error: bench has no NCCL mode; `--set device=cuda` benchmarks GPU 0, and \
             `--collective nccl` belongs to gradcheck"
        );
        return ExitCode::from(2);
    }
    let ranks = match Ranks::new(collective, ranks) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let cfg = config_file::load::<BenchConfig>(config, overrides);
    match ranks {
        Ranks::Single => single(cfg, threads, json),
        Ranks::InProcess(ranks) => {
            let per_rank = threads_per_rank(threads, ranks);
            let benches = cfg.and_then(|cfg| sharded_bench::run(&cfg, ranks, per_rank));
            print_rank_benches(benches, json)
        }
        Ranks::Mpi => mpi(cfg, threads, json),
        Ranks::Nccl => unreachable!("bench returned on --collective nccl above"),
    }
}

/// One run with a progress bar; the table, and the report as JSON to `json`.
fn single(cfg: Result<BenchConfig>, threads: Option<usize>, json: Option<PathBuf>) -> ExitCode {
    let bar = ProgressBar::new(0).with_style(
        ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} steps").expect("template"),
    );
    // A stage (total 0) is a line on stderr at once, whether or not the bar is drawn.
    let mut progress = |label: &str, done: usize, total: usize| {
        if total == 0 {
            bar.suspend(|| eprintln!("bench: {label}"));
            return;
        }
        bar.set_length(total as u64);
        bar.set_position(done as u64);
        bar.set_message(label.to_string());
    };
    let report = cfg.and_then(|cfg| with_threads(threads, || bench::run(&cfg, &mut progress)));
    bar.finish_and_clear();
    let report = match report {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    print_bench(&report);
    if let Some(path) = json {
        let text = serde_json::to_string_pretty(&report).expect("serializable");
        if let Err(e) = std::fs::write(&path, text + "\n") {
            eprintln!("error: cannot write {}: {e}", path.display());
            return ExitCode::from(2);
        }
    }
    ExitCode::SUCCESS
}

/// This process's rank of an `mpirun` job runs the sharded bench; rank 0 prints.
fn mpi(cfg: Result<BenchConfig>, threads: Option<usize>, json: Option<PathBuf>) -> ExitCode {
    let world = match collective::mpi(sharded_bench::TIMEOUT) {
        Ok(w) => w,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let threads = threads_per_rank(threads, world.local_ranks());
    let comm = world.comm();
    let benches = cfg.and_then(|cfg| sharded_bench::run_on(&cfg, comm, threads));
    if comm.rank() == 0 || benches.is_err() {
        print_rank_benches(benches, json)
    } else {
        ExitCode::SUCCESS
    }
}

/// Prints every rank's bench line (and writes them to `json` as an array).
fn print_rank_benches(
    benches: Result<Vec<sharded_bench::RankBench>>,
    json: Option<PathBuf>,
) -> ExitCode {
    let benches = match benches {
        Ok(b) => b,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    for b in &benches {
        println!("{}", serde_json::to_string(b).expect("serializable"));
    }
    if let Some(path) = json {
        let text = serde_json::to_string_pretty(&benches).expect("serializable");
        if let Err(e) = std::fs::write(&path, text + "\n") {
            eprintln!("error: cannot write {}: {e}", path.display());
            return ExitCode::from(2);
        }
    }
    ExitCode::SUCCESS
}

/// `widened (measured: widened 376.2, avx512bf16 219.4 GFLOP/s)` and the like.
pub(crate) fn bf16_choice_line(c: &flashloss::cpu::Bf16Choice) -> String {
    use flashloss::cpu::Bf16Reason;
    let by = match (c.by, c.rates) {
        (Bf16Reason::Measured, Some(r)) => format!(
            "auto, measured: widened {:.1}, avx512bf16 {:.1} GFLOP/s",
            r.widened_gflops, r.avx512bf16_gflops
        ),
        (Bf16Reason::Environment, _) => format!("auto, {}", flashloss::cpu::BF16_PRODUCTS_ENV),
        (Bf16Reason::NoAvx512Bf16, _) => "auto, no AVX512-BF16".into(),
        (Bf16Reason::Option, _) | (Bf16Reason::Measured, None) => "the option".into(),
    };
    format!("{} ({by})", c.runs.name())
}

fn mib(bytes: f64) -> String {
    format!("{:.1} MiB", bytes / (1024.0 * 1024.0))
}

/// The table of a one-rank bench.
fn print_bench(report: &BenchReport) {
    for note in &report.notes {
        println!("note: {note}");
    }
    let Some(r0) = report.results.first() else {
        return;
    };
    let linear = r0.hidden.is_some();
    println!(
        "bench level={:?} loss={:?} N={} H={} V={} dtype={:?} threads={}",
        r0.level,
        r0.loss_kind,
        r0.tokens,
        r0.hidden.map_or("-".into(), |h| h.to_string()),
        r0.vocab,
        r0.dtype,
        r0.threads
    );
    if let Some(c) = r0.copy_gbytes_per_s {
        println!("copy bandwidth (same run): {c:.2} GB/s");
    }
    if let Some(g) = r0.gemm_gflops_per_s {
        println!("plain GEMM [N,H]x[H,V] (same run): {g:.1} GFLOP/s");
    }
    let bf16_rate = report.results.iter().find_map(|r| r.bf16_gemm_gflops_per_s);
    if let Some(g) = bf16_rate {
        println!(
            "bf16 product [N,H]x[H,V] on vdpbf16ps (same run; %gemm of a run on it): {g:.1} GFLOP/s"
        );
    }
    let (rate, share) = if linear {
        ("GFLOP/s", "%gemm")
    } else {
        ("GB/s", "%copy")
    };
    println!(
        "{:<10} {:>10} {:>10} {:>10} {:>14} {:>16} {:>10} {:>8} {:>14}",
        "impl", "median_s", "min_s", "max_s", "peak", "peak_above_io", rate, share, "loss"
    );
    for r in &report.results {
        let (value, reference) = if linear {
            (
                r.gflops_per_s,
                r.bf16_gemm_gflops_per_s.or(r.gemm_gflops_per_s),
            )
        } else {
            (r.gbytes_per_s, r.copy_gbytes_per_s)
        };
        let (value, reference) = (value.unwrap_or(f64::NAN), reference.unwrap_or(f64::NAN));
        println!(
            "{:<10} {:>10.4} {:>10.4} {:>10.4} {:>14} {:>16} {:>10.2} {:>7.1}% {:>14.7e}",
            r.implementation,
            r.step_seconds.median,
            r.step_seconds.min,
            r.step_seconds.max,
            mib(r.peak_bytes as f64),
            mib(r.peak_above_io_bytes as f64),
            value,
            100.0 * value / reference,
            r.loss
        );
        if let Some(p) = &r.plan {
            println!(
                "{:<10} plan: {} block_rows={} vocab_tile={} workspace={} gemm_reserve={}{}",
                "",
                if p.compact {
                    "compact"
                } else if p.single_pass {
                    "single_pass"
                } else {
                    "two_pass"
                },
                p.block_rows,
                p.vocab_tile,
                mib(p.workspace_bytes as f64),
                mib(p.gemm_reserve_bytes as f64),
                match p.bf16_products {
                    Some(products) => format!(" bf16_products={}", products.name()),
                    None => String::new(),
                }
            );
        }
        if let Some(c) = &r.bf16_choice {
            println!("{:<10} bf16_products: {}", "", bf16_choice_line(c));
        }
        if let Some(used) = r.device_used_bytes {
            println!(
                "{:<10} device: peak / floor = {:.3} (floor {}), cudaMemGetInfo in use {}",
                "",
                r.peak_bytes as f64 / r.io_bytes as f64,
                mib(r.io_bytes as f64),
                mib(used as f64)
            );
        }
    }
    let named = |name: &str| report.results.iter().find(|r| r.implementation == name);
    if let (Some(a), Some(b)) = (named("baseline"), named("fused")) {
        println!(
            "fused/baseline: time {:.3}x, peak {:.3}x, peak above io {:.3}x",
            b.step_seconds.median / a.step_seconds.median,
            b.peak_bytes as f64 / a.peak_bytes as f64,
            b.peak_above_io_bytes as f64 / a.peak_above_io_bytes as f64
        );
    }
}
