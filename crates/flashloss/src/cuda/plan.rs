//! The GPU's plans on a device: the pure decisions are `crate::gpu_plan`'s (they build
//! and are tested without the `cuda` feature); here a call without a budget gets the
//! device's free memory (`cuMemGetInfo`) to plan from.

use super::device::Gpu;
use crate::error::Result;
use crate::fused::{FusedOptions, Plan};
use crate::gpu_plan::{CallShape, plan_on};
pub use crate::gpu_plan::{materialized_plan, plan};

/// The plan of `shape` on `gpu`: [`plan`] where `opts` has a budget; without one, within
/// the device's default (`gpu_plan::default_budget`, from the memory free now).
pub(crate) fn plan_on_device(
    gpu: &Gpu,
    shape: &CallShape,
    opts: &FusedOptions,
    single_pass_allowed: bool,
) -> Result<Plan> {
    if opts.budget_bytes.is_some() {
        return plan(shape.n, shape.v, shape.dtype, opts, single_pass_allowed);
    }
    let (free, _total) = gpu.mem_get_info()?;
    plan_on(shape, free, opts, single_pass_allowed)
}
