//! Fused linear GRPO vs the f64 reference (loss, metrics, logp, dH, dW, d bias), both
//! modes, bias, bf16, odd shapes; single-pass = two-pass; thread invariance; the
//! the workspace budget is tested in fused_budget.rs.

use crate::common;
use common::cpu_steps::{grpo_linear, logp_linear};
use common::*;
use flashloss::policy::Normalizers;
use flashloss::reference::{grpo_reference, linear_grads, linear_logits};
use flashloss::{Element, GrpoLoss, GrpoLossConfig, LossType};
use flashloss::{FusedOptions, Mode};
use half::bf16;

/// Runs the fused kernel and the reference; checks loss, logp, dH, dW, dbias.
/// `shape` = (B, T, H, V).
fn check<E: Element>(
    loss_cfg: GrpoLossConfig,
    shape: (usize, usize, usize, usize),
    bias: bool,
    mode: Mode,
    seed: u64,
) {
    let (b, t, h, v) = shape;
    let loss = GrpoLoss::new(loss_cfg).unwrap();
    let head = Head::<E>::random(b * t, h, v, bias, seed);
    let mut x = draw(b, t, v, seed + 100);
    let z = linear_logits(&head.inputs());
    x.follow_policy(&z, loss.config().temperature);
    let batch = x.batch();
    let opts = FusedOptions {
        bf16_products: Default::default(),
        mode,
        budget_bytes: Some(flashloss::cpu::gemm_reserve_bytes() + (1 << 20)),
        grad_output: 0.75,
        head_grad: Default::default(),
    };
    let case = format!(
        "{} {:?} {mode:?} [B={b},T={t},H={h},V={v}] bias={bias}",
        loss.config().loss_type.name(),
        E::DTYPE
    );
    let out =
        grpo_linear(&loss, &batch, &head.inputs(), &opts).unwrap_or_else(|e| panic!("{case}: {e}"));
    let r = grpo_reference(&loss, &batch, Normalizers::local(&batch), &z, v, 0.75);
    let (dh, dw, db) = linear_grads(&head.inputs(), &r.dlogits);
    let (loss_tol, grad_tol) = if E::DTYPE == flashloss::DType::F32 && out.plan.compact {
        // f16 exponentials: each probability rounded to a relative 2^-11.
        (1e-5, COMPACT_GRAD_TOL)
    } else if E::DTYPE == flashloss::DType::F32 {
        (1e-5, 1e-4)
    } else {
        (1e-3, 1e-2)
    };
    assert!(
        (out.loss - r.loss).abs() <= loss_tol * r.loss.abs().max(1.0),
        "{case}: loss {} vs {}",
        out.loss,
        r.loss
    );
    for i in (0..b * t).filter(|&i| batch.mask[i]) {
        assert!(
            (out.stats[i].logp as f64 - r.logp[i]).abs() <= 1e-5 * r.logp[i].abs().max(1.0),
            "{case}: logp row {i}"
        );
    }
    assert!(
        (out.metrics.entropy_mean - r.metrics.entropy_mean).abs() < 1e-5,
        "{case}: entropy mean"
    );
    assert!(
        (out.metrics.kl_mean - r.metrics.kl_mean).abs() < 1e-5,
        "{case}: kl mean"
    );
    assert_close(&format!("{case} dH"), &out.grads.dhidden, &dh, grad_tol);
    assert_close(&format!("{case} dW"), &out.grads.dweight, &dw, grad_tol);
    match (&out.grads.dbias, bias) {
        (Some(got), true) => assert_close(&format!("{case} dbias"), got, &db, grad_tol),
        (None, false) => {}
        _ => panic!("{case}: dbias presence"),
    }
}

#[test]
fn every_loss_type_both_modes_f32() {
    for (t, level) in valid_types() {
        let mut cfg = base_config(t, level);
        cfg.beta = 0.04;
        cfg.entropy_coef = 0.01;
        cfg.temperature = 0.9;
        let token_level = !GrpoLoss::new(cfg.clone())
            .unwrap()
            .needs_sequence_reduction();
        for mode in [
            Mode::Auto,
            Mode::AutoF32,
            Mode::TwoPass,
            Mode::SinglePass,
            Mode::Compact,
        ] {
            if matches!(mode, Mode::SinglePass | Mode::Compact) && !token_level {
                continue;
            }
            check::<f32>(cfg.clone(), (3, 5, 37, 2053), true, mode, 1);
            check::<f32>(cfg.clone(), (1, 1, 19, 301), false, mode, 2);
        }
    }
}

