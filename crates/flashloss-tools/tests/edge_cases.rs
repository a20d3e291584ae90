//! Masked sequences, extreme logits, banned tokens, small temperatures: finite
//! everywhere and still at the reference.

use crate::common;
use common::*;
use flashloss::{Error, GrpoLoss, ImportanceSamplingLevel, LogitsLayout, LossType};
use flashloss_tools::gradcheck::{self, GradcheckConfig};
use flashloss_tools::inputs::GrpoInputs;

fn check(inputs: &GrpoInputs, cfg: &GradcheckConfig, case: &str) -> gradcheck::GradcheckReport {
    let loss = GrpoLoss::new(cfg.loss.clone()).unwrap();
    let report = gradcheck::check_inputs(cfg, &loss, inputs, inputs.logits.clone())
        .unwrap_or_else(|e| panic!("{case}: {e}"));
    assert!(
        report.loss_kernel.is_finite(),
        "{case}: loss {}",
        report.loss_kernel
    );
    assert!(report.passed, "{case}: {:?}", report.gates);
    report
}

fn all_cases() -> Vec<(LossType, ImportanceSamplingLevel)> {
    valid_types()
}

#[test]
fn fully_masked_sequence_and_all_rows_masked() {
    for (t, level) in all_cases() {
        let mut cfg = small(3, 6, 2100, base_config(t, level));
        cfg.loss.beta = 0.04;
        cfg.loss.entropy_coef = 0.01;
        let mut x = draw(3, 6, 2100, 5);
        x.data.mask[6..12].fill(false);
        check(&x, &cfg, &format!("one masked sequence {}", t.name()));
        x.data.mask.fill(false);
        let r = check(&x, &cfg, &format!("all masked {}", t.name()));
        assert_eq!(r.loss_kernel, 0.0);
        assert_eq!(r.gate("dlogits").unwrap().value, 0.0);
    }
}

#[test]
fn huge_logits_and_small_temperature() {
    for (t, level) in all_cases() {
        for temperature in [1.0, 0.05] {
            let mut cfg = small(2, 5, 3001, base_config(t, level));
            cfg.loss.temperature = temperature;
            cfg.loss.entropy_coef = 0.01;
            cfg.loss.beta = 0.04;
            let mut x = draw(2, 5, 3001, 9);
            for (k, z) in x.logits.iter_mut().enumerate() {
                *z = if (k * 7919) % 3 == 0 { 1e4 } else { -1e4 } + (k % 13) as f32;
            }
            // Sampled tokens have non-negligible probability: put each target at the top.
            for (row, &id) in x.data.target_ids.iter().enumerate() {
                x.logits[row * 3001 + id as usize] = 1e4 + 12.5;
            }
            // Keep the ratios near 1 for the new, sharper policy.
            let layout = LogitsLayout::contiguous(2, 5, 3001);
            let fresh = flashloss::cpu::selective_log_softmax(
                &x.logits,
                &layout,
                &x.data.target_ids,
                None,
                flashloss::Temperature::new(temperature).unwrap(),
            )
            .unwrap();
            for (i, st) in fresh.iter().enumerate() {
                x.data.old_logp.as_mut().unwrap()[i] = st.logp + 0.05 * ((i % 3) as f32 - 1.0);
                x.data.ref_logp.as_mut().unwrap()[i] = st.logp + 0.1;
            }
            check(&x, &cfg, &format!("±1e4 T={temperature} {}", t.name()));
        }
    }
}

#[test]
fn banned_tokens_with_neg_inf_logits() {
    for (t, level) in all_cases() {
        let mut cfg = small(3, 4, 2500, base_config(t, level));
        cfg.loss.entropy_coef = 0.02;
        cfg.loss.beta = 0.04;
        let mut x = draw(3, 4, 2500, 11);
        for row in 0..12 {
            for j in (row % 5..2500).step_by(5) {
                if j as i64 != x.data.target_ids[row] {
                    x.logits[row * 2500 + j] = f32::NEG_INFINITY;
                }
            }
        }
        check(&x, &cfg, &format!("-inf banned {}", t.name()));
        let mut cfg_bf16 = bf16(cfg.clone());
        cfg_bf16.in_place = true;
        let loss = GrpoLoss::new(cfg.loss.clone()).unwrap();
        let data: Vec<half::bf16> = x.logits.iter().map(|&z| half::bf16::from_f32(z)).collect();
        let r = gradcheck::check_inputs(&cfg_bf16, &loss, &x, data).unwrap();
        assert!(r.passed, "bf16 -inf banned {}: {:?}", t.name(), r.gates);
    }
}

#[test]
fn a_neg_inf_target_is_an_error_not_a_nan() {
    let cfg = small(
        2,
        3,
        100,
        base_config(LossType::Grpo, ImportanceSamplingLevel::Token),
    );
    let mut x = draw(2, 3, 100, 1);
    x.data.mask.fill(true);
    let row = 4;
    x.logits[row * 100 + x.data.target_ids[row] as usize] = f32::NEG_INFINITY;
    let loss = GrpoLoss::new(cfg.loss.clone()).unwrap();
    let err = gradcheck::check_inputs(&cfg, &loss, &x, x.logits.clone()).unwrap_err();
    assert_eq!(
        err,
        flashloss_tools::Error::Kernel(Error::ImpossibleTarget {
            row: 4,
            seq: 1,
            pos: 1,
            id: x.data.target_ids[row]
        })
    );
    let mut y = draw(2, 3, 100, 1);
    y.data.mask.fill(true);
    y.logits[2 * 100 + 17] = f32::NAN;
    let err = gradcheck::check_inputs(&cfg, &loss, &y, y.logits.clone()).unwrap_err();
    assert!(
        err.to_string().contains("row 2 holds NaN or +inf logits"),
        "{err}"
    );
}
