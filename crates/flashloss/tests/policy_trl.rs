//! The shared policy stage (`policy::policy_stage`) against the f64 reference on the
//! TRL 1.16 rules (spec, "Alignment with TRL 1.16"): luspo's `1/B` reduction at token
//! and sequence level, the entropy bonus as a token mean over `m' = m·entropy_mask`,
//! the policy and entropy masks, vespo's sampler ratio inside `φ_b`, cispo and sapo at
//! sequence level, the bias-corrected KL by default. Plus hand-computed values, so
//! that a change shared by the stage and the reference still fails.

use flashloss::policy::{Normalizers, policy_stage};
use flashloss::reference::grpo_reference;
use flashloss::{GrpoBatch, GrpoLoss, GrpoLossConfig, ImportanceSamplingLevel, LossType};
use flashloss::{PerSeqOrToken, PerSeqOrTokenBuf};

/// A small deterministic generator (xorshift64*), uniform in [0, 1).
struct Draw(u64);

impl Draw {
    fn next(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
    }
}

const B: usize = 4;
const T: usize = 5;
const V: usize = 13;

/// Which optional inputs a case draws.
#[derive(Debug, Clone, Copy)]
struct Extras {
    policy_mask: bool,
    entropy_mask: bool,
    /// 0: none, 1: per token, 2: per sequence.
    rho: u8,
}

/// Inputs: sequence 2 fully padded; the policy mask drops all of sequence 0 and some
/// tokens; the entropy mask drops all of sequence 3 and some tokens.
struct Case {
    logits: Vec<f64>,
    targets: Vec<i64>,
    mask: Vec<bool>,
    adv: Vec<f32>,
    old: Vec<f32>,
    reference: Vec<f32>,
    rho: Option<PerSeqOrTokenBuf>,
    policy_mask: Option<Vec<bool>>,
    entropy_mask: Option<Vec<bool>>,
}

impl Case {
    fn new(seed: u64, x: Extras) -> Self {
        let mut d = Draw(seed);
        let n = B * T;
        let logits = (0..n * V).map(|_| d.next() * 6.0 - 3.0).collect();
        let targets = (0..n).map(|_| (d.next() * V as f64) as i64).collect();
        let mask: Vec<bool> = (0..n)
            .map(|i| i / T != 2 && (i % T < 2 || d.next() > 0.25))
            .collect();
        let adv = (0..B).map(|_| (d.next() * 2.0 - 1.0) as f32).collect();
        let old = (0..n).map(|_| (-2.6 - 0.4 * d.next()) as f32).collect();
        let reference = (0..n).map(|_| (-2.6 - 0.4 * d.next()) as f32).collect();
        let rho = match x.rho {
            1 => Some(PerSeqOrTokenBuf::Token(
                (0..n).map(|_| (0.5 + d.next()) as f32).collect(),
            )),
            2 => Some(PerSeqOrTokenBuf::Sequence(
                (0..B).map(|_| (0.5 + d.next()) as f32).collect(),
            )),
            _ => None,
        };
        let policy_mask = x
            .policy_mask
            .then(|| (0..n).map(|i| i / T != 0 && d.next() > 0.2).collect());
        let entropy_mask = x
            .entropy_mask
            .then(|| (0..n).map(|i| i / T != 3 && d.next() > 0.3).collect());
        Case {
            logits,
            targets,
            mask,
            adv,
            old,
            reference,
            rho,
            policy_mask,
            entropy_mask,
        }
    }

    fn batch(&self) -> GrpoBatch<'_> {
        GrpoBatch {
            batch: B,
            seq_len: T,
            target_ids: &self.targets,
            mask: &self.mask,
            advantages: PerSeqOrToken::Sequence(&self.adv),
            old_logp: Some(&self.old),
            ref_logp: Some(&self.reference),
            sampler_ratio: self.rho.as_ref().map(PerSeqOrTokenBuf::view),
            policy_mask: self.policy_mask.as_deref(),
            entropy_mask: self.entropy_mask.as_deref(),
        }
    }
}

fn max_abs(x: impl Iterator<Item = f64>) -> f64 {
    x.fold(0.0, |m, v| m.max(v.abs()))
}

