//! The GRPO policy stage alone, from per-token statistics: what `flashloss.torch` runs
//! above a log-prob kernel when the rows of `hidden` (or the logits) do not lie as
//! `[B, T]` (a packed batch, its sequences given by `cu_seqlens`). The caller scatters
//! each row's `logp` and entropy into `[B, T]` (only these O(B·T) vectors, never the
//! hidden states); this runs the crate's [`policy_stage`] on them, the one place the
//! per-sequence reductions (sequence-level ratios, vespo's `log w_b`, each loss type's
//! normalizer) are written, and returns the loss with `∂L/∂logp` and `∂L/∂H` per token.

use crate::args::{BatchTensors, F32};
use crate::front::run;
use crate::losses::{grpo_result, parse_json, write_f32};
use crate::tensor::Tensor;
use flashloss::policy::{Normalizers, policy_stage};
use flashloss::range::check_policy_rows;
use flashloss::{GrpoLoss, GrpoLossConfig};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// The loss of `config_json` (a `GrpoLossConfig`) and its metrics from per-token `logp`
/// and `entropy` `[B, T]` (f32, read where `completion_mask` is set), with the batch's
/// inputs as [`crate::losses::grpo_linear`] takes them (`completion_ids` only gives the
/// shape: the ids are not read). Writes `∂L/∂logp`, `∂L/∂H` and the per-token KL into
/// `out_dlogp`, `out_dentropy`, `out_kl` (`[B, T]` f32, 0 where masked).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
#[pyo3(signature = (logp, entropy, completion_ids, completion_mask, advantages,
    old_per_token_logps, ref_per_token_logps, importance_sampling_ratio, policy_mask,
    entropy_mask, config_json, out_dlogp, out_dentropy, out_kl))]
pub fn grpo_policy<'py>(
    py: Python<'py>,
    logp: &Bound<'py, PyAny>,
    entropy: &Bound<'py, PyAny>,
    completion_ids: &Bound<'py, PyAny>,
    completion_mask: &Bound<'py, PyAny>,
    advantages: &Bound<'py, PyAny>,
    old_per_token_logps: Option<&Bound<'py, PyAny>>,
    ref_per_token_logps: Option<&Bound<'py, PyAny>>,
    importance_sampling_ratio: Option<&Bound<'py, PyAny>>,
    policy_mask: Option<&Bound<'py, PyAny>>,
    entropy_mask: Option<&Bound<'py, PyAny>>,
    config_json: &str,
    out_dlogp: &Bound<'py, PyAny>,
    out_dentropy: &Bound<'py, PyAny>,
    out_kl: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyDict>> {
    let loss = GrpoLoss::new(parse_json::<GrpoLossConfig>("config", config_json)?)
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
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
    let batch = tensors.batch()?;
    let shape = tensors.ids.shape.clone();
    let (logp, entropy) = (
        Tensor::new("logp", logp, F32)?,
        Tensor::new("entropy", entropy, F32)?,
    );
    logp.expect_shape(&shape)?;
    entropy.expect_shape(&shape)?;
    let (lp, ent) = (logp.f32s()?, entropy.f32s()?);
    let policy = run(py, || {
        // The ids are not read: every id is in range of an unbounded vocabulary.
        batch.validate(usize::MAX, &loss)?;
        let policy = policy_stage(&loss, &batch, Normalizers::local(&batch), lp, ent);
        let live = |i: usize| batch.mask[i];
        check_policy_rows(
            &policy,
            |i| ent[i],
            0..batch.rows(),
            live,
            batch.seq_len,
            None,
        )?;
        Ok(policy)
    })?;
    write_f32(
        &policy.dlogp,
        &mut Tensor::new("out_dlogp", out_dlogp, F32)?,
    )?;
    write_f32(
        &policy.dentropy,
        &mut Tensor::new("out_dentropy", out_dentropy, F32)?,
    )?;
    write_f32(&policy.kl, &mut Tensor::new("out_kl", out_kl, F32)?)?;
    grpo_result(py, policy.loss, &policy.metrics, None)
}
