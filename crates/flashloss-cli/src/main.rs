//! `flashloss`: parses arguments, calls the library, prints. Nothing else.

use clap::{Parser, Subcommand};
use flashloss::tools::{config_file, gradcheck};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "flashloss", version, about = "Fused GRPO / cross-entropy loss kernels")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
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
        /// Worker threads (default: all cores).
        #[arg(long)]
        threads: Option<usize>,
    },
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

fn main() -> ExitCode {
    match Cli::parse().command {
        Command::Gradcheck {
            config,
            overrides,
            json,
            threads,
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
                println!("loss_ref             {:.9e}", report.loss_ref);
                println!("loss_kernel          {:.9e}", report.loss_kernel);
                println!("abs_diff_loss        {:.3e}", report.abs_diff_loss);
                println!("max_abs_diff_logp    {:.3e}", report.max_abs_diff_logp);
                println!("max_abs_diff_entropy {:.3e}", report.max_abs_diff_entropy);
                println!("max_abs_diff_dlogits {:.3e}", report.max_abs_diff_dlogits);
                println!("max_rel_diff_dlogits {:.3e}", report.max_rel_diff_dlogits);
                println!("kernel_seconds       {:.4}", report.kernel_seconds);
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