/// Runs the stage on the reference's f32-rounded logp and entropy; checks the loss,
/// `dlogp`, `dentropy`, KL and metrics against the reference.
fn check(config: GrpoLossConfig, x: Extras, seed: u64) {
    let case_name = format!(
        "{} {:?} beta={} {x:?}",
        config.loss_type.name(),
        config.importance_sampling_level,
        config.beta
    );
    let loss = GrpoLoss::new(config).unwrap();
    let case = Case::new(seed, x);
    let batch = case.batch();
    batch.validate(V, &loss).unwrap();
    let norm = Normalizers::local(&batch);
    let r = grpo_reference(&loss, &batch, norm, &case.logits, V, 1.0);
    let logp: Vec<f32> = r.logp.iter().map(|&v| v as f32).collect();
    let entropy: Vec<f32> = r.entropy.iter().map(|&v| v as f32).collect();
    let out = policy_stage(&loss, &batch, norm, &logp, &entropy);
    assert!(
        (out.loss - r.loss).abs() <= 1e-5 * r.loss.abs().max(1.0),
        "{case_name}: loss {} vs {}",
        out.loss,
        r.loss
    );
    for (name, got, want) in [
        ("dlogp", &out.dlogp, &r.dlogp),
        ("dentropy", &out.dentropy, &r.dentropy),
        ("kl", &out.kl, &r.kl),
    ] {
        let scale = max_abs(want.iter().copied());
        let err = max_abs(got.iter().zip(want).map(|(g, w)| *g as f64 - w));
        assert!(
            err <= 1e-4 * scale + 1e-6,
            "{case_name}: {name} error {err:.3e}, max |ref| {scale:.3e}"
        );
    }
    assert!((out.metrics.clip_ratio_region - r.metrics.clip_ratio_region).abs() < 1e-12);
    // ∂L/∂H_i = -entropy_coef · m'_i / max(1, Σ m'), exactly.
    let live: Vec<bool> = (0..B * T)
        .map(|i| batch.mask[i] && case.entropy_mask.as_ref().is_none_or(|e| e[i]))
        .collect();
    let count = live.iter().filter(|&&m| m).count().max(1) as f64;
    for (i, &on) in live.iter().enumerate() {
        let want = if on {
            -loss.config().entropy_coef / count
        } else {
            0.0
        };
        assert!(
            (r.dentropy[i] - want).abs() <= 1e-12 && (out.dentropy[i] as f64 - want).abs() < 1e-9,
            "{case_name}: dentropy[{i}] = {} / {}, want {want}",
            r.dentropy[i],
            out.dentropy[i]
        );
    }
}

fn config(t: LossType, level: ImportanceSamplingLevel, beta: f64) -> GrpoLossConfig {
    GrpoLossConfig {
        loss_type: t,
        importance_sampling_level: level,
        beta,
        entropy_coef: 0.01,
        max_completion_length: Some(7),
        epsilon_high: if t == LossType::Cispo { 1.02 } else { 0.2 },
        ..GrpoLossConfig::default()
    }
}

#[test]
fn every_type_level_mask_and_ratio_matches_the_reference() {
    use ImportanceSamplingLevel::*;
    let mut seed = 1;
    for t in LossType::ALL {
        for level in [Token, Sequence] {
            if !t.allows_level(level) {
                continue;
            }
            for beta in [0.0, 0.04] {
                for (policy_mask, entropy_mask) in
                    [(false, false), (true, false), (false, true), (true, true)]
                {
                    for rho in [0, 1, 2] {
                        let x = Extras {
                            policy_mask,
                            entropy_mask,
                            rho,
                        };
                        check(config(t, level, beta), x, seed);
                        seed += 1;
                    }
                }
            }
        }
    }
}

