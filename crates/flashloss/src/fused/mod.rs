//! The fused LM-head losses, backend-neutral: GRPO and cross-entropy computed from
//! hidden states `[N, H]` and the head's weight `[V, H]` (and bias) without ever holding
//! the `[N, V]` logits or their gradient. A backend provides a [`Head`] (its buffers,
//! workspace and [`FusedPasses`]); the [`plan`] cuts the work to a memory budget; the
//! drivers here run each loss's per-row stage between the passes, once for every
//! backend, on one rank ([`grpo_linear`], [`ce_linear`], [`logp_linear`] and its
//! gradient [`logp_linear_grads`]) or sharded over a [`Grid`] of ranks
//! ([`grpo_linear_sharded`], [`ce_linear_sharded`], [`logp_linear_grads_sharded`]).
//! [`HeadGrad`] chooses whether the head's own gradients (dW, dbias) are formed.

mod ce;
mod gather;
mod grpo;
mod grpo_support;
pub(crate) mod key;
mod logp;
mod logp_request;
mod passes;
pub mod plan;
mod sharded;
mod split;
mod support;
mod terms;
mod two_pass;

pub use ce::{CeLinearOutput, ce_linear, ce_linear_lse, ce_row_losses};
pub use grpo::{GrpoLinearOutput, grpo_linear};
pub use key::support_key;
pub use logp::{
    LogpRows, logp_linear, logp_linear_grads, logp_linear_grads_with, logp_linear_with,
};
pub use logp_request::{GatherIds, LogpOutput, LogpRequest, LogpUpstream, SupportStats};
pub use passes::{
    FusedPasses, GradPart, GradsOf, Head, LinearGrads, LinearGradsMut, SinglePassHooks,
    SparseGrads, check_grad_lens,
};
pub use plan::{
    Bf16Products, Block, FusedOptions, HeadGrad, Mode, Plan, PlanLimits, mib_to_bytes, plan_blocks,
    tile_budget,
};
pub use sharded::{
    ce_linear_sharded, grpo_linear_sharded, logp_linear_grads_sharded,
    logp_linear_grads_sharded_with, logp_linear_sharded, logp_linear_sharded_with,
};
pub use split::{
    accumulate_row_grads, ce_accumulate_row_grads, ce_partial_row_states, partial_row_states,
};
pub use support::RowSupport;
pub use terms::{DeviceGatherSink, DeviceSinks, DeviceTopSink, RowGrad, SupportTerm, TileVisitor};
