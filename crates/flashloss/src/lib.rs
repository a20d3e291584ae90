//! flashloss: fused GRPO and cross-entropy losses for LLM training that never hold the
//! `[tokens × vocab]` logits or their gradient.
//!
//! Layers: the spec layer knows no backend ([`grpo_config`], [`temperature`], [`support_filter`], [`cross_entropy`], [`batch`],
//! [`error`], [`element`], [`policy`], [`reference`], [`rows`], [`weight_layout`]); the fused LM-head losses
//! are written once in [`fused`] over a backend's [`fused::Head`]; the backends are
//! sibling folders that never import each other ([`cpu`], and `cuda` with the feature);
//! [`device`] is the one entry point per loss over a [`Device`]; sharded runs exchange
//! data through [`collective`]. The command-line tool's drivers (YAML configs, random
//! inputs, gradcheck, bench) are the `flashloss-tools` crate. The math is
//! `docs/spec/losses.md`; `docs/design.md` maps the layout.

#![warn(missing_docs)]

pub mod batch;
pub mod collective;
pub mod cpu;
pub mod cross_entropy;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod device;
pub mod element;
pub mod error;
pub mod fused;
pub mod gpu_plan;
pub mod grpo_config;
pub mod grpo_logits;
pub mod memory;
pub mod policy;
pub mod range;
pub mod reference;
pub mod rows;
pub mod sharding;
pub mod support_filter;
pub mod temperature;
pub mod weight_layout;

pub use batch::{
    GrpoBatch, GrpoBatchData, HeadShape, LinearInputs, LogitsLayout, PerSeqOrToken,
    PerSeqOrTokenBuf,
};
pub use cross_entropy::{CeConfig, CrossEntropy, Reduction};
pub use device::{
    CeCall, CeUpstream, Device, GrpoCall, HeadArgs, LogpCall, LossCall, Returns, Vocab,
};
pub use element::{DType, Element};
pub use error::{Error, Result};
pub use fused::{
    Bf16Products, CeLinearOutput, FusedOptions, GrpoLinearOutput, HeadGrad, LinearGrads,
    LinearGradsMut, Mode, Plan,
};
pub use grpo_config::{GrpoLoss, GrpoLossConfig, ImportanceSamplingLevel, LossType};
pub use grpo_logits::GrpoLogitsForward;
pub use rows::RowStats;
pub use sharding::{Grid, Parallel, Shard, shard_range};
pub use support_filter::SupportFilter;
pub use temperature::Temperature;
pub use weight_layout::WeightLayout;
