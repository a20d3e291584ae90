//! The GPU's budget where a call gives none. The CPU takes a fixed 160 MiB
//! ([`DEFAULT_BUDGET_MIB`]); on the GPU that budget holds only a two-pass plan at the
//! issue-51 shape (N = 8192, H = 4096, V = 151936, bf16: 1.42x the unfused path's time on
//! an H200 at 17878ef), while a bigger block runs near the GEMM rate. The device's default
//! is the largest budget that keeps the call's peak (arguments, outputs, workspace) within
//! [`PEAK_SHARE`] of the unfused path's peak and takes at most [`FREE_SHARE`] of the free
//! memory; its blocks hold at most [`DEFAULT_MAX_BLOCK_ROWS`] rows. Where even the
//! arguments and outputs exceed that share of the unfused peak (an f32 head at the issue
//! shape, or a few rows against a big head), no budget can keep it, and the CPU's 160 MiB
//! is taken: the plan of a call without a budget before issue 51.

use super::blocks::{
    CUBLAS_WORKSPACE_BYTES, DEFAULT_MAX_BLOCK_ROWS, materialized_plan, plan, plan_rows,
};
use crate::element::DType;
use crate::error::Result;
use crate::fused::plan::{DEFAULT_BUDGET_MIB, mib_to_bytes};
use crate::fused::{FusedOptions, HeadGrad, Plan};
use serde::Serialize;

/// Share of the unfused path's peak a call without a budget may reach (issue 41's
/// target: at most 0.5x the peak).
pub const PEAK_SHARE: f64 = 0.5;
/// Share of the device's free memory (after the call's arguments and outputs) a call
/// without a budget may take for its workspace.
pub const FREE_SHARE: f64 = 0.5;

/// What a call holds on the device besides a plan's workspace: its arguments (hidden
/// states `[N, H]` and the weight `[V, H]` in the head's dtype) and its outputs (the f32
/// `dH` `[N, H]`, and `dW` `[V, H]` of a trainable head; none for a call without
/// gradients). Per-row vectors (ids, coefficients, states: O(N)) and a bias are left out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct CallShape {
    /// Rows (tokens).
    pub n: usize,
    /// Hidden size.
    pub h: usize,
    /// Vocabulary entries.
    pub v: usize,
    /// The head's dtype.
    pub dtype: DType,
    /// The gradients formed (`None`: a forward, e.g. log-probs without gradients).
    pub grads: Option<HeadGrad>,
}

impl CallShape {
    /// Bytes of the arguments and outputs.
    pub fn base_bytes(&self) -> usize {
        let (n, h, v) = (self.n, self.h, self.v);
        let args = (n * h + v * h) * self.dtype.size();
        let outputs = match self.grads {
            None => 0,
            Some(HeadGrad::Frozen) => n * h * 4,
            Some(HeadGrad::Full) => (n * h + v * h) * 4,
        };
        args + outputs
    }

    /// The peak of `plan` on this call: arguments, outputs, workspace and reserve.
    pub fn peak_bytes(&self, plan: &Plan) -> usize {
        self.base_bytes() + plan.workspace_bytes + plan.gemm_reserve_bytes
    }

    /// The peak of the unfused path ([`materialized_plan`]: the `[N, V]` logits and
    /// their gradient).
    pub fn unfused_peak_bytes(&self) -> usize {
        self.peak_bytes(&materialized_plan(self.n, self.v, self.dtype))
    }
}

/// What bounded a device's default budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BudgetBound {
    /// [`PEAK_SHARE`] of the unfused path's peak.
    Peak,
    /// [`FREE_SHARE`] of the free memory.
    Free,
    /// Neither leaves the CPU's 160 MiB: that is taken.
    Floor,
}

/// A device's default budget for one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct DefaultBudget {
    /// Bytes of workspace, the cuBLAS workspace included.
    pub bytes: usize,
    /// What bounded it.
    pub bound: BudgetBound,
}

/// The budget of `shape` on a device with `free_bytes` free (after its arguments and
/// outputs): the smaller of what keeps the peak within [`PEAK_SHARE`] of the unfused
/// path's and [`FREE_SHARE`] of `free_bytes`, or the CPU's 160 MiB where that is less.
pub fn default_budget(shape: &CallShape, free_bytes: usize) -> DefaultBudget {
    let peak = (shape.unfused_peak_bytes() as f64 * PEAK_SHARE) as usize;
    let by_peak = peak.saturating_sub(shape.base_bytes());
    let by_free = (free_bytes as f64 * FREE_SHARE) as usize;
    let floor = mib_to_bytes(DEFAULT_BUDGET_MIB);
    let (bytes, bound) = if by_peak <= by_free {
        (by_peak, BudgetBound::Peak)
    } else {
        (by_free, BudgetBound::Free)
    };
    if bytes < floor.max(CUBLAS_WORKSPACE_BYTES) {
        return DefaultBudget {
            bytes: floor,
            bound: BudgetBound::Floor,
        };
    }
    DefaultBudget { bytes, bound }
}

