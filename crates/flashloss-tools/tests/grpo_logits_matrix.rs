//! Every loss type × level × δ × β × bias correction × temperature × entropy bonus,
//! f32 kernel vs the f64 reference at spec tolerances, on odd shapes.

use crate::common;
use common::*;
use flashloss_tools::gradcheck::GradcheckConfig;

fn matrix_cases() -> Vec<(String, GradcheckConfig)> {
    let mut cases = Vec::new();
    for (t, level) in valid_types() {
        let deltas: &[Option<f64>] = if t.is_clipped() {
            &[None, Some(1.5)]
        } else {
            &[None]
        };
        for &delta in deltas {
            for beta in [0.0, 0.04] {
                for bias in [false, true] {
                    if bias && beta == 0.0 {
                        continue;
                    }
                    for temperature in [1.0, 0.7] {
                        for entropy_coef in [0.0, 0.01] {
                            let mut loss = base_config(t, level);
                            loss.delta = delta;
                            loss.beta = beta;
                            loss.use_bias_correction_kl = bias;
                            loss.temperature = temperature;
                            loss.entropy_coef = entropy_coef;
                            let name = format!(
                                "{} {level:?} delta={delta:?} beta={beta} bias={bias} T={temperature} ent={entropy_coef}",
                                t.name()
                            );
                            cases.push((name, small(3, 5, 2053, loss)));
                        }
                    }
                }
            }
        }
    }
    cases
}

#[test]
fn every_loss_configuration_matches_the_reference_f32() {
    let cases = matrix_cases();
    assert!(cases.len() > 150, "matrix too small: {}", cases.len());
    for (name, mut cfg) in cases {
        for (b, t, seed) in [(3, 5, 1), (1, 1, 2), (3, 1, 3)] {
            cfg.batch = b;
            cfg.seq_len = t;
            cfg.seed = seed;
            assert_passes(&cfg, &format!("{name} [B={b}, T={t}]"));
        }
    }
}

#[test]
fn every_loss_type_matches_the_reference_bf16() {
    for (t, level) in valid_types() {
        let mut loss = base_config(t, level);
        loss.beta = 0.04;
        loss.entropy_coef = 0.01;
        let cfg = bf16(small(3, 7, 4099, loss));
        assert_passes(&cfg, &format!("bf16 {} {level:?}", t.name()));
    }
}

/// float16 logits (issue 33): widened exactly, the gradient stored in f16.
#[test]
fn every_loss_type_matches_the_reference_f16() {
    for (t, level) in valid_types() {
        let mut loss = base_config(t, level);
        loss.beta = 0.04;
        loss.entropy_coef = 0.01;
        for in_place in [false, true] {
            let mut cfg = f16(small(3, 7, 4099, loss.clone()));
            cfg.in_place = in_place;
            assert_passes(
                &cfg,
                &format!("f16 {} {level:?} in_place={in_place}", t.name()),
            );
        }
    }
}

#[test]
fn sampler_ratio_per_token_advantages_and_in_place() {
    for (t, level) in valid_types() {
        let mut loss = base_config(t, level);
        loss.beta = 0.04;
        let mut cfg = small(2, 9, 3001, loss);
        cfg.sampler_ratio = true;
        cfg.per_token_advantages = true;
        cfg.in_place = true;
        cfg.grad_output = 0.37;
        assert_passes(
            &cfg,
            &format!("rho/per-token/in-place {} {level:?}", t.name()),
        );
        assert_passes(
            &bf16(cfg),
            &format!("bf16 rho/per-token/in-place {}", t.name()),
        );
    }
}

#[test]
fn on_policy_without_old_logp() {
    for (t, level) in valid_types() {
        let mut cfg = small(3, 6, 1500, base_config(t, level));
        cfg.old_logp = false;
        cfg.ref_logp = false;
        assert_passes(&cfg, &format!("on-policy {} {level:?}", t.name()));
    }
}

/// TRL 1.16's optional per-token masks on every (type, level): the policy mask (whole
/// sequences and single tokens off) and the top-entropy mask (the last sequence fully
/// off), alone and together, with and without a sampler ratio (vespo: inside φ_b), KL
/// with the default bias correction, and the entropy bonus. The gradcheck gates cover
/// the loss, `∂L/∂logp`, `∂L/∂H` and `dlogits` against the reference.
#[test]
fn policy_and_entropy_masks_on_every_type() {
    for (t, level) in valid_types() {
        for (policy, entropy) in [(0.3, 0.0), (0.0, 0.6), (0.3, 0.4)] {
            for rho in [false, true] {
                let mut loss = base_config(t, level);
                loss.beta = 0.04;
                loss.entropy_coef = 0.02;
                assert!(loss.use_bias_correction_kl);
                let mut cfg = small(4, 6, 1031, loss);
                cfg.policy_mask_fraction = policy;
                cfg.entropy_mask_fraction = entropy;
                cfg.sampler_ratio = rho;
                cfg.seed = 11;
                let case = format!(
                    "masks {} {level:?} policy={policy} entropy={entropy} rho={rho}",
                    t.name()
                );
                assert_passes(&cfg, &case);
                if rho && policy > 0.0 && entropy > 0.0 {
                    assert_passes(&bf16(cfg), &format!("bf16 {case}"));
                }
            }
        }
    }
}

/// The level rules of TRL 1.16: luspo at token level, cispo and sapo at sequence level
/// are valid and match the reference; vespo at sequence level is a config error.
#[test]
fn trl_levels_luspo_token_cispo_and_sapo_sequence() {
    use flashloss::{ImportanceSamplingLevel::*, LossType::*};
    let cases = valid_types();
    for want in [
        (Luspo, Token),
        (Luspo, Sequence),
        (Cispo, Sequence),
        (Sapo, Sequence),
    ] {
        assert!(cases.contains(&want), "{want:?} missing");
        let mut loss = base_config(want.0, want.1);
        loss.beta = 0.04;
        loss.entropy_coef = 0.01;
        loss.temperature = 0.8;
        let cfg = small(3, 7, 2053, loss);
        assert_passes(&cfg, &format!("{want:?}"));
    }
    assert!(!cases.contains(&(Vespo, Sequence)));
}
