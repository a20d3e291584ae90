//! The loss switch: the same three quantities (SFT cross-entropy, GRPO loss, no-grad
//! log-probs) from hidden states and the LM head, by the path `loss.impl` picks.

use super::config::LossImpl;
use candle_core::{Result, Storage, Tensor};
use flashloss::device::LogpCall;
use flashloss::fused::{FusedOptions, LogpRows};
use flashloss::policy::{Normalizers, policy_stage};
use flashloss::{CrossEntropy, GrpoBatchData, GrpoLoss, HeadArgs, LinearInputs, Temperature};
use flashloss_candle::ops::{self, GrpoStep, baseline};

pub(crate) struct LossPath {
    implementation: LossImpl,
    loss: GrpoLoss,
    ce: CrossEntropy,
    budget_bytes: usize,
}

/// Runs `f` on the f32 elements of a CPU tensor without copying them (`arg` names it
/// in errors).
fn with_f32<R>(t: &Tensor, arg: &str, f: impl FnOnce(&[f32]) -> Result<R>) -> Result<R> {
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(s) => f(ops::contiguous::<f32>(s, layout, arg)?),
        _ => candle_core::bail!("{arg}: expected a CPU tensor"),
    }
}

/// The values of `[N]` tensor `t`, with 0 where `mask` is false.
fn masked(t: &Tensor, mask: &[bool]) -> Result<Vec<f32>> {
    let v = t.to_vec1::<f32>()?;
    Ok(v.iter()
        .zip(mask)
        .map(|(&x, &m)| if m { x } else { 0.0 })
        .collect())
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
        inputs: &GrpoBatchData,
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
                let (logp, entropy) = (
                    masked(&logp, &inputs.mask)?,
                    masked(&entropy, &inputs.mask)?,
                );
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
        inputs: &GrpoBatchData,
    ) -> Result<Vec<f32>> {
        let (hidden, head) = (hidden.detach(), head.detach());
        let temperature = self.loss.config().temperature;
        match self.implementation {
            LossImpl::Fused => {
                let (n, h) = hidden.dims2()?;
                let v = head.dim(0)?;
                with_f32(&hidden, "hidden", |x| {
                    with_f32(&head, "weight", |w| {
                        let lin = LinearInputs {
                            hidden: x,
                            weight: w,
                            layout: flashloss::WeightLayout::VocabMajor,
                            bias: None,
                            tokens: n,
                            hidden_size: h,
                            vocab: v,
                        };
                        let stats = ops::device()
                            .logprobs(
                                HeadArgs::host(&lin),
                                LogpCall::forward(
                                    LogpRows {
                                        targets: &inputs.target_ids,
                                        mask: Some(&inputs.mask),
                                        temperature: Temperature::new(temperature)
                                            .map_err(ops::wrap)?,
                                    },
                                    &FusedOptions::forward(self.budget_bytes),
                                    inputs.seq_len,
                                ),
                            )
                            .map(|o| o.stats)
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
                masked(&logp, &inputs.mask)
            }
        }
    }
}
