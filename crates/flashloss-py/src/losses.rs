//! The LM-head entry points of `flashloss._native` (the logits-level ones are in
//! `logits.rs`). Shapes follow PyTorch: `hidden` `[..., H]` with `N` rows in all,
//! `weight` `[V, H]`, `bias` `[V]`, token ids and masks `[B, T]` (GRPO) or `[N]` (CE). Configs arrive as JSON of the Rust
//! `GrpoLossConfig`/`CeConfig` (unknown keys are errors). Gradients are added into f32
//! tensors the caller zeroed.

use crate::args::{
    BatchArrays, BatchTensors, F32, GradArrays, Grads, HeadArrays, HeadTensors, I64,
};
use crate::dist::VocabGroup;
use crate::front::{call_head, with_element};
use crate::spec::Spec;
use crate::tensor::{Tensor, arg_error};
use flashloss::device::{CeCall, CeUpstream, GrpoCall, Vocab};
use flashloss::fused::{self, FusedOptions, Plan};
use flashloss::policy::GrpoMetrics;
use flashloss::{CeConfig, CrossEntropy, Grid, GrpoLoss, GrpoLossConfig, RowStats, Shard};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// Writes the per-row `logp` and entropy into `[N]`-sized f32 tensors.
pub(crate) fn write_stats(
    stats: &[RowStats],
    logp: &mut Tensor,
    entropy: &mut Tensor,
) -> PyResult<()> {
    for t in [&*logp, &*entropy] {
        if t.numel() != stats.len() {
            return Err(arg_error(
                t.arg,
                format!("expected {} elements, got {}", stats.len(), t.numel()),
            ));
        }
    }
    // SAFETY: fresh output tensors from the Python side.
    let (lp, ent) = unsafe { (logp.f32s_mut()?, entropy.f32s_mut()?) };
    for ((s, l), e) in stats.iter().zip(lp).zip(ent) {
        *l = s.logp;
        *e = s.entropy;
    }
    Ok(())
}

pub(crate) fn write_f32(values: &[f32], out: &mut Tensor) -> PyResult<()> {
    if out.numel() != values.len() {
        return Err(arg_error(
            out.arg,
            format!("expected {} elements, got {}", values.len(), out.numel()),
        ));
    }
    // SAFETY: a fresh output tensor from the Python side.
    unsafe { out.f32s_mut()? }.copy_from_slice(values);
    Ok(())
}

pub(crate) fn grpo_result<'py>(
    py: Python<'py>,
    loss: f64,
    m: &GrpoMetrics,
    plan: Option<&Plan>,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("loss", loss)?;
    d.set_item("kl", m.kl_mean)?;
    d.set_item("entropy", m.entropy_mean)?;
    d.set_item("clip_ratio/low_mean", m.clip_ratio_low)?;
    d.set_item("clip_ratio/high_mean", m.clip_ratio_high)?;
    d.set_item("clip_ratio/region_mean", m.clip_ratio_region)?;
    if let Some(p) = plan {
        d.set_item("single_pass", p.single_pass)?;
        d.set_item("block_rows", p.block_rows)?;
        d.set_item("workspace_bytes", p.workspace_bytes + p.gemm_reserve_bytes)?;
    }
    Ok(d)
}

