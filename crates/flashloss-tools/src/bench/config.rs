//! What a bench runs: the config file (`configs/bench/*.yaml`).

use crate::gradcheck::Backend;
use flashloss::{Bf16Products, FusedOptions, HeadGrad, Mode, Parallel};
use flashloss::{CeConfig, DType, GrpoLossConfig};
use serde::{Deserialize, Serialize};

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
    /// The log-prob gradient (`linear_logprobs`' backward: upstream 1 on every row's
    /// `logp`; level `linear` only, no baseline). With `gather_k`, also the same call
    /// with `gather_k` candidate ids per row and their cotangents, timed beside it; with
    /// `top_k`/`top_p`/`min_p`, the call under that truncated support.
    Logprobs,
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
    /// Fraction of the N tokens that are padding, at the end (masked for GRPO, targets
    /// at `ce.ignore_index` for CE): rows the fused step leaves out of its products.
    pub padding: f64,
    /// Fused linear recomputation mode.
    pub mode: Mode,
    /// Fused linear workspace budget in MiB (includes the GEMM reserve, or on the GPU
    /// the cuBLAS workspace); omitted: the device's default (the CPU's 160 MiB; on the
    /// GPU from its memory, `flashloss::gpu_plan::default_budget`).
    pub budget_mib: Option<f64>,
    /// The CPU's products on a bf16 head (`auto`, `widened`, `avx512bf16`).
    pub bf16_products: Bf16Products,
    /// The head's own gradients (level `linear`): `full` (dW, dbias) or `frozen` (dH
    /// alone, no dW buffer or product).
    pub head_grad: HeadGrad,
    /// Where the step runs (`cuda`: GPU 0, level `linear`, a build with feature `cuda`).
    pub device: Backend,
    /// The GRPO loss.
    pub grpo: GrpoLossConfig,
    /// The cross-entropy loss.
    pub ce: CeConfig,
    /// Candidate ids per row of a `logprobs` bench's second call (0: none).
    pub gather_k: usize,
    /// A `logprobs` or `grpo` bench's truncated support (vLLM's top-k, top-p, min-p):
    /// where any is set, the call (the GRPO step) under that support ("fused_support",
    /// with its extra passes in the notes) is timed beside the plain one.
    pub top_k: Option<usize>,
    /// See [`BenchConfig::top_k`].
    pub top_p: Option<f64>,
    /// See [`BenchConfig::top_k`].
    pub min_p: Option<f64>,
}

impl BenchConfig {
    /// The truncated support of a `logprobs` or `grpo` bench, where any of its keys is set.
    pub fn support(&self) -> Option<flashloss::SupportFilter> {
        let f = flashloss::SupportFilter {
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
        };
        (f.top_k.is_some() || f.top_p.is_some() || f.min_p.is_some()).then_some(f)
    }

    /// The fused kernel's options (mode, budget, bf16 products, head gradients),
    /// `grad_output` 1.
    pub fn fused_options(&self) -> FusedOptions {
        FusedOptions {
            bf16_products: self.bf16_products,
            head_grad: self.head_grad,
            ..FusedOptions::from_mib(self.mode, self.budget_mib, 1.0)
        }
    }
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
            padding: 0.0,
            mode: Mode::Auto,
            budget_mib: None,
            bf16_products: Bf16Products::Auto,
            head_grad: HeadGrad::Full,
            device: Backend::Cpu,
            grpo: GrpoLossConfig::default(),
            ce: CeConfig::default(),
            gather_k: 0,
            top_k: None,
            top_p: None,
            min_p: None,
        }
    }
}
