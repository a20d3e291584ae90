//! `flashloss gradcheck`: random inputs, the f64 reference and a kernel side by side,
//! and tolerance gates (spec: "Numerical tolerances"). Kernels: the logits-level GRPO
//! kernel (gradient w.r.t. logits), and the fused LM-head GRPO and cross-entropy
//! kernels (gradients w.r.t. hidden states, weight and bias).

use super::inputs::{GrpoInputs, HeadInputs, InputSpec};
use crate::batch::LogitsLayout;
use crate::config::{GrpoLoss, LossConfig};
use crate::cpu::{
    FusedOptions, LinearGrads, Mode, Parallel, Workspace, ce_linear_into, grpo_linear_into,
    grpo_logits_forward,
};
use crate::cross_entropy::{CeConfig, CrossEntropy};
use crate::element::{DType, Element};
use crate::error::{Error, Result};
use crate::policy::{GrpoMetrics, Normalizers};
use crate::reference::{ce_reference, dense_f64, grpo_reference, linear_grads, linear_logits};
use half::bf16;
use serde::{Deserialize, Serialize};
use std::time::Instant;

/// Which kernel gradcheck runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Kernel {
    /// The logits-level kernel: logits `[B, T, V]` in, `dlogits` out (GRPO).
    #[default]
    Logits,
    /// The fused LM-head kernel: hidden `[N, H]` and weight `[V, H]` in, dH, dW, dbias out.
    Linear,
}

/// Which loss gradcheck checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Objective {
    /// The GRPO policy loss (`loss:` holds its config).
    #[default]
    Grpo,
    /// Cross-entropy (`ce:` holds its config; masked positions get `ignore_index`).
    Ce,
}

/// A fault on one rank of a sharded gradcheck.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fault {
    /// The rank it hits.
    pub rank: usize,
    /// What happens there.
    pub kind: FaultKind,
}

/// What an injected fault does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultKind {
    /// A NaN in the rank's hidden states: every rank must return the same error.
    Nan,
    /// The rank panics before its step.
    Panic,
    /// The rank sleeps twice the timeout before its step.
    Hang,
    /// The rank leaves: in-process its closure returns, under MPI its process exits
    /// at once (no `MPI_Finalize`), as a crashed process would.
    Exit,
}

/// Where the kernel runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Device {
    /// The CPU backend.
    #[default]
    Cpu,
    /// GPU 0 through the CUDA backend (a build with feature `cuda`).
    Cuda,
}

/// The gradcheck config file (`configs/gradcheck/*.yaml`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GradcheckConfig {
    /// Which kernel.
    pub kernel: Kernel,
    /// Where it runs.
    pub device: Device,
    /// Which loss (`ce` needs kernel `linear`).
    pub objective: Objective,
    /// How `--ranks P` splits the work (kernel `linear`).
    pub parallel: Parallel,
    /// Vocab groups of a `2d` grid (they must divide P; token groups = P / vocab_groups).
    pub vocab_groups: Option<usize>,
    /// Seconds a rank of a sharded run waits for its peers in one collective.
    pub timeout_s: f64,
    /// A fault injected on one rank of a sharded run, to see the run fail together.
    pub fault: Option<Fault>,
    /// B.
    pub batch: usize,
    /// T.
    pub seq_len: usize,
    /// V.
    pub vocab: usize,
    /// Storage dtype of the logits.
    pub dtype: DType,
    /// Seed of the inputs.
    pub seed: u64,
    /// Expected fraction of padding positions.
    pub masked_fraction: f64,
    /// Standard deviation of the logits.
    pub logit_std: f64,
    /// Draw old-policy logp.
    pub old_logp: bool,
    /// Draw reference logp (needed when `loss.beta > 0`).
    pub ref_logp: bool,
    /// Draw a sampler importance ratio.
    pub sampler_ratio: bool,
    /// Per-token advantages.
    pub per_token_advantages: bool,
    /// Upstream gradient that scales `dlogits`.
    pub grad_output: f64,
    /// Write `dlogits` over the logits.
    pub in_place: bool,
    /// The GRPO loss.
    pub loss: LossConfig,
    /// The cross-entropy loss (objective `ce`).
    pub ce: CeConfig,
    /// H (kernel `linear`).
    pub hidden: usize,
    /// Give the LM head a bias (kernel `linear`).
    pub bias: bool,
    /// Recomputation mode (kernel `linear`).
    pub mode: Mode,
    /// Workspace budget in MiB, GEMM reserve included (kernel `linear`).
    pub budget_mib: f64,
    /// Gates; unset ones take the spec's value for `dtype`.
    pub tolerance: Tolerance,
}

