//! Selective log-softmax on the GPU (no gradient): per-row `logp` of the target, `lse`
//! and entropy of device logits, one `row_states` pass over each row (one block per
//! row). The old- and reference-policy passes of GRPO, and the forward of the
//! logits-level GRPO kernel.

use super::device::{DeviceBuffer, Gpu, GpuElement, device_error};
use super::launch::{KernelLayout, cols_arg, rows_launch};
use crate::batch::LogitsLayout;
use crate::error::Result;
use crate::rows::{OnlineSoftmax, RowStats, RowTransform, check_row_stats, check_targets};
use crate::temperature::Temperature;
use cudarc::driver::PushKernelArg;

/// Per-row statistics of `logits · inv_temp` (device, laid out as `layout`, already
/// validated) at `target_ids`; rows where `live` is false get zeroed [`RowStats`].
pub(crate) fn row_stats<E: GpuElement>(
    gpu: &Gpu,
    logits: &DeviceBuffer<E>,
    layout: &LogitsLayout,
    target_ids: &[i64],
    live: &[bool],
    inv_temp: f32,
) -> Result<Vec<RowStats>> {
    let n = layout.rows();
    let mut stats = vec![RowStats::default(); n];
    if n == 0 {
        return Ok(stats);
    }
    let targets = gpu.upload(target_ids)?;
    let flags: Vec<u8> = live.iter().map(|&m| u8::from(m)).collect();
    let flags = gpu.upload(&flags)?;
    let mut mu = gpu.zeros::<f32>(n)?;
    let mut s = gpu.zeros::<f32>(n)?;
    let mut u = gpu.zeros::<f32>(n)?;
    let mut target = gpu.zeros::<f32>(n)?;
    let mut sum = gpu.zeros::<f32>(n)?;
    let f = gpu.kernel(&format!("row_states_{}", E::SUFFIX))?;
    let (lz, cols) = (KernelLayout::of(layout), cols_arg(layout.vocab)?);
    let (offset, null, merge_into, zero) = (0i64, 0u64, 0i32, 0.0f32);
    let mut launch = gpu.stream().launch_builder(f);
    launch
        .arg(logits.slice())
        .arg(&lz)
        .arg(&cols)
        .arg(&offset)
        .arg(&null)
        .arg(&inv_temp)
        .arg(&zero)
        .arg(&zero)
        .arg(targets.slice())
        .arg(flags.slice())
        .arg(&merge_into)
        .arg(mu.slice_mut())
        .arg(s.slice_mut())
        .arg(u.slice_mut())
        .arg(target.slice_mut())
        .arg(sum.slice_mut())
        .arg(&null);
    // SAFETY: the arguments match `row_states` in softmax_rows.cu; every buffer holds
    // the rows the layout was validated for.
    unsafe { launch.launch(rows_launch(n)?) }
        .map_err(|e| device_error("launching row_states", e))?;
    let (mu, s, u, target) = (
        gpu.download(&mu)?,
        gpu.download(&s)?,
        gpu.download(&u)?,
        gpu.download(&target)?,
    );
    for i in (0..n).filter(|&i| live[i]) {
        let state = OnlineSoftmax {
            inv_temp,
            max: mu[i],
            sum: s[i] as f64,
            weighted: u[i] as f64,
            // Not formed here (`st_s2` null): no logits-level call asks `Σp²`.
            sum2: f64::NAN,
        };
        stats[i] = RowStats::finish(&state, target[i]);
    }
    Ok(stats)
}

/// Per-row statistics of device `logits / temperature` (`[B, T, V]` laid out as
/// `layout`) at `target_ids` `[B, T]` (host); rows where `mask` is false are skipped
/// and get zeroed [`RowStats`]. What the CPU's `selective_log_softmax` returns.
pub fn selective_log_softmax<E: GpuElement>(
    gpu: &Gpu,
    logits: &DeviceBuffer<E>,
    layout: &LogitsLayout,
    target_ids: &[i64],
    mask: Option<&[bool]>,
    temperature: Temperature,
) -> Result<Vec<RowStats>> {
    layout.validate("logits", logits.len())?;
    let n = layout.rows();
    check_targets(target_ids, mask, n, layout.vocab, layout.seq_len)?;
    let live: Vec<bool> = (0..n).map(|i| mask.is_none_or(|m| m[i])).collect();
    let stats = row_stats(
        gpu,
        logits,
        layout,
        target_ids,
        &live,
        RowTransform::with_temperature(temperature).inv_temp,
    )?;
    check_row_stats(&stats, |i| live[i], target_ids, layout.seq_len)?;
    Ok(stats)
}