/// A compact block of four vocabulary tiles (each lane takes two; the last is 7 wide)
/// in two row blocks, with bias and masked rows, with and without the entropy term (the
/// logits-back and the rescaling formulas).
#[test]
fn compact_block_over_several_tiles() {
    for entropy_coef in [0.0, 0.01] {
        let mut cfg = base_config(LossType::Grpo, flashloss::ImportanceSamplingLevel::Token);
        cfg.beta = 0.04;
        cfg.entropy_coef = entropy_coef;
        cfg.temperature = 0.9;
        check::<f32>(cfg, (3, 13, 24, 3 * 2048 + 7), true, Mode::Compact, 11);
    }
}

#[test]
fn bf16_inputs() {
    for (t, level) in [
        (LossType::Grpo, flashloss::ImportanceSamplingLevel::Token),
        (LossType::Dapo, flashloss::ImportanceSamplingLevel::Sequence),
        (LossType::Vespo, flashloss::ImportanceSamplingLevel::Token),
    ] {
        let mut cfg = base_config(t, level);
        cfg.beta = 0.04;
        check::<bf16>(cfg.clone(), (2, 7, 45, 1031), true, Mode::Auto, 3);
        check::<bf16>(cfg.clone(), (2, 7, 45, 1031), false, Mode::TwoPass, 4);
        if level == flashloss::ImportanceSamplingLevel::Token && t != LossType::Vespo {
            check::<bf16>(cfg, (2, 7, 45, 1031), true, Mode::Compact, 5);
        }
    }
}

#[test]
fn single_pass_equals_two_pass_and_threads_do_not_change_bits() {
    let loss = GrpoLoss::new(GrpoLossConfig {
        beta: 0.04,
        entropy_coef: 0.01,
        loss_type: LossType::Grpo,
        ..GrpoLossConfig::default()
    })
    .unwrap();
    // Four vocabulary tiles: each lane of a compact block takes two.
    let head = Head::<f32>::random(2 * 40, 64, 3 * 2048 + 7, true, 5);
    let x = draw(2, 40, 3 * 2048 + 7, 6);
    assert_modes_agree_and_threads_invariant(&|opts| {
        let out = grpo_linear(&loss, &x.batch(), &head.inputs(), opts).unwrap();
        FusedRun {
            loss: out.loss,
            grads: out.grads,
            single_pass: out.plan.single_pass,
        }
    });
}

#[test]
fn no_grad_logp_matches_the_reference_and_budget_errors_are_clear() {
    let head = Head::<f32>::random(9, 21, 777, true, 9);
    let x = draw(1, 9, 777, 10);
    let budget = flashloss::cpu::gemm_reserve_bytes() + (1 << 20);
    let stats = logp_linear(&head.inputs(), &x.data.target_ids, None, 0.8, budget, 9).unwrap();
    let z = linear_logits(&head.inputs());
    for (i, st) in stats.iter().enumerate() {
        let row = flashloss::reference::row_softmax(&z[i * 777..(i + 1) * 777], 0.8);
        let want = row.log_probs[x.data.target_ids[i] as usize];
        assert!((st.logp as f64 - want).abs() <= 1e-5 * want.abs().max(1.0));
        assert!((st.entropy as f64 - row.entropy).abs() <= 1e-5 * row.entropy.max(1.0));
    }
    let err = logp_linear(&head.inputs(), &x.data.target_ids, None, 1.0, 100, 9).unwrap_err();
    assert!(
        err.to_string()
            .starts_with("argument `budget_mib`: 0.000095367431640625 MiB (100 bytes) is below the GEMM packing reserve"),
        "{err}"
    );
    let reserve = flashloss::cpu::gemm_reserve_bytes();
    let err = logp_linear(
        &head.inputs(),
        &x.data.target_ids,
        None,
        1.0,
        reserve + 100,
        9,
    )
    .unwrap_err();
    assert!(
        err.to_string()
            .ends_with("cannot hold one row of 777 logits"),
        "{err}"
    );
    let loss = GrpoLoss::new(GrpoLossConfig {
        importance_sampling_level: flashloss::ImportanceSamplingLevel::Sequence,
        loss_type: LossType::Grpo,
        ..GrpoLossConfig::default()
    })
    .unwrap();
    let opts = FusedOptions {
        mode: Mode::SinglePass,
        ..FusedOptions::default()
    };
    let err = grpo_linear(&loss, &x.batch(), &head.inputs(), &opts)
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("argument `mode`: single_pass needs a token-level loss"),
        "{err}"
    );
}

