//! The GRPO loss of the spec, literally, and its reference gradients:
//! `L = Σ_i w_i·(ℓ_i·e_i·ρ_i + β·kl_i) - entropy_coef·Σ_i m'_i·H_i / max(1, Σ_i m'_i)`
//! (spec, "Alignment with TRL 1.16").

use super::dual::{Dual, Num};
use super::softmax::row_softmax;
use super::support::{SupportRow, support_row};
use crate::batch::{GrpoBatch, PerSeqOrToken};
use crate::grpo_config::{GrpoLoss, GrpoLossConfig, ImportanceSamplingLevel, LossType};
use crate::policy::{GrpoMetrics, Normalizers};

/// Everything the reference computes; per-token vectors are `[N]` (0 where masked).
#[derive(Debug, Clone)]
pub struct GrpoReference {
    /// The loss `L`.
    pub loss: f64,
    /// Batch metrics.
    pub metrics: GrpoMetrics,
    /// Per-token `logp_i` (under a truncated support `logp^K_i`; `-inf` for a token
    /// masked by it, whose `lse^K` and entropy are kept too).
    pub logp: Vec<f64>,
    /// Per-token `lse_i`.
    pub lse: Vec<f64>,
    /// Per-token entropy `H_i`.
    pub entropy: Vec<f64>,
    /// Per-token KL as it enters the loss.
    pub kl: Vec<f64>,
    /// Each token's share `weight·ℓ_tot + bonus` of the loss.
    pub token_loss: Vec<f64>,
    /// `∂L/∂logp_i`.
    pub dlogp: Vec<f64>,
    /// `∂L/∂H_i`.
    pub dentropy: Vec<f64>,
    /// `grad_output · ∂L/∂z` `[N, V]`, dense.
    pub dlogits: Vec<f64>,
    /// Under the loss config's truncated support: whether each token's target is
    /// outside it (the token is then masked, its `logp` `-inf`); all false otherwise.
    pub outside: Vec<bool>,
}

/// How each token's `ℓ_tot` enters the loss: the loss type's reduction (with the
/// entropy bonus), or given per-token weights `g_i` (`L = Σ_i g_i·ℓ_tot,i`, no bonus:
/// the per-token losses of Liger's `reduce=False`).
#[derive(Clone, Copy)]
enum Weights<'a> {
    Reduction(Normalizers),
    PerToken(&'a [f32]),
}

/// One token's share of the loss: `L = Σ (weight · total + bonus)`.
struct TokenTerm<N> {
    row: usize,
    weight: f64,
    ratio: N,
    advantage: f64,
    kl: N,
    /// `ℓ·e·ρ + β·kl`.
    total: N,
    /// The entropy bonus's share, `-entropy_coef · m'·H / max(1, Σ m')`.
    bonus: N,
}

/// TRL's clip flags `(low, high)` of ratio `r` and advantage `a`.
fn clipped(c: &GrpoLossConfig, r: f64, a: f64) -> (bool, bool) {
    match c.loss_type {
        LossType::Cispo => (false, r > c.epsilon_high && a > 0.0),
        LossType::Sapo | LossType::Vespo => (false, false),
        _ => (
            r < 1.0 - c.epsilon_low && a < 0.0,
            r > 1.0 + c.epsilon_high && a > 0.0,
        ),
    }
}

