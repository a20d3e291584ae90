//! `flashloss bench`: A/B of the baseline (the plain path a framework runs) against the
//! fused kernel, side by side in one run: step time (median, min, max), peak bytes in
//! use (tracking allocator) and the peak above inputs and outputs, and the rate against
//! a reference measured in the same run (memory copy bandwidth at logits level).

use super::inputs::{GrpoInputs, InputSpec};
use crate::batch::LogitsLayout;
use crate::config::{GrpoLoss, LossConfig};
use crate::cpu::{grpo_logits_forward, grpo_logits_unfused};
use crate::element::{DType, Element};
use crate::error::{Error, Result};
use crate::memory;
use half::bf16;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use std::time::Instant;

/// Which implementations to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Impl {
    /// The plain path only.
    Baseline,
    /// The fused kernel only.
    Fused,
    /// Both, side by side.
    Both,
}

/// What the kernel starts from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Level {
    /// Logits `[N, V]` given (the logits-level kernel).
    Logits,
}

/// The bench config file (`configs/bench/*.yaml`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BenchConfig {
    /// Where the step starts.
    pub level: Level,
    /// Which implementations.
    #[serde(rename = "impl")]
    pub implementation: Impl,
    /// N, tokens per step (one sequence of N positions).
    pub tokens: usize,
    /// V.
    pub vocab: usize,
    /// Storage dtype of the logits.
    pub dtype: DType,
    /// Untimed steps before timing.
    pub warmup: usize,
    /// Timed steps.
    pub repeat: usize,
    /// Seed of the inputs.
    pub seed: u64,
    /// The GRPO loss.
    pub grpo: LossConfig,
}

impl Default for BenchConfig {
    fn default() -> Self {
        BenchConfig {
            level: Level::Logits,
            implementation: Impl::Both,
            tokens: 256,
            vocab: 32000,
            dtype: DType::F32,
            warmup: 1,
            repeat: 5,
            seed: 0,
            grpo: LossConfig::default(),
        }
    }
}

/// Step times in seconds.
#[derive(Debug, Clone, Copy, Serialize)]
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
    /// `baseline` or `fused`.
    pub implementation: &'static str,
    /// The config's level.
    pub level: Level,
    /// N.
    pub tokens: usize,
    /// V.
    pub vocab: usize,
    /// Logits dtype.
    pub dtype: DType,
    /// Rayon threads.
    pub threads: usize,
    /// Forward + backward step time.
    pub step_seconds: Timing,
    /// The loss (the same for every implementation).
    pub loss: f64,
    /// Peak bytes in use during a step (whole process).
    pub peak_bytes: usize,
    /// Bytes of inputs and outputs (logits, per-token inputs, dlogits).
    pub io_bytes: usize,
    /// `peak_bytes` less the bytes in use before the inputs were made and `io_bytes`.
    pub peak_above_io_bytes: i64,
    /// The least bytes a step must move: read logits twice, write dlogits once.
    pub bytes_moved: f64,
    /// `bytes_moved / median step time`, GB/s.
    pub gbytes_per_s: f64,
    /// Parallel memory copy of a logits-sized buffer in this run (read + write), GB/s.
    pub copy_gbytes_per_s: f64,
}

