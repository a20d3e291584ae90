//! The O(N) middle of every GRPO kernel, shared by all backends: from per-token `logp`
//! and entropy `H` to the loss, the metrics and the two per-row coefficients the
//! backward needs, `dlogp_i = ∂L/∂logp_i` and `dentropy_i = ∂L/∂H_i`. Then
//! `∂L/∂s_ij = dlogp_i·(1[j=y_i] - p_ij) - dentropy_i·p_ij·(log p_ij + H_i)`.
//! Computed in f64, serially in row order, so it is deterministic.

use crate::batch::{GrpoBatch, PerSeqOrToken};
use crate::grpo_config::{GrpoLoss, GrpoLossConfig, ImportanceSamplingLevel, LossType};
use serde::Serialize;
use std::ops::Range;

/// Bit of [`PolicyOutput::clip`]: ratio below `1-ε_low` with `A < 0`.
pub const CLIP_LOW: u8 = 1;
/// Bit of [`PolicyOutput::clip`]: ratio above `1+ε_high` (cispo: above `ε_high`) with `A > 0`.
pub const CLIP_HIGH: u8 = 2;

/// The global normalizers of the reduction weights (spec: "Reduction weights").
/// One rank computes them from its batch; a sharded run all-reduces them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Normalizers {
    /// B of grpo, sapo, dr_grpo and luspo: sequences in the (global) batch.
    pub batch_size: f64,
    /// Unmasked tokens in the (global) batch: bnpo's count, and dapo/cispo/vespo's
    /// `num_items_in_batch` when the config leaves it unset.
    pub token_count: f64,
    /// `Σ_i m'_i`, the tokens of the entropy bonus's mean in the (global) batch:
    /// unmasked tokens, within [`GrpoBatch::entropy_mask`] when one is given.
    pub entropy_count: f64,
}

impl Normalizers {
    /// The normalizers of a batch seen whole by one rank.
    pub fn local(batch: &GrpoBatch) -> Self {
        Normalizers {
            batch_size: batch.batch as f64,
            token_count: batch.mask.iter().filter(|&&m| m).count() as f64,
            entropy_count: (0..batch.rows())
                .filter(|&i| batch.in_entropy_bonus(i))
                .count() as f64,
        }
    }

    /// These normalizers less the rows of `batch` that `dropped` takes out of its mask
    /// (the token count and the entropy bonus's; `B` stays).
    pub(crate) fn without(self, batch: &GrpoBatch, dropped: &[bool]) -> Self {
        let live_dropped = |i: &usize| batch.mask[*i] && dropped[*i];
        let rows = (0..batch.rows()).filter(live_dropped);
        let tokens = rows.clone().count() as f64;
        let bonus = rows.filter(|&i| batch.in_entropy_bonus(i)).count() as f64;
        Normalizers {
            batch_size: self.batch_size,
            token_count: self.token_count - tokens,
            entropy_count: self.entropy_count - bonus,
        }
    }
}

/// Masked means over the batch's unmasked tokens.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct GrpoMetrics {
    /// Mean KL (as it enters the loss: times the ratio with bias correction).
    pub kl_mean: f64,
    /// Fraction of tokens with [`CLIP_LOW`].
    pub clip_ratio_low: f64,
    /// Fraction of tokens with [`CLIP_HIGH`].
    pub clip_ratio_high: f64,
    /// Fraction of tokens clipped either way.
    pub clip_ratio_region: f64,
    /// Mean entropy.
    pub entropy_mean: f64,
}

/// Loss, metrics, per-token KL and clip flags, and the backward's coefficients.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyOutput {
    /// `L = Σ_i w_i · ℓ_tot,i`.
    pub loss: f64,
    /// Batch metrics.
    pub metrics: GrpoMetrics,
    /// Per-token KL `[N]` as it enters the loss (0 where masked or without `ref_logp`).
    pub kl: Vec<f32>,
    /// Per-token clip flags `[N]` ([`CLIP_LOW`] | [`CLIP_HIGH`]).
    pub clip: Vec<u8>,
    /// `∂L/∂logp_i` `[N]` (0 where masked).
    pub dlogp: Vec<f32>,
    /// `∂L/∂H_i = -entropy_coef · m'_i / max(1, Σ m')` `[N]`.
    pub dentropy: Vec<f32>,
    /// Each token's share `w_i · ℓ_tot,i - entropy_coef · m'_i H_i / max(1, Σ m')` of
    /// the loss `[N]`.
    pub token_loss: Vec<f64>,
}

