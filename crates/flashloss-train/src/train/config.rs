//! The training config (`configs/train/*.yaml`): every key has a default, unknown keys
//! are errors naming the key.

use super::optim::OptimConfig;
use crate::model::{Qwen2Config, Sampling};
use crate::task::Arithmetic;
use flashloss::{CeConfig, GrpoLossConfig};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// Which loss path trains the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LossImpl {
    /// candle ops on materialized `[N, V]` logits (log-softmax, gather, TRL's formulas).
    Baseline,
    /// The fused LM-head kernels: no `[N, V]` tensor (GRPO and the SFT cross-entropy).
    Fused,
    /// Materialized logits with the logits-level GRPO kernel (SFT as baseline).
    Logits,
}

/// The loss switch and its options.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LossSwitch {
    /// `baseline | fused | logits`.
    #[serde(rename = "impl")]
    pub implementation: LossImpl,
    /// Logit workspace of the fused kernels, MiB.
    pub budget_mib: usize,
    /// The GRPO loss (TRL's keys: `loss_type`, `beta`, `epsilon_low`, ...).
    pub grpo: GrpoLossConfig,
    /// The SFT cross-entropy.
    pub ce: CeConfig,
}

impl Default for LossSwitch {
    fn default() -> Self {
        LossSwitch {
            implementation: LossImpl::Fused,
            budget_mib: 64,
            grpo: GrpoLossConfig {
                beta: 0.04,
                ..GrpoLossConfig::default()
            },
            ce: CeConfig::default(),
        }
    }
}

/// Where the model comes from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelSource {
    /// A Hugging Face folder (`config.json`, `model.safetensors`); unset: random
    /// weights of `config`.
    pub pretrained: Option<PathBuf>,
    /// The architecture of a randomly initialized model.
    pub config: Qwen2Config,
}

impl Default for ModelSource {
    fn default() -> Self {
        ModelSource {
            pretrained: None,
            config: Qwen2Config {
                vocab_size: 128,
                hidden_size: 64,
                intermediate_size: 192,
                num_hidden_layers: 2,
                num_attention_heads: 4,
                num_key_value_heads: 2,
                max_position_embeddings: 128,
                rope_theta: 10_000.0,
                rms_norm_eps: 1e-6,
                tie_word_embeddings: false,
            },
        }
    }
}

/// The tokenizer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TokenizerSource {
    /// A `tokenizer.json`; unset: the built-in character tokenizer.
    pub file: Option<PathBuf>,
    /// End-of-sequence token of a `tokenizer.json`.
    pub eos_token: String,
}

impl Default for TokenizerSource {
    fn default() -> Self {
        TokenizerSource {
            file: None,
            eos_token: "<|endoftext|>".into(),
        }
    }
}

/// The problems.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TaskConfig {
    /// GSM8K JSON lines; unset: generated arithmetic.
    pub gsm8k: Option<PathBuf>,
    /// The generator's settings.
    pub arithmetic: Arithmetic,
    /// Reward for a parsable `#### N`, added to the correctness reward (0 or 1).
    pub format_reward: f64,
}

impl Default for TaskConfig {
    fn default() -> Self {
        TaskConfig {
            gsm8k: None,
            arithmetic: Arithmetic::default(),
            format_reward: 0.1,
        }
    }
}

/// The supervised warm-up (fused or baseline cross-entropy on the worked answers).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SftConfig {
    /// Optimizer steps.
    pub steps: usize,
    /// Problems per step.
    pub batch_size: usize,
    /// Learning rate.
    pub lr: f64,
}

impl Default for SftConfig {
    fn default() -> Self {
        SftConfig {
            steps: 150,
            batch_size: 32,
            lr: 3e-3,
        }
    }
}

/// GRPO sampling and updates.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GrpoConfig {
    /// Prompts per generation.
    pub prompts_per_step: usize,
    /// G completions per prompt.
    pub group_size: usize,
    /// μ: optimizer steps per generated batch (old log-probs come from the policy that
    /// sampled it; μ = 1 is on-policy, ratio 1).
    pub num_iterations: usize,
    /// Learning rate.
    pub lr: f64,
    /// Completion sampling.
    pub sampling: Sampling,
}

impl Default for GrpoConfig {
    fn default() -> Self {
        GrpoConfig {
            prompts_per_step: 8,
            group_size: 8,
            num_iterations: 1,
            lr: 1e-3,
            sampling: Sampling::default(),
        }
    }
}

/// A training run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    /// Seeds the weights, the problems and the sampling of every step.
    pub seed: u64,
    /// GRPO optimizer steps (after the warm-up).
    pub steps: usize,
    /// Where metrics, checkpoints and the resolved config go.
    pub out_dir: PathBuf,
    /// Save a checkpoint every k steps (0 = only at the end).
    pub checkpoint_every: usize,
    /// Continue from `out_dir`'s checkpoint when there is one.
    pub resume: bool,
    /// The model.
    pub model: ModelSource,
    /// The tokenizer.
    pub tokenizer: TokenizerSource,
    /// The problems.
    pub task: TaskConfig,
    /// The warm-up.
    pub sft: SftConfig,
    /// GRPO.
    pub grpo: GrpoConfig,
    /// AdamW.
    pub optim: OptimConfig,
    /// The loss switch.
    pub loss: LossSwitch,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            seed: 0,
            steps: 100,
            out_dir: PathBuf::from("runs/default"),
            checkpoint_every: 25,
            resume: true,
            model: ModelSource::default(),
            tokenizer: TokenizerSource::default(),
            task: TaskConfig::default(),
            sft: SftConfig::default(),
            grpo: GrpoConfig::default(),
            optim: OptimConfig::default(),
            loss: LossSwitch::default(),
        }
    }
}
