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
