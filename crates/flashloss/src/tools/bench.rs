//! `flashloss bench`: A/B of the baseline (the plain path a framework runs) against the
//! fused kernel, side by side in one run: step time (median, min, max), peak bytes in
//! use (tracking allocator) and the peak above inputs and outputs, and the rate against
//! a reference measured in the same run: memory copy bandwidth at logits level, the
//! plain `[N,H]×[H,V]` GEMM rate at LM-head level.

use super::gradcheck::Device;
use super::inputs::{GrpoInputs, InputSpec};
use crate::batch::{LinearInputs, LogitsLayout};
use crate::config::{GrpoLoss, LossConfig};
use crate::cpu::matmul::{MatRef, matmul};
use crate::cpu::{
    BaselineWorkspace, FusedOptions, LinearGrads, Mode, Parallel, Plan, UnfusedWorkspace,
    Workspace, ce_linear_baseline_into, ce_linear_into, grpo_linear_baseline_into,
    grpo_linear_into, grpo_logits_forward, grpo_logits_unfused_into,
};
use crate::cross_entropy::{CeConfig, CrossEntropy};
use crate::element::{DType, Element};
use crate::error::{Error, Result};
use crate::memory;
use crate::policy::Normalizers;
use half::bf16;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal};
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
    /// Hidden states `[N, H]` and the LM head `[V, H]` given (the fused linear kernel).
    Linear,
}

/// Which loss.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LossKind {
    /// The GRPO policy loss (`grpo:` holds its config).
    Grpo,
    /// Cross-entropy (`ce:` holds its config; level `linear` only).
    Ce,
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
    /// Which loss.
    pub loss: LossKind,
    /// N, tokens per step.
    pub tokens: usize,
    /// Sequences the N tokens form (sharded runs split them over token groups).
    pub batch: usize,
    /// How `--ranks P` or `--collective mpi` splits the step.
    pub parallel: Parallel,
    /// Vocab groups of a `2d` grid (they must divide P).
    pub vocab_groups: Option<usize>,
    /// H (level `linear`).
    pub hidden: usize,
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
    /// Fused linear recomputation mode.
    pub mode: Mode,
    /// Fused linear workspace budget in MiB (includes the GEMM reserve, or on the GPU
    /// the cuBLAS workspace).
    pub budget_mib: f64,
    /// Where the step runs (`cuda`: GPU 0, level `linear`, a build with feature `cuda`).
    pub device: Device,
    /// The GRPO loss.
    pub grpo: LossConfig,
    /// The cross-entropy loss.
    pub ce: CeConfig,
}

impl Default for BenchConfig {
    fn default() -> Self {
        BenchConfig {
            level: Level::Logits,
            implementation: Impl::Both,
            loss: LossKind::Grpo,
            tokens: 256,
            batch: 1,
            parallel: Parallel::Vocab,
            vocab_groups: None,
            hidden: 256,
            vocab: 32000,
            dtype: DType::F32,
            warmup: 1,
            repeat: 5,
            seed: 0,
            mode: Mode::Auto,
            budget_mib: 64.0,
            device: Device::Cpu,
            grpo: LossConfig::default(),
            ce: CeConfig::default(),
        }
    }
}

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
    /// `baseline` or `fused`.
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
pub fn run(cfg: &BenchConfig, progress: &mut dyn FnMut(&str, usize, usize)) -> Result<BenchReport> {
    if cfg.device == Device::Cuda {
        return super::gpu_bench::run(cfg, progress);
    }
    if !memory::is_tracking() {
        return Err(Error::InvalidArgument {
            arg: "bench",
            reason: "the tracking allocator is not installed in this binary".into(),
        });
    }
    if cfg.level == Level::Logits && cfg.loss == LossKind::Ce {
        return Err(Error::InvalidArgument {
            arg: "loss",
            reason: "ce is benchmarked at level `linear` (there is no logits-level CE kernel)"
                .into(),
        });
    }
    match (cfg.level, cfg.dtype) {
        (Level::Logits, DType::F32) => run_logits::<f32>(cfg, progress),
        (Level::Logits, DType::Bf16) => run_logits::<bf16>(cfg, progress),
        (Level::Linear, DType::F32) => run_linear::<f32>(cfg, progress),
        (Level::Linear, DType::Bf16) => run_linear::<bf16>(cfg, progress),
    }
}