impl PolicyOutput {
    /// Zeroed per-token outputs for N rows.
    pub fn new(n: usize) -> Self {
        PolicyOutput {
            loss: 0.0,
            metrics: GrpoMetrics::default(),
            kl: vec![0.0; n],
            clip: vec![0; n],
            dlogp: vec![0.0; n],
            dentropy: vec![0.0; n],
            token_loss: vec![0.0; n],
        }
    }

    /// Sums the loss and the metrics over live tokens, serially in row order (so the
    /// result does not depend on how rows were blocked or threaded). The clip metrics
    /// are TRL 1.16's `global_masked_mean`: over tokens, or over the B sequences where
    /// the ratio and the advantage are both one per sequence ([`clips_per_sequence`]).
    pub fn finish(&mut self, loss: &GrpoLoss, batch: &GrpoBatch, entropy: &[f32]) {
        let mask = batch.mask;
        let (mut total, mut kl, mut ent, mut tokens) = (0.0, 0.0, 0.0, 0.0);
        let mut clips = [0.0; 3];
        let count = |flags: u8, clips: &mut [f64; 3]| {
            clips[0] += (flags & CLIP_LOW != 0) as u8 as f64;
            clips[1] += (flags & CLIP_HIGH != 0) as u8 as f64;
            clips[2] += (flags != 0) as u8 as f64;
        };
        let per_sequence = clips_per_sequence(loss, batch);
        for i in (0..mask.len()).filter(|&i| mask[i]) {
            total += self.token_loss[i];
            kl += self.kl[i] as f64;
            ent += entropy[i] as f64;
            tokens += 1.0;
            if !per_sequence {
                count(self.clip[i], &mut clips);
            }
        }
        if per_sequence {
            for b in 0..batch.batch {
                count(self.sequence_clip(loss, batch, b), &mut clips);
            }
        }
        let denom = f64::max(tokens, 1.0);
        let clip_denom = if per_sequence {
            f64::max(batch.batch as f64, 1.0)
        } else {
            denom
        };
        self.loss = total;
        self.metrics = GrpoMetrics {
            kl_mean: kl / denom,
            clip_ratio_low: clips[0] / clip_denom,
            clip_ratio_high: clips[1] / clip_denom,
            clip_ratio_region: clips[2] / clip_denom,
            entropy_mean: ent / denom,
        };
    }

    /// Sequence `b`'s clip flags at sequence level: its live tokens' (they share `R_b`
    /// and `A_b`), or those of `R_b = 1` when it has none (TRL counts every sequence).
    fn sequence_clip(&self, loss: &GrpoLoss, batch: &GrpoBatch, b: usize) -> u8 {
        let t = batch.seq_len;
        let seq = b * t..(b + 1) * t;
        match seq.clone().find(|&i| batch.mask[i]) {
            Some(i) => self.clip[i],
            None => clip_flags(loss.config(), 1.0, batch.advantages.at(b * t, t) as f64),
        }
    }
}

/// True when TRL 1.16's clip metrics are means over sequences: the ratio is one per
/// sequence (sequence level) and so is the advantage (`[B]`, `[B, 1]`), so TRL's
/// clip flags are `[B, 1]` and its `global_masked_mean` divides by B. Per-token
/// advantages make the flags `[B, T]`, a mean over live tokens.
pub fn clips_per_sequence(loss: &GrpoLoss, batch: &GrpoBatch) -> bool {
    loss.config().importance_sampling_level == ImportanceSamplingLevel::Sequence
        && matches!(batch.advantages, PerSeqOrToken::Sequence(_))
}

/// Policy term of one token: `ℓ` and `∂ℓ/∂r` (ratio-based losses) or `∂ℓ/∂logp`
/// (losses linear in logp: cispo, vespo).
struct PolicyTerm {
    loss: f64,
    /// `∂ℓ/∂r` for clipped and sapo, `∂ℓ/∂logp` for cispo and vespo.
    grad: f64,
}

