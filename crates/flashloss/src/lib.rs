//! flashloss: fused GRPO and cross-entropy losses for LLM training that never hold the
//! `[tokens × vocab]` logits or their gradient.
//!
//! Layers: the spec layer knows no backend ([`config`], [`cross_entropy`], [`batch`], [`error`],
//! [`element`], [`policy`], [`reference`]); backends live in folders ([`cpu`]); sharded runs exchange data through
//! [`collective`]. The command-line tool's drivers (YAML configs, random inputs,
//! gradcheck, bench) are the `flashloss-tools` crate.
//! The math is `shared/spec/losses.md`.

#![warn(missing_docs)]

pub mod batch;
pub mod collective;
pub mod config;
pub mod cpu;
pub mod cross_entropy;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod device;
pub mod element;
pub mod error;
pub mod fused;
pub mod grpo_logits;
pub mod memory;
pub mod policy;
pub mod reference;
pub mod rows;

pub use batch::{
    GrpoBatch, GrpoBatchData, HeadShape, LinearInputs, LogitsLayout, PerSeqOrToken,
    PerSeqOrTokenBuf,
};
pub use config::{GrpoLoss, ImportanceSamplingLevel, LossConfig, LossType};
pub use cross_entropy::{CeConfig, CrossEntropy, Reduction};
pub use device::Device;
pub use element::{DType, Element};
pub use error::{Error, Result};
pub use fused::{
    CeLinearOutput, FusedOptions, Grid, GrpoLinearOutput, LinearGrads, Mode, Parallel, Plan, Shard,
};
pub use grpo_logits::GrpoLogitsForward;
pub use rows::RowStats;