#[test]
fn baseline_matches_the_reference() {
    let loss = GrpoLoss::new(GrpoLossConfig {
        beta: 0.04,
        loss_type: LossType::Grpo,
        ..GrpoLossConfig::default()
    })
    .unwrap();
    let head = Head::<f32>::random(2 * 6, 23, 1501, true, 11);
    let mut x = draw(2, 6, 1501, 12);
    let z = linear_logits(&head.inputs());
    x.follow_policy(&z, 1.0);
    let batch = x.batch();
    let (value, grads) =
        flashloss::cpu::grpo_linear_baseline(&loss, &batch, &head.inputs(), 1.0).unwrap();
    let r = grpo_reference(&loss, &batch, Normalizers::local(&batch), &z, 1501, 1.0);
    let (dh, dw, db) = linear_grads(&head.inputs(), &r.dlogits);
    assert!((value - r.loss).abs() <= 1e-5 * r.loss.abs().max(1.0));
    assert_close("baseline dH", &grads.dhidden, &dh, 1e-4);
    assert_close("baseline dW", &grads.dweight, &dw, 1e-4);
    assert_close("baseline dbias", grads.dbias.as_ref().unwrap(), &db, 1e-4);
}

/// TRL 1.16 on the fused LM-head kernel, every (type, level) and mode: policy and
/// top-entropy masks (whole sequences off included), a sampler ratio, KL with the
/// default bias correction and the entropy bonus, against the f64 reference
/// (gradcheck's loss, logp, entropy, dH, dW, dbias gates).
#[test]
fn trl_masks_every_type_and_mode() {
    use flashloss_tools::gradcheck::{GradcheckConfig, Kernel};
    for (t, level) in valid_types() {
        let mut loss = base_config(t, level);
        loss.beta = 0.04;
        loss.entropy_coef = 0.02;
        loss.temperature = 0.9;
        let token_level = !GrpoLoss::new(loss.clone())
            .unwrap()
            .needs_sequence_reduction();
        for mode in [Mode::Auto, Mode::TwoPass, Mode::SinglePass] {
            if mode == Mode::SinglePass && !token_level {
                continue;
            }
            let cfg = GradcheckConfig {
                kernel: Kernel::Linear,
                batch: 4,
                seq_len: 5,
                hidden: 37,
                vocab: 1031,
                mode,
                sampler_ratio: true,
                policy_mask_fraction: 0.3,
                entropy_mask_fraction: 0.5,
                seed: 21,
                loss: loss.clone(),
                ..GradcheckConfig::default()
            };
            assert_passes(
                &cfg,
                &format!("linear masks {} {level:?} {mode:?}", t.name()),
            );
        }
    }
}

/// Compact mode on confident rows (the target is the row's argmax, `p_y` up to ~1, as
/// for a policy on its own samples), with and without an entropy term. `1 - p_y` does
/// not cancel an f16 rounding: a tile's largest exponential is `exp(0) = 1`, exact in
/// f16. What is left is the relative 2^-12 rounding of the other entries; measured
/// against the f64 reference (`--nocapture` prints it): at most 9.2e-5 of the largest
/// gradient, at sharpness 8, where the second-largest probabilities are largest.
#[test]
fn compact_on_confident_rows() {
    let (b, t, h, v) = (2, 6, 16, 1000);
    for sharpness in [1.0f32, 8.0, 32.0] {
        for entropy_coef in [0.0, 0.01] {
            let loss = GrpoLoss::new(GrpoLossConfig {
                loss_type: LossType::Dapo,
                beta: 0.04,
                entropy_coef,
                ..Default::default()
            })
            .unwrap();
            let mut head = Head::<f32>::random(b * t, h, v, true, 3);
            head.hidden.iter_mut().for_each(|x| *x *= sharpness);
            let z = linear_logits(&head.inputs());
            let mut x = draw(b, t, v, 4);
            for (i, id) in x.data.target_ids.iter_mut().enumerate() {
                let row = &z[i * v..(i + 1) * v];
                *id = (0..v).max_by(|&a, &c| row[a].total_cmp(&row[c])).unwrap() as i64;
            }
            x.follow_policy(&z, 1.0);
            let batch = x.batch();
            let opts = FusedOptions {
                bf16_products: Default::default(),
                mode: Mode::Compact,
                budget_bytes: Some(flashloss::cpu::gemm_reserve_bytes() + (1 << 20)),
                grad_output: 1.0,
                head_grad: Default::default(),
            };
            let out = grpo_linear(&loss, &batch, &head.inputs(), &opts).unwrap();
            let r = grpo_reference(&loss, &batch, Normalizers::local(&batch), &z, v, 1.0);
            let (dh, dw, db) = linear_grads(&head.inputs(), &r.dlogits);
            let p_min = (0..b * t).map(|i| r.logp[i].exp()).fold(1.0f64, f64::min);
            let case = format!("sharpness {sharpness} entropy {entropy_coef} (min p_y {p_min:.6})");
            assert_grads_of_largest(&case, &out.grads, (&dh, &dw, &db), COMPACT_GRAD_TOL);
        }
    }
}

