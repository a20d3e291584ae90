//! `flashloss`: parses arguments, calls the library, prints. Nothing else.

use clap::{Parser, Subcommand, ValueEnum};
use flashloss::memory::TrackingAllocator;
use flashloss_tools::{bench, config_file, gradcheck, sharded_bench, sharded_check};
use indicatif::{ProgressBar, ProgressStyle};
use std::path::PathBuf;
use std::process::ExitCode;

#[global_allocator]
static ALLOCATOR: TrackingAllocator = TrackingAllocator;

#[derive(Parser)]
#[command(
    name = "flashloss",
    version,
    about = "Fused GRPO / cross-entropy loss kernels"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// GRPO training on candle (warm-up CE, then GRPO) with `loss.impl: baseline | fused | logits`;
    /// writes OUT_DIR/metrics.jsonl and checkpoints, and resumes from the last checkpoint.
    Train {
        /// YAML config (configs/train/*.yaml).
        #[arg(long)]
        config: PathBuf,
        /// Override a config key (`steps=20`, `out_dir=runs/x`, `loss.impl=baseline`).
        #[arg(long = "set", value_name = "KEY=VALUE")]
        overrides: Vec<String>,
    },
    /// Charts (PNG) and a markdown summary comparing training runs.
    Report {
        /// Run folders (each with metrics.jsonl), e.g. A and B of an A/B.
        #[arg(required = true)]
        runs: Vec<PathBuf>,
        /// Output folder.
        #[arg(long)]
        out: PathBuf,
    },
    /// Compare a kernel with the f64 reference on random inputs; exit 0 only if every gate passes.
    Gradcheck {
        /// YAML config (configs/gradcheck/*.yaml).
        #[arg(long)]
        config: PathBuf,
        /// Override a config key: --set loss.beta=0.04 (repeatable).
        #[arg(long = "set", value_name = "KEY=VALUE")]
        overrides: Vec<String>,
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
        /// Where the kernel runs: cpu, or cuda (a build with `--features cuda`); the
        /// same as `--set device=...`.
        #[arg(long)]
        device: Option<String>,
        /// Worker threads (default: all cores).
        #[arg(long)]
        threads: Option<usize>,
        /// Run the fused LM-head kernel sharded over P in-process ranks (config key
        /// `parallel`: token, vocab or 2d with `vocab_groups`) and compare each rank
        /// with a single-rank run; every rank prints one JSON line.
        #[arg(long)]
        ranks: Option<usize>,
        /// Engine of sharded runs: `mpi` makes every process of `mpirun -np P` a rank
        /// (needs a build with feature `mpi`); `in-process` runs `--ranks` threads;
        /// `nccl` runs one rank on GPU 0 whose collectives go through NCCL (needs a
        /// build with feature `cuda`).
        #[arg(long, value_enum, default_value_t = CollectiveKind::InProcess)]
        collective: CollectiveKind,
    },
    /// A/B of baseline and fused: step time, peak memory, achieved rates.
    Bench {
        /// YAML config (configs/bench/*.yaml).
        #[arg(long)]
        config: PathBuf,
        /// Override a config key (repeatable).
        #[arg(long = "set", value_name = "KEY=VALUE")]
        overrides: Vec<String>,
        /// Also write the results as JSON (one object per implementation) to this file.
        #[arg(long)]
        json: Option<PathBuf>,
        /// Worker threads (default: all cores; with ranks, per rank: the cores over the
        /// ranks on this machine).
        #[arg(long)]
        threads: Option<usize>,
        /// Shard the fused step over P in-process ranks (config keys `parallel`,
        /// `vocab_groups`, `batch`) and time it against one rank; one JSON line per rank.
        #[arg(long)]
        ranks: Option<usize>,
        /// Engine of sharded runs (see gradcheck).
        #[arg(long, value_enum, default_value_t = CollectiveKind::InProcess)]
        collective: CollectiveKind,
    },
}

/// Which collective engine runs the ranks.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum CollectiveKind {
    /// Ranks are threads of this process (`--ranks P`).
    InProcess,
    /// Ranks are the processes of an `mpirun` job.
    Mpi,
    /// One rank on GPU 0, exchanging through NCCL (a world of one).
    Nccl,
}

