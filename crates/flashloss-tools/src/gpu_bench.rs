//! `flashloss bench` with `device: cuda` (feature `cuda`): the fused LM-head kernel
//! against the unfused cuBLAS baseline on GPU 0, side by side in one run. Times are
//! CUDA-event times (warm-up, then the median of `repeat` steps; inputs drawn from
//! normals, never zeros); peak bytes are the backend's device accounting (head,
//! gradients, per-row state, tiles, cuBLAS workspace), next to the floor (inputs +
//! dH + dW in f32 + per-row state) and what `cudaMemGetInfo` says is in use. The
//! baseline materializes the `[N, V]` logits (f32) and their gradient (in place for
//! f32 heads, bf16 for bf16 heads) and runs the same row kernels and products.
//! `bench::run` dispatches here, so this module takes the bench's config, report and
//! inputs from their own modules (`bench::{config, report, inputs}`), not from `bench`.

use crate::Result;
use crate::bench::config::BenchConfig;
#[cfg(feature = "cuda")]
use crate::bench::config::{Impl, Level};
use crate::bench::report::BenchReport;
#[cfg(feature = "cuda")]
use crate::bench::report::{BenchResult, Timing};

/// Runs a level-`linear` bench on GPU 0.
#[cfg(feature = "cuda")]
pub fn run(cfg: &BenchConfig, progress: &mut dyn FnMut(&str, usize, usize)) -> Result<BenchReport> {
    use flashloss::DType;
    use half::bf16;
    if cfg.level != Level::Linear {
        return Err(flashloss::Error::InvalidArgument {
            arg: "level",
            reason: "device cuda benchmarks level `linear` (the logits-level GPU kernel is \
                     checked by gradcheck)"
                .into(),
        }
        .into());
    }
    Ok(match cfg.dtype {
        DType::F32 => typed::<f32>(cfg, progress),
        DType::Bf16 => typed::<bf16>(cfg, progress),
        DType::F16 => Err(flashloss::Error::InvalidArgument {
            arg: "dtype",
            reason: "the CUDA backend takes f32 or bf16, not f16".into(),
        }),
    }?)
}

/// Without feature `cuda`: an error saying so.
#[cfg(not(feature = "cuda"))]
pub fn run(_: &BenchConfig, _: &mut dyn FnMut(&str, usize, usize)) -> Result<BenchReport> {
    Err(flashloss::Error::Device {
        reason: "this build has no CUDA backend: build with `--features cuda`".into(),
    }
    .into())
}

/// Median, min and max of step times.
#[cfg(feature = "cuda")]
fn timing(mut times: Vec<f64>) -> Timing {
    times.sort_by(f64::total_cmp);
    Timing {
        median: times[times.len() / 2],
        min: times[0],
        max: times[times.len() - 1],
    }
}

