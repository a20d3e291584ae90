//! The GPU's plans: the largest row blocks whose tiles (f32 logits, and the bf16 `dZ` of
//! bf16 heads) fit the budget less the cuBLAS workspace, and the unfused baseline's plan.

use super::blas::CUBLAS_WORKSPACE_BYTES;
use crate::element::DType;
use crate::error::Result;
use crate::fused::{Block, FusedOptions, HeadGrad, Plan, PlanLimits, plan_blocks};

/// Widest vocabulary tile of a two-pass product.
const VOCAB_TILE_MAX: usize = 16_384;
/// Largest row block (the products are near peak well before it).
const MAX_BLOCK_ROWS: usize = 8192;
/// Single-pass blocks with fewer rows make thin products; auto mode then chooses
/// two-pass.
const MIN_SINGLE_PASS_ROWS: usize = 1024;

/// Bytes per logit of a plan's tiles: the f32 logits, and the bf16 `dZ` of bf16 heads.
fn tile_bytes(dtype: DType) -> usize {
    match dtype {
        DType::F32 => 4,
        // f16 never reaches the GPU's passes (`run_on_borrowed` refuses it).
        DType::Bf16 | DType::F16 => 6,
    }
}

/// Chooses the mode and block sizes on the GPU: the largest blocks whose tiles fit the
/// budget less the cuBLAS workspace. `single_pass_allowed` is false for losses that
/// reduce over sequences.
pub fn plan(
    n: usize,
    v: usize,
    dtype: DType,
    opts: &FusedOptions,
    single_pass_allowed: bool,
) -> Result<Plan> {
    let limits = PlanLimits {
        reserve_bytes: CUBLAS_WORKSPACE_BYTES,
        reserve_name: format!("the cuBLAS workspace of {CUBLAS_WORKSPACE_BYTES} bytes"),
        vocab_tile: v.min(VOCAB_TILE_MAX),
        max_block_rows: MAX_BLOCK_ROWS,
        min_single_pass_rows: MIN_SINGLE_PASS_ROWS,
        half_rate_rows: 0.0,
        has_compact: false,
        extra_name: "",
    };
    let per = tile_bytes(dtype);
    plan_blocks(
        n,
        v,
        &limits,
        |rows, block| match block {
            Block::Tile => rows * limits.vocab_tile * per,
            Block::Whole | Block::Compact => rows * v * per,
        },
        opts,
        single_pass_allowed,
    )
}

/// The unfused baseline's plan: one block of all `n` rows over the whole vocabulary,
/// i.e. the `[N, V]` logits (f32) and their gradient (in place, or bf16) materialized.
pub fn materialized_plan(n: usize, v: usize, dtype: DType) -> Plan {
    Plan {
        single_pass: true,
        compact: false,
        block_rows: n,
        vocab_tile: v,
        workspace_bytes: n * v * tile_bytes(dtype),
        gemm_reserve_bytes: CUBLAS_WORKSPACE_BYTES,
        bf16_products: None,
        head_grad: HeadGrad::Full,
    }
}