/// One rank's JSON line; the exit code it asks for (0 pass, 1 fail, 2 error).
fn print_rank(rank: usize, result: &flashloss_tools::Result<sharded_check::RankReport>) -> u8 {
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

/// `--ranks` with `--collective mpi`: an error (exit 2), since mpirun's -np sets the ranks.
fn ranks_under_mpi(ranks: Option<usize>) -> Option<ExitCode> {
    ranks.map(|_| {
        eprintln!("error: --ranks runs in-process ranks; under MPI the ranks are mpirun's -np");
        ExitCode::from(2)
    })
}

/// Threads per rank when `ranks` ranks share this machine's cores.
fn threads_per_rank(threads: Option<usize>, ranks: usize) -> usize {
    threads.unwrap_or_else(|| (rayon::current_num_threads() / ranks.max(1)).max(1))
}

/// Prints every rank's bench line (and writes them to `json` as an array).
fn print_rank_benches(
    benches: flashloss_tools::Result<Vec<sharded_bench::RankBench>>,
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

/// This process's rank of an `mpirun` job runs the sharded bench; rank 0 prints.
#[cfg(feature = "mpi")]
fn bench_mpi(
    cfg: flashloss_tools::Result<bench::BenchConfig>,
    threads: Option<usize>,
    json: Option<PathBuf>,
) -> ExitCode {
    use flashloss::collective::Collective;
    let runtime = match flashloss::collective::MpiRuntime::init() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let world = runtime.world(sharded_bench::TIMEOUT);
    let threads = threads_per_rank(threads, runtime.local_ranks());
    let benches = cfg.and_then(|cfg| sharded_bench::run_on(&cfg, &world, threads));
    if world.rank() == 0 || benches.is_err() {
        print_rank_benches(benches, json)
    } else {
        ExitCode::SUCCESS
    }
}

#[cfg(not(feature = "mpi"))]
fn bench_mpi(
    _: flashloss_tools::Result<bench::BenchConfig>,
    _: Option<usize>,
    _: Option<PathBuf>,
) -> ExitCode {
    eprintln!("error: --collective mpi needs a build with `--features mpi`");
    ExitCode::from(2)
}

/// This process's rank of an `mpirun` job runs the sharded gradcheck.
#[cfg(feature = "mpi")]
fn gradcheck_mpi(
    cfg: flashloss_tools::Result<gradcheck::GradcheckConfig>,
    threads: Option<usize>,
) -> u8 {
    let runtime = match flashloss::collective::MpiRuntime::init() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: {e}");
            return 2;
        }
    };
    let timeout = cfg
        .as_ref()
        .map_or(std::time::Duration::ZERO, sharded_check::timeout);
    let world = runtime.world(timeout);
    let result = cfg.and_then(|cfg| with_threads(threads, || sharded_check::run_on(&cfg, &world)));
    print_rank(flashloss::collective::Collective::rank(&world), &result)
}

#[cfg(not(feature = "mpi"))]
fn gradcheck_mpi(_: flashloss_tools::Result<gradcheck::GradcheckConfig>, _: Option<usize>) -> u8 {
    eprintln!("error: --collective mpi needs a build with `--features mpi`");
    2
}

/// A world of one NCCL rank on GPU 0 runs the sharded gradcheck.
#[cfg(feature = "cuda")]
fn gradcheck_nccl(
    cfg: flashloss_tools::Result<gradcheck::GradcheckConfig>,
    threads: Option<usize>,
) -> u8 {
    let world = flashloss::cuda::Gpu::new(0)
        .map(std::sync::Arc::new)
        .and_then(flashloss::collective::Nccl::solo);
    let result = world.map_err(Into::into).and_then(|world| {
        cfg.and_then(|cfg| with_threads(threads, || sharded_check::run_on(&cfg, &world)))
    });
    print_rank(0, &result)
}

#[cfg(not(feature = "cuda"))]
fn gradcheck_nccl(_: flashloss_tools::Result<gradcheck::GradcheckConfig>, _: Option<usize>) -> u8 {
    eprintln!("error: --collective nccl needs a build with `--features cuda`");
    2
}

fn with_threads<T: Send>(threads: Option<usize>, f: impl FnOnce() -> T + Send) -> T {
    match threads {
        Some(n) => rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build()
            .expect("thread pool")
            .install(f),
        None => f(),
    }
}

fn mib(bytes: f64) -> String {
    format!("{:.1} MiB", bytes / (1024.0 * 1024.0))
}

fn print_bench(report: &bench::BenchReport) {
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
            (r.gflops_per_s, r.gemm_gflops_per_s)
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
                "{:<10} plan: {} block_rows={} vocab_tile={} workspace={} gemm_reserve={}",
                "",
                if p.single_pass {
                    "single_pass"
                } else {
                    "two_pass"
                },
                p.block_rows,
                p.vocab_tile,
                mib(p.workspace_bytes as f64),
                mib(p.gemm_reserve_bytes as f64)
            );
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
    if let [a, b] = &report.results[..] {
        println!(
            "fused/baseline: time {:.3}x, peak {:.3}x, peak above io {:.3}x",
            b.step_seconds.median / a.step_seconds.median,
            b.peak_bytes as f64 / a.peak_bytes as f64,
            b.peak_above_io_bytes as f64 / a.peak_above_io_bytes as f64
        );
    }
}