fn policy_term(c: &GrpoLossConfig, r: f64, adv: f64, logp: f64, vespo_phi: f64) -> PolicyTerm {
    match c.loss_type {
        LossType::Cispo => {
            let w = r.min(c.epsilon_high);
            PolicyTerm {
                loss: -w * adv * logp,
                grad: -w * adv,
            }
        }
        LossType::Sapo => {
            let tau = if adv > 0.0 {
                c.sapo_temperature_pos
            } else {
                c.sapo_temperature_neg
            };
            let sig = 1.0 / (1.0 + (-tau * (r - 1.0)).exp());
            PolicyTerm {
                loss: -adv * (4.0 / tau) * sig,
                grad: -adv * 4.0 * sig * (1.0 - sig),
            }
        }
        LossType::Vespo => PolicyTerm {
            loss: -vespo_phi * adv * logp,
            grad: -vespo_phi * adv,
        },
        _ => {
            // Clipped family: ℓ = -min(r̃·A, c·A); the gradient follows the branch the
            // min takes (ties to r̃), as autograd does.
            let (lo, hi) = (1.0 - c.epsilon_low, 1.0 + c.epsilon_high);
            let clipped = r.clamp(lo, hi);
            let capped = c.delta.map_or(r, |d| r.min(d));
            if capped * adv <= clipped * adv {
                let pass = c.delta.is_none_or(|d| r <= d);
                PolicyTerm {
                    loss: -capped * adv,
                    grad: if pass { -adv } else { 0.0 },
                }
            } else {
                let pass = (lo..=hi).contains(&r);
                PolicyTerm {
                    loss: -clipped * adv,
                    grad: if pass { -adv } else { 0.0 },
                }
            }
        }
    }
}

fn clip_flags(c: &GrpoLossConfig, r: f64, adv: f64) -> u8 {
    match c.loss_type {
        LossType::Cispo => {
            if r > c.epsilon_high && adv > 0.0 {
                CLIP_HIGH
            } else {
                0
            }
        }
        LossType::Sapo | LossType::Vespo => 0,
        _ => {
            let low = r < 1.0 - c.epsilon_low && adv < 0.0;
            let high = r > 1.0 + c.epsilon_high && adv > 0.0;
            (low as u8 * CLIP_LOW) | (high as u8 * CLIP_HIGH)
        }
    }
}

/// vespo's sequence weight `φ_b = exp(λ + k·log w_b - λ·w_b)` given `log w_b`.
fn vespo_phi(c: &GrpoLossConfig, log_w: f64, adv: f64) -> f64 {
    let (k, lambda) = if adv >= 0.0 {
        (c.vespo_k_pos, c.vespo_lambda_pos)
    } else {
        (c.vespo_k_neg, c.vespo_lambda_neg)
    };
    (lambda + k * log_w - lambda * log_w.exp()).exp()
}

/// `w_bt / m_bt`, the reduction weight of a live token of a sequence with `len_b`
/// live tokens (spec "Reduction weights", luspo as TRL 1.16: `1/B`).
fn reduction_weight(c: &GrpoLossConfig, norm: Normalizers, len_b: f64) -> f64 {
    match c.loss_type {
        LossType::Grpo | LossType::Sapo => 1.0 / (norm.batch_size * len_b),
        LossType::Bnpo => 1.0 / norm.token_count.max(1.0),
        LossType::DrGrpo => 1.0 / (norm.batch_size * c.max_completion_length.unwrap_or(1) as f64),
        LossType::Dapo | LossType::Cispo | LossType::Vespo => {
            1.0 / c.num_items_in_batch.unwrap_or(norm.token_count.max(1.0))
        }
        LossType::Luspo => 1.0 / norm.batch_size,
    }
}

/// `Σ_i w_i` over the live rows of `batch`: the weights of the rows in the loss's
/// reduction, whose sum times `|grad_output|` scales the absolute floor of a gradient
/// entry that sums over rows (`dW`, `dbias`; spec: "Absolute floor of a summed gradient
/// entry").
pub fn reduction_weight_sum(loss: &GrpoLoss, batch: &GrpoBatch, norm: Normalizers) -> f64 {
    let t = batch.seq_len.max(1);
    batch
        .mask
        .chunks(t)
        .map(|seq| {
            let len = seq.iter().filter(|&&m| m).count();
            len as f64 * reduction_weight(loss.config(), norm, len.max(1) as f64)
        })
        .sum()
}

/// vespo's `log w_b = clamp(Σ_t m·clamp(log r_t, ±20) + log ρ, ln 1e-8, 20)`, where the
/// sampler ratio adds `Σ_t m·clamp(log ρ_t, ln 1e-8, 20)` (per token) or
/// `clamp(log ρ_b, ln 1e-8, 20)` once (per sequence).
fn vespo_log_w(batch: &GrpoBatch, b: usize, log_ratio: impl Fn(usize) -> f64) -> f64 {
    let t_len = batch.seq_len;
    let lo = 1e-8f64.ln();
    let live = (b * t_len..(b + 1) * t_len).filter(|&i| batch.mask[i]);
    let mut sum: f64 = live.clone().map(|i| log_ratio(i).clamp(-20.0, 20.0)).sum();
    let log_rho = |x: f32| (x as f64).ln().clamp(lo, 20.0);
    match batch.sampler_ratio {
        Some(PerSeqOrToken::Token(rho)) => sum += live.map(|i| log_rho(rho[i])).sum::<f64>(),
        Some(PerSeqOrToken::Sequence(rho)) => sum += log_rho(rho[b]),
        None => {}
    }
    sum.clamp(lo, 20.0)
}

