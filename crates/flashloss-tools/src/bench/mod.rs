//! `flashloss bench`: A/B of the baseline (the plain path a framework runs) against the
//! fused kernel, side by side in one run: step time (median, min, max), peak bytes in
//! use (tracking allocator) and the peak above inputs and outputs, and the rate against
//! a reference measured in the same run: memory copy bandwidth at logits level, the
//! plain `[N,H]×[H,V]` GEMM rate at LM-head level.

use crate::Result;
use crate::gradcheck::Device;

pub(crate) mod config;
mod cpu;
pub(crate) mod inputs;
pub(crate) mod report;
pub(crate) mod step;

pub use config::{BenchConfig, Impl, Level, LossKind};
pub use report::{BenchReport, BenchResult, Timing, time_steps};

/// Runs the bench; `progress(label, done, total)` reports long runs.
pub fn run(cfg: &BenchConfig, progress: &mut dyn FnMut(&str, usize, usize)) -> Result<BenchReport> {
    match cfg.device {
        Device::Cuda => crate::gpu_bench::run(cfg, progress),
        Device::Cpu => Ok(cpu::run(cfg, progress)?),
    }
}
