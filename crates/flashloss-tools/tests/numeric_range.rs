//! Numeric range (spec: "Numeric range"): valid inputs at the extremes either give
//! finite results at the reference, or a typed `OutOfRange` error naming the row and
//! the quantity, before any gradient is written. Never a NaN.

use crate::common;
use common::cpu_steps::grpo_linear;
use common::*;
use flashloss::device::CeCall;
use flashloss::policy::Normalizers;
use flashloss::reference::{grpo_reference, linear_logits};
use flashloss::{Device, Error, FusedOptions, GrpoLoss, LogitsLayout, LossType, Mode};
use flashloss_tools::gradcheck::{self, GradcheckConfig};
use flashloss_tools::inputs::GrpoInputs;

/// Kernel vs reference on `inputs`: `Ok(true)` when every gate passed with finite
/// numbers, `Err` with the kernel's error otherwise; panics on a NaN that got out.
fn outcome(inputs: &GrpoInputs, cfg: &GradcheckConfig, case: &str) -> Result<(), Error> {
    let loss = GrpoLoss::new(cfg.loss.clone()).unwrap();
    match gradcheck::check_inputs(cfg, &loss, inputs, inputs.logits.clone()) {
        Ok(r) => {
            assert!(r.loss_kernel.is_finite(), "{case}: loss {}", r.loss_kernel);
            assert!(r.passed, "{case}: {:?}", r.gates);
            Ok(())
        }
        Err(flashloss_tools::Error::Kernel(e)) => Err(e),
        Err(e) => panic!("{case}: {e}"),
    }
}

fn assert_out_of_range(err: &Error, case: &str) {
    match err {
        Error::OutOfRange {
            value, quantity, ..
        } => {
            assert!(
                !(value.is_finite() && value.abs() <= f32::MAX as f64),
                "{case}: {quantity} = {value} is within f32"
            );
        }
        e => panic!("{case}: expected OutOfRange, got {e}"),
    }
}

/// The issue's case: temperature 0.05 with old/reference logp drawn at temperature 1
/// (the default gradcheck inputs): the f64 gradient is ~1e69. Both out-of-place and in
/// place, the kernel returns OutOfRange and, in place, leaves the logits untouched.
#[test]
fn issue_case_small_temperature_with_far_old_logp_is_an_error() {
    let mut cfg = GradcheckConfig::default();
    // The issue's run predates TRL 1.16's default of bias-corrected KL.
    cfg.loss.use_bias_correction_kl = false;
    cfg.loss.temperature = 0.05;
    cfg.loss.beta = 0.04;
    cfg.loss.entropy_coef = 0.01;
    for in_place in [false, true] {
        cfg.in_place = in_place;
        let err = gradcheck::run(&cfg).unwrap_err();
        match err {
            flashloss_tools::Error::Kernel(e) => assert_out_of_range(&e, "issue case"),
            e => panic!("expected a kernel error, got {e}"),
        }
    }
    // In place: the logits are unchanged by a failed step.
    let x = GrpoInputs::random(&cfg.input_spec(), cfg.seed);
    let loss = GrpoLoss::new(cfg.loss.clone()).unwrap();
    let layout = LogitsLayout::contiguous(cfg.batch, cfg.seq_len, cfg.vocab);
    let mut logits = x.logits.clone();
    let err = Device::cpu()
        .grpo_logits_in_place(&loss, &x.batch(), &mut logits, &layout, 1.0)
        .unwrap_err();
    assert_out_of_range(&err, "in place");
    assert_eq!(logits, x.logits);
}

/// The loss of `configs/gradcheck/default.yaml`.
fn yaml_loss() -> flashloss::GrpoLossConfig {
    flashloss::GrpoLossConfig {
        temperature: 0.9,
        beta: 0.04,
        entropy_coef: 0.01,
        ..Default::default()
    }
}

