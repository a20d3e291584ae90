//! The losses written with candle's own ops, on materialized `[N, V]` logits: what a
//! framework runs (TRL's formulas), the A/B baseline of training, and the oracle of the
//! fused ops' tests. Autograd keeps every `[N, V]` intermediate for the backward.

use candle_core::{D, DType, Result, Tensor};
use flashloss::{
    CrossEntropy, GrpoBatchData, GrpoLoss, ImportanceSamplingLevel, LossType, Reduction,
};

/// `hidden · weightᵀ`: `[N, H] × [V, H]ᵀ → [N, V]`.
pub fn head_logits(hidden: &Tensor, weight: &Tensor) -> Result<Tensor> {
    hidden.matmul(&weight.t()?)
}

/// Per-row `(logp at targets, entropy, lse)` of `logits / temperature`, each `[N]`.
/// `targets` `[N]` must be in range on every row (clamp masked rows first).
pub fn log_softmax_stats(
    logits: &Tensor,
    targets: &[i64],
    temperature: f64,
) -> Result<(Tensor, Tensor, Tensor)> {
    let z = (logits / temperature)?;
    let max = z.max_keepdim(D::Minus1)?.detach();
    let shifted = z.broadcast_sub(&max)?;
    let log_sum = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
    let logp_all = shifted.broadcast_sub(&log_sum)?;
    let ids: Vec<u32> = targets.iter().map(|&t| t as u32).collect();
    let ids = Tensor::from_vec(ids, (targets.len(), 1), logits.device())?;
    let logp = logp_all.gather(&ids, 1)?.squeeze(1)?;
    let entropy = (logp_all.exp()? * &logp_all)?.sum(D::Minus1)?.neg()?;
    let lse = (max + log_sum)?.squeeze(1)?;
    Ok((logp, entropy, lse))
}

/// Targets with masked rows set to 0, so that a gather over them stays in range.
pub fn live_targets(inputs: &GrpoBatchData) -> Vec<i64> {
    inputs
        .target_ids
        .iter()
        .zip(&inputs.mask)
        .map(|(&t, &m)| if m { t } else { 0 })
        .collect()
}

/// Each token's reduction weight `w_i` (spec "Reduction weights"; 0 where masked).
fn reduction_weights(loss: &GrpoLoss, inputs: &GrpoBatchData) -> Vec<f32> {
    let c = loss.config();
    let (b, t) = (inputs.batch, inputs.seq_len);
    let tokens = inputs.mask.iter().filter(|&&m| m).count().max(1) as f64;
    (0..b * t)
        .map(|i| {
            if !inputs.mask[i] {
                return 0.0;
            }
            let seq = &inputs.mask[i / t * t..(i / t + 1) * t];
            let len = seq.iter().filter(|&&m| m).count().max(1) as f64;
            let w = match c.loss_type {
                LossType::Grpo | LossType::Sapo => 1.0 / (b as f64 * len),
                LossType::Bnpo => 1.0 / tokens,
                LossType::DrGrpo => 1.0 / (b as f64 * c.max_completion_length.unwrap_or(1) as f64),
                LossType::Dapo | LossType::Cispo | LossType::Vespo => {
                    1.0 / c.num_items_in_batch.unwrap_or(tokens)
                }
                LossType::Luspo => 1.0 / b as f64,
            };
            w as f32
        })
        .collect()
}