/// Times one implementation's step; fills the common fields of its result.
fn measure(
    cfg: &BenchConfig,
    name: &'static str,
    base: usize,
    io_bytes: usize,
    progress: &mut dyn FnMut(&str, usize, usize),
    step: &mut dyn FnMut() -> Result<f64>,
) -> Result<BenchResult> {
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
        loss_kind: cfg.loss,
        tokens: cfg.tokens,
        hidden: (cfg.level == Level::Linear).then_some(cfg.hidden),
        vocab: cfg.vocab,
        dtype: cfg.dtype,
        threads: rayon::current_num_threads(),
        step_seconds: timing,
        loss: loss_value,
        peak_bytes,
        io_bytes,
        peak_above_io_bytes: peak_bytes as i64 - base as i64 - io_bytes as i64,
        bytes_moved: None,
        gbytes_per_s: None,
        copy_gbytes_per_s: None,
        flops: None,
        gflops_per_s: None,
        gemm_gflops_per_s: None,
        plan: None,
        device_used_bytes: None,
    })
}

/// Bytes the OS says are available (Linux), if known.
fn available_memory() -> Option<usize> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Per-token GRPO inputs of one sequence of N tokens over V (logits not kept).
fn token_inputs(cfg: &BenchConfig) -> GrpoInputs {
    let spec = InputSpec {
        batch: 1,
        seq_len: cfg.tokens,
        vocab: cfg.vocab,
        masked_fraction: 0.0,
        ..InputSpec::default()
    };
    GrpoInputs::random(&spec, cfg.seed)
}

/// The inputs of a level-`linear` bench: hidden `[N, H]` ~ N(0, 1), weight `[V, H]`
/// ~ N(0, 4/H) (never zeros), and one sequence's per-token GRPO inputs, on-policy (old
/// logp unset: ratio 1 keeps the loss meaningful without a logits pass).
pub(crate) fn linear_inputs<E: Element>(
    cfg: &BenchConfig,
    loss: &GrpoLoss,
) -> (Vec<E>, Vec<E>, GrpoInputs) {
    let (n, h, v) = (cfg.tokens, cfg.hidden, cfg.vocab);
    let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed);
    let normal = Normal::new(0.0f32, 1.0).expect("valid");
    let w_scale = 2.0 / (h as f32).sqrt();
    let hidden: Vec<E> = (0..n * h)
        .map(|_| E::from_f32(normal.sample(&mut rng)))
        .collect();
    let weight: Vec<E> = (0..v * h)
        .map(|_| E::from_f32(normal.sample(&mut rng) * w_scale))
        .collect();
    let mut tokens = token_inputs(cfg);
    tokens.logits = Vec::new();
    tokens.old_logp = None;
    tokens.ref_logp = tokens.ref_logp.take().filter(|_| loss.config().beta > 0.0);
    (hidden, weight, tokens)
}

fn run_linear<E: Element>(
    cfg: &BenchConfig,
    progress: &mut dyn FnMut(&str, usize, usize),
) -> Result<BenchReport> {
    let loss = GrpoLoss::new(cfg.grpo.clone())?;
    let ce = CrossEntropy::new(cfg.ce.clone())?;
    let (n, h, v) = (cfg.tokens, cfg.hidden, cfg.vocab);
    let base = memory::in_use();
    let (hidden, weight, tokens) = linear_inputs::<E>(cfg, &loss);
    let inputs = LinearInputs {
        hidden: &hidden,
        weight: &weight,
        bias: None,
        tokens: n,
        hidden_size: h,
        vocab: v,
    };
    let batch = tokens.batch();
    let elem = E::DTYPE.size();
    let per_token_bytes = n * (8 + 1 + 4 * 3) + 4;
    let io_bytes = (n * h + v * h) * elem + (n * h + v * h) * 4 + per_token_bytes;
    let gemm_gflops_per_s = gemm_rate(n, h, v, cfg.repeat.clamp(1, 3), progress);

    let mut report = BenchReport {
        results: Vec::new(),
        notes: Vec::new(),
    };
    if cfg.implementation != Impl::Fused {
        let need = 4 * n * v * 4 + (n * h + v * h) * 4;
        let have = available_memory().unwrap_or(usize::MAX);
        if need as f64 > 0.9 * have as f64 {
            report.notes.push(format!(
                "baseline skipped: it materializes 4 [N, V] f32 buffers and a widened copy of the inputs, about {:.1} GiB, and {:.1} GiB are available",
                need as f64 / (1u64 << 30) as f64,
                have as f64 / (1u64 << 30) as f64
            ));
        } else {
            let mut ws = BaselineWorkspace::default();
            let mut grads = LinearGrads::zeros(&inputs);
            let mut r = measure(
                cfg,
                "baseline",
                base,
                io_bytes,
                progress,
                &mut || match cfg.loss {
                    LossKind::Grpo => {
                        grpo_linear_baseline_into(&loss, &batch, &inputs, 1.0, &mut ws, &mut grads)
                    }
                    LossKind::Ce => ce_linear_baseline_into(
                        &ce,
                        batch.target_ids,
                        &inputs,
                        1.0,
                        &mut ws,
                        &mut grads,
                    ),
                },
            )?;
            let flops = 6.0 * n as f64 * h as f64 * v as f64;
            r.flops = Some(flops);
            r.gflops_per_s = Some(flops / r.step_seconds.median / 1e9);
            r.gemm_gflops_per_s = Some(gemm_gflops_per_s);
            report.results.push(r);
        }
    }
    if cfg.implementation != Impl::Baseline {
        let opts = FusedOptions {
            mode: cfg.mode,
            budget_bytes: (cfg.budget_mib * (1u64 << 20) as f64) as usize,
            grad_output: 1.0,
        };
        let mut plan = None;
        let mut ws = Workspace::new();
        let mut grads = LinearGrads::zeros(&inputs);
        let norm = Normalizers::local(&batch);
        let mut r = measure(cfg, "fused", base, io_bytes, progress, &mut || {
            // A training step zeroes its gradients; the fused kernel adds into them.
            grads.dhidden.fill(0.0);
            grads.dweight.fill(0.0);
            let (value, ran) = match cfg.loss {
                LossKind::Grpo => {
                    let out =
                        grpo_linear_into(&loss, &batch, norm, &inputs, &opts, &mut ws, &mut grads)?;
                    (out.loss, out.plan)
                }
                LossKind::Ce => {
                    let out = ce_linear_into(
                        &ce,
                        batch.target_ids,
                        None,
                        &inputs,
                        &opts,
                        &mut ws,
                        &mut grads,
                    )?;
                    (out.loss, out.plan)
                }
            };
            plan = Some(ran);
            Ok(value)
        })?;
        let flops = plan.map(|p| p.flops(n, h, v));
        r.flops = flops;
        r.gflops_per_s = flops.map(|f| f / r.step_seconds.median / 1e9);
        r.gemm_gflops_per_s = Some(gemm_gflops_per_s);
        r.plan = plan;
        report.results.push(r);
    }
    Ok(report)
}