/// Times `repeat` calls of `step` after `warmup` calls; `progress(done, total)` after each.
pub fn time_steps(
    warmup: usize,
    repeat: usize,
    mut step: impl FnMut() -> Result<()>,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Timing> {
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

/// Runs the bench; `progress(label, done, total)` reports long runs.
pub fn run(
    cfg: &BenchConfig,
    progress: &mut dyn FnMut(&str, usize, usize),
) -> Result<Vec<BenchResult>> {
    if !memory::is_tracking() {
        return Err(Error::InvalidArgument {
            arg: "bench",
            reason: "the tracking allocator is not installed in this binary".into(),
        });
    }
    match cfg.dtype {
        DType::F32 => run_logits::<f32>(cfg, progress),
        DType::Bf16 => run_logits::<bf16>(cfg, progress),
    }
}

fn run_logits<E: Element>(
    cfg: &BenchConfig,
    progress: &mut dyn FnMut(&str, usize, usize),
) -> Result<Vec<BenchResult>> {
    let loss = GrpoLoss::new(cfg.grpo.clone())?;
    let (n, v) = (cfg.tokens, cfg.vocab);
    let spec = InputSpec {
        batch: 1,
        seq_len: n,
        vocab: v,
        masked_fraction: 0.0,
        ..InputSpec::default()
    };
    let base = memory::in_use();
    let mut inputs = GrpoInputs::random(&spec, cfg.seed);
    let logits: Vec<E> = std::mem::take(&mut inputs.logits)
        .into_iter()
        .map(E::from_f32)
        .collect();
    let batch = inputs.batch();
    let layout = LogitsLayout::contiguous(1, n, v);
    let per_token_bytes = n * (8 + 1 + 4 * 3) + 4;
    let elem = E::DTYPE.size();
    let io_bytes = 2 * n * v * elem + per_token_bytes;
    let bytes_moved = 3.0 * (n * v * elem) as f64;
    let copy_gbytes_per_s = copy_bandwidth(n * v, cfg.repeat.max(9));

    let run_one = |name: &'static str,
                   progress: &mut dyn FnMut(&str, usize, usize),
                   step: &mut dyn FnMut() -> Result<f64>|
     -> Result<BenchResult> {
        let mut loss_value = 0.0;
        memory::reset_peak();
        let timing = time_steps(
            cfg.warmup,
            cfg.repeat,
            || {
                loss_value = step()?;
                Ok(())
            },
            &mut |d, t| progress(name, d, t),
        )?;
        let peak_bytes = memory::peak();
        Ok(BenchResult {
            implementation: name,
            level: cfg.level,
            tokens: n,
            vocab: v,
            dtype: E::DTYPE,
            threads: rayon::current_num_threads(),
            step_seconds: timing,
            loss: loss_value,
            peak_bytes,
            io_bytes,
            peak_above_io_bytes: peak_bytes as i64 - base as i64 - io_bytes as i64,
            bytes_moved,
            gbytes_per_s: bytes_moved / timing.median / 1e9,
            copy_gbytes_per_s,
        })
    };

    let mut results = Vec::new();
    if cfg.implementation != Impl::Fused {
        results.push(run_one("baseline", progress, &mut || {
            let (value, dlogits) = grpo_logits_unfused(&loss, &batch, &logits, &layout, 1.0)?;
            std::hint::black_box(&dlogits);
            Ok(value)
        })?);
    }
    if cfg.implementation != Impl::Baseline {
        let mut dlogits = vec![E::default(); n * v];
        results.push(run_one("fused", progress, &mut || {
            let fwd = grpo_logits_forward(&loss, &batch, &logits, &layout)?;
            fwd.backward(&logits, 1.0, &mut dlogits)?;
            Ok(fwd.loss)
        })?);
    }
    Ok(results)
}

/// GB/s of a parallel copy of `len` f32 (bytes read + bytes written), median of `repeat`.
fn copy_bandwidth(len: usize, repeat: usize) -> f64 {
    let src: Vec<f32> = (0..len).map(|i| i as f32).collect();
    let mut dst = vec![0.0f32; len];
    let chunk = 1 << 16;
    let mut times: Vec<f64> = (0..repeat + 1)
        .map(|_| {
            let start = Instant::now();
            dst.par_chunks_mut(chunk)
                .zip(src.par_chunks(chunk))
                .for_each(|(d, s)| d.copy_from_slice(s));
            std::hint::black_box(&dst);
            start.elapsed().as_secs_f64()
        })
        .skip(1)
        .collect();
    times.sort_by(f64::total_cmp);
    2.0 * (len * 4) as f64 / times[times.len() / 2] / 1e9
}
