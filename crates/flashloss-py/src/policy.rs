//! The GRPO policy stage alone, from per-token statistics: what `flashloss.torch` runs
//! above a log-prob kernel when the rows of `hidden` (or the logits) do not lie as
//! `[B, T]` (a packed batch, its sequences given by `cu_seqlens`). The caller scatters
//! each row's `logp` and entropy into `[B, T]` (only these O(B·T) vectors, never the
//! hidden states); this runs the crate's [`policy_stage`] on them, the one place the
//! per-sequence reductions (sequence-level ratios, vespo's `log w_b`, each loss type's
//! normalizer) are written, and returns the loss with `∂L/∂logp` and `∂L/∂H` per token.

use crate::args::{BatchArrays, BatchTensors, F32};
use crate::device::run;
use crate::losses::{grpo_result, write_f32};
use crate::spec::Spec;
use crate::tensor::Tensor;
use flashloss::policy::{Normalizers, policy_stage};
use flashloss::range::check_policy_rows;
use flashloss::{GrpoLoss, GrpoLossConfig};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// The loss of `spec` (its `config` a `GrpoLossConfig`) and its metrics from per-token
/// `logp` and `entropy` `[B, T]` (f32, read where `completion_mask` is set), with the
/// batch's arrays as [`crate::losses::grpo_linear`] takes them ([`BatchArrays`];
/// `completion_ids` only gives the shape: the ids are not read). Writes `∂L/∂logp`,
/// `∂L/∂H` and the per-token KL into `outs` (`[B, T]` f32 each, 0 where masked).
#[pyfunction]
#[pyo3(signature = (logp, entropy, batch, outs, spec))]
pub fn grpo_policy<'py>(
    py: Python<'py>,
    logp: &Bound<'py, PyAny>,
    entropy: &Bound<'py, PyAny>,
    batch: BatchArrays<'py>,
    outs: (Bound<'py, PyAny>, Bound<'py, PyAny>, Bound<'py, PyAny>),
    spec: &str,
) -> PyResult<Bound<'py, PyDict>> {
    let loss = GrpoLoss::new(Spec::parse(spec)?.config::<GrpoLossConfig>()?)
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    let tensors = BatchTensors::new(&batch)?;
    let (out_dlogp, out_dentropy, out_kl) = (&outs.0, &outs.1, &outs.2);
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