impl Default for GradcheckConfig {
    fn default() -> Self {
        let inputs = InputSpec::default();
        GradcheckConfig {
            kernel: Kernel::Logits,
            device: Device::Cpu,
            objective: Objective::Grpo,
            parallel: Parallel::Token,
            vocab_groups: None,
            timeout_s: 600.0,
            fault: None,
            batch: inputs.batch,
            seq_len: inputs.seq_len,
            vocab: inputs.vocab,
            dtype: DType::F32,
            seed: 0,
            masked_fraction: inputs.masked_fraction,
            logit_std: inputs.logit_std,
            old_logp: inputs.old_logp,
            ref_logp: inputs.ref_logp,
            sampler_ratio: inputs.sampler_ratio,
            per_token_advantages: inputs.per_token_advantages,
            grad_output: 1.0,
            in_place: false,
            loss: LossConfig::default(),
            ce: CeConfig::default(),
            hidden: 64,
            bias: true,
            mode: Mode::Auto,
            budget_mib: 64.0,
            tolerance: Tolerance::default(),
        }
    }
}

impl GradcheckConfig {
    /// The inputs this config draws.
    pub fn input_spec(&self) -> InputSpec {
        InputSpec {
            batch: self.batch,
            seq_len: self.seq_len,
            vocab: self.vocab,
            masked_fraction: self.masked_fraction,
            logit_std: self.logit_std,
            old_logp: self.old_logp,
            ref_logp: self.ref_logp,
            sampler_ratio: self.sampler_ratio,
            per_token_advantages: self.per_token_advantages,
        }
    }
}

/// Tolerance gates (spec defaults: f32 1e-5 / 1e-4 / 1e-6; bf16 1e-3 / 1e-2).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Tolerance {
    /// `|ΔL| ≤ loss_rel · max(|L_ref|, 1)`.
    pub loss_rel: Option<f64>,
    /// `|Δlogp_i| ≤ logp_rel · max(|logp_i|, 1)`, and the same for entropy.
    pub logp_rel: Option<f64>,
    /// `max|Δg| ≤ max(grad_rel · max|g_ref|, grad_atol)` for each gradient g.
    pub grad_rel: Option<f64>,
    /// Absolute floor of the gradient gate.
    pub grad_atol: Option<f64>,
}

impl Tolerance {
    /// Fills unset gates with the spec's values for `dtype`.
    pub fn resolved(self, dtype: DType) -> Tolerance {
        let (loss, grad) = match dtype {
            DType::F32 => (1e-5, 1e-4),
            DType::Bf16 => (1e-3, 1e-2),
        };
        Tolerance {
            loss_rel: Some(self.loss_rel.unwrap_or(loss)),
            logp_rel: Some(self.logp_rel.unwrap_or(1e-5)),
            grad_rel: Some(self.grad_rel.unwrap_or(grad)),
            grad_atol: Some(self.grad_atol.unwrap_or(1e-6)),
        }
    }
}

/// One tolerance gate.
#[derive(Debug, Clone, Serialize)]
pub struct Gate {
    /// What is compared.
    pub name: &'static str,
    /// The measured error.
    pub value: f64,
    /// The bound.
    pub limit: f64,
    /// `value ≤ limit` (false for NaN).
    pub passed: bool,
}

impl Gate {
    pub(crate) fn new(name: &'static str, value: f64, limit: f64) -> Self {
        Gate {
            name,
            value,
            limit,
            passed: value <= limit,
        }
    }
}

