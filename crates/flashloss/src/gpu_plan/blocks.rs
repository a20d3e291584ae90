//! The GPU's plans: the largest row blocks whose tiles fit the budget less the cuBLAS
//! workspace, and the unfused baseline's plan. A block costs, per logit: f32 logits and
//! the bf16 `dZ` of bf16 heads (two-pass tiles, f32 single-pass rows), or, for a bf16
//! head's compact plan, 2 bytes: one bf16 chunk `[rows, V]` that the logits GEMM writes
//! (rounded to bf16, as an unfused bf16 head's logits are) and the row kernel turns into
//! `dZ` in place, the operand of the `dH` and `dW` products. Pure: no device (the CUDA
//! backend calls it, `cuda/cuda_head.rs`; `flashloss plan` asks it on a host).

use crate::element::DType;
use crate::error::Result;
use crate::fused::{Block, FusedOptions, HeadGrad, Mode, Plan, PlanLimits, plan_blocks};

/// Bytes of the cuBLAS workspace the CUDA backend gives each handle (counted in its
/// memory; NVIDIA recommends 32 MiB on Hopper).
pub const CUBLAS_WORKSPACE_BYTES: usize = 32 << 20;
/// Widest vocabulary tile of a two-pass product.
const VOCAB_TILE_MAX: usize = 16_384;
/// Largest row block (the products are near peak well before it).
const MAX_BLOCK_ROWS: usize = 8192;
/// Largest row block of a call without a budget (the device's default,
/// [`super::default_budget`]): the bf16 chunk ran fastest at 4196 rows on the H200 at
/// 17878ef (0.96x the unfused path; 2098 rows 0.99x, 8171 rows 1.01x: docs/results/gpu.md).
pub const DEFAULT_MAX_BLOCK_ROWS: usize = 4096;
/// Single-pass blocks with fewer rows make thin products; auto mode then chooses
/// two-pass.
const MIN_SINGLE_PASS_ROWS: usize = 1024;
/// Auto mode's rate model (`PlanLimits::half_rate_rows`): a block of `k` rows runs its
/// products at `k / (k + 480)` of the plain GEMM rate. From the H200 run at 429ab96
/// (docs/bench/gpu.md): two-pass blocks of 1706 rows at 512-516 TFLOP/s against the
/// same run's 657 TFLOP/s GEMM, `1706 / (1706 + 480) = 0.78`.
const HALF_RATE_ROWS: f64 = 480.0;

/// Bytes per logit of a plan's tiles: the f32 logits, and the bf16 `dZ` of bf16 heads.
pub(crate) fn tile_bytes(dtype: DType) -> usize {
    match dtype {
        DType::F32 => 4,
        // f16 never reaches the GPU's passes (`run_on_borrowed` refuses it).
        DType::Bf16 | DType::F16 => 6,
    }
}

/// Chooses the mode and block sizes on the GPU: the largest blocks whose tiles fit the
/// budget less the cuBLAS workspace (an unset budget: the CPU's default; the backend
/// resolves it from the device first, [`super::plan_on`]). `single_pass_allowed` is false
/// for losses that reduce over sequences.
pub fn plan(
    n: usize,
    v: usize,
    dtype: DType,
    opts: &FusedOptions,
    single_pass_allowed: bool,
) -> Result<Plan> {
    plan_rows(n, v, dtype, opts, single_pass_allowed, MAX_BLOCK_ROWS)
}

/// [`plan`] with blocks of at most `max_block_rows` rows.
pub(crate) fn plan_rows(
    n: usize,
    v: usize,
    dtype: DType,
    opts: &FusedOptions,
    single_pass_allowed: bool,
    max_block_rows: usize,
) -> Result<Plan> {
    let limits = PlanLimits {
        reserve_bytes: CUBLAS_WORKSPACE_BYTES,
        reserve_name: format!("the cuBLAS workspace of {CUBLAS_WORKSPACE_BYTES} bytes"),
        vocab_tile: v.min(VOCAB_TILE_MAX),
        max_block_rows,
        min_single_pass_rows: MIN_SINGLE_PASS_ROWS,
        half_rate_rows: HALF_RATE_ROWS,
        has_compact: has_compact(dtype, opts.mode),
        extra_name: "",
    };
    let per = tile_bytes(dtype);
    plan_blocks(
        n,
        v,
        &limits,
        |rows, block| match block {
            Block::Tile => rows * limits.vocab_tile * per,
            Block::Whole => rows * v * per,
            Block::Compact => rows * v * 2,
        },
        opts,
        single_pass_allowed,
    )
}