/// The GRPO loss from per-token `logp` and `entropy` `[B·T]` (with autograd), written
/// with candle ops as TRL writes it: token-level ratios, the clipped family (grpo,
/// bnpo, dr_grpo, dapo, with δ), cispo and sapo, the policy and entropy masks
/// (`ℓ·e`), k3 KL (optionally bias-corrected) and the entropy bonus
/// `-entropy_coef · Σ m'H / max(1, Σ m')`. Sequence-level ratios, luspo, vespo and a
/// sampler ratio are an error here.
pub fn grpo_loss(
    logp: &Tensor,
    entropy: &Tensor,
    loss: &GrpoLoss,
    inputs: &GrpoBatchData,
) -> Result<Tensor> {
    let c = loss.config();
    if c.importance_sampling_level == ImportanceSamplingLevel::Sequence
        || matches!(c.loss_type, LossType::Luspo | LossType::Vespo)
    {
        candle_core::bail!(
            "loss.loss_type: the candle-ops baseline implements token-level grpo, bnpo, dr_grpo, dapo, cispo and sapo; {} at {:?} level runs with loss.impl = fused",
            c.loss_type.name(),
            c.importance_sampling_level
        )
    }
    if inputs.sampler_ratio.is_some() {
        candle_core::bail!(
            "sampler_ratio: the candle-ops baseline has no sampler importance ratio; it runs with loss.impl = fused"
        )
    }
    let dev = logp.device();
    let n = inputs.batch * inputs.seq_len;
    let per_token = |v: Vec<f32>| Tensor::from_vec(v, n, dev);
    let advantages = inputs.advantages.view();
    let adv_values: Vec<f32> = (0..n).map(|i| advantages.at(i, inputs.seq_len)).collect();
    let adv = per_token(adv_values.clone())?;
    let old = match &inputs.old_logp {
        Some(o) => per_token(o.clone())?,
        None => logp.detach(),
    };
    let ratio = (logp - &old)?.exp()?;
    let term = match c.loss_type {
        LossType::Cispo => (ratio.minimum(c.epsilon_high)?.detach() * &adv)?
            .mul(logp)?
            .neg()?,
        LossType::Sapo => {
            let tau: Vec<f32> = adv_values
                .iter()
                .map(|&a| if a > 0.0 { c.sapo_temperature_pos } else { c.sapo_temperature_neg } as f32)
                .collect();
            let tau = per_token(tau)?;
            let gate = candle_core::Tensor::ones_like(&ratio)?
                .add(&(&tau * (&ratio - 1.0)?)?.neg()?.exp()?)?
                .recip()?;
            ((adv * 4.0)?.div(&tau)?.mul(&gate))?.neg()?
        }
        _ => {
            let clipped = ratio.clamp(1.0 - c.epsilon_low, 1.0 + c.epsilon_high)?;
            let capped = match c.delta {
                Some(d) => ratio.minimum(d)?,
                None => ratio.clone(),
            };
            let unclipped = (&capped * &adv)?;
            let clipped = (&clipped * &adv)?;
            unclipped
                .le(&clipped)?
                .where_cond(&unclipped, &clipped)?
                .neg()?
        }
    };
    let keep: Vec<f32> = (0..n)
        .map(|i| {
            let on = |m: &Option<Vec<bool>>| m.as_ref().is_none_or(|m| m[i]);
            (on(&inputs.policy_mask) && on(&inputs.entropy_mask)) as u8 as f32
        })
        .collect();
    let mut token_loss = (term * per_token(keep)?)?;
    if c.beta > 0.0 {
        let Some(r) = &inputs.ref_logp else {
            candle_core::bail!("ref_logp: required when beta > 0 (beta = {})", c.beta)
        };
        let d = (per_token(r.clone())? - logp)?;
        let mut kl = ((d.exp()? - &d)? - 1.0)?;
        if c.use_bias_correction_kl {
            kl = (kl * &ratio)?;
        }
        token_loss = (token_loss + (kl * c.beta)?)?;
    }
    let policy = (token_loss * per_token(reduction_weights(loss, inputs))?)?.sum_all()?;
    if c.entropy_coef == 0.0 {
        return Ok(policy);
    }
    let bonus: Vec<f32> = (0..n)
        .map(|i| {
            let on = inputs.entropy_mask.as_ref().is_none_or(|e| e[i]);
            (inputs.mask[i] && on) as u8 as f32
        })
        .collect();
    let count = bonus.iter().sum::<f32>().max(1.0) as f64;
    let mean_entropy = ((entropy * per_token(bonus)?)?.sum_all()? / count)?;
    policy - (mean_entropy * c.entropy_coef)?
}

/// The cross-entropy of `logits` `[N, V]` at `targets` `[N]` with candle ops (spec
/// "Cross-entropy": soft-cap, temperature, label smoothing, z-loss, `ignore_index`,
/// mean or sum).
pub fn ce_loss(logits: &Tensor, targets: &[i64], ce: &CrossEntropy) -> Result<Tensor> {
    let c = ce.config();
    let dev = logits.device();
    let mut z = logits.to_dtype(DType::F32)?;
    if let Some(cap) = c.softcap {
        z = ((z / cap)?.tanh()? * cap)?;
    }
    let live: Vec<f32> = targets.iter().map(|&t| ce.counts(t) as u8 as f32).collect();
    let count = live.iter().sum::<f32>() as usize;
    let ids: Vec<i64> = targets
        .iter()
        .map(|&t| if ce.counts(t) { t } else { 0 })
        .collect();
    let (logp, _, lse) = log_softmax_stats(&z, &ids, c.temperature)?;
    let s_mean = (z / c.temperature)?.mean(D::Minus1)?;
    let smooth = (&lse - s_mean)?;
    let mut row = ((logp.neg()? * (1.0 - c.label_smoothing))? + (smooth * c.label_smoothing)?)?;
    if c.z_loss > 0.0 {
        row = (row + (lse.sqr()? * c.z_loss)?)?;
    }
    let weight = ce.row_weight(count) as f32;
    let live = Tensor::from_vec(live, targets.len(), dev)?;
    match c.reduction {
        Reduction::None => {
            candle_core::bail!("ce.reduction: the baseline returns a scalar; use mean or sum")
        }
        _ => (row * live)?.sum_all()? * weight as f64,
    }
}