/// What gradcheck measured.
#[derive(Debug, Clone, Serialize)]
pub struct GradcheckReport {
    /// What ran, e.g. `linear ce single_pass`.
    pub kernel: String,
    /// Reference loss.
    pub loss_ref: f64,
    /// Kernel loss.
    pub loss_kernel: f64,
    /// `|loss_kernel - loss_ref|`.
    pub abs_diff_loss: f64,
    /// Reference metrics (GRPO).
    pub metrics_ref: Option<GrpoMetrics>,
    /// Kernel metrics (GRPO).
    pub metrics_kernel: Option<GrpoMetrics>,
    /// Seconds of the kernel's forward + backward.
    pub kernel_seconds: f64,
    /// Every gate: relative errors for loss, logp and entropy; max absolute
    /// differences for gradients (`dlogits`, or `dhidden`, `dweight`, `dbias`).
    pub gates: Vec<Gate>,
    /// All gates passed.
    pub passed: bool,
}

impl GradcheckReport {
    /// The gate called `name`.
    pub fn gate(&self, name: &str) -> Option<&Gate> {
        self.gates.iter().find(|g| g.name == name)
    }

    pub(crate) fn new(
        kernel: String,
        loss: (f64, f64),
        metrics: Option<(GrpoMetrics, GrpoMetrics)>,
        kernel_seconds: f64,
        gates: Vec<Gate>,
    ) -> Self {
        GradcheckReport {
            kernel,
            loss_ref: loss.0,
            loss_kernel: loss.1,
            abs_diff_loss: (loss.1 - loss.0).abs(),
            metrics_ref: metrics.map(|m| m.0),
            metrics_kernel: metrics.map(|m| m.1),
            kernel_seconds,
            passed: gates.iter().all(|g| g.passed),
            gates,
        }
    }
}

/// Runs gradcheck as configured.
pub fn run(cfg: &GradcheckConfig) -> Result<GradcheckReport> {
    match (cfg.kernel, cfg.objective) {
        (Kernel::Logits, Objective::Ce) => Err(Error::InvalidArgument {
            arg: "objective",
            reason: "ce is checked on kernel `linear` (there is no logits-level CE kernel)".into(),
        }),
        (Kernel::Logits, Objective::Grpo) => {
            let loss = GrpoLoss::new(cfg.loss.clone())?;
            let inputs = GrpoInputs::random(&cfg.input_spec(), cfg.seed);
            match cfg.dtype {
                DType::F32 => check_inputs(cfg, &loss, &inputs, inputs.logits.clone()),
                DType::Bf16 => {
                    let data = inputs.logits.iter().map(|&x| bf16::from_f32(x)).collect();
                    check_inputs(cfg, &loss, &inputs, data)
                }
            }
        }
        (Kernel::Linear, _) => match cfg.dtype {
            DType::F32 => check_linear::<f32>(cfg),
            DType::Bf16 => check_linear::<bf16>(cfg),
        },
    }
}

/// The logits-level kernel on the GPU (feature `cuda`).
mod cuda_logits {
    use super::GradcheckConfig;
    use crate::batch::{GrpoBatch, LogitsLayout};
    use crate::config::GrpoLoss;
    use crate::cpu::GrpoLogitsForward;
    use crate::element::Element;
    #[cfg(not(feature = "cuda"))]
    use crate::error::Error;
    use crate::error::Result;