/// The terms of sequence `b`, given its T logp and entropy values.
fn sequence_terms<N: Num>(
    c: &GrpoLossConfig,
    batch: &GrpoBatch,
    weights: Weights,
    b: usize,
    logp: &[N],
    entropy: &[N],
) -> Vec<TokenTerm<N>> {
    let t_len = batch.seq_len;
    let row = |t: usize| b * t_len + t;
    let live: Vec<usize> = (0..t_len).filter(|&t| batch.mask[row(t)]).collect();
    let len_b = live.len().max(1) as f64;
    // o = stopgrad(logp) when there is no old policy.
    let old = |t: usize| match batch.old_logp {
        Some(o) => N::c(o[row(t)] as f64),
        None => logp[t].stopgrad(),
    };
    let mut log_ratio_sum = N::c(0.0);
    let mut vespo_log_w = N::c(0.0);
    let log_rho = |x: f32| (x as f64).ln().clamp(1e-8f64.ln(), 20.0);
    for &t in &live {
        log_ratio_sum = log_ratio_sum + (logp[t] - old(t));
        vespo_log_w = vespo_log_w + (logp[t] - old(t)).clamp_v(-20.0, 20.0);
        // TRL's get_gamma_weights: log w += Σ_t log ρ_t (over live tokens here).
        if let Some(PerSeqOrToken::Token(rho)) = batch.sampler_ratio {
            vespo_log_w = vespo_log_w + N::c(log_rho(rho[row(t)]));
        }
    }
    if let Some(PerSeqOrToken::Sequence(rho)) = batch.sampler_ratio {
        vespo_log_w = vespo_log_w + N::c(log_rho(rho[b]));
    }
    let seq_log_ratio = log_ratio_sum * N::c(1.0 / len_b);
    let vespo_log_w = vespo_log_w.clamp_v(1e-8f64.ln(), 20.0);

    let mut terms = Vec::new();
    for &t in &live {
        let i = row(t);
        let adv = batch.advantages.at(i, t_len) as f64;
        let a = N::c(adv);
        let log_r = match c.importance_sampling_level {
            ImportanceSamplingLevel::Token => logp[t] - old(t),
            ImportanceSamplingLevel::Sequence => seq_log_ratio,
        };
        let r = log_r.exp();
        let policy = match c.loss_type {
            LossType::Cispo => -(r.min_v(N::c(c.epsilon_high)).stopgrad() * a * logp[t]),
            LossType::Sapo => {
                let tau = if adv > 0.0 {
                    c.sapo_temperature_pos
                } else {
                    c.sapo_temperature_neg
                };
                let sigmoid = (N::c(1.0) + (-(N::c(tau) * (r - N::c(1.0)))).exp()).recip();
                -(a * N::c(4.0 / tau) * sigmoid)
            }
            LossType::Vespo => {
                let (k, lambda) = if adv >= 0.0 {
                    (c.vespo_k_pos, c.vespo_lambda_pos)
                } else {
                    (c.vespo_k_neg, c.vespo_lambda_neg)
                };
                let w = vespo_log_w.exp();
                let phi = (N::c(lambda) + N::c(k) * vespo_log_w - N::c(lambda) * w).exp();
                -(phi.stopgrad() * a * logp[t])
            }
            _ => {
                let capped = match c.delta {
                    Some(d) => r.min_v(N::c(d)),
                    None => r,
                };
                let clipped = r.clamp_v(1.0 - c.epsilon_low, 1.0 + c.epsilon_high);
                -((capped * a).min_v(clipped * a))
            }
        };
        // vespo: ρ is inside φ_b, not a factor of ℓ (TRL skips the product for vespo).
        let rho = match batch.sampler_ratio {
            Some(s) if c.loss_type != LossType::Vespo => s.at(i, t_len) as f64,
            _ => 1.0,
        };
        let on = |m: Option<&[bool]>| m.is_none_or(|m| m[i]);
        let e = if on(batch.policy_mask) && on(batch.entropy_mask) {
            1.0
        } else {
            0.0
        };
        let in_bonus = on(batch.entropy_mask);
        // β·kl is absent when β = 0; k3·r is written exp(d + log r) - (d + 1)·r.
        let kl = match (batch.ref_logp, c.beta != 0.0) {
            (Some(q), true) => {
                let d = N::c(q[i] as f64) - logp[t];
                match c.use_bias_correction_kl {
                    true => (d + log_r).exp() - (d + N::c(1.0)) * r,
                    false => d.exp() - d - N::c(1.0),
                }
            }
            _ => N::c(0.0),
        };
        let (weight, bonus) = match weights {
            Weights::PerToken(g) => (g[i] as f64, N::c(0.0)),
            Weights::Reduction(norm) => {
                let weight = match c.loss_type {
                    LossType::Grpo | LossType::Sapo => 1.0 / (norm.batch_size * len_b),
                    LossType::Bnpo => 1.0 / norm.token_count.max(1.0),
                    LossType::DrGrpo => {
                        1.0 / (norm.batch_size * c.max_completion_length.unwrap_or(1) as f64)
                    }
                    LossType::Dapo | LossType::Cispo | LossType::Vespo => {
                        1.0 / c.num_items_in_batch.unwrap_or(norm.token_count.max(1.0))
                    }
                    LossType::Luspo => 1.0 / norm.batch_size,
                };
                let bonus = if in_bonus {
                    -(N::c(c.entropy_coef / norm.entropy_count.max(1.0)) * entropy[t])
                } else {
                    N::c(0.0)
                };
                (weight, bonus)
            }
        };
        let total = policy * N::c(e) * N::c(rho) + N::c(c.beta) * kl;
        terms.push(TokenTerm {
            row: i,
            weight,
            ratio: r,
            advantage: adv,
            kl,
            total,
            bonus,
        });
    }
    terms
}

fn sequence_loss<N: Num>(terms: &[TokenTerm<N>]) -> N {
    terms
        .iter()
        .fold(N::c(0.0), |acc, t| acc + N::c(t.weight) * t.total + t.bonus)
}