/// Logits with a scale in the thousands at temperature 0.9 and old/reference logp
/// at temperature 1 (gradcheck's inputs): where the loss leaves f32 the kernel says so
/// by row; never a NaN loss.
#[test]
fn logits_in_the_thousands_give_an_error_not_a_nan_loss() {
    for std in [1e3, 5e3, 1e4] {
        let cfg = GradcheckConfig {
            logit_std: std,
            vocab: 5003,
            loss: yaml_loss(),
            ..GradcheckConfig::default()
        };
        match gradcheck::run(&cfg) {
            // f32 logits of ~1e3 hold logp to ~1e-4 nats, so the gates are about
            // precision here; the range promise is finite numbers.
            Ok(r) => {
                assert!(r.loss_kernel.is_finite(), "std {std}: {}", r.loss_kernel);
                assert!(
                    r.gates.iter().all(|g| g.value.is_finite()),
                    "std {std}: {:?}",
                    r.gates
                );
            }
            Err(flashloss_tools::Error::Kernel(e)) => assert_out_of_range(&e, "logit std"),
            Err(e) => panic!("std {std}: {e}"),
        }
    }
    // At 5e3 the reference log-probs (drawn at temperature 1) are ~1e3 nats from the
    // policy's (0.9): the literal k3·r is ∞·0, but written exp(d + log r) - (d+1)·r
    // (spec additions) the loss is finite, and the kernel's equals the reference's.
    let cfg = GradcheckConfig {
        logit_std: 5e3,
        vocab: 5003,
        loss: yaml_loss(),
        ..GradcheckConfig::default()
    };
    let r = gradcheck::run(&cfg).unwrap();
    assert!(r.loss_ref.is_finite(), "{}", r.loss_ref);
    assert!(r.gate("loss").unwrap().passed, "{:?}", r.gates);
}

/// The issue-22 input: logits of std 3000 with and without a KL term, at the YAML's
/// temperature 0.9, end with finite numbers (a NaN came from `β·kl = 0·∞` and `k3·r =
/// ∞·0` before), and at the reference.
#[test]
fn logits_of_std_3000_give_a_finite_loss_at_the_reference() {
    for beta in [0.04, 0.0] {
        let mut loss = yaml_loss();
        loss.beta = beta;
        let cfg = GradcheckConfig {
            logit_std: 3000.0,
            batch: 2,
            seq_len: 9,
            vocab: 301,
            loss,
            ..GradcheckConfig::default()
        };
        let r = gradcheck::run(&cfg).unwrap();
        assert!(r.loss_kernel.is_finite() && r.loss_ref.is_finite());
        assert!(r.gate("loss").unwrap().passed, "beta {beta}: {:?}", r.gates);
    }
}

/// Sets old and reference logp at `logp + shift` for every row (log-ratio `-shift`).
fn shifted(x: &mut GrpoInputs, temperature: f64, old_shift: f32, ref_shift: f32) {
    let layout = LogitsLayout::contiguous(x.data.batch, x.data.seq_len, x.vocab);
    let stats = flashloss::cpu::selective_log_softmax(
        &x.logits,
        &layout,
        &x.data.target_ids,
        None,
        flashloss::Temperature::new(temperature).unwrap(),
    )
    .unwrap();
    for (i, st) in stats.iter().enumerate() {
        x.data.old_logp.as_mut().unwrap()[i] = st.logp + old_shift;
        x.data.ref_logp.as_mut().unwrap()[i] = st.logp + ref_shift;
    }
}

