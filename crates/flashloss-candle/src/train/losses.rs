//! The loss switch: the same three quantities (SFT cross-entropy, GRPO loss, no-grad
//! log-probs) from hidden states and the LM head, by the path `loss.impl` picks.

use super::config::LossImpl;
use crate::ops::{self, GrpoInputs, GrpoStep, baseline};
use candle_core::{CpuStorage, Result, Storage, Tensor};
use flashloss::cpu::logp_linear;
use flashloss::policy::{Normalizers, policy_stage};
use flashloss::{CrossEntropy, GrpoLoss, LinearInputs};

pub(crate) struct LossPath {
    implementation: LossImpl,
    loss: GrpoLoss,
    ce: CrossEntropy,
    budget_bytes: usize,
}

/// Runs `f` on the f32 elements of a contiguous CPU tensor without copying them.
fn with_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> Result<R>) -> Result<R> {
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    let Some((start, end)) = layout.contiguous_offsets() else {
        candle_core::bail!("tensor: not contiguous")
    };
    match &*storage {
        Storage::Cpu(CpuStorage::F32(v)) => f(&v[start..end]),
        _ => candle_core::bail!("tensor: expected f32 on the CPU, got {:?}", t.dtype()),
    }
}

impl LossPath {
    pub(crate) fn new(
        implementation: LossImpl,
        loss: GrpoLoss,
        ce: CrossEntropy,
        budget_bytes: usize,
    ) -> Self {
        LossPath {
            implementation,
            loss,
            ce,
            budget_bytes,
        }
    }

    /// The SFT cross-entropy of `hidden · headᵀ` at `targets`.
    pub(crate) fn ce(&self, hidden: &Tensor, head: &Tensor, targets: Vec<i64>) -> Result<Tensor> {
        match self.implementation {
            LossImpl::Fused => ops::ce_linear(hidden, head, &self.ce, targets, self.budget_bytes),
            LossImpl::Baseline | LossImpl::Logits => {
                baseline::ce_loss(&baseline::head_logits(hidden, head)?, &targets, &self.ce)
            }
        }
    }

    /// The GRPO loss of `inputs` on `hidden · headᵀ`, with its metrics.
    pub(crate) fn grpo(
        &self,
        hidden: &Tensor,
        head: &Tensor,
        inputs: &GrpoInputs,
    ) -> Result<(Tensor, GrpoStep)> {
        match self.implementation {
            LossImpl::Fused => {
                ops::grpo_linear(hidden, head, &self.loss, inputs.clone(), self.budget_bytes)
            }
            LossImpl::Logits => ops::grpo_logits(
                &baseline::head_logits(hidden, head)?,
                &self.loss,
                inputs.clone(),
            ),
            LossImpl::Baseline => {
                let logits = baseline::head_logits(hidden, head)?;
                let temperature = self.loss.config().temperature;
                let (logp, entropy, _) = baseline::log_softmax_stats(
                    &logits,
                    &baseline::live_targets(inputs),
                    temperature,
                )?;
                let loss = baseline::grpo_loss(&logp, &entropy, &self.loss, inputs)?;
                let masked = |t: &Tensor| -> Result<Vec<f32>> {
                    let v = t.to_vec1::<f32>()?;
                    Ok(v.iter()
                        .zip(&inputs.mask)
                        .map(|(&x, &m)| if m { x } else { 0.0 })
                        .collect())
                };
                let (logp, entropy) = (masked(&logp)?, masked(&entropy)?);
                let batch = inputs.batch();
                let out = policy_stage(
                    &self.loss,
                    &batch,
                    Normalizers::local(&batch),
                    &logp,
                    &entropy,
                );
                let step = GrpoStep {
                    loss: loss.to_scalar::<f32>()? as f64,
                    metrics: out.metrics,
                    logp,
                    entropy,
                };
                Ok((loss, step))
            }
        }
    }

    /// No-grad per-token log-probs `[B·T]` of `inputs`' targets (0 where masked):
    /// old- and reference-policy passes.
    pub(crate) fn logp(
        &self,
        hidden: &Tensor,
        head: &Tensor,
        inputs: &GrpoInputs,
    ) -> Result<Vec<f32>> {
        let (hidden, head) = (hidden.detach(), head.detach());
        let temperature = self.loss.config().temperature;
        match self.implementation {
            LossImpl::Fused => {
                let (n, h) = hidden.dims2()?;
                let v = head.dim(0)?;
                with_f32(&hidden, |x| {
                    with_f32(&head, |w| {
                        let lin = LinearInputs {
                            hidden: x,
                            weight: w,
                            bias: None,
                            tokens: n,
                            hidden_size: h,
                            vocab: v,
                        };
                        let stats = logp_linear(
                            &lin,
                            &inputs.target_ids,
                            Some(&inputs.mask),
                            temperature,
                            self.budget_bytes,
                            inputs.seq_len,
                        )
                        .map_err(ops::wrap)?;
                        Ok(stats.iter().map(|s| s.logp).collect())
                    })
                })
            }
            LossImpl::Baseline | LossImpl::Logits => {
                let logits = baseline::head_logits(&hidden, &head)?;
                let (logp, _, _) = baseline::log_softmax_stats(
                    &logits,
                    &baseline::live_targets(inputs),
                    temperature,
                )?;
                let logp = logp.to_vec1::<f32>()?;
                Ok(logp
                    .iter()
                    .zip(&inputs.mask)
                    .map(|(&x, &m)| if m { x } else { 0.0 })
                    .collect())
            }
        }
    }
}
