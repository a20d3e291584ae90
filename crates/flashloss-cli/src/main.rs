//! `flashloss`: parses arguments, calls the library, prints. Nothing else. This file is
//! the table of subcommands and their flags; each subcommand's call-and-print is its
//! own module, and the ranks of sharded runs are built in [`collective`].

mod bench;
mod collective;
mod gradcheck;
mod plan;
mod train;

use clap::{Parser, Subcommand};
use collective::CollectiveKind;
use flashloss::memory::TrackingAllocator;
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
    /// The plan a call without a budget would take on a GPU (no device needed): mode,
    /// block rows, vocabulary tile, budget, peak against the unfused path's and the time
    /// the rate model predicts from the cuBLAS rates recorded on that GPU; JSON.
    Plan {
        /// A GPU with recorded rates: h100-80gb or h200.
        #[arg(long)]
        device: Option<String>,
        /// Device memory in GiB (instead of --device; no predicted time then).
        #[arg(long)]
        memory_gib: Option<f64>,
        /// Free memory in GiB when the call plans (default: the memory less the call's
        /// arguments and outputs).
        #[arg(long)]
        free_gib: Option<f64>,
        /// Rows (tokens).
        #[arg(long)]
        n: usize,
        /// Hidden size.
        #[arg(long)]
        h: usize,
        /// Vocabulary entries.
        #[arg(long)]
        v: usize,
        /// The head's dtype: bf16 or f32.
        #[arg(long, default_value = "bf16")]
        dtype: String,
        /// The loss: grpo or ce (token level, with the head's gradients).
        #[arg(long, default_value = "grpo")]
        loss: String,
        /// The mode: auto (the default call), auto_f32, two_pass, single_pass, compact.
        #[arg(long, default_value = "auto")]
        mode: String,
    },
}

fn main() -> ExitCode {
    match Cli::parse().command {
        Command::Train { config, overrides } => train::train(&config, &overrides),
        Command::Report { runs, out } => train::report(&runs, &out),
        Command::Gradcheck {
            config,
            overrides,
            json,
            device,
            threads,
            ranks,
            collective,
        } => gradcheck::run(&config, overrides, json, device, threads, ranks, collective),
        Command::Bench {
            config,
            overrides,
            json,
            threads,
            ranks,
            collective,
        } => bench::run(&config, &overrides, json, threads, ranks, collective),
        Command::Plan {
            device,
            memory_gib,
            free_gib,
            n,
            h,
            v,
            dtype,
            loss,
            mode,
        } => plan::run(flashloss::gpu_plan::query::QueryArgs {
            device,
            memory_gib,
            free_gib,
            n,
            h,
            v,
            dtype,
            loss,
            mode,
        }),
    }
}
