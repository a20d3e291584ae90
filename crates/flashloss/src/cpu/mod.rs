//! The CPU backend: multithreaded (rayon, over rows) and vectorized kernels, one file
//! per kernel. Results are bitwise identical for any thread count: every row is
//! computed by one thread in a fixed order, reductions across rows are serial, and the
//! compact block's lanes are a fixed number, merged in lane order.
//! [`CpuHead`] is its [`crate::fused::Head`] for the fused LM-head losses.

mod baseline_linear;
pub mod bf16_choice;
pub mod bf16_gemm;
mod grpo_logits;
mod grpo_logits_staged;
pub mod matmul;
mod online_softmax;
mod passes;
mod products;
mod row_blocks;
mod selective_log_softmax;
pub mod simd;
mod single_pass;
mod support_grad;
mod tiles;
mod unfused_logits;

pub use baseline_linear::{
    BaselineWorkspace, ce_linear_baseline_into, grpo_linear_baseline, grpo_linear_baseline_into,
};
pub use bf16_choice::{BF16_PRODUCTS_ENV, Bf16Choice, Bf16Rates, Bf16Reason, bf16_products_choice};
pub use bf16_gemm::Avx512Bf16;
pub use grpo_logits::{
    grpo_logits_forward, grpo_logits_forward_per_token, grpo_logits_forward_sharded,
    grpo_logits_forward_with,
};
pub use grpo_logits_staged::{StagedForward, grpo_logits_forward_staged};
pub use online_softmax::{VOCAB_TILE, row_state, tile_state};
pub use passes::{CpuHead, GEMM_SCRATCH_PER_THREAD, gemm_reserve_bytes, plan};
pub use selective_log_softmax::selective_log_softmax;
pub use tiles::Workspace;
pub use unfused_logits::{UnfusedWorkspace, grpo_logits_unfused, grpo_logits_unfused_into};