/// Computes the loss, metrics and backward coefficients from per-token `logp` and
/// `entropy` (`[N]`, f32 statistics of the kernel's forward). `batch` must have been
/// validated.
pub fn policy_stage(
    loss: &GrpoLoss,
    batch: &GrpoBatch,
    norm: Normalizers,
    logp: &[f32],
    entropy: &[f32],
) -> PolicyOutput {
    let mut out = PolicyOutput::new(batch.rows());
    policy_rows(loss, batch, norm, logp, entropy, 0..batch.rows(), &mut out);
    out.finish(loss, batch, entropy);
    out
}

/// The per-token part of [`policy_stage`] for `rows` only (their `logp` and `entropy`
/// must be final; others are not read). When [`GrpoLoss::needs_sequence_reduction`],
/// `rows` must cover whole sequences. Call [`PolicyOutput::finish`] once all rows are done.
///
/// Per live token: `ℓ_tot,i = ℓ_i·e_i·ρ_i + β·kl_i` (vespo: ρ is in φ_b, not a factor),
/// with `e_i` = [`GrpoBatch::policy_weight`]; its share of the loss is
/// `w_i·ℓ_tot,i - entropy_coef·m'_i·H_i / max(1, Σ m')`.
pub fn policy_rows(
    loss: &GrpoLoss,
    batch: &GrpoBatch,
    norm: Normalizers,
    logp: &[f32],
    entropy: &[f32],
    rows: Range<usize>,
    out: &mut PolicyOutput,
) {
    let weights = Weights::Reduction(norm);
    weighted_rows(loss, batch, weights, (logp, entropy), rows, out);
}

/// How each live token's `ℓ_tot,i` enters the loss.
#[derive(Debug, Clone, Copy)]
enum Weights<'a> {
    /// The loss type's reduction weight `w_i` (and the entropy bonus).
    Reduction(Normalizers),
    /// A given weight per token `[N]` and no entropy bonus: `L = Σ_i g_i·ℓ_tot,i`.
    PerToken(&'a [f32]),
}

/// The per-token losses `ℓ_tot,i = ℓ_i·e_i·ρ_i + β·kl_i` of every live token (0 where
/// masked), unreduced: Liger's `triton_grpo_loss(..., reduce=False)`. With
/// `grad_rows` `[N]` (the upstream gradient of each token's loss; ones for the
/// losses themselves), [`PolicyOutput::token_loss`] holds `g_i·ℓ_tot,i`, the loss their
/// sum, and `dlogp`, `dentropy` the derivatives of that sum (at sequence level with the
/// cross-token terms through `R_b`). The entropy bonus, a batch mean, is no token's
/// loss and takes no part. Metrics as [`policy_stage`]'s.
pub fn policy_stage_per_token(
    loss: &GrpoLoss,
    batch: &GrpoBatch,
    logp: &[f32],
    entropy: &[f32],
    grad_rows: &[f32],
) -> PolicyOutput {
    let mut out = PolicyOutput::new(batch.rows());
    let weights = Weights::PerToken(grad_rows);
    weighted_rows(
        loss,
        batch,
        weights,
        (logp, entropy),
        0..batch.rows(),
        &mut out,
    );
    out.finish(loss, batch, entropy);
    out
}