/// The reference's loss from given per-token `logp` and `entropy` (`[N]`; only live
/// rows are read): its policy stage alone, e.g. on a kernel's own statistics, to tell
/// what the kernel's per-token errors do to the loss (spec, flashloss addition 5). Under
/// the loss's truncated support `logp` is `logp^K`, and a live row at `-inf` (its target
/// outside the support) is masked, the normalizers less it (addition 13).
pub fn grpo_reference_loss(
    loss: &GrpoLoss,
    batch: &GrpoBatch,
    norm: Normalizers,
    logp: &[f64],
    entropy: &[f64],
) -> f64 {
    let outside: Vec<bool> = (logp.iter())
        .map(|&lp| loss.support().is_some() && lp == f64::NEG_INFINITY)
        .collect();
    let mask: Vec<bool> = (0..batch.rows())
        .map(|i| batch.mask[i] && !outside[i])
        .collect();
    let norm = norm.without(batch, &outside);
    let batch = &GrpoBatch {
        mask: &mask,
        ..*batch
    };
    let t_len = batch.seq_len;
    (0..batch.batch)
        .map(|b| {
            let rows = b * t_len..(b + 1) * t_len;
            let terms = sequence_terms::<f64>(
                loss.config(),
                batch,
                Weights::Reduction(norm),
                b,
                &logp[rows.clone()],
                &entropy[rows],
            );
            sequence_loss(&terms)
        })
        .sum()
}

/// Runs the reference on dense f64 logits `[N, V]` (N = B·T). `batch` must be valid;
/// `grad_output` scales `dlogits`.
pub fn grpo_reference(
    loss: &GrpoLoss,
    batch: &GrpoBatch,
    norm: Normalizers,
    logits: &[f64],
    vocab: usize,
    grad_output: f64,
) -> GrpoReference {
    let weights = Weights::Reduction(norm);
    reference_with(loss, batch, weights, logits, vocab, grad_output)
}

/// The reference of the per-token losses (Liger's `reduce=False`): `L = Σ_i g_i·ℓ_tot,i`
/// with `grad_rows` `[N]` the upstream gradient of each token's loss and no entropy
/// bonus; [`GrpoReference::token_loss`] holds `g_i·ℓ_tot,i` (the losses themselves for
/// ones), the derivatives are those of `L`.
pub fn grpo_reference_per_token(
    loss: &GrpoLoss,
    batch: &GrpoBatch,
    grad_rows: &[f32],
    logits: &[f64],
    vocab: usize,
) -> GrpoReference {
    reference_with(
        loss,
        batch,
        Weights::PerToken(grad_rows),
        logits,
        vocab,
        1.0,
    )
}

