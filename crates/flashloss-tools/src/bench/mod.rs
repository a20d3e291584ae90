//! `flashloss bench`: A/B of the baseline (the plain path a framework runs) against the
//! fused kernel, side by side in one run: step time (median, min, max), peak bytes in
//! use (tracking allocator) and the peak above inputs and outputs, and the rate against
//! a reference measured in the same run: memory copy bandwidth at logits level, the
//! plain `[N,H]×[H,V]` GEMM rate at LM-head level.

use crate::Result;
use crate::gradcheck::Backend;

pub(crate) mod config;
mod cpu;
pub(crate) mod inputs;
pub(crate) mod report;
pub(crate) mod step;

pub use config::{BenchConfig, Impl, Level, LossKind};
pub use report::{BenchReport, BenchResult, Timing, time_steps};

/// Runs the bench; `progress(label, done, total)` reports long runs (a stage with
/// `total` 0 is a note of what it is doing). The config and the memory plan are
/// checked first ([`BenchConfig::check_plan`]): on the CPU a baseline that cannot fit
/// is skipped with a note, and a fused run that cannot fit is an error, before any
/// input is drawn.
pub fn run(cfg: &BenchConfig, progress: &mut dyn FnMut(&str, usize, usize)) -> Result<BenchReport> {
    let baseline_fits = cfg.check_plan()?;
    let (common, baseline) = cfg.planned_bytes();
    progress(
        &format!(
            "{:?} {:?} N={} V={}{} {:?} on {:?}: drawing inputs (about {:.1} MiB, baseline {:.1} MiB more)",
            cfg.level,
            cfg.loss,
            cfg.tokens,
            cfg.vocab,
            if cfg.level == Level::Linear {
                format!(" H={}", cfg.hidden)
            } else {
                String::new()
            },
            cfg.dtype,
            cfg.device,
            common as f64 / 1048576.0,
            baseline as f64 / 1048576.0
        ),
        0,
        0,
    );
    match cfg.device {
        Backend::Cuda => crate::gpu_bench::run(cfg, progress),
        Backend::Cpu if !baseline_fits && cfg.implementation == Impl::Both => {
            let fused = BenchConfig {
                implementation: Impl::Fused,
                ..cfg.clone()
            };
            let mut report = cpu::run(&fused, progress)?;
            let note = format!(
                "baseline skipped: it needs about {:.1} GiB more than the fused run, and {:.1} GiB are available",
                baseline as f64 / (1u64 << 30) as f64,
                flashloss::memory::available_bytes().unwrap_or(0) as f64 / (1u64 << 30) as f64
            );
            progress(&note, 0, 0);
            report.notes.push(note);
            Ok(report)
        }
        Backend::Cpu => Ok(cpu::run(cfg, progress)?),
    }
}