/// GRPO from hidden states: the loss of `spec` (its `config` a `GrpoLossConfig`, with
/// `mode`, `budget_mib`: see [`Spec`]) on `head` `(hidden, weight, bias)` and `batch`
/// ([`BatchArrays`]); `∂L/∂hidden`, `∂L/∂weight`, `∂L/∂bias` added into `grads`
/// `(grad_hidden, grad_weight, grad_bias)` (no `grad_weight`: a frozen head, neither dW
/// nor dbias formed), per-token `logp`, entropy and KL written into `outs` (`[B, T]` f32
/// each). Returns the loss and the metrics.
#[pyfunction]
#[allow(clippy::too_many_arguments)] // the arrays by role, the spec, stream, group
#[pyo3(signature = (head, batch, grads, outs, spec, stream=0, group=None))]
pub fn grpo_linear<'py>(
    py: Python<'py>,
    head: HeadArrays<'py>,
    batch: BatchArrays<'py>,
    grads: GradArrays<'py>,
    outs: (Bound<'py, PyAny>, Bound<'py, PyAny>, Bound<'py, PyAny>),
    spec: &str,
    stream: usize,
    group: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyDict>> {
    let group = VocabGroup::new(group)?;
    let parsed = (|| {
        let spec = Spec::parse(spec)?;
        let loss = GrpoLoss::new(spec.config::<GrpoLossConfig>()?)
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        let head = HeadTensors::of(&head)?;
        let grads = Grads::new(&head, &grads)?;
        let opts = FusedOptions {
            head_grad: grads.head_grad(),
            ..spec.options()?
        };
        let tensors = BatchTensors::new(&batch)?;
        let rows = tensors.batch()?.rows();
        if head.tokens != rows {
            return Err(arg_error(
                "hidden",
                format!(
                    "has {} rows but completion_ids {:?} has {rows}",
                    head.tokens, tensors.ids.shape
                ),
            ));
        }
        Ok((loss, opts, head, grads, tensors))
    })();
    let (loss, opts, head, mut grads, tensors) = agreed(py, group.as_ref(), parsed)?;
    let batch = tensors.batch()?;
    let split = vocab_split(py, group.as_ref(), &head)?;
    let call = GrpoCall {
        vocab: vocab(&split),
        ..GrpoCall::new(&loss, &batch, &opts)
    };
    let out = with_element!(head.hidden.dtype, E => call_head::<E, _>(
        py, &head, Some(&mut grads), stream, |d, h| d.grpo(h, call),
    ))?;
    grpo_outputs(py, &out, &outs)
}

/// `parsed` as is without a group, else agreed over it (see [`VocabGroup::agree`]).
pub(crate) fn agreed<T>(
    py: Python<'_>,
    group: Option<&VocabGroup>,
    parsed: PyResult<T>,
) -> PyResult<T> {
    match group {
        Some(g) => g.agree(py, parsed),
        None => parsed,
    }
}

/// The grid and this rank's shard of a head split over `group` (see
/// [`VocabGroup::shard`]); `None` without a group (the head holds the whole vocabulary).
pub(crate) fn vocab_split<'g>(
    py: Python<'_>,
    group: Option<&'g VocabGroup>,
    head: &HeadTensors,
) -> PyResult<Option<(Grid<'g>, Shard)>> {
    let dtype = head.hidden.dtype as u8;
    group
        .map(|g| {
            let shard = g.shard(py, head.vocab, head.tokens, head.hidden_size, dtype)?;
            Ok((Grid::vocab(&g.0), shard))
        })
        .transpose()
}

/// A call's [`Vocab`] over a [`vocab_split`].
pub(crate) fn vocab<'a>(split: &'a Option<(Grid<'a>, Shard)>) -> Vocab<'a> {
    match split {
        Some((grid, shard)) => Vocab::Sharded {
            grid,
            shard: *shard,
        },
        None => Vocab::Whole,
    }
}

fn grpo_outputs<'py>(
    py: Python<'py>,
    out: &fused::GrpoLinearOutput,
    (out_logp, out_entropy, out_kl): &(Bound<'py, PyAny>, Bound<'py, PyAny>, Bound<'py, PyAny>),
) -> PyResult<Bound<'py, PyDict>> {
    write_stats(
        &out.stats,
        &mut Tensor::new("out_logp", out_logp, F32)?,
        &mut Tensor::new("out_entropy", out_entropy, F32)?,
    )?;
    write_f32(&out.kl, &mut Tensor::new("out_kl", out_kl, F32)?)?;
    grpo_result(py, out.loss, &out.metrics, Some(&out.plan))
}