    /// Forward and backward on GPU 0; `dlogits` comes back in the logits' dtype
    /// (poisoned with NaN before the kernel when not in place).
    #[cfg(feature = "cuda")]
    pub(super) fn step<E: Element>(
        cfg: &GradcheckConfig,
        loss: &GrpoLoss,
        batch: &GrpoBatch,
        logits: &[E],
        layout: &LogitsLayout,
    ) -> Result<(GrpoLogitsForward, Vec<E>)> {
        use crate::cuda::{Gpu, GpuElement, grpo_logits_backward, grpo_logits_forward};
        use crate::element::DType;
        use half::bf16;
        fn typed<T: GpuElement>(
            cfg: &GradcheckConfig,
            loss: &GrpoLoss,
            batch: &GrpoBatch,
            host: &[T],
            layout: &LogitsLayout,
        ) -> Result<(GrpoLogitsForward, Vec<f32>)> {
            let gpu = Gpu::new(0)?;
            let mut logits = gpu.upload(host)?;
            let fwd = grpo_logits_forward(&gpu, loss, batch, &logits, layout)?;
            let g = cfg.grad_output as f32;
            let out = if cfg.in_place {
                grpo_logits_backward(&gpu, &fwd, &mut logits, g, None)?;
                gpu.download(&logits)?
            } else {
                let poison = vec![T::from_f32(f32::NAN); layout.rows() * layout.vocab];
                let mut dlogits = gpu.upload(&poison)?;
                grpo_logits_backward(&gpu, &fwd, &mut logits, g, Some(&mut dlogits))?;
                gpu.download(&dlogits)?
            };
            Ok((fwd, out.iter().map(|x| x.to_f32()).collect()))
        }
        // The element type is the config's dtype: these conversions are exact.
        let (fwd, out) = match E::DTYPE {
            DType::F32 => {
                let host: Vec<f32> = logits.iter().map(|x| x.to_f32()).collect();
                typed(cfg, loss, batch, &host, layout)?
            }
            DType::Bf16 => {
                let host: Vec<bf16> = logits.iter().map(|x| bf16::from_f32(x.to_f32())).collect();
                typed(cfg, loss, batch, &host, layout)?
            }
        };
        Ok((fwd, out.into_iter().map(E::from_f32).collect()))
    }

    /// Without feature `cuda`: an error saying so.
    #[cfg(not(feature = "cuda"))]
    pub(super) fn step<E: Element>(
        _: &GradcheckConfig,
        _: &GrpoLoss,
        _: &GrpoBatch,
        _: &[E],
        _: &LogitsLayout,
    ) -> Result<(GrpoLogitsForward, Vec<E>)> {
        Err(Error::Device {
            reason: "this build has no CUDA backend: build with `--features cuda`".into(),
        })
    }
}

/// The fused LM-head kernels on the GPU (feature `cuda`): GPU 0, the head uploaded,
/// gradients zeroed on the device and copied back.
mod cuda_linear {
    use super::HeadInputs;
    use crate::batch::GrpoBatch;
    use crate::config::GrpoLoss;
    use crate::cpu::{CeLinearOutput, FusedOptions, GrpoLinearOutput, LinearGrads};
    use crate::cross_entropy::CrossEntropy;
    use crate::element::Element;
    use crate::error::{Error, Result};
    use crate::policy::Normalizers;

    /// Which loss to run (read only by the CUDA build).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(super) enum Job<'a> {
        Grpo(&'a GrpoLoss, &'a GrpoBatch<'a>, Normalizers),
        Ce(&'a CrossEntropy, &'a [i64]),
    }

