//! What a bench measured (per implementation, and the notes of a run), and the timer
//! of its steps.

use super::config::{Level, LossKind};
use flashloss::DType;
use flashloss::Plan;
use flashloss::cpu::Bf16Choice;
use serde::{Deserialize, Serialize};
use std::time::Instant;

/// Step times in seconds.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct Timing {
    /// Median.
    pub median: f64,
    /// Fastest.
    pub min: f64,
    /// Slowest.
    pub max: f64,
}

/// One implementation's numbers.
#[derive(Debug, Clone, Serialize)]
pub struct BenchResult {
    /// `baseline`, `fused` (or `fused_2exp`: the logits-level two-`exp` kernel).
    pub implementation: &'static str,
    /// The config's level.
    pub level: Level,
    /// The config's loss.
    pub loss_kind: LossKind,
    /// N.
    pub tokens: usize,
    /// H (level `linear`).
    pub hidden: Option<usize>,
    /// V.
    pub vocab: usize,
    /// Storage dtype of logits or hidden states and weight.
    pub dtype: DType,
    /// Rayon threads.
    pub threads: usize,
    /// Forward + backward step time.
    pub step_seconds: Timing,
    /// The loss (the same for every implementation).
    pub loss: f64,
    /// Peak bytes in use during a step (whole process).
    pub peak_bytes: usize,
    /// Bytes of inputs and outputs.
    pub io_bytes: usize,
    /// `peak_bytes` less the bytes in use before the inputs were made and `io_bytes`.
    pub peak_above_io_bytes: i64,
    /// Logits level: the least bytes a step moves (read logits twice, write dlogits once).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes_moved: Option<f64>,
    /// Logits level: `bytes_moved / median`, GB/s.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gbytes_per_s: Option<f64>,
    /// Logits level: parallel copy of a logits-sized buffer, same run (read + write), GB/s.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub copy_gbytes_per_s: Option<f64>,
    /// Linear level: FLOPs done (6NHV, or 8NHV for two-pass).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub flops: Option<f64>,
    /// Linear level: `flops / median`, GFLOP/s.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gflops_per_s: Option<f64>,
    /// Linear level: the plain `[N,H]×[H,V]` GEMM, same run, GFLOP/s.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gemm_gflops_per_s: Option<f64>,
    /// Linear level, bf16 head on a CPU with AVX512-BF16: the same product on bf16
    /// operands (`vdpbf16ps`, packing included), same run, GFLOP/s.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bf16_gemm_gflops_per_s: Option<f64>,
    /// Linear level, fused, bf16 head on the CPU: the products the config's
    /// `bf16_products` ran and why (`auto`: this process's measured rates).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bf16_choice: Option<Bf16Choice>,
    /// Linear level, fused: the plan that ran.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub plan: Option<Plan>,
    /// Bytes in use on the device by `cudaMemGetInfo` after the run (device `cuda`:
    /// the CUDA context, cuBLAS and the backend's buffers together).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_used_bytes: Option<usize>,
}

/// What [`run`] returns: one result per implementation that ran, and notes (e.g. a
/// baseline skipped for lack of memory).
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    /// Per implementation.
    pub results: Vec<BenchResult>,
    /// Why something did not run.
    pub notes: Vec<String>,
}

/// Times `repeat` calls of `step` after `warmup` calls; `progress(done, total)` after each.
pub fn time_steps<Err>(
    warmup: usize,
    repeat: usize,
    mut step: impl FnMut() -> Result<(), Err>,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Timing, Err> {
    for k in 0..warmup {
        step()?;
        progress(k + 1, warmup + repeat);
    }
    let mut times = Vec::with_capacity(repeat);
    for k in 0..repeat.max(1) {
        let start = Instant::now();
        step()?;
        times.push(start.elapsed().as_secs_f64());
        progress(warmup + k + 1, warmup + repeat);
    }
    times.sort_by(f64::total_cmp);
    Ok(Timing {
        median: times[times.len() / 2],
        min: times[0],
        max: times[times.len() - 1],
    })
}