/// Log-ratio ±80 (ratio e^±80, within f32) is finite and at the reference for every
/// loss type; ±100 (e^100 > f32::MAX) is finite or OutOfRange, and an error for the
/// token-level clipped loss, whose gradient carries the ratio.
#[test]
fn log_ratio_at_plus_minus_80_and_beyond() {
    for (t, level) in valid_types() {
        for shift in [80.0f32, -80.0, 100.0, -100.0] {
            let mut cfg = small(2, 5, 301, base_config(t, level));
            cfg.loss.beta = 0.04;
            // Plain k3 KL: with bias correction the f64 dual-number reference is no oracle
            // at |q - logp| = 80 (its ∂(kl·r)/∂logp is e^80-sized terms cancelling to
            // r·(logp - q), lost to f64 rounding); the kernel uses the closed form.
            cfg.loss.use_bias_correction_kl = false;
            cfg.loss.entropy_coef = 0.01;
            cfg.old_logp = true;
            cfg.ref_logp = true;
            let mut x = draw(2, 5, 301, 3);
            x.data.mask.fill(true);
            // Both signs of advantage.
            if let flashloss::PerSeqOrTokenBuf::Sequence(a) = &mut x.data.advantages {
                *a = vec![1.0, -1.0];
            }
            shifted(&mut x, cfg.loss.temperature, -shift, 0.1);
            let case = format!("{} {level:?} log-ratio {shift}", t.name());
            let got = outcome(&x, &cfg, &case);
            if shift.abs() <= 80.0 {
                got.clone().unwrap_or_else(|e| panic!("{case}: {e}"));
            } else if let Err(e) = &got {
                assert_out_of_range(e, &case);
            }
            if shift == 100.0
                && t == LossType::Grpo
                && level == flashloss::ImportanceSamplingLevel::Token
            {
                assert!(got.is_err(), "{case}: expected OutOfRange");
            }
            // The KL side: reference logp 100 nats above the policy.
            let mut y = x.clone();
            shifted(&mut y, cfg.loss.temperature, 0.0, shift);
            let got = outcome(&y, &cfg, &format!("{case} (ref)"));
            if shift == 100.0 {
                assert_out_of_range(&got.unwrap_err(), &case);
            } else if let Err(e) = &got {
                assert_out_of_range(e, &case);
            }
        }
    }
}

/// Temperature 0.01 with ±1e4 logits and one unmasked token: finite, at the reference.
#[test]
fn temperature_0_01_one_unmasked_token() {
    for (t, level) in valid_types() {
        let mut cfg = small(2, 4, 257, base_config(t, level));
        cfg.loss.temperature = 0.01;
        cfg.loss.beta = 0.04;
        cfg.loss.entropy_coef = 0.01;
        let mut x = draw(2, 4, 257, 8);
        for (k, z) in x.logits.iter_mut().enumerate() {
            *z = if k % 3 == 0 { 1e4 } else { -1e4 } + (k % 7) as f32 * 0.01;
        }
        for (row, &id) in x.data.target_ids.iter().enumerate() {
            x.logits[row * 257 + id as usize] = 1e4 + 0.05;
        }
        x.data.mask.fill(false);
        x.data.mask[5] = true;
        shifted(&mut x, 0.01, 0.3, -0.2);
        let case = format!("T=0.01 one token {}", t.name());
        outcome(&x, &cfg, &case).unwrap_or_else(|e| panic!("{case}: {e}"));
    }
}

/// The fused LM-head kernel, both modes: a policy e^100 away from its old logp is
/// OutOfRange (the sum of the rows' gradients would be infinite); at e^20 it is at the
/// reference.
#[test]
fn fused_linear_out_of_range_is_an_error_in_both_modes() {
    let (b, t, h, v) = (2, 5, 8, 301);
    let loss = GrpoLoss::new(base_config(
        LossType::Grpo,
        flashloss::ImportanceSamplingLevel::Token,
    ))
    .unwrap();
    let head = Head::<f32>::random(b * t, h, v, true, 4);
    let z = linear_logits(&head.inputs());
    for mode in [Mode::SinglePass, Mode::TwoPass] {
        for shift in [20.0f32, 100.0] {
            let mut x = draw(b, t, v, 5);
            x.data.mask.fill(true);
            if let flashloss::PerSeqOrTokenBuf::Sequence(a) = &mut x.data.advantages {
                *a = vec![-1.0, -0.5];
            }
            x.follow_policy(&z, 1.0);
            for lp in x.data.old_logp.as_mut().unwrap() {
                *lp -= shift;
            }
            let batch = x.batch();
            let opts = FusedOptions {
                bf16_products: Default::default(),
                mode,
                budget_bytes: Some(flashloss::cpu::gemm_reserve_bytes() + (1 << 20)),
                grad_output: 1.0,
                head_grad: Default::default(),
            };
            let got = grpo_linear(&loss, &batch, &head.inputs(), &opts);
            let case = format!("{mode:?} shift {shift}");
            if shift > 88.0 {
                assert_out_of_range(&got.unwrap_err(), &case);
            } else {
                let out = got.unwrap_or_else(|e| panic!("{case}: {e}"));
                let r = grpo_reference(&loss, &batch, Normalizers::local(&batch), &z, v, 1.0);
                assert!(
                    (out.loss - r.loss).abs() <= 1e-5 * r.loss.abs().max(1.0),
                    "{case}: {} vs {}",
                    out.loss,
                    r.loss
                );
                assert!(out.grads.dhidden.iter().all(|g| g.is_finite()), "{case}");
            }
        }
    }
}