    /// What the job returned (built only by the CUDA build).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(super) enum Done {
        Grpo(GrpoLinearOutput),
        Ce(CeLinearOutput),
    }

    impl Done {
        pub(super) fn grpo(self) -> Result<GrpoLinearOutput> {
            match self {
                Done::Grpo(out) => Ok(out),
                Done::Ce(_) => Err(mismatch()),
            }
        }

        pub(super) fn ce(self) -> Result<CeLinearOutput> {
            match self {
                Done::Ce(out) => Ok(out),
                Done::Grpo(_) => Err(mismatch()),
            }
        }
    }

    fn mismatch() -> Error {
        Error::Device {
            reason: "the GPU job returned another loss's output".into(),
        }
    }

    /// Runs `job` on GPU 0 on `head` (converted exactly to the GPU's element type).
    #[cfg(feature = "cuda")]
    pub(super) fn step<E: Element>(
        head: &HeadInputs<E>,
        job: Job,
        opts: &FusedOptions,
    ) -> Result<(Done, LinearGrads)> {
        use crate::cuda::{
            Gpu, GpuElement, GpuGrads, GpuHead, GpuWorkspace, ce_linear_into, grpo_linear_into,
        };
        use crate::element::DType;
        use half::bf16;
        fn typed<T: GpuElement>(
            head: &HeadInputs<T>,
            job: Job,
            opts: &FusedOptions,
        ) -> Result<(Done, LinearGrads)> {
            let gpu = Gpu::new(0)?;
            let dev = GpuHead::upload(&gpu, &head.inputs())?;
            let mut grads = GpuGrads::zeros(&gpu, &dev)?;
            let mut ws = GpuWorkspace::new(&gpu)?;
            let done = match job {
                Job::Grpo(loss, batch, norm) => Done::Grpo(grpo_linear_into(
                    &gpu, loss, batch, norm, &dev, opts, &mut ws, &mut grads,
                )?),
                Job::Ce(ce, targets) => Done::Ce(ce_linear_into(
                    &gpu, ce, targets, None, &dev, opts, &mut ws, &mut grads,
                )?),
            };
            Ok((done, grads.download(&gpu)?))
        }
        fn convert<E: Element, T: Element>(head: &HeadInputs<E>) -> HeadInputs<T> {
            let to = |x: &[E]| x.iter().map(|v| T::from_f32(v.to_f32())).collect();
            HeadInputs {
                hidden: to(&head.hidden),
                weight: to(&head.weight),
                bias: head.bias.as_deref().map(to),
                n: head.n,
                h: head.h,
                v: head.v,
            }
        }
        // The element type is the config's dtype: these conversions are exact.
        match E::DTYPE {
            DType::F32 => typed(&convert::<E, f32>(head), job, opts),
            DType::Bf16 => typed(&convert::<E, bf16>(head), job, opts),
        }
    }

    /// Without feature `cuda`: an error saying so.
    #[cfg(not(feature = "cuda"))]
    pub(super) fn step<E: Element>(
        _: &HeadInputs<E>,
        _: Job,
        _: &FusedOptions,
    ) -> Result<(Done, LinearGrads)> {
        Err(Error::Device {
            reason: "this build has no CUDA backend: build with `--features cuda`".into(),
        })
    }
}

fn max_abs_diff(a: impl Iterator<Item = f64>, b: impl Iterator<Item = f64>) -> f64 {
    max_abs_diff_by(a.zip(b).map(|(x, y)| (x - y).abs()))
}

/// NaN-propagating max of errors, so an unwritten (NaN-poisoned) element fails every gate.
fn max_abs_diff_by(errors: impl Iterator<Item = f64>) -> f64 {
    errors.fold(0.0, |m, d| if d.is_nan() || d > m { d } else { m })
}

/// Compares kernel and reference on given inputs (`logits` in the storage dtype,
/// dense `[B, T, V]`); `cfg` gives `grad_output`, `in_place` and the gates.
pub fn check_inputs<E: Element>(
    cfg: &GradcheckConfig,
    loss: &GrpoLoss,
    inputs: &GrpoInputs,
    mut logits: Vec<E>,
) -> Result<GradcheckReport> {
    let batch = inputs.batch();
    let layout = LogitsLayout::contiguous(inputs.batch, inputs.seq_len, inputs.vocab);
    batch.validate(layout.vocab, loss)?;
    let reference = grpo_reference(
        loss,
        &batch,
        Normalizers::local(&batch),
        &dense_f64(&logits, &layout),
        layout.vocab,
        cfg.grad_output,
    );

    let start = Instant::now();
    let (fwd, dlogits) = match cfg.device {
        Device::Cpu => {
            let fwd = grpo_logits_forward(loss, &batch, &logits, &layout)?;
            let dlogits: Vec<E> = if cfg.in_place {
                fwd.backward_in_place(&mut logits, cfg.grad_output as f32)?;
                logits
            } else {
                let mut out = vec![E::from_f32(f32::NAN); layout.rows() * layout.vocab];
                fwd.backward(&logits, cfg.grad_output as f32, &mut out)?;
                out
            };
            (fwd, dlogits)
        }
        Device::Cuda => cuda_logits::step(cfg, loss, &batch, &logits, &layout)?,
    };
    let kernel_seconds = start.elapsed().as_secs_f64();

    let live: Vec<usize> = (0..layout.rows()).filter(|&i| batch.mask[i]).collect();
    let tol = cfg.tolerance.resolved(E::DTYPE);
    let logp_err = worst_rel(live.iter().map(|&i| (fwd.stats[i].logp, reference.logp[i])));
    let entropy_err = worst_rel(
        live.iter()
            .map(|&i| (fwd.stats[i].entropy, reference.entropy[i])),
    );
    let gates = vec![
        Gate::new(
            "loss",
            (fwd.loss - reference.loss).abs() / reference.loss.abs().max(1.0),
            tol.loss_rel.unwrap_or_default(),
        ),
        Gate::new("logp", logp_err, tol.logp_rel.unwrap_or_default()),
        Gate::new("entropy", entropy_err, tol.logp_rel.unwrap_or_default()),
        grad_gate(
            "dlogits",
            dlogits.iter().map(|x| x.to_f32() as f64),
            &reference.dlogits,
            &tol,
        ),
    ];
    Ok(GradcheckReport::new(
        format!("logits grpo {:?}", E::DTYPE),
        (reference.loss, fwd.loss),
        Some((reference.metrics, fwd.metrics)),
        kernel_seconds,
        gates,
    ))
}