/// Whether a plan may take the bf16 chunk: a bf16 head, asked for (`mode: compact`) or
/// in auto mode, where the rate model takes it when it is faster (its logits carry the
/// rounding an unfused bf16 head's do: docs/results/gpu_chunk_rounding.md);
/// `auto_f32` keeps the f32 statistics.
pub(crate) fn has_compact(dtype: DType, mode: Mode) -> bool {
    dtype != DType::F32 && matches!(mode, Mode::Compact | Mode::Auto)
}

/// Auto mode's rate model on the GPU, `k / (k + half_rate_rows)` of the plain GEMM rate
/// for a block of `k` rows ([`PlanLimits::half_rate_rows`]).
pub fn half_rate_rows() -> f64 {
    HALF_RATE_ROWS
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fused::Mode;

    const V: usize = 151_936;

    fn plan_at(dtype: DType, mode: Mode, budget_mib: f64) -> Plan {
        plan(
            8192,
            V,
            dtype,
            &FusedOptions::from_mib(mode, budget_mib, 1.0),
            true,
        )
        .unwrap()
    }

    /// The bf16 chunk (2 bytes a logit) runs when asked (`mode: compact`) on a bf16
    /// head, with rows as the budget holds, and in auto mode where the rate model finds
    /// it faster (docs/results/gpu_chunk_rounding.md: its rounding is the unfused bf16
    /// path's); `auto_f32` keeps the f32 plans: f32 single-pass rows where they hold a
    /// useful block, two-pass below.
    #[test]
    fn the_bf16_chunk_runs_when_asked_or_faster_and_auto_f32_keeps_f32_statistics() {
        let chunk_rows = |mib: f64| {
            let p = plan_at(DType::Bf16, Mode::Compact, mib);
            assert!(p.single_pass && p.compact, "{mib} MiB: {p:?}");
            assert_eq!(p.workspace_bytes, p.block_rows * V * 2);
            assert!(p.workspace_bytes + CUBLAS_WORKSPACE_BYTES <= (mib * 1048576.0) as usize);
            p.block_rows
        };
        assert_eq!(chunk_rows(32.0 + 4096.0 * V as f64 * 2.0 / 1048576.0), 4096);
        assert_eq!(chunk_rows(32.0 + 2048.0 * V as f64 * 2.0 / 1048576.0), 2048);
        assert_eq!(chunk_rows(192.0), 552);
        // f32 logits and the bf16 dZ: 6 bytes a logit, single-pass from 1024 rows.
        let mib = 32.0 + 1706.0 * V as f64 * 6.0 / 1048576.0;
        let f32_stats = plan_at(DType::Bf16, Mode::AutoF32, mib);
        assert!(
            f32_stats.single_pass && !f32_stats.compact && f32_stats.block_rows == 1706,
            "{f32_stats:?}"
        );
        assert_eq!(f32_stats.workspace_bytes, f32_stats.block_rows * V * 6);
        // Auto: the chunk holds three times the rows, so the model finds it faster.
        let auto = plan_at(DType::Bf16, Mode::Auto, mib);
        assert!(
            auto.single_pass && auto.compact && auto.block_rows == 3 * 1706,
            "{auto:?}"
        );
        // 192 MiB: the chunk's 552 rows are below the useful 1024; two-pass either way.
        for mode in [Mode::Auto, Mode::AutoF32] {
            let tight = plan_at(DType::Bf16, mode, 192.0);
            assert!(!tight.single_pass && !tight.compact, "{tight:?}");
        }
        assert!(!has_compact(DType::Bf16, Mode::AutoF32) && has_compact(DType::Bf16, Mode::Auto));
        assert!(!has_compact(DType::F32, Mode::Auto) && !has_compact(DType::F32, Mode::Compact));
        // An f32 head has no chunk: compact runs as f32 single-pass.
        let f32_head = plan_at(DType::F32, Mode::Compact, 1248.0);
        assert!(f32_head.single_pass && !f32_head.compact);
        assert_eq!(f32_head.workspace_bytes, f32_head.block_rows * V * 4);
        let opts = FusedOptions::from_mib(Mode::Compact, 1248.0, 1.0);
        assert!(plan(8192, V, DType::Bf16, &opts, false).is_err());
    }
}