/// Found by `prop_validation` (shrunk): with `grad_output = f32::MAX` the fused CE's
/// gradient coefficients are in f32 but `dH = dZ·W` sums past it (it was `inf`); the
/// fused heads now say so by row.
#[test]
fn grad_output_at_f32_max_is_out_of_range_not_inf() {
    let (b, t, v, h) = (1, 2, 20, 1);
    let loss = GrpoLoss::new(flashloss::GrpoLossConfig {
        beta: 0.04,
        entropy_coef: 0.01,
        ..Default::default()
    })
    .unwrap();
    let spec = flashloss_tools::inputs::InputSpec {
        batch: b,
        seq_len: t,
        vocab: v,
        sampler_ratio: true,
        ..Default::default()
    };
    let x = GrpoInputs::random(&spec, 86);
    let head = Head::<f32>::random(b * t, h, v, true, 86);
    let batch = x.batch();
    for mode in [Mode::SinglePass, Mode::TwoPass] {
        let opts = FusedOptions {
            bf16_products: Default::default(),
            mode,
            budget_bytes: Some(flashloss::cpu::gemm_reserve_bytes() + (1 << 20)),
            grad_output: f32::MAX,
            head_grad: Default::default(),
        };
        match grpo_linear(&loss, &batch, &head.inputs(), &opts) {
            Ok(out) => assert!(out.grads.dhidden.iter().all(|g| g.is_finite())),
            Err(err) => assert_out_of_range(&err, &format!("{mode:?}")),
        }
        let ce = flashloss::CrossEntropy::new(Default::default()).unwrap();
        let err = Device::cpu()
            .with_host_grads(&head.inputs(), CeCall::new(&ce, batch.target_ids, &opts))
            .unwrap_err();
        assert_out_of_range(&err, &format!("ce {mode:?}"));
    }
}

/// Found by fuzzing (`fuzz/regressions/batch_validation/logits-grad-not-finite`): the
/// upstream scale `g/T` itself beyond f32 (`g = -1.9e15`, `T = 2.9e-24`) while every
/// product `g/T·dlogp` is within it. The kernels formed `g/T` in f32 (infinite) and
/// multiplied it by `1 - p = 0`: NaN. With one vocabulary entry the exact gradient is
/// zero (a softmax over one logit is constant), so every path must give exactly zero.
/// (The one-`exp` kernel, merged after the fix, still formed `g/T` in f32: NaN.)
#[test]
fn upstream_scale_beyond_f32_with_products_within_it() {
    let (b, t, v, h) = (1, 4, 1, 1);
    let loss = GrpoLoss::new(flashloss::GrpoLossConfig {
        loss_type: LossType::DrGrpo,
        beta: 0.04,
        entropy_coef: 0.01,
        temperature: 2.890_821e-24,
        max_completion_length: Some(t),
        ..Default::default()
    })
    .unwrap();
    let mut x = draw(b, t, v, 95);
    x.data.mask[0] = false;
    let batch = x.batch();
    let g = -1.905_826_2e15f32;
    assert!(!((g as f64 / loss.config().temperature) as f32).is_finite());
    let layout = LogitsLayout::contiguous(b, t, v);
    let zero = |name: &str, xs: &[f32]| {
        assert!(xs.iter().all(|&d| d == 0.0), "{name}: {xs:?}");
    };
    for in_place in [false, true] {
        let mut logits = x.logits.clone();
        let mut out = vec![f32::NAN; logits.len()];
        let device = Device::cpu();
        let fwd = match in_place {
            true => device.grpo_logits_in_place(&loss, &batch, &mut logits, &layout, g),
            false => device.grpo_logits(&loss, &batch, &logits, &layout, g, &mut out),
        }
        .unwrap();
        assert!(fwd.loss.is_finite());
        zero("logits level", if in_place { &logits } else { &out });
    }
    let mut staged = vec![f32::NAN; x.logits.len()];
    let fwd =
        flashloss::cpu::grpo_logits_forward_staged(&loss, &batch, &x.logits, &layout, &mut staged)
            .unwrap();
    fwd.backward(&x.logits, g, &mut staged).unwrap();
    zero("one-exp (staged)", &staged);
    let (value, dlogits) =
        flashloss::cpu::grpo_logits_unfused(&loss, &batch, &x.logits, &layout, g).unwrap();
    assert!(value.is_finite());
    zero("unfused", &dlogits);
    let head = Head::<f32>::random(b * t, h, v, true, 7);
    for mode in [Mode::SinglePass, Mode::TwoPass] {
        let opts = FusedOptions {
            bf16_products: Default::default(),
            mode,
            budget_bytes: Some(flashloss::cpu::gemm_reserve_bytes() + (1 << 20)),
            grad_output: g,
            head_grad: Default::default(),
        };
        let out = grpo_linear(&loss, &batch, &head.inputs(), &opts).unwrap();
        zero("fused dhidden", &out.grads.dhidden);
        zero("fused dweight", &out.grads.dweight);
    }
}