/// `max |got - want| / max(|want|, 1)` over `(got, want)` pairs (NaN propagates).
fn worst_rel(pairs: impl Iterator<Item = (f32, f64)>) -> f64 {
    max_abs_diff_by(pairs.map(|(g, w)| (g as f64 - w).abs() / w.abs().max(1.0)))
}

/// The gate of one gradient: `max|Δg| ≤ max(grad_rel · max|g_ref|, grad_atol)`.
pub(crate) fn grad_gate(
    name: &'static str,
    got: impl Iterator<Item = f64>,
    want: &[f64],
    tol: &Tolerance,
) -> Gate {
    let max_ref = want.iter().fold(0.0f64, |m, x| m.max(x.abs()));
    Gate::new(
        name,
        max_abs_diff(got, want.iter().cloned()),
        (tol.grad_rel.unwrap_or_default() * max_ref).max(tol.grad_atol.unwrap_or_default()),
    )
}

/// The fused LM-head kernel (GRPO or CE) vs the reference on a random head of shape
/// `[N = B·T, H] × [V, H]`: loss, logp (and entropy for GRPO), dH, dW, dbias. The
/// gradient buffers start as NaN-free zeros (the kernel adds into them).
fn check_linear<E: Element>(cfg: &GradcheckConfig) -> Result<GradcheckReport> {
    let (n, v) = (cfg.batch * cfg.seq_len, cfg.vocab);
    let LinearCase {
        head,
        tokens,
        z,
        opts,
    } = LinearCase::<E>::new(cfg);
    let inputs = head.inputs();
    let tol = cfg.tolerance.resolved(E::DTYPE);
    let mut grads = LinearGrads::zeros(&inputs);
    let start = Instant::now();
    let (name, loss_pair, metrics, mut gates, dlogits_ref) = match cfg.objective {
        Objective::Grpo => {
            let loss = GrpoLoss::new(cfg.loss.clone())?;
            let batch = tokens.batch();
            let norm = Normalizers::local(&batch);
            let out = match cfg.device {
                Device::Cpu => grpo_linear_into(
                    &loss,
                    &batch,
                    norm,
                    &inputs,
                    &opts,
                    &mut Workspace::new(),
                    &mut grads,
                )?,
                Device::Cuda => {
                    let (done, g) = cuda_linear::step(
                        &head,
                        cuda_linear::Job::Grpo(&loss, &batch, norm),
                        &opts,
                    )?;
                    grads = g;
                    done.grpo()?
                }
            };
            let r = grpo_reference(&loss, &batch, norm, &z, v, cfg.grad_output);
            let live: Vec<usize> = (0..n).filter(|&i| batch.mask[i]).collect();
            let gates = vec![
                Gate::new(
                    "logp",
                    worst_rel(live.iter().map(|&i| (out.stats[i].logp, r.logp[i]))),
                    tol.logp_rel.unwrap_or_default(),
                ),
                Gate::new(
                    "entropy",
                    worst_rel(live.iter().map(|&i| (out.stats[i].entropy, r.entropy[i]))),
                    tol.logp_rel.unwrap_or_default(),
                ),
            ];
            let name = format!(
                "linear grpo {:?} {}",
                E::DTYPE,
                mode_name(out.plan.single_pass)
            );
            (
                name,
                (r.loss, out.loss),
                Some((r.metrics, out.metrics)),
                gates,
                r.dlogits,
            )
        }
        Objective::Ce => {
            let ce = CrossEntropy::new(cfg.ce.clone())?;
            let targets = ce_targets(&tokens, &ce);
            let out = match cfg.device {
                Device::Cpu => ce_linear_into(
                    &ce,
                    &targets,
                    None,
                    &inputs,
                    &opts,
                    &mut Workspace::new(),
                    &mut grads,
                )?,
                Device::Cuda => {
                    let (done, g) =
                        cuda_linear::step(&head, cuda_linear::Job::Ce(&ce, &targets), &opts)?;
                    grads = g;
                    done.ce()?
                }
            };
            let r = ce_reference(&ce, &targets, &z, v, cfg.grad_output, None);
            let live: Vec<usize> = (0..n).filter(|&i| ce.counts(targets[i])).collect();
            let gates = vec![Gate::new(
                "logp",
                worst_rel(live.iter().map(|&i| (out.stats[i].logp, r.logp[i]))),
                tol.logp_rel.unwrap_or_default(),
            )];
            let name = format!(
                "linear ce {:?} {}",
                E::DTYPE,
                mode_name(out.plan.single_pass)
            );
            (name, (r.loss, out.loss), None, gates, r.dlogits)
        }
    };
    let kernel_seconds = start.elapsed().as_secs_f64();
    let (dh, dw, db) = linear_grads(&inputs, &dlogits_ref);
    gates.insert(
        0,
        Gate::new(
            "loss",
            (loss_pair.1 - loss_pair.0).abs() / loss_pair.0.abs().max(1.0),
            tol.loss_rel.unwrap_or_default(),
        ),
    );
    let f64s = |x: &[f32]| x.iter().map(|&v| v as f64).collect::<Vec<_>>();
    gates.push(grad_gate(
        "dhidden",
        f64s(&grads.dhidden).into_iter(),
        &dh,
        &tol,
    ));
    gates.push(grad_gate(
        "dweight",
        f64s(&grads.dweight).into_iter(),
        &dw,
        &tol,
    ));
    if let Some(got) = &grads.dbias {
        gates.push(grad_gate("dbias", f64s(got).into_iter(), &db, &tol));
    }
    Ok(GradcheckReport::new(
        name,
        loss_pair,
        metrics,
        kernel_seconds,
        gates,
    ))
}