fn weighted_rows(
    loss: &GrpoLoss,
    batch: &GrpoBatch,
    weights: Weights,
    (logp, entropy): (&[f32], &[f32]),
    rows: Range<usize>,
    out: &mut PolicyOutput,
) {
    let c = loss.config();
    let t_len = batch.seq_len;
    let sequence_level = c.importance_sampling_level == ImportanceSamplingLevel::Sequence;
    let lp = |i: usize| logp[i] as f64;
    let old = |i: usize| batch.old_logp.map_or(lp(i), |o| o[i] as f64);
    let needs_sequence = loss.needs_sequence_reduction();
    let entropy_scale = match weights {
        Weights::Reduction(norm) => -c.entropy_coef / norm.entropy_count.max(1.0),
        Weights::PerToken(_) => 0.0,
    };
    // ℓ is a function of the ratio (its gradient goes through r), or linear in logp.
    let ratio_based = !matches!(c.loss_type, LossType::Cispo | LossType::Vespo);

    for b in rows.start / t_len..rows.end.div_ceil(t_len) {
        let seq = b * t_len..(b + 1) * t_len;
        let seq_tokens = seq.clone().filter(|&i| batch.mask[i]).count();
        let len_b = seq_tokens.max(1) as f64;
        let live = |r: &Range<usize>| {
            let r = r.clone();
            r.filter(|&i| batch.mask[i])
        };
        // Sequence-level ratio R_b, and vespo's log w_b (need the whole sequence).
        let (seq_log_ratio, log_w) = if needs_sequence {
            let log_ratio_sum: f64 = live(&seq).map(|i| lp(i) - old(i)).sum();
            let log_w = vespo_log_w(batch, b, |i| lp(i) - old(i));
            (log_ratio_sum / len_b, log_w)
        } else {
            (0.0, 0.0)
        };
        let seq_ratio = seq_log_ratio.exp();
        // Σ_s w_bs · ∂ℓ_tot,bs/∂R_b, the cross-token part of a sequence-level gradient
        // (the policy terms; `seq_grad_kl` holds the KL's, already times R_b).
        let (mut seq_grad, mut seq_grad_kl) = (0.0f64, 0.0f64);
        let here = seq.start.max(rows.start)..seq.end.min(rows.end);
        let w_seq = match weights {
            Weights::Reduction(norm) => reduction_weight(c, norm, len_b),
            Weights::PerToken(_) => 0.0,
        };

        for i in live(&here) {
            let w = match weights {
                Weights::Reduction(_) => w_seq,
                Weights::PerToken(g) => g[i] as f64,
            };
            let adv = batch.advantages.at(i, t_len) as f64;
            let rho = match (c.loss_type, batch.sampler_ratio) {
                (LossType::Vespo, _) | (_, None) => 1.0,
                (_, Some(s)) => s.at(i, t_len) as f64,
            };
            // The policy term's factor e_i·ρ_i.
            let scale = batch.policy_weight(i) * rho;
            let log_r = if sequence_level {
                seq_log_ratio
            } else {
                lp(i) - old(i)
            };
            let r = log_r.exp();
            let phi = vespo_phi(c, log_w, adv);
            let term = policy_term(c, r, adv, lp(i), phi);

            // KL (k3) and its derivative w.r.t. this token's logp (direct part); none
            // when β = 0 (TRL computes it only then). With bias correction,
            // `kl·r = exp(d + log r) - (d + 1)·r`, never `∞·0` where `exp(d)` leaves f64
            // and r underflows.
            let (mut kl, mut dkl) = (0.0, 0.0);
            if let (Some(q), true) = (batch.ref_logp, c.beta != 0.0) {
                let d = q[i] as f64 - lp(i);
                if !c.use_bias_correction_kl {
                    kl = d.exp() - d - 1.0;
                    dkl = 1.0 - d.exp();
                } else {
                    kl = (d + log_r).exp() - (d + 1.0) * r;
                    if sequence_level {
                        // ∂(k3·R)/∂R · R = k3·R.
                        seq_grad_kl += w * c.beta * kl;
                        dkl = r - (d + log_r).exp();
                    } else {
                        dkl = -r * d;
                    }
                }
            }

            let h = entropy[i] as f64;
            let bonus = if batch.in_entropy_bonus(i) {
                entropy_scale
            } else {
                0.0
            };
            out.token_loss[i] = w * (term.loss * scale + c.beta * kl) + bonus * h;
            let mut dlogp = w * c.beta * dkl;
            if !ratio_based {
                dlogp += w * scale * term.grad;
            } else if sequence_level {
                seq_grad += w * scale * term.grad;
            } else {
                dlogp += w * scale * term.grad * r;
            }
            out.dlogp[i] = dlogp as f32;
            out.dentropy[i] = bonus as f32;
            out.kl[i] = kl as f32;
            out.clip[i] = clip_flags(c, r, adv);
        }
        if sequence_level {
            // ∂R_b/∂logp_bt = R_b · m_bt / L_b.
            let cross = (seq_grad * seq_ratio + seq_grad_kl) / len_b;
            for i in live(&here) {
                out.dlogp[i] = (out.dlogp[i] as f64 + cross) as f32;
            }
        }
    }
}
