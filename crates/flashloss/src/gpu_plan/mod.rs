//! The GPU's planning, without a device: the plans of the CUDA backend ([`plan`],
//! [`materialized_plan`], the unfused baseline's), the budget of a call that gives none
//! ([`default_budget`]: a share of the device's free memory, bounded so that the call's
//! peak stays within half the unfused path's), and a planning query for a named device
//! ([`query`], `flashloss plan`). Nothing here touches a device or imports the `cuda`
//! backend, so it builds and is tested without the `cuda` feature; `cuda/` calls it with
//! the memory `cuMemGetInfo` reports.

mod blocks;
mod budget;
pub mod query;

pub use blocks::{
    CUBLAS_WORKSPACE_BYTES, DEFAULT_MAX_BLOCK_ROWS, half_rate_rows, materialized_plan, plan,
};
pub use budget::{
    BudgetBound, CallShape, DefaultBudget, FREE_SHARE, PEAK_SHARE, default_budget, plan_on,
};
