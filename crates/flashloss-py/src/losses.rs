//! The LM-head entry points of `flashloss._native` (the logits-level ones are in
//! `logits.rs`). Shapes follow PyTorch: `hidden` `[..., H]` with `N` rows in all,
//! `weight` `[V, H]`, `bias` `[V]`, token ids and masks `[B, T]` (GRPO) or `[N]` (CE). Configs arrive as JSON of the Rust
//! `GrpoLossConfig`/`CeConfig` (unknown keys are errors). Gradients are added into f32
//! tensors the caller zeroed.

use crate::args::{BatchTensors, F32, Grads, HeadTensors, I64};
use crate::dist::VocabGroup;
use crate::front::{call_head, with_element};
use crate::tensor::{Tensor, arg_error};
use flashloss::device::{CeCall, CeUpstream, GrpoCall};
use flashloss::fused::{self, FusedOptions, Mode, Plan};
use flashloss::policy::GrpoMetrics;
use flashloss::{CeConfig, CrossEntropy, Grid, GrpoLoss, GrpoLossConfig, RowStats, Shard};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// Parses a config; an error names the offending keyword (e.g. `loss_type`).
pub(crate) fn parse_json<T: serde::de::DeserializeOwned>(arg: &str, json: &str) -> PyResult<T> {
    let de = &mut serde_json::Deserializer::from_str(json);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let key = if path == "." { arg } else { &path };
        arg_error(key, e.into_inner())
    })
}

pub(crate) fn budget(mode: &str, budget_mib: f64) -> PyResult<FusedOptions> {
    if !(budget_mib.is_finite() && budget_mib > 0.0) {
        return Err(arg_error(
            "budget_mib",
            format!("must be a positive number, got {budget_mib}"),
        ));
    }
    let mode: Mode = parse_json("mode", &format!("{mode:?}"))?;
    Ok(FusedOptions::from_mib(mode, budget_mib, 1.0))
}

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

/// GRPO from hidden states: the loss of `config_json` (a `GrpoLossConfig`), `∂L/∂hidden`,
/// `∂L/∂weight`, `∂L/∂bias` added into the `grad_*` tensors (no `grad_weight`: a frozen
/// head, neither dW nor dbias formed), per-token `logp`, entropy and KL written into
/// `out_*` (`[B, T]` f32). Returns the loss and the metrics.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
#[pyo3(signature = (hidden, weight, bias, completion_ids, completion_mask, advantages,
    old_per_token_logps, ref_per_token_logps, importance_sampling_ratio, policy_mask,
    entropy_mask, config_json, mode, budget_mib, grad_hidden, grad_weight, grad_bias, out_logp,
    out_entropy, out_kl, stream=0, group=None))]