#[cfg(feature = "cuda")]
fn typed<E: flashloss::cuda::GpuElement>(
    cfg: &BenchConfig,
    progress: &mut dyn FnMut(&str, usize, usize),
) -> flashloss::Result<BenchReport> {
    use crate::bench::inputs::linear_inputs;
    use crate::bench::step::{LogprobCall, LogprobRows, fused_step};
    use flashloss::FusedOptions;
    use flashloss::GrpoLoss;
    use flashloss::Result;
    use flashloss::batch::LinearInputs;
    use flashloss::cross_entropy::CrossEntropy;
    use flashloss::cuda::{
        CudaHead, Gpu, GpuGrads, GpuInputs, GpuWorkspace, head_logits, materialized_plan,
    };
    use flashloss::policy::Normalizers;

    let loss = GrpoLoss::new(cfg.grpo.clone())?;
    let ce = CrossEntropy::new(cfg.ce.clone())?;
    let (n, h, v) = (cfg.tokens, cfg.hidden, cfg.vocab);
    let gpu = Gpu::new(0)?;
    let (hidden, weight, tokens) = linear_inputs::<E>(cfg, &loss)?;
    progress("uploading the head", 0, 0);
    let head = GpuInputs::upload(
        &gpu,
        &LinearInputs {
            hidden: &hidden,
            weight: &weight,
            layout: flashloss::WeightLayout::VocabMajor,
            bias: None,
            tokens: n,
            hidden_size: h,
            vocab: v,
        },
    )?;
    drop((hidden, weight));
    let batch = tokens.batch();
    let norm = Normalizers::local(&batch);
    // A `logprobs` bench with `gather_k` or a support also times those calls.
    let logprobs = LogprobRows::of_bench(cfg, n, v);
    let opts = FusedOptions::from_mib(cfg.mode, cfg.budget_mib, 1.0);
    let elem = E::DTYPE.size();
    // Inputs, dH and dW in f32, and the per-row state: targets, live flags, five f32
    // running statistics and a 40-byte gradient coefficient per row.
    let per_row = 8 + 1 + 5 * 4 + 40;
    let floor = (n * h + v * h) * (elem + 4) + n * per_row;
    let nhv = n as f64 * h as f64 * v as f64;
    let mut report = BenchReport {
        results: Vec::new(),
        notes: vec![format!("device: {} ({})", gpu.name()?, gpu.arch())],
    };

    // The plain logits product's rate, the reference of every achieved rate, where its
    // f32 [N, V] fits on the device.
    let (free, _) = gpu.mem_get_info()?;
    let gemm_bytes = (n as f64) * (v as f64) * 4.0;
    let gemm_tflops = if gemm_bytes > 0.9 * free as f64 {
        let note = format!(
            "plain GEMM reference skipped: its f32 [N, V] is {:.1} GiB and the device has {:.1} GiB free",
            gemm_bytes / (1u64 << 30) as f64,
            free as f64 / (1u64 << 30) as f64
        );
        progress(&note, 0, 0);
        report.notes.push(note);
        f64::NAN
    } else {
        progress("gemm reference", 0, cfg.warmup + cfg.repeat.max(1));
        let ws = GpuWorkspace::new(&gpu)?;
        let mut logits = gpu.zeros::<f32>(n * v)?;
        let mut times = Vec::new();
        for k in 0..cfg.warmup + cfg.repeat.max(1) {
            let t = gpu.timed(|| head_logits(&gpu, &head, &ws, &mut logits))?;
            if k >= cfg.warmup {
                times.push(t);
            }
            progress("gemm", k + 1, cfg.warmup + cfg.repeat.max(1));
        }
        2.0 * n as f64 * h as f64 * v as f64 / timing(times).median / 1e12
    };

    // Whether the baseline's materialized [N, V] fits on the device (said at once).
    let mut run_baseline = cfg.implementation != Impl::Fused;
    if run_baseline {
        let (free, _) = gpu.mem_get_info()?;
        let need = materialized_plan(n, v, E::DTYPE).workspace_bytes + floor;
        if need as f64 > 0.95 * free as f64 {
            let note = format!(
                "baseline skipped: it needs about {:.1} GiB and the device has {:.1} GiB free",
                need as f64 / (1u64 << 30) as f64,
                free as f64 / (1u64 << 30) as f64
            );
            progress(&note, 0, 0);
            report.notes.push(note);
            run_baseline = false;
        }
    }
    let mut run_one =
        |name: &'static str, materialized: bool, call: LogprobCall| -> Result<BenchResult> {
            let mut ws = GpuWorkspace::new(&gpu)?;
            let mut grads = GpuGrads::zeros(&gpu, &head, opts.head_grad)?;
            gpu.memory().reset_peak();
            let mut times = Vec::new();
            let mut value = 0.0;
            let mut ran = None;
            let total = cfg.warmup + cfg.repeat.max(1);
            for k in 0..total {
                let t = gpu.timed(|| {
                    // A training step zeroes its gradients; the kernels add into them.
                    gpu.fill_zeros(&mut grads.dhidden)?;
                    if let Some(dw) = &mut grads.dweight {
                        gpu.fill_zeros(dw)?;
                    }
                    let head = &mut CudaHead {
                        gpu: &gpu,
                        head: &head,
                        ws: &mut ws,
                        grads: Some(&mut grads),
                        materialized,
                    };
                    let step = (&batch, norm);
                    let (l, p) =
                        fused_step(head, cfg.loss, (&loss, &ce), step, (&logprobs, call), &opts)?;
                    value = l;
                    ran = Some(p);
                    Ok(())
                })?;
                if k >= cfg.warmup {
                    times.push(t);
                }
                progress(name, k + 1, total);
            }
            gpu.synchronize()?;
            let (free, total_bytes) = gpu.mem_get_info()?;
            let peak = gpu.memory().peak();
            let step = timing(times);
            let extra = logprobs.extra_passes_of(name, call).0;
            let flops =
                ran.map(|p| p.flops(n, h, v)).unwrap_or(6.0 * nhv) + 2.0 * extra as f64 * nhv;
            Ok(BenchResult {
                implementation: name,
                level: cfg.level,
                loss_kind: cfg.loss,
                tokens: n,
                hidden: Some(h),
                vocab: v,
                dtype: cfg.dtype,
                threads: 1,
                step_seconds: step,
                loss: value,
                peak_bytes: peak,
                io_bytes: floor,
                peak_above_io_bytes: peak as i64 - floor as i64,
                bytes_moved: None,
                gbytes_per_s: None,
                copy_gbytes_per_s: None,
                flops: Some(flops),
                gflops_per_s: Some(flops / step.median / 1e9),
                gemm_gflops_per_s: gemm_tflops.is_finite().then_some(gemm_tflops * 1e3),
                bf16_gemm_gflops_per_s: None,
                bf16_choice: None,
                plan: ran,
                device_used_bytes: Some(total_bytes - free),
            })
        };

    if run_baseline {
        report
            .results
            .push(run_one("baseline", true, LogprobCall::Plain)?);
    }
    if cfg.implementation != Impl::Baseline {
        for (name, call) in logprobs.bench_calls() {
            report.results.push(run_one(name, false, call)?);
            report.notes.extend(logprobs.extra_passes_of(name, call).1);
        }
    }
    Ok(report)
}