/// A bf16 head on every product path this CPU has (widened f32 products, and bf16
/// operands on `vdpbf16ps` where it has AVX512-BF16: said where skipped), in every mode,
/// on flat rows (hidden states scaled by 0.02: `p_y` near `1/V`), sampled ones and peaked
/// ones (scaled by 8 and 32, the target the row's argmax: `p_y` near 1).
/// The plan names the path that ran. bf16 products round `dZ` to bf16 (relative 2^-9),
/// so their gradients differ from the reference by about 2^-9 of the largest entry
/// (`--nocapture` prints it); the gate is the spec's bf16 one.
#[test]
fn bf16_products_on_flat_and_peaked_rows() {
    let mut paths = vec![flashloss::Bf16Products::Widened];
    match flashloss::cpu::Avx512Bf16::detect() {
        Some(_) => paths.push(flashloss::Bf16Products::Avx512Bf16),
        None => eprintln!("skipped: bf16 products on avx512bf16 (this CPU has no AVX512-BF16)"),
    }
    let (b, t, h, v) = (2, 9, 64, 2 * 2048 + 77);
    for products in paths {
        for sharpness in [0.02f32, 1.0, 8.0, 32.0] {
            for mode in [Mode::TwoPass, Mode::SinglePass, Mode::Compact] {
                let loss = GrpoLoss::new(GrpoLossConfig {
                    loss_type: LossType::Dapo,
                    beta: 0.04,
                    entropy_coef: 0.01,
                    ..Default::default()
                })
                .unwrap();
                let mut head = Head::<bf16>::random(b * t, h, v, true, 5);
                let sharpen = |x: &mut bf16| *x = bf16::from_f32(x.to_f32() * sharpness);
                head.hidden.iter_mut().for_each(sharpen);
                let z = linear_logits(&head.inputs());
                let mut x = draw(b, t, v, 6);
                if sharpness > 1.0 {
                    for (i, id) in x.data.target_ids.iter_mut().enumerate() {
                        let row = &z[i * v..(i + 1) * v];
                        *id = (0..v).max_by(|&a, &c| row[a].total_cmp(&row[c])).unwrap() as i64;
                    }
                }
                x.follow_policy(&z, 1.0);
                let batch = x.batch();
                let opts = FusedOptions {
                    bf16_products: products,
                    mode,
                    budget_bytes: Some(flashloss::cpu::gemm_reserve_bytes() + (4 << 20)),
                    grad_output: 1.0,
                    head_grad: Default::default(),
                };
                let out = grpo_linear(&loss, &batch, &head.inputs(), &opts).unwrap();
                assert_eq!(out.plan.bf16_products, Some(products));
                let r = grpo_reference(&loss, &batch, Normalizers::local(&batch), &z, v, 1.0);
                let (dh, dw, db) = linear_grads(&head.inputs(), &r.dlogits);
                let p_y = (0..b * t)
                    .filter(|&i| batch.mask[i])
                    .map(|i| r.logp[i].exp());
                let (lo, hi) = p_y.fold((1.0f64, 0.0f64), |(lo, hi), p| (lo.min(p), hi.max(p)));
                let case = format!(
                    "{} {mode:?} sharpness {sharpness} (p_y {lo:.2e}..{hi:.2e})",
                    products.name()
                );
                assert!(
                    (out.loss - r.loss).abs() <= 1e-3 * r.loss.abs().max(1.0),
                    "{case}: loss"
                );
                assert_grads_of_largest(&case, &out.grads, (&dh, &dw, &db), 1e-2);
            }
        }
    }
}