/// Cross-entropy from hidden states at `targets` `[N]` (`spec`: its `config` a
/// `CeConfig`, with `mode`, `budget_mib`, `grad_output`); gradients of
/// `grad_output·L + Σ_i grad_lse_i·lse_i` added into `grads` (`L` with `grad_rows` `[N]`
/// for reduction `none`; `upstream` is `(grad_rows, grad_lse)`, each optional; no
/// `grad_weight`: a frozen head), the per-row losses written into `outs.0` `[N]` and,
/// given `outs.1`, each row's log-sum-exp of the scaled logits (0 where ignored).
/// Returns loss, z-loss and the count of rows that are not ignored.
#[pyfunction]
#[allow(clippy::too_many_arguments)] // the arrays by role, the spec, stream, group
#[pyo3(signature = (head, targets, upstream, grads, outs, spec, stream=0, group=None))]
pub fn ce_linear<'py>(
    py: Python<'py>,
    head: HeadArrays<'py>,
    targets: &Bound<'py, PyAny>,
    upstream: (Option<Bound<'py, PyAny>>, Option<Bound<'py, PyAny>>),
    grads: GradArrays<'py>,
    outs: CeOuts<'py>,
    spec: &str,
    stream: usize,
    group: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyDict>> {
    let group = VocabGroup::new(group)?;
    let parsed = (|| {
        let (ce, opts, head, targets) = ce_args(spec, &head, targets)?;
        let grads = Grads::new(&head, &grads)?;
        let opts = FusedOptions {
            head_grad: grads.head_grad(),
            ..opts
        };
        let grad_rows = Tensor::optional("grad_rows", upstream.0.as_ref(), F32)?;
        let grad_lse = Tensor::optional("grad_lse", upstream.1.as_ref(), F32)?;
        for g in grad_rows.iter().chain(&grad_lse) {
            g.expect_shape(&[head.tokens])?;
        }
        if grad_lse.is_some() && group.is_some() {
            let reason = "an upstream gradient of the log-sum-exp is not taken with a vocab_parallel_group (so far)";
            return Err(arg_error("grad_lse", reason));
        }
        Ok((ce, opts, head, grads, targets, grad_rows, grad_lse))
    })();
    let (ce, opts, head, mut grads, targets, grad_rows, grad_lse) =
        agreed(py, group.as_ref(), parsed)?;
    let upstream = CeUpstream {
        rows: grad_rows.as_ref().map(|t| t.f32s()).transpose()?,
        lse: grad_lse.as_ref().map(|t| t.f32s()).transpose()?,
    };
    let targets = targets.i64s()?;
    let split = vocab_split(py, group.as_ref(), &head)?;
    let call = CeCall {
        vocab: vocab(&split),
        ..CeCall::new(&ce, targets, &opts).upstream(upstream)
    };
    let out = with_element!(head.hidden.dtype, E => call_head::<E, _>(
        py, &head, Some(&mut grads), stream, |d, h| d.cross_entropy(h, call),
    ))?;
    write_ce_rows(&out, &outs)?;
    let d = PyDict::new(py);
    d.set_item("loss", out.loss)?;
    d.set_item("z_loss", out.z_loss)?;
    d.set_item("count", out.count)?;
    d.set_item("single_pass", out.plan.single_pass)?;
    Ok(d)
}

/// Where a CE call writes its per-row outputs: `(out_row_loss [N], out_lse [N] or None)`.
type CeOuts<'py> = (Bound<'py, PyAny>, Option<Bound<'py, PyAny>>);

fn write_ce_rows(out: &fused::CeLinearOutput, (row_loss, lse): &CeOuts) -> PyResult<()> {
    write_f32(
        &out.row_loss,
        &mut Tensor::new("out_row_loss", row_loss, F32)?,
    )?;
    write_lse(&out.stats, lse.as_ref())
}

/// A CE call's loss, plan options, head and `targets` `[N]`, each checked.
fn ce_args<'py>(
    spec: &str,
    head: &HeadArrays<'py>,
    targets: &Bound<'py, PyAny>,
) -> PyResult<(CrossEntropy, FusedOptions, HeadTensors<'py>, Tensor<'py>)> {
    let spec = Spec::parse(spec)?;
    let ce = CrossEntropy::new(spec.config::<CeConfig>()?)
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    let opts = spec.options()?;
    let head = HeadTensors::of(head)?;
    let targets = Tensor::new("target", targets, I64)?;
    targets.expect_shape(&[head.tokens])?;
    Ok((ce, opts, head, targets))
}

/// Each row's log-sum-exp of the scaled logits into `out` `[N]`, when given.
fn write_lse(stats: &[RowStats], out: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
    let Some(out) = out else { return Ok(()) };
    let lse: Vec<f32> = stats.iter().map(|s| s.lse).collect();
    write_f32(&lse, &mut Tensor::new("out_lse", out, F32)?)
}

/// The per-row cross-entropy losses at `targets` `[N]` without gradients (reduction
/// `none`'s forward, two-pass within `spec`'s `budget_mib`), written into `outs.0` `[N]`
/// (and each row's log-sum-exp into `outs.1`, when given); CPU tensors.
#[pyfunction]
#[pyo3(signature = (head, targets, outs, spec))]
pub fn ce_rows<'py>(
    py: Python<'py>,
    head: HeadArrays<'py>,
    targets: &Bound<'py, PyAny>,
    outs: CeOuts<'py>,
    spec: &str,
) -> PyResult<()> {
    let (ce, opts, head, targets) = ce_args(spec, &head, targets)?;
    let (opts, targets) = (opts.two_pass(), targets.i64s()?);
    let out = with_element!(head.hidden.dtype, E => call_head::<E, _>(
        py, &head, None, 0, |d, h| d.cross_entropy(h, CeCall::new(&ce, targets, &opts).forward()),
    ))?;
    write_ce_rows(&out, &outs)
}