/// Runs `flashloss train`, with a progress bar showing the last step's metrics.
fn train(config: &std::path::Path, overrides: &[String]) -> ExitCode {
    use flashloss_candle::train::{TrainConfig, Trainer};
    let trainer = config_file::load::<TrainConfig>(config, overrides)
        .map_err(|e| e.to_string())
        .and_then(|cfg| Trainer::new(cfg).map_err(|e| e.to_string()));
    let mut trainer = match trainer {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let bar = ProgressBar::new(trainer.total_steps() as u64).with_style(
        ProgressStyle::with_template("[{bar:30}] {pos}/{len} {msg}").expect("template"),
    );
    bar.set_position(trainer.done as u64);
    let result = trainer.run(|m| {
        bar.set_position(m.step as u64 + 1);
        let reward = m
            .reward_mean
            .map_or(String::new(), |r| format!(" reward {r:.3}"));
        bar.set_message(format!(
            "{} loss {:.4}{reward} {:.2}s",
            m.phase, m.loss, m.step_time_s
        ));
    });
    bar.finish();
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}

fn main() -> ExitCode {
    let mut cli = Cli::parse();
    if let Command::Gradcheck {
        device: Some(device),
        overrides,
        ..
    } = &mut cli.command
    {
        overrides.push(format!("device={device}"));
    }
    match cli.command {
        Command::Train { config, overrides } => train(&config, &overrides),
        Command::Report { runs, out } => match flashloss_candle::report::report(&runs, &out) {
            Ok(md) => {
                println!("{md}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::from(2)
            }
        },
        Command::Bench {
            config,
            overrides,
            json,
            threads,
            collective: CollectiveKind::Mpi,
            ranks,
        } => {
            if let Some(code) = ranks_under_mpi(ranks) {
                return code;
            }
            let cfg = config_file::load::<bench::BenchConfig>(&config, &overrides);
            bench_mpi(cfg, threads, json)
        }
        Command::Bench {
            collective: CollectiveKind::Nccl,
            ..
        } => {
            eprintln!(
                "error: bench has no NCCL mode; `--set device=cuda` benchmarks GPU 0, and \
                 `--collective nccl` belongs to gradcheck"
            );
            ExitCode::from(2)
        }
        Command::Bench {
            config,
            overrides,
            json,
            threads,
            ranks: Some(ranks),
            ..
        } => {
            let per_rank = threads_per_rank(threads, ranks);
            let benches = config_file::load::<bench::BenchConfig>(&config, &overrides)
                .and_then(|cfg| sharded_bench::run(&cfg, ranks, per_rank));
            print_rank_benches(benches, json)
        }
        Command::Bench {
            config,
            overrides,
            json,
            threads,
            ranks: None,
            ..
        } => {
            let bar = ProgressBar::new(0).with_style(
                ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} steps")
                    .expect("template"),
            );
            let mut progress = |label: &str, done: usize, total: usize| {
                bar.set_length(total as u64);
                bar.set_position(done as u64);
                bar.set_message(label.to_string());
            };
            let report = config_file::load::<bench::BenchConfig>(&config, &overrides)
                .and_then(|cfg| with_threads(threads, || bench::run(&cfg, &mut progress)));
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
        Command::Gradcheck {
            config,
            overrides,
            threads,
            collective: CollectiveKind::Mpi,
            ranks,
            ..
        } => {
            if let Some(code) = ranks_under_mpi(ranks) {
                return code;
            }
            let cfg = config_file::load::<gradcheck::GradcheckConfig>(&config, &overrides);
            ExitCode::from(gradcheck_mpi(cfg, threads))
        }
        Command::Gradcheck {
            config,
            overrides,
            threads,
            collective: CollectiveKind::Nccl,
            ranks,
            ..
        } => {
            if ranks.is_some_and(|r| r != 1) {
                eprintln!("error: --collective nccl runs a world of one rank (GPU 0)");
                return ExitCode::from(2);
            }
            let cfg = config_file::load::<gradcheck::GradcheckConfig>(&config, &overrides);
            ExitCode::from(gradcheck_nccl(cfg, threads))
        }
        Command::Gradcheck {
            config,
            overrides,
            threads,
            ranks: Some(ranks),
            ..
        } => {
            let results = config_file::load::<gradcheck::GradcheckConfig>(&config, &overrides)
                .and_then(|cfg| with_threads(threads, || sharded_check::run(&cfg, ranks)));
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
        Command::Gradcheck {
            config,
            overrides,
            json,
            threads,
            ranks: None,
            ..
        } => {
            let report = config_file::load::<gradcheck::GradcheckConfig>(&config, &overrides)
                .and_then(|cfg| with_threads(threads, || gradcheck::run(&cfg)));
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
    }
}
