//! The logits-level GRPO loss on the GPU: one kernel pass over each row for its
//! statistics (`row_states`: max, Σexp, entropy accumulator, target logit; one block
//! per row on a 1-D grid), the O(N) policy stage on the host ([`crate::grpo_logits`]),
//! and one kernel pass writing `dz_ij = (g/T)·[dlogp_i·(1[j=y_i] - p_ij) -
//! dentropy_i·p_ij·(log p_ij + H_i)]` in the logits' dtype, into a dense `[N, V]` buffer
//! or over the logits. Statistics in f32.

use super::device::{DeviceBuffer, Gpu, GpuElement, device_error};
use super::launch::{KernelLayout, RowCoef, cols_arg, rows_launch};
use super::selective_log_softmax::row_stats;
use crate::batch::{GrpoBatch, LogitsLayout};
use crate::error::Result;
use crate::grpo_config::GrpoLoss;
use crate::grpo_logits::GrpoLogitsForward;
use crate::policy::Normalizers;
use crate::rows::{RowTransform, check_row_stats};
use cudarc::driver::{DevicePtr, DevicePtrMut, PushKernelArg};

/// Forward of the GRPO loss on device logits `[B, T, V]` laid out as `layout`; the
/// per-token inputs in `batch` are on the host. Returns what the CPU forward returns.
pub fn grpo_logits_forward<E: GpuElement>(
    gpu: &Gpu,
    loss: &GrpoLoss,
    batch: &GrpoBatch,
    logits: &DeviceBuffer<E>,
    layout: &LogitsLayout,
) -> Result<GrpoLogitsForward> {
    GrpoLogitsForward::check_batch(loss, batch, layout, layout.vocab)?;
    layout.validate("logits", logits.len())?;
    let stats = row_stats(
        gpu,
        logits,
        layout,
        batch.target_ids,
        batch.mask,
        RowTransform::grpo(loss).inv_temp,
    )?;
    check_row_stats(&stats, |i| batch.mask[i], batch.target_ids, batch.seq_len)?;
    GrpoLogitsForward::from_stats(loss, batch, Normalizers::local(batch), stats, layout, None)
}

/// Writes `grad_output · ∂L/∂z` of `fwd` into `dlogits` (a dense `[N, V]` buffer), or
/// over `logits` when `dlogits` is `None`.
pub fn grpo_logits_backward<E: GpuElement>(
    gpu: &Gpu,
    fwd: &GrpoLogitsForward,
    logits: &mut DeviceBuffer<E>,
    grad_output: f32,
    dlogits: Option<&mut DeviceBuffer<E>>,
) -> Result<()> {
    fwd.check(logits.len(), grad_output)?;
    let layout = &fwd.layout;
    let (n, v) = (layout.rows(), layout.vocab);
    if let Some(d) = &dlogits {
        layout.validate_dense("dlogits", d.len())?;
    }
    if n == 0 {
        return Ok(());
    }
    let inv_temp = fwd.transform.inv_temp;
    let coefs: Vec<RowCoef> = (0..n)
        .map(|i| {
            let (st, dlogp, dentropy) = (&fwd.stats[i], fwd.dlogp()[i], fwd.dentropy()[i]);
            let c = fwd
                .transform
                .grpo_coefs(grad_output as f64, dlogp, dentropy);
            RowCoef {
                max: st.max,
                log_sum: st.log_sum,
                entropy: st.entropy,
                coef_p: c.p,
                coef_h: c.h,
                coef_uniform: 0.0,
                coef_target: c.target,
                target: fwd.targets[i],
                ..RowCoef::default()
            }
        })
        .collect();
    let coefs = gpu.upload(&coefs)?;
    let f = gpu.kernel(&format!("row_grad_{}", E::SUFFIX))?;
    let stream = gpu.stream();
    let (lz, cols) = (KernelLayout::of(layout), cols_arg(v)?);
    let (null, zero, col_offset) = (0u64, 0.0f32, 0i64);
    let launch_with = |z: u64, out: u64, lo: KernelLayout| -> Result<()> {
        let mut launch = stream.launch_builder(f);
        launch
            .arg(&z)
            .arg(&lz)
            .arg(&cols)
            .arg(&col_offset)
            .arg(&null)
            .arg(&inv_temp)
            .arg(&zero)
            .arg(&zero)
            .arg(coefs.slice())
            .arg(&out)
            .arg(&lo);
        // SAFETY: the arguments match `row_grad` in softmax_rows.cu; `z` and `out`
        // hold every row of their layouts.
        unsafe { launch.launch(rows_launch(n)?) }
            .map(|_| ())
            .map_err(|e| device_error("launching row_grad", e))
    };
    match dlogits {
        Some(d) => {
            let (z, _read) = logits.slice().device_ptr(stream);
            let (out, _write) = d.slice_mut().device_ptr_mut(stream);
            launch_with(z, out, KernelLayout::dense(n, v))
        }
        None => {
            let (z, _write) = logits.slice_mut().device_ptr_mut(stream);
            launch_with(z, z, lz)
        }
    }
}