/// The plan of `shape` on a device with `free_bytes` free: as given where `opts` has a
/// budget; without one, within [`default_budget`] and blocks of at most
/// [`DEFAULT_MAX_BLOCK_ROWS`] rows.
pub fn plan_on(
    shape: &CallShape,
    free_bytes: usize,
    opts: &FusedOptions,
    single_pass_allowed: bool,
) -> Result<Plan> {
    let (n, v, dtype) = (shape.n, shape.v, shape.dtype);
    if opts.budget_bytes.is_some() {
        return plan(n, v, dtype, opts, single_pass_allowed);
    }
    let budget = default_budget(shape, free_bytes).bytes;
    let opts = opts.or_budget(budget);
    plan_rows(
        n,
        v,
        dtype,
        &opts,
        single_pass_allowed,
        DEFAULT_MAX_BLOCK_ROWS,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fused::Mode;

    const GIB: usize = 1 << 30;
    const V: usize = 151_936;

    fn shape(n: usize, dtype: DType) -> CallShape {
        CallShape {
            n,
            h: 4096,
            v: V,
            dtype,
            grads: Some(HeadGrad::Full),
        }
    }

    /// The issue shape in bf16: 3.67 GiB of arguments and outputs, 10.66 GiB unfused
    /// (docs/results/gpu.md: measured 10.65 GiB); the default keeps 0.5x of it.
    #[test]
    fn the_default_budget_keeps_half_the_unfused_peak() {
        let s = shape(8192, DType::Bf16);
        assert_eq!(s.base_bytes(), (8192 + V) * 4096 * 6);
        assert!((s.unfused_peak_bytes() as f64 / GIB as f64 - 10.66).abs() < 0.01);
        let b = default_budget(&s, 130 * GIB);
        assert_eq!(b.bound, BudgetBound::Peak);
        assert_eq!(s.base_bytes() + b.bytes, s.unfused_peak_bytes() / 2);
        // Little free memory: a share of it.
        let tight = default_budget(&s, GIB);
        assert_eq!((tight.bytes, tight.bound), (GIB / 2, BudgetBound::Free));
        // Less free than the floor: the CPU's 160 MiB.
        let floor = default_budget(&s, 100 << 20);
        assert_eq!((floor.bytes, floor.bound), (160 << 20, BudgetBound::Floor));
        // An f32 head: arguments and outputs alone are above 0.5x the unfused peak.
        let f = shape(8192, DType::F32);
        assert!(f.base_bytes() > f.unfused_peak_bytes() / 2);
        assert_eq!(default_budget(&f, 130 * GIB).bound, BudgetBound::Floor);
        // A forward has no outputs: more of the peak is left to the workspace.
        let fwd = CallShape { grads: None, ..s };
        assert!(default_budget(&fwd, 130 * GIB).bytes > b.bytes);
    }

    /// Without a budget a bf16 head at the issue shape takes the bf16 chunk at 4096 rows
    /// (auto) or f32 single-pass rows (auto_f32), each within 0.5x the unfused peak; a
    /// given budget plans as before (192 MiB: two-pass).
    #[test]
    fn a_call_without_a_budget_plans_from_the_device() {
        let s = shape(8192, DType::Bf16);
        let at = |mode: Mode, mib: Option<f64>| {
            plan_on(&s, 130 * GIB, &FusedOptions::from_mib(mode, mib, 1.0), true).unwrap()
        };
        let auto = at(Mode::Auto, None);
        assert!(auto.single_pass && auto.compact, "{auto:?}");
        assert_eq!(auto.block_rows, DEFAULT_MAX_BLOCK_ROWS);
        assert!(s.peak_bytes(&auto) * 2 <= s.unfused_peak_bytes());
        let f32_stats = at(Mode::AutoF32, None);
        assert!(f32_stats.single_pass && !f32_stats.compact, "{f32_stats:?}");
        assert!(f32_stats.block_rows > 1900 && f32_stats.block_rows < 1950);
        assert!(s.peak_bytes(&f32_stats) * 2 <= s.unfused_peak_bytes());
        let given = at(Mode::Auto, Some(192.0));
        assert!(!given.single_pass, "{given:?}");
        // Two-pass asked for: the device's budget, rows capped at 4096.
        let two = at(Mode::TwoPass, None);
        assert!(!two.single_pass && two.block_rows == DEFAULT_MAX_BLOCK_ROWS);
        // An f32 head: the CPU's 160 MiB, two-pass, as before issue 51.
        let f = shape(8192, DType::F32);
        let f32_head = plan_on(&f, 130 * GIB, &FusedOptions::default(), true).unwrap();
        let before = plan(8192, V, DType::F32, &FusedOptions::default(), true);
        assert_eq!(f32_head, before.unwrap());
        assert!(!f32_head.single_pass);
    }
}