fn reference_with(
    loss: &GrpoLoss,
    batch: &GrpoBatch,
    weights: Weights,
    logits: &[f64],
    vocab: usize,
    grad_output: f64,
) -> GrpoReference {
    let c = loss.config();
    let (b_count, t_len) = (batch.batch, batch.seq_len);
    let n = b_count * t_len;
    // Under a truncated support: each live row's support, and the mask without the
    // tokens whose target is outside it (flashloss addition 13).
    let supports: Vec<Option<SupportRow>> = (0..n)
        .map(|i| {
            let filter = loss.support().filter(|_| batch.mask[i])?;
            let row = &logits[i * vocab..(i + 1) * vocab];
            Some(support_row(
                row,
                c.temperature,
                batch.target_ids[i] as usize,
                filter,
            ))
        })
        .collect();
    let outside: Vec<bool> = (supports.iter())
        .map(|s| s.as_ref().is_some_and(|s| s.logp == f64::NEG_INFINITY))
        .collect();
    let mask: Vec<bool> = (0..n).map(|i| batch.mask[i] && !outside[i]).collect();
    let weights = match weights {
        Weights::Reduction(norm) => Weights::Reduction(norm.without(batch, &outside)),
        per_token => per_token,
    };
    let batch = &GrpoBatch {
        mask: &mask,
        ..*batch
    };
    let mut out = GrpoReference {
        loss: 0.0,
        metrics: GrpoMetrics::default(),
        logp: vec![0.0; n],
        lse: vec![0.0; n],
        entropy: vec![0.0; n],
        kl: vec![0.0; n],
        token_loss: vec![0.0; n],
        dlogp: vec![0.0; n],
        dentropy: vec![0.0; n],
        dlogits: vec![0.0; n * vocab],
        outside: outside.clone(),
    };
    let mut softmax = Vec::with_capacity(n);
    for i in 0..n {
        if !batch.mask[i] {
            softmax.push(None);
            continue;
        }
        let row = row_softmax(&logits[i * vocab..(i + 1) * vocab], c.temperature);
        out.entropy[i] = row.entropy;
        (out.logp[i], out.lse[i]) = match &supports[i] {
            Some(s) => (s.logp, s.lse),
            None => (row.log_probs[batch.target_ids[i] as usize], row.lse),
        };
        softmax.push(Some(row));
    }
    // A token masked by the support keeps its statistics: `-inf`, `lse^K`, the entropy.
    for (i, s) in supports.iter().enumerate().filter(|&(i, _)| outside[i]) {
        let row = row_softmax(&logits[i * vocab..(i + 1) * vocab], c.temperature);
        out.entropy[i] = row.entropy;
        out.lse[i] = s.as_ref().map_or(0.0, |s| s.lse);
        out.logp[i] = f64::NEG_INFINITY;
    }

    let (mut tokens, mut kl_sum, mut ent_sum) = (0.0, 0.0, 0.0);
    // TRL 1.16's `global_masked_mean`: clip flags of shape `[B, 1]` (a sequence-level
    // ratio and per-sequence advantages) are averaged over the B sequences.
    let per_sequence = c.importance_sampling_level == ImportanceSamplingLevel::Sequence
        && matches!(batch.advantages, PerSeqOrToken::Sequence(_));
    let (mut low, mut high, mut region) = (0.0, 0.0, 0.0);
    for b in 0..b_count {
        let rows = b * t_len..(b + 1) * t_len;
        let lp = &out.logp[rows.clone()];
        let ent = &out.entropy[rows.clone()];
        let terms = sequence_terms::<f64>(c, batch, weights, b, lp, ent);
        out.loss += sequence_loss(&terms);
        let mut flags = |(is_low, is_high): (bool, bool)| {
            low += is_low as u8 as f64;
            high += is_high as u8 as f64;
            region += (is_low || is_high) as u8 as f64;
        };
        for term in &terms {
            let i = term.row;
            out.kl[i] = term.kl;
            out.token_loss[i] = term.weight * term.total + term.bonus;
            tokens += 1.0;
            kl_sum += term.kl;
            ent_sum += out.entropy[i];
            if !per_sequence {
                flags(clipped(c, term.ratio, term.advantage));
            }
        }
        if per_sequence {
            // TRL's `[B, 1]` flags: one per sequence, `R_b = exp(0) = 1` for a sequence
            // with no live token.
            let (r, a) = terms.first().map_or_else(
                || (1.0, batch.advantages.at(b * t_len, t_len) as f64),
                |term| (term.ratio, term.advantage),
            );
            flags(clipped(c, r, a));
        }
        // Exact derivatives: one dual evaluation per seeded input.
        for seed in 0..2 * t_len {
            let (t, seed_entropy) = (seed % t_len, seed >= t_len);
            if !batch.mask[b * t_len + t] {
                continue;
            }
            let dual = |values: &[f64], seeded: bool| -> Vec<Dual> {
                values
                    .iter()
                    .enumerate()
                    .map(|(k, &v)| Dual {
                        v,
                        d: (seeded && k == t) as u8 as f64,
                    })
                    .collect()
            };
            let terms = sequence_terms(
                c,
                batch,
                weights,
                b,
                &dual(lp, !seed_entropy),
                &dual(ent, seed_entropy),
            );
            let d = sequence_loss(&terms).d;
            if seed_entropy {
                out.dentropy[b * t_len + t] = d;
            } else {
                out.dlogp[b * t_len + t] = d;
            }
        }
    }
    let denom = f64::max(tokens, 1.0);
    let clip_denom = match per_sequence {
        true => f64::max(b_count as f64, 1.0),
        false => denom,
    };
    out.metrics = GrpoMetrics {
        kl_mean: kl_sum / denom,
        clip_ratio_low: low / clip_denom,
        clip_ratio_high: high / clip_denom,
        clip_ratio_region: region / clip_denom,
        entropy_mean: ent_sum / denom,
    };

    // ∂L/∂z_ij = (1/T)·[dlogp·(1[j=y] - p_j) - dentropy·p_j·(log p_j + H)]; under a
    // support, dlogp's term is `∂logp^K/∂z_j` (K held fixed).
    for (i, row) in softmax.iter().enumerate() {
        let Some(row) = row else { continue };
        let scale = grad_output / c.temperature;
        let dz = &mut out.dlogits[i * vocab..(i + 1) * vocab];
        for (j, &log_p) in row.log_probs.iter().enumerate() {
            let p = log_p.exp();
            let entropy_term = if p > 0.0 {
                p * (log_p + out.entropy[i])
            } else {
                0.0
            };
            let logp_term = match &supports[i] {
                Some(s) => grad_output * out.dlogp[i] * s.dlogp[j],
                None => -scale * out.dlogp[i] * p,
            };
            dz[j] = logp_term - scale * out.dentropy[i] * entropy_term;
        }
        if supports[i].is_none() {
            dz[batch.target_ids[i] as usize] += scale * out.dlogp[i];
        }
    }
    out
}