/// On-policy (ratio 1), no KL: the clipped loss is `ℓ = -A`, so luspo's
/// `L = (1/B) Σ_b Σ_t m_bt e_bt ℓ_bt = -(1/B) Σ_b A_b Σ_t m_bt e_bt`; with
/// `A = 0` the loss is the entropy bonus alone, `-coef · Σ m'H / Σ m'`.
#[test]
fn hand_computed_luspo_and_entropy_bonus() {
    let x = Extras {
        policy_mask: true,
        entropy_mask: true,
        rho: 0,
    };
    for level in [
        ImportanceSamplingLevel::Token,
        ImportanceSamplingLevel::Sequence,
    ] {
        let mut case = Case::new(99, x);
        let mut cfg = config(LossType::Luspo, level, 0.0);
        cfg.entropy_coef = 0.0;
        let loss = GrpoLoss::new(cfg).unwrap();
        let mut batch = case.batch();
        batch.old_logp = None;
        let r = grpo_reference(
            &loss,
            &batch,
            Normalizers::local(&batch),
            &case.logits,
            V,
            1.0,
        );
        let want: f64 = -(0..B * T)
            .filter(|&i| batch.mask[i] && batch.policy_weight(i) > 0.0)
            .map(|i| case.adv[i / T] as f64)
            .sum::<f64>()
            / B as f64;
        assert!(
            (r.loss - want).abs() < 1e-12,
            "{level:?}: {} vs {want}",
            r.loss
        );

        case.adv.fill(0.0);
        let mut cfg = config(LossType::Dapo, level, 0.0);
        cfg.entropy_coef = 0.25;
        let loss = GrpoLoss::new(cfg).unwrap();
        let batch = case.batch();
        let r = grpo_reference(
            &loss,
            &batch,
            Normalizers::local(&batch),
            &case.logits,
            V,
            1.0,
        );
        let live: Vec<usize> = (0..B * T).filter(|&i| batch.in_entropy_bonus(i)).collect();
        let mean = live.iter().map(|&i| r.entropy[i]).sum::<f64>() / live.len() as f64;
        assert!(
            (r.loss + 0.25 * mean).abs() < 1e-12,
            "{} vs {}",
            r.loss,
            -0.25 * mean
        );
    }
}

/// vespo: `log w_b = clamp(Σ_t m·clamp(log r_t) + Σ_t m·clamp(log ρ_t), ln 1e-8, 20)`;
/// a ρ of 0 is clamped at `ln 1e-8`, never NaN. With `ρ_t = r_t⁻¹` on every live token
/// the weight is `w_b = 1`, so `φ_b = exp(λ - λ) = 1` and `∂L/∂logp = -A/N`.
#[test]
fn vespo_sampler_ratio_enters_phi() {
    let x = Extras {
        policy_mask: false,
        entropy_mask: false,
        rho: 1,
    };
    let mut case = Case::new(5, x);
    let cfg = config(LossType::Vespo, ImportanceSamplingLevel::Token, 0.0);
    let loss = GrpoLoss::new(GrpoLossConfig {
        entropy_coef: 0.0,
        ..cfg
    })
    .unwrap();
    let r0 = grpo_reference(
        &loss,
        &case.batch(),
        Normalizers::local(&case.batch()),
        &case.logits,
        V,
        1.0,
    );
    let inverse: Vec<f32> = (0..B * T)
        .map(|i| (case.old[i] as f64 - r0.logp[i]).exp() as f32)
        .collect();
    case.rho = Some(PerSeqOrTokenBuf::Token(inverse));
    let batch = case.batch();
    let norm = Normalizers::local(&batch);
    let r = grpo_reference(&loss, &batch, norm, &case.logits, V, 1.0);
    let logp: Vec<f32> = r.logp.iter().map(|&v| v as f32).collect();
    let entropy: Vec<f32> = r.entropy.iter().map(|&v| v as f32).collect();
    let out = policy_stage(&loss, &batch, norm, &logp, &entropy);
    for i in (0..B * T).filter(|&i| batch.mask[i]) {
        let want = -(case.adv[i / T] as f64) / norm.token_count;
        assert!(
            (r.dlogp[i] - want).abs() < 1e-5 * want.abs().max(1e-3),
            "ref row {i}"
        );
        assert!(
            (out.dlogp[i] as f64 - want).abs() < 1e-4 * want.abs().max(1e-3),
            "row {i}"
        );
    }
    // ρ = 0 everywhere: finite.
    case.rho = Some(PerSeqOrTokenBuf::Sequence(vec![0.0; B]));
    let batch = case.batch();
    let norm = Normalizers::local(&batch);
    let out = policy_stage(&loss, &batch, norm, &logp, &entropy);
    assert!(out.loss.is_finite() && out.dlogp.iter().all(|g| g.is_finite()));
}

