//! The bench on the CPU backend, under the tracking allocator: the rate of a step is
//! set against a reference measured in the same run (memory copy bandwidth at logits
//! level, the plain `[N,H]×[H,V]` GEMM at LM-head level).

use super::config::{BenchConfig, Impl, Level, LossKind};
use super::inputs::{linear_inputs, token_inputs};
use super::report::{BenchReport, BenchResult, time_steps};
use super::step::{LogprobRows, fused_step};
use flashloss::batch::{LinearInputs, LogitsLayout};
use flashloss::cpu::Avx512Bf16;
use flashloss::cpu::bf16_gemm::{PackedA, PackedB};
use flashloss::cpu::matmul::{MatRef, matmul};
use flashloss::cpu::{
    BaselineWorkspace, CpuHead, UnfusedWorkspace, Workspace, ce_linear_baseline_into,
    grpo_linear_baseline_into, grpo_logits_forward, grpo_logits_unfused_into,
};
use flashloss::memory;
use flashloss::policy::Normalizers;
use flashloss::{Bf16Products, LinearGrads};
use flashloss::{CrossEntropy, DType, Device, Element, Error, GrpoLoss, Result};
use half::{bf16, f16};
use rayon::prelude::*;
use std::convert::Infallible;
use std::time::Instant;

/// Runs the bench on the CPU backend.
pub(super) fn run(
    cfg: &BenchConfig,
    progress: &mut dyn FnMut(&str, usize, usize),
) -> Result<BenchReport> {
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
        (Level::Logits, DType::F16) => run_logits::<f16>(cfg, progress),
        (Level::Linear, DType::F16) => run_linear::<f16>(cfg, progress),
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
        bf16_gemm_gflops_per_s: None,
        bf16_choice: None,
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

fn run_linear<E: Element>(
    cfg: &BenchConfig,
    progress: &mut dyn FnMut(&str, usize, usize),
) -> Result<BenchReport> {
    let loss = GrpoLoss::new(cfg.grpo.clone())?;
    let ce = CrossEntropy::new(cfg.ce.clone())?;
    let (n, h, v) = (cfg.tokens, cfg.hidden, cfg.vocab);
    let base = memory::in_use();
    let (hidden, weight, tokens) = linear_inputs::<E>(cfg, &loss)?;
    let inputs = LinearInputs {
        hidden: &hidden,
        weight: &weight,
        layout: flashloss::WeightLayout::VocabMajor,
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
    if cfg.implementation != Impl::Fused && cfg.loss == LossKind::Logprobs {
        report
            .notes
            .push("baseline skipped: loss logprobs has no plain path here".into());
    } else if cfg.implementation != Impl::Fused {
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
                    LossKind::Ce | LossKind::Logprobs => ce_linear_baseline_into(
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
    // A `logprobs` bench with `gather_k` or a support also times those calls.
    let logprobs = LogprobRows::of_bench(cfg, n, v);
    for (name, call) in logprobs.bench_calls() {
        if cfg.implementation == Impl::Baseline {
            break;
        }
        let opts = cfg.fused_options();
        let mut plan = None;
        let mut ws = Workspace::new();
        let mut grads = LinearGrads::zeros_for(&inputs, opts.head_grad);
        let norm = Normalizers::local(&batch);
        let mut r = measure(cfg, name, base, io_bytes, progress, &mut || {
            // A training step zeroes its gradients; the fused kernel adds into them.
            grads.dhidden.fill(0.0);
            grads.dweight.fill(0.0);
            let head = &mut CpuHead {
                inputs: &inputs,
                ws: &mut ws,
                grads: grads.view(),
            };
            let (value, ran) = fused_step(
                head,
                cfg.loss,
                (&loss, &ce),
                (&batch, norm),
                (&logprobs, call),
                &opts,
            )?;
            plan = Some(ran);
            Ok(value)
        })?;
        let (extra, note) = logprobs.extra_passes_of(name, call);
        let extra_flops = 2.0 * extra as f64 * (n * h) as f64 * v as f64;
        let flops = plan.map(|p| p.flops(n, h, v) + extra_flops);
        r.flops = flops;
        r.gflops_per_s = flops.map(|f| f / r.step_seconds.median / 1e9);
        r.gemm_gflops_per_s = Some(gemm_gflops_per_s);
        if plan.and_then(|p| p.bf16_products) == Some(Bf16Products::Avx512Bf16) {
            let repeat = cfg.repeat.clamp(1, 3);
            r.bf16_gemm_gflops_per_s =
                bf16_gemm_rate(&hidden, &weight, (n, h, v), repeat, progress);
        }
        if E::DTYPE == DType::Bf16 {
            r.bf16_choice = Some(flashloss::cpu::bf16_products_choice(opts.bf16_products)?);
        }
        r.plan = plan;
        report.results.push(r);
        report.notes.extend(note);
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
    let Ok(timing) = time_steps::<Infallible>(
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
    );
    2.0 * n as f64 * h as f64 * v as f64 / timing.median / 1e9
}

/// GFLOP/s of the same product on the bf16 operands `hidden` `[N,H]` and `weight`
/// `[V,H]` through `vdpbf16ps` (packing included; median of `repeat` after one warm-up);
/// `None` for f32 operands or a CPU without AVX512-BF16.
fn bf16_gemm_rate<E: Element>(
    hidden: &[E],
    weight: &[E],
    (n, h, v): (usize, usize, usize),
    repeat: usize,
    progress: &mut dyn FnMut(&str, usize, usize),
) -> Option<f64> {
    let (cpu, hidden, weight) = (
        Avx512Bf16::detect()?,
        E::as_bf16(hidden)?,
        E::as_bf16(weight)?,
    );
    let (mut a, mut b) = (PackedA::default(), PackedB::default());
    let mut c = vec![0.0f32; n * v];
    let threads = rayon::current_num_threads();
    let Ok(timing) = time_steps::<Infallible>(
        1,
        repeat,
        || {
            a.pack_a(MatRef::row_major(hidden, n, h), threads);
            b.pack_b(MatRef::row_major(weight, v, h).t(), threads);
            cpu.gemm(&mut c, v, &a, &b, false, threads);
            Ok(())
        },
        &mut |d, t| progress("bf16 gemm", d, t),
    );
    Some(2.0 * n as f64 * h as f64 * v as f64 / timing.median / 1e9)
}

fn run_logits<E: Element>(
    cfg: &BenchConfig,
    progress: &mut dyn FnMut(&str, usize, usize),
) -> Result<BenchReport> {
    let loss = GrpoLoss::new(cfg.grpo.clone())?;
    let (n, v) = (cfg.tokens, cfg.vocab);
    let base = memory::in_use();
    let mut inputs = token_inputs(cfg)?;
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
        if E::DTYPE == flashloss::DType::F32 {
            // The two-`exp` kernel, for the same-run comparison.
            let r = measure(cfg, "fused_2exp", base, io_bytes, progress, &mut || {
                let fwd = grpo_logits_forward(&loss, &batch, &logits, &layout)?;
                fwd.backward(&logits, 1.0, &mut dlogits)?;
                Ok(fwd.loss)
            })?;
            results.push(with_rates(r));
        }
        // What users get: `Device::grpo_logits` (one `exp` per logit for f32 gradients).
        let device = Device::cpu();
        let r = measure(cfg, "fused", base, io_bytes, progress, &mut || {
            let fwd = device.grpo_logits(&loss, &batch, &logits, &layout, 1.0, &mut dlogits)?;
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