pub fn grpo_linear<'py>(
    py: Python<'py>,
    hidden: &Bound<'py, PyAny>,
    weight: &Bound<'py, PyAny>,
    bias: Option<&Bound<'py, PyAny>>,
    completion_ids: &Bound<'py, PyAny>,
    completion_mask: &Bound<'py, PyAny>,
    advantages: &Bound<'py, PyAny>,
    old_per_token_logps: Option<&Bound<'py, PyAny>>,
    ref_per_token_logps: Option<&Bound<'py, PyAny>>,
    importance_sampling_ratio: Option<&Bound<'py, PyAny>>,
    policy_mask: Option<&Bound<'py, PyAny>>,
    entropy_mask: Option<&Bound<'py, PyAny>>,
    config_json: &str,
    mode: &str,
    budget_mib: f64,
    grad_hidden: &Bound<'py, PyAny>,
    grad_weight: Option<&Bound<'py, PyAny>>,
    grad_bias: Option<&Bound<'py, PyAny>>,
    out_logp: &Bound<'py, PyAny>,
    out_entropy: &Bound<'py, PyAny>,
    out_kl: &Bound<'py, PyAny>,
    stream: usize,
    group: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyDict>> {
    let group = VocabGroup::new(group)?;
    let parsed = (|| {
        let loss = GrpoLoss::new(parse_json::<GrpoLossConfig>("config", config_json)?)
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        let head = HeadTensors::new(hidden, weight, bias)?;
        let grads = Grads::new(&head, grad_hidden, grad_weight, grad_bias)?;
        let opts = FusedOptions {
            head_grad: grads.head_grad(),
            ..budget(mode, budget_mib)?
        };
        let tensors = BatchTensors::new(
            completion_ids,
            completion_mask,
            advantages,
            old_per_token_logps,
            ref_per_token_logps,
            importance_sampling_ratio,
            policy_mask,
            entropy_mask,
        )?;
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
    let out = match &group {
        None => with_element!(head.hidden.dtype, E => call_head::<E, _>(
            py, &head, Some(&mut grads), stream,
            |d, h| d.grpo(h, GrpoCall::new(&loss, &batch, &opts)),
        ))?,
        Some(g) => {
            let shard = head_shard(py, g, &head)?;
            with_element!(head.hidden.dtype, E => call_head::<E, _>(
                py, &head, Some(&mut grads), stream,
                |d, h| d.grpo(h, GrpoCall::new(&loss, &batch, &opts).sharded(&Grid::vocab(&g.0), shard)),
            ))?
        }
    };
    grpo_outputs(py, &out, out_logp, out_entropy, out_kl)
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

/// This rank's shard of a head split over `group` (see [`VocabGroup::shard`]).
pub(crate) fn head_shard(
    py: Python<'_>,
    group: &VocabGroup,
    head: &HeadTensors,
) -> PyResult<Shard> {
    let dtype = head.hidden.dtype as u8;
    group.shard(py, head.vocab, head.tokens, head.hidden_size, dtype)
}

fn grpo_outputs<'py>(
    py: Python<'py>,
    out: &fused::GrpoLinearOutput,
    out_logp: &Bound<'py, PyAny>,
    out_entropy: &Bound<'py, PyAny>,
    out_kl: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyDict>> {
    write_stats(
        &out.stats,
        &mut Tensor::new("out_logp", out_logp, F32)?,
        &mut Tensor::new("out_entropy", out_entropy, F32)?,
    )?;
    write_f32(&out.kl, &mut Tensor::new("out_kl", out_kl, F32)?)?;
    grpo_result(py, out.loss, &out.metrics, Some(&out.plan))
}

/// Cross-entropy from hidden states at `targets` `[N]` (`config_json`: a `CeConfig`);
/// gradients of `grad_output·L + Σ_i grad_lse_i·lse_i` added into `grad_*` (`L` with
/// `grad_rows` `[N]` for reduction `none`; no `grad_weight`: a frozen head), the per-row
/// losses written into `out_row_loss` `[N]` and, given `out_lse`, each row's log-sum-exp
/// of the scaled logits (0 where ignored). Returns loss, z-loss and the count of rows that
/// are not ignored.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
#[pyo3(signature = (hidden, weight, bias, targets, config_json, mode, budget_mib, grad_rows,
    grad_hidden, grad_weight, grad_bias, out_row_loss, stream=0, group=None, grad_lse=None,
    grad_output=1.0, out_lse=None))]