/// TRL 1.16's `global_masked_mean` of `[B, 1]` clip flags (issue 33): at sequence level
/// with per-sequence advantages the clip metrics are means over the B sequences, a
/// sequence with no live token counting with `R_b = 1`; with per-token advantages they
/// stay means over live tokens. Sequence 0 (4 live tokens) has `R_0 = 1.5`, sequence 1
/// (1 live token) `R_1 = 1`, sequence 2 none.
#[test]
fn sequence_level_clip_metrics_are_means_over_sequences() {
    let t = 4;
    let mask: Vec<bool> = (0..3 * t).map(|i| i <= t).collect();
    let targets = vec![0i64; 3 * t];
    let logp = vec![-1.0f32; 3 * t];
    let old: Vec<f32> = (0..3 * t)
        .map(|i| if i < t { -1.0 - 1.5f32.ln() } else { -1.0 })
        .collect();
    let adv = vec![1.0f32, 1.0, 1.0];
    let adv_tokens = vec![1.0f32; 3 * t];
    let entropy = vec![0.5f32; 3 * t];
    let batch = |advantages| GrpoBatch {
        batch: 3,
        seq_len: t,
        target_ids: &targets,
        mask: &mask,
        advantages,
        old_logp: Some(&old),
        ref_logp: None,
        sampler_ratio: None,
        policy_mask: None,
        entropy_mask: None,
    };
    let metric = |loss_type, eps_high, advantages| {
        let c = GrpoLossConfig {
            loss_type,
            importance_sampling_level: ImportanceSamplingLevel::Sequence,
            epsilon_high: eps_high,
            ..GrpoLossConfig::default()
        };
        let (loss, batch) = (GrpoLoss::new(c).unwrap(), batch(advantages));
        let m = policy_stage(&loss, &batch, Normalizers::local(&batch), &logp, &entropy).metrics;
        (m.clip_ratio_high, m.clip_ratio_region, m.clip_ratio_low)
    };
    let per_seq = PerSeqOrToken::Sequence(&adv);
    let per_token = PerSeqOrToken::Token(&adv_tokens);
    // Rows 0..=t: sequence 0 whole and position 0 of sequence 1. Only sequence 0 is clipped: 1 of 3 sequences (the token mean would be 4/5).
    assert_eq!(
        metric(LossType::Grpo, 0.2, per_seq),
        (1.0 / 3.0, 1.0 / 3.0, 0.0)
    );
    assert_eq!(metric(LossType::Grpo, 0.2, per_token), (0.8, 0.8, 0.0));
    // cispo with ε_high = 0.5: every sequence has R_b > 0.5 and A_b > 0, the empty one too.
    assert_eq!(metric(LossType::Cispo, 0.5, per_seq), (1.0, 1.0, 0.0));
}

/// Per-token losses (Liger's `reduce=False`, issue 33) against the reference's: the
/// losses `ℓ_tot,i` with unit weights, and the derivatives of `Σ_i g_i·ℓ_tot,i` for
/// drawn `g` (sequence level: the cross-token terms through `R_b`). Then ties them to
/// the reduced loss: bnpo's `L = Σ_i ℓ_tot,i / Σ m` with no entropy bonus.
#[test]
fn per_token_losses_match_the_reference() {
    use ImportanceSamplingLevel::*;
    use flashloss::policy::policy_stage_per_token;
    use flashloss::reference::grpo_reference_per_token;
    let mut seed = 500;
    for t in LossType::ALL {
        for level in [Token, Sequence] {
            if !t.allows_level(level) {
                continue;
            }
            for rho in [0, 1, 2] {
                let x = Extras {
                    policy_mask: false,
                    entropy_mask: false,
                    rho,
                };
                let loss = GrpoLoss::new(config(t, level, 0.04)).unwrap();
                let case = Case::new(seed, x);
                seed += 1;
                let batch = case.batch();
                let mut d = Draw(seed);
                let ones = vec![1.0f32; B * T];
                let g: Vec<f32> = (0..B * T).map(|_| (d.next() * 2.0 - 0.5) as f32).collect();
                for grad_rows in [&ones, &g] {
                    let name = format!("{} {level:?} rho={rho}", t.name());
                    let r = grpo_reference_per_token(&loss, &batch, grad_rows, &case.logits, V);
                    let logp: Vec<f32> = r.logp.iter().map(|&v| v as f32).collect();
                    let entropy: Vec<f32> = r.entropy.iter().map(|&v| v as f32).collect();
                    let out = policy_stage_per_token(&loss, &batch, &logp, &entropy, grad_rows);
                    let close = |a: f64, b: f64, scale: f64| (a - b).abs() <= 1e-4 * scale + 1e-6;
                    let loss_scale = max_abs(r.token_loss.iter().copied()).max(1.0);
                    assert!(close(out.loss, r.loss, loss_scale), "{name}: loss");
                    for i in 0..B * T {
                        let tl = (out.token_loss[i], r.token_loss[i]);
                        assert!(close(tl.0, tl.1, loss_scale), "{name}: token_loss[{i}]");
                        assert!(batch.mask[i] || tl.1 == 0.0, "{name}: masked {i}");
                    }
                    let scale = max_abs(r.dlogp.iter().copied());
                    for i in 0..B * T {
                        let dl = (out.dlogp[i] as f64, r.dlogp[i]);
                        assert!(close(dl.0, dl.1, scale), "{name}: dlogp[{i}] {dl:?}");
                        assert_eq!(out.dentropy[i], 0.0, "{name}: no entropy bonus");
                    }
                }
            }
        }
    }
    // Unit weights: the per-token losses are the reduced loss's terms.
    let cfg = GrpoLossConfig {
        entropy_coef: 0.0,
        ..config(LossType::Bnpo, Token, 0.04)
    };
    let loss = GrpoLoss::new(cfg).unwrap();
    let case = Case::new(
        7,
        Extras {
            policy_mask: true,
            entropy_mask: false,
            rho: 1,
        },
    );
    let batch = case.batch();
    let norm = Normalizers::local(&batch);
    let reduced = grpo_reference(&loss, &batch, norm, &case.logits, V, 1.0);
    let per_token = grpo_reference_per_token(&loss, &batch, &[1.0; B * T], &case.logits, V);
    let sum: f64 = per_token.token_loss.iter().sum();
    assert!((sum / norm.token_count - reduced.loss).abs() < 1e-12);
}

