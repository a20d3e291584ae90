//! The CPU backend: multithreaded (rayon, over rows) and vectorized kernels, one file
//! per kernel. Results are bitwise identical for any thread count: every row is
//! computed by one thread in a fixed order, and reductions across rows are serial.

mod baseline_linear;
mod ce_linear;
mod fused_linear;
mod grpo_linear;
mod grpo_logits;
mod logp_linear;
pub mod matmul;
mod online_softmax;
mod selective_log_softmax;
mod sharded_linear;
pub mod simd;
mod unfused_logits;

pub use baseline_linear::{
    BaselineWorkspace, ce_linear_baseline_into, grpo_linear_baseline, grpo_linear_baseline_into,
};
pub use ce_linear::{CeLinearOutput, ce_linear, ce_linear_into};
#[cfg(feature = "cuda")]
pub(crate) use ce_linear::{CeRows, ce_fused};
pub use fused_linear::{
    FusedOptions, GEMM_SCRATCH_PER_THREAD, LinearGrads, Mode, Plan, Workspace, gemm_reserve_bytes,
};
#[cfg(feature = "cuda")]
pub(crate) use fused_linear::{FusedPasses, GradsOf, RowGrad, check_grad_lens};
pub use grpo_linear::{GrpoLinearOutput, grpo_linear, grpo_linear_into, grpo_linear_with};
#[cfg(feature = "cuda")]
pub(crate) use grpo_linear::{check_batch as check_grpo_batch, grpo_fused};
pub use grpo_logits::{GrpoLogitsForward, grpo_logits_forward, grpo_logits_forward_with};
pub use logp_linear::logp_linear;
pub use online_softmax::{OnlineSoftmax, RowStats, VOCAB_TILE};
pub use selective_log_softmax::selective_log_softmax;
#[cfg(feature = "cuda")]
pub(crate) use selective_log_softmax::{check_row_stats, check_targets};
pub use sharded_linear::{
    Grid, Parallel, VocabShard, ce_linear_grid, ce_linear_token_parallel, ce_linear_vocab_parallel,
    grpo_linear_grid, grpo_linear_token_parallel, grpo_linear_vocab_parallel, shard_range,
};
pub use unfused_logits::{UnfusedWorkspace, grpo_logits_unfused, grpo_logits_unfused_into};