pub fn ce_linear<'py>(
    py: Python<'py>,
    hidden: &Bound<'py, PyAny>,
    weight: &Bound<'py, PyAny>,
    bias: Option<&Bound<'py, PyAny>>,
    targets: &Bound<'py, PyAny>,
    config_json: &str,
    mode: &str,
    budget_mib: f64,
    grad_rows: Option<&Bound<'py, PyAny>>,
    grad_hidden: &Bound<'py, PyAny>,
    grad_weight: Option<&Bound<'py, PyAny>>,
    grad_bias: Option<&Bound<'py, PyAny>>,
    out_row_loss: &Bound<'py, PyAny>,
    stream: usize,
    group: Option<&Bound<'py, PyAny>>,
    grad_lse: Option<&Bound<'py, PyAny>>,
    grad_output: f64,
    out_lse: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyDict>> {
    let group = VocabGroup::new(group)?;
    let parsed = (|| {
        let (ce, mut opts, head, targets) =
            ce_args(config_json, mode, budget_mib, hidden, weight, bias, targets)?;
        opts.grad_output = grad_output as f32;
        let grads = Grads::new(&head, grad_hidden, grad_weight, grad_bias)?;
        let opts = FusedOptions {
            head_grad: grads.head_grad(),
            ..opts
        };
        let grad_rows = Tensor::optional("grad_rows", grad_rows, F32)?;
        let grad_lse = Tensor::optional("grad_lse", grad_lse, F32)?;
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
    let (targets, grad_rows, grad_lse) = (
        targets.i64s()?,
        grad_rows.as_ref().map(|t| t.f32s()).transpose()?,
        grad_lse.as_ref().map(|t| t.f32s()).transpose()?,
    );
    let out = match &group {
        None => with_element!(head.hidden.dtype, E => call_head::<E, _>(
            py, &head, Some(&mut grads), stream,
            |d, h| d.cross_entropy(h, CeCall::new(&ce, targets, &opts).upstream(CeUpstream { rows: grad_rows, lse: grad_lse })),
        ))?,
        Some(g) => {
            let shard = head_shard(py, g, &head)?;
            with_element!(head.hidden.dtype, E => call_head::<E, _>(
                py, &head, Some(&mut grads), stream,
                |d, h| d.cross_entropy(h, CeCall::new(&ce, targets, &opts).upstream(CeUpstream { rows: grad_rows, lse: None }).sharded(&Grid::vocab(&g.0), shard)),
            ))?
        }
    };
    write_f32(
        &out.row_loss,
        &mut Tensor::new("out_row_loss", out_row_loss, F32)?,
    )?;
    write_lse(&out.stats, out_lse)?;
    let d = PyDict::new(py);
    d.set_item("loss", out.loss)?;
    d.set_item("z_loss", out.z_loss)?;
    d.set_item("count", out.count)?;
    d.set_item("single_pass", out.plan.single_pass)?;
    Ok(d)
}

/// A CE call's loss, plan options, head and `targets` `[N]`, each checked.
fn ce_args<'py>(
    config_json: &str,
    mode: &str,
    budget_mib: f64,
    hidden: &Bound<'py, PyAny>,
    weight: &Bound<'py, PyAny>,
    bias: Option<&Bound<'py, PyAny>>,
    targets: &Bound<'py, PyAny>,
) -> PyResult<(CrossEntropy, FusedOptions, HeadTensors<'py>, Tensor<'py>)> {
    let ce = CrossEntropy::new(parse_json::<CeConfig>("config", config_json)?)
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    let opts = budget(mode, budget_mib)?;
    let head = HeadTensors::new(hidden, weight, bias)?;
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
/// `none`'s forward), written into `out_row_loss` `[N]` (and each row's log-sum-exp
/// into `out_lse`, when given); CPU tensors.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
#[pyo3(signature = (hidden, weight, bias, targets, config_json, budget_mib, out_row_loss,
    out_lse=None))]
pub fn ce_rows<'py>(
    py: Python<'py>,
    hidden: &Bound<'py, PyAny>,
    weight: &Bound<'py, PyAny>,
    bias: Option<&Bound<'py, PyAny>>,
    targets: &Bound<'py, PyAny>,
    config_json: &str,
    budget_mib: f64,
    out_row_loss: &Bound<'py, PyAny>,
    out_lse: Option<&Bound<'py, PyAny>>,
) -> PyResult<()> {
    let (ce, opts, head, targets) = ce_args(
        config_json,
        "two_pass",
        budget_mib,
        hidden,
        weight,
        bias,
        targets,
    )?;
    let targets = targets.i64s()?;
    let out = with_element!(head.hidden.dtype, E => call_head::<E, _>(
        py, &head, None, 0, |d, h| d.cross_entropy(h, CeCall::new(&ce, targets, &opts).forward()),
    ))?;
    write_f32(
        &out.row_loss,
        &mut Tensor::new("out_row_loss", out_row_loss, F32)?,
    )?;
    write_lse(&out.stats, out_lse)
}
