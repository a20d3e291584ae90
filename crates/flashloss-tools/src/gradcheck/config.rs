//! What gradcheck runs: the config file (`configs/gradcheck/*.yaml`) and its gates.

use crate::inputs::InputSpec;
use flashloss::SupportFilter;
use flashloss::{Bf16Products, HeadGrad, Mode, Parallel};
use flashloss::{CeConfig, DType, GrpoLossConfig};
use serde::{Deserialize, Serialize};

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
    /// The log-prob primitive (`linear_logprobs`; `logprobs:` holds its config): the
    /// gradient of `g·Σ_i [g_logp·logp_i + g_H·H_i + g_lse·lse_i + Σ_k c_ik·logp_ik]`
    /// for random upstream gradients.
    Logprobs,
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
    /// The rank's kernel reads wrong inputs: its hidden states (logits at kernel
    /// `logits`) scaled by `1 + 2^-4`, the reference keeping them: its gates must FAIL.
    Perturb,
}

/// Where the kernel runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Backend {
    /// The CPU backend.
    #[default]
    Cpu,
    /// GPU 0 through the CUDA backend (a build with feature `cuda`).
    Cuda,
}

impl Backend {
    /// The library's device (GPU 0 for `cuda`): an error without the `cuda` feature or
    /// a driver.
    pub fn open(self) -> flashloss::Result<flashloss::Device> {
        match self {
            Backend::Cpu => Ok(flashloss::Device::cpu()),
            Backend::Cuda => flashloss::Device::cuda(0),
        }
    }
}

/// The gradcheck config file (`configs/gradcheck/*.yaml`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GradcheckConfig {
    /// Which kernel.
    pub kernel: Kernel,
    /// Where it runs.
    pub device: Backend,
    /// Which loss (`ce` needs kernel `linear`).
    pub objective: Objective,
    /// How `--ranks P` splits the work (kernel `linear`).
    pub parallel: Parallel,
    /// Vocab groups of a `2d` grid (they must divide P; token groups = P / vocab_groups).
    pub vocab_groups: Option<usize>,
    /// Seconds a rank of a sharded run waits for its peers in one collective.
    pub timeout_s: f64,
    /// A fault injected on one rank of a sharded run, to see the run fail together (`nan`
    /// and `perturb` also on rank 0 of a one-rank run of kernel `linear`).
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
    /// Draw a policy mask (off-policy mask) with this masked fraction; 0: none.
    pub policy_mask_fraction: f64,
    /// Draw an entropy (top-entropy) mask with this masked fraction; 0: none.
    pub entropy_mask_fraction: f64,
    /// Upstream gradient that scales `dlogits`.
    pub grad_output: f64,
    /// Write `dlogits` over the logits.
    pub in_place: bool,
    /// The GRPO loss.
    pub loss: GrpoLossConfig,
    /// The cross-entropy loss (objective `ce`).
    pub ce: CeConfig,
    /// The log-prob call (objective `logprobs`).
    pub logprobs: LogprobsConfig,
    /// H (kernel `linear`).
    pub hidden: usize,
    /// Give the LM head a bias (kernel `linear`).
    pub bias: bool,
    /// Recomputation mode (kernel `linear`).
    pub mode: Mode,
    /// Workspace budget in MiB, GEMM reserve included (kernel `linear`).
    pub budget_mib: f64,
    /// The CPU's products on a bf16 head (`auto`, `widened`, `avx512bf16`; kernel `linear`).
    pub bf16_products: Bf16Products,
    /// The head's own gradients (kernel `linear`): `full`, or `frozen` (dH alone; the
    /// gates check that no dW or dbias came back).
    pub head_grad: HeadGrad,
    /// Gates; unset ones take the spec's value for `dtype`.
    pub tolerance: Tolerance,
}

impl Default for GradcheckConfig {
    fn default() -> Self {
        let inputs = InputSpec::default();
        GradcheckConfig {
            kernel: Kernel::Logits,
            device: Backend::Cpu,
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
            policy_mask_fraction: inputs.policy_mask_fraction,
            entropy_mask_fraction: inputs.entropy_mask_fraction,
            grad_output: 1.0,
            in_place: false,
            loss: GrpoLossConfig::default(),
            ce: CeConfig::default(),
            logprobs: LogprobsConfig::default(),
            hidden: 64,
            bias: true,
            mode: Mode::Auto,
            budget_mib: 64.0,
            bf16_products: Bf16Products::Auto,
            head_grad: HeadGrad::Full,
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
            policy_mask_fraction: self.policy_mask_fraction,
            entropy_mask_fraction: self.entropy_mask_fraction,
            draw_logits: true,
        }
    }
}

/// The log-prob call of objective `logprobs` (spec: "Per-token statistics beyond logp
/// and entropy"): what it asks beyond `logp`, `lse` and entropy, and which upstream
/// gradients are drawn (`logp` and entropy always).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogprobsConfig {
    /// The logits are divided by it.
    pub temperature: f64,
    /// Return `Σ_j p_ij²` (gated, not differentiated).
    pub return_sum_p2: bool,
    /// Candidate ids drawn per row (some equal to the target, repeats allowed), with
    /// random upstream gradients of their log-probs; 0: none.
    pub gather_k: usize,
    /// The truncated support (vLLM's top-k, top-p, min-p; unset: none): `logp^K`
    /// replaces `logp` in the objective.
    pub top_k: Option<usize>,
    /// See [`LogprobsConfig::top_k`].
    pub top_p: Option<f64>,
    /// See [`LogprobsConfig::top_k`].
    pub min_p: Option<f64>,
    /// Draw an upstream gradient of `lse`.
    pub lse_grad: bool,
}

impl Default for LogprobsConfig {
    fn default() -> Self {
        LogprobsConfig {
            temperature: 1.0,
            return_sum_p2: false,
            gather_k: 0,
            top_k: None,
            top_p: None,
            min_p: None,
            lse_grad: false,
        }
    }
}

impl LogprobsConfig {
    /// The truncated support, where any of its keys is set.
    pub fn support(&self) -> Option<SupportFilter> {
        let f = SupportFilter {
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
        };
        (f.top_k.is_some() || f.top_p.is_some() || f.min_p.is_some()).then_some(f)
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
            // f16 inputs widen exactly and run in f32; only a stored gradient (the
            // logits level's) is rounded, to 2^-11 relative.
            DType::F16 => (1e-5, 1e-3),
        };
        Tolerance {
            loss_rel: Some(self.loss_rel.unwrap_or(loss)),
            logp_rel: Some(self.logp_rel.unwrap_or(1e-5)),
            grad_rel: Some(self.grad_rel.unwrap_or(grad)),
            grad_atol: Some(self.grad_atol.unwrap_or(1e-6)),
        }
    }
}