/// GFLOP/s of the plain `[N,H]×[H,V]` f32 GEMM (median of `repeat` after one warm-up).
fn gemm_rate(
    n: usize,
    h: usize,
    v: usize,
    repeat: usize,
    progress: &mut dyn FnMut(&str, usize, usize),
) -> f64 {
    let a: Vec<f32> = (0..n * h).map(|i| ((i % 7) as f32 - 3.0) * 0.1).collect();
    let b: Vec<f32> = (0..v * h).map(|i| ((i % 5) as f32 - 2.0) * 0.1).collect();
    let mut c = vec![0.0f32; n * v];
    let timing = time_steps(
        1,
        repeat,
        || {
            matmul(
                &mut c,
                v,
                MatRef::row_major(&a, n, h),
                MatRef::row_major(&b, v, h).t(),
                false,
            );
            Ok(())
        },
        &mut |d, t| progress("gemm", d, t),
    )
    .expect("the GEMM step cannot fail");
    2.0 * n as f64 * h as f64 * v as f64 / timing.median / 1e9
}

fn run_logits<E: Element>(
    cfg: &BenchConfig,
    progress: &mut dyn FnMut(&str, usize, usize),
) -> Result<BenchReport> {
    let loss = GrpoLoss::new(cfg.grpo.clone())?;
    let (n, v) = (cfg.tokens, cfg.vocab);
    let base = memory::in_use();
    let mut inputs = token_inputs(cfg);
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
    let with_rates = |mut r: BenchResult| {
        r.bytes_moved = Some(bytes_moved);
        r.gbytes_per_s = Some(bytes_moved / r.step_seconds.median / 1e9);
        r.copy_gbytes_per_s = Some(copy_gbytes_per_s);
        r
    };

    let mut results = Vec::new();
    if cfg.implementation != Impl::Fused {
        let mut ws = UnfusedWorkspace::default();
        let r = measure(cfg, "baseline", base, io_bytes, progress, &mut || {
            grpo_logits_unfused_into(&loss, &batch, &logits, &layout, 1.0, &mut ws)
        })?;
        results.push(with_rates(r));
    }
    if cfg.implementation != Impl::Baseline {
        let mut dlogits = vec![E::default(); n * v];
        let r = measure(cfg, "fused", base, io_bytes, progress, &mut || {
            let fwd = grpo_logits_forward(&loss, &batch, &logits, &layout)?;
            fwd.backward(&logits, 1.0, &mut dlogits)?;
            Ok(fwd.loss)
        })?;
        results.push(with_rates(r));
    }
    Ok(BenchReport {
        results,
        notes: Vec::new(),
    })
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