/// The CPU's logits-level per-token call (`Device::grpo_logits_per_token`) against the
/// reference: the losses with unit weights, and `∂(Σ g_i·ℓ_tot,i)/∂z`.
#[test]
fn per_token_logits_kernel_matches_the_reference() {
    use flashloss::reference::grpo_reference_per_token;
    use flashloss::{Device, LogitsLayout};
    for level in [
        ImportanceSamplingLevel::Token,
        ImportanceSamplingLevel::Sequence,
    ] {
        let loss = GrpoLoss::new(config(LossType::Grpo, level, 0.04)).unwrap();
        let case = Case::new(
            11,
            Extras {
                policy_mask: false,
                entropy_mask: false,
                rho: 2,
            },
        );
        let batch = case.batch();
        let logits: Vec<f32> = case.logits.iter().map(|&z| z as f32).collect();
        let z64: Vec<f64> = logits.iter().map(|&z| z as f64).collect();
        let layout = LogitsLayout::contiguous(B, T, V);
        let mut d = Draw(3);
        let g: Vec<f32> = (0..B * T).map(|_| d.next() as f32 - 0.3).collect();
        let device = Device::cpu();
        let ones = vec![1.0f32; B * T];
        let fwd = device
            .grpo_logits_per_token(&loss, &batch, &logits, &layout, &ones, None)
            .unwrap();
        let r = grpo_reference_per_token(&loss, &batch, &ones, &z64, V);
        for i in 0..B * T {
            let (got, want) = (fwd.token_loss[i], r.token_loss[i]);
            assert!(
                (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                "{level:?} loss {i}"
            );
        }
        let mut dlogits = vec![0.0f32; B * T * V];
        device
            .grpo_logits_per_token(&loss, &batch, &logits, &layout, &g, Some(&mut dlogits))
            .unwrap();
        let r = grpo_reference_per_token(&loss, &batch, &g, &z64, V);
        let scale = max_abs(r.dlogits.iter().copied());
        let err = max_abs(dlogits.iter().zip(&r.dlogits).map(|(a, b)| *a as f64 - b));
        assert!(
            err <= 1e-4 * scale + 1e-6,
            "{level:?}: dlogits {err:.3e} of {scale:.3e}"
        );
    }
    // grad_rows of the wrong length or not finite are errors naming it.
    let loss = GrpoLoss::new(config(LossType::Dapo, ImportanceSamplingLevel::Token, 0.0)).unwrap();
    let case = Case::new(
        12,
        Extras {
            policy_mask: false,
            entropy_mask: false,
            rho: 0,
        },
    );
    let logits: Vec<f32> = case.logits.iter().map(|&z| z as f32).collect();
    let layout = flashloss::LogitsLayout::contiguous(B, T, V);
    let device = flashloss::Device::cpu();
    let batch = case.batch();
    let err = device
        .grpo_logits_per_token(&loss, &batch, &logits, &layout, &[1.0; 3], None)
        .unwrap_err();
    assert!(err.to_string().starts_with("argument `grad_rows`"), "{err}");
    let mut g = vec![1.0f32; B * T];
    g[0] = f32::NAN;
    let err = device
        .grpo_logits_per_token(&loss, &batch, &logits, &layout, &g, None)
        .unwrap_err();
    assert!(err.to_string().starts_with("argument `grad_rows`"), "{err}");
}