/// The entropy term's f32 coefficient `g/T·∂L/∂H` beyond f32 on rows of entropy ~0,
/// where every `|dz_j|` (≤ its `1/e` share) is within it: an `OutOfRange` error naming
/// `dlogits`, never the NaN of `inf·0` it was before (fuzz: `batch_validation`'s
/// `entropy-coef-beyond-f32`; spec, flashloss addition 6).
#[test]
fn entropy_coefficient_beyond_f32_at_zero_entropy_is_an_error() {
    let (b, t, v) = (1, 4, 8);
    let loss = GrpoLoss::new(flashloss::GrpoLossConfig {
        loss_type: LossType::Vespo,
        entropy_coef: 0.01,
        temperature: 2.35e-38,
        ..Default::default()
    })
    .unwrap();
    let x = draw(b, t, v, 3);
    let batch = x.batch();
    let g = -6304.0f32;
    let dentropy = 0.01 / t as f64;
    let scale = g as f64 / loss.config().temperature;
    assert!((scale * dentropy).abs() > f32::MAX as f64);
    assert!((scale * dentropy / std::f64::consts::E).abs() < f32::MAX as f64);
    let layout = LogitsLayout::contiguous(b, t, v);
    let mut out = vec![f32::NAN; x.logits.len()];
    let device = Device::cpu();
    let err = device
        .grpo_logits(&loss, &batch, &x.logits, &layout, g, &mut out)
        .unwrap_err();
    assert_out_of_range(&err, "logits level");
    assert!(
        matches!(
            err,
            Error::OutOfRange {
                quantity: "dlogits",
                ..
            }
        ),
        "{err}"
    );
}

/// A temperature whose inverse leaves f32 (the kernels scale logits by `1/T` in f32) is
/// a config error naming it, for GRPO and cross-entropy.
#[test]
fn temperature_with_inverse_beyond_f32_is_a_config_error() {
    for temperature in [1e-39, 1e-300] {
        let err = GrpoLoss::new(flashloss::GrpoLossConfig {
            temperature,
            ..Default::default()
        })
        .unwrap_err();
        assert!(err.to_string().contains("temperature"), "{err}");
        let err = flashloss::CrossEntropy::new(flashloss::CeConfig {
            temperature,
            ..Default::default()
        })
        .unwrap_err();
        assert!(err.to_string().contains("temperature"), "{err}");
    }
    assert!(
        GrpoLoss::new(flashloss::GrpoLossConfig {
            temperature: 1e-38,
            ..Default::default()
        })
        .is_ok()
    );
}