/// The random inputs of a fused LM-head check: a head, per-token GRPO inputs whose old
/// and reference logp follow the head's policy, the head's f64 logits, the options.
pub(crate) struct LinearCase<E> {
    pub(crate) head: HeadInputs<E>,
    pub(crate) tokens: GrpoInputs,
    pub(crate) z: Vec<f64>,
    pub(crate) opts: FusedOptions,
}

impl<E: Element> LinearCase<E> {
    pub(crate) fn new(cfg: &GradcheckConfig) -> Self {
        let (n, h, v) = (cfg.batch * cfg.seq_len, cfg.hidden, cfg.vocab);
        let head = HeadInputs::<E>::random(n, h, v, cfg.bias, cfg.seed);
        let mut tokens = GrpoInputs::random(&cfg.input_spec(), cfg.seed + 1);
        tokens.logits = Vec::new();
        let z = linear_logits(&head.inputs());
        tokens.follow_policy(&z, cfg.loss.temperature);
        let opts = FusedOptions {
            mode: cfg.mode,
            budget_bytes: (cfg.budget_mib * (1u64 << 20) as f64) as usize,
            grad_output: cfg.grad_output as f32,
        };
        LinearCase {
            head,
            tokens,
            z,
            opts,
        }
    }
}

/// CE targets of GRPO inputs: the target ids, `ignore_index` at masked positions.
pub(crate) fn ce_targets(tokens: &GrpoInputs, ce: &CrossEntropy) -> Vec<i64> {
    let ignore = ce.config().ignore_index;
    (0..tokens.mask.len())
        .map(|i| {
            if tokens.mask[i] {
                tokens.target_ids[i]
            } else {
                ignore
            }
        })
        .collect()
}

fn mode_name(single_pass: bool) -> &'static str {
    if single_pass {
        "single_pass"
    } else {
        "two_pass"
    }
}
