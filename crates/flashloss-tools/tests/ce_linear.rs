//! Fused linear cross-entropy vs the f64 reference (loss, z-loss, per-row loss and
//! logp, dH, dW, d bias) for every option (ignore_index, label smoothing, z-loss,
//! soft-cap, reductions, temperature), both modes, bias, bf16, odd shapes; the reference
//! vs central differences; finite differences of the LM-head loss w.r.t. hidden and
//! weight entries; single-pass = two-pass; thread invariance; the baseline; errors
//! (the workspace budget is tested in fused_budget.rs).

use crate::common;
use common::cpu_steps::{ce_linear, ce_linear_into};
use common::*;
use flashloss::cpu::{BaselineWorkspace, Workspace, ce_linear_baseline_into};
use flashloss::device::{CeCall, CeUpstream};
use flashloss::reference::{ce_reference, linear_grads, linear_logits};
use flashloss::{CeConfig, CrossEntropy, Element, Reduction};
use flashloss::{FusedOptions, LinearGrads, Mode};
use half::bf16;
use rand::{Rng, SeedableRng};

/// Targets in `[0, V)` with every `ignore_every`-th row set to `ignore_index`.
fn targets(n: usize, v: usize, ignore_index: i64, ignore_every: usize, seed: u64) -> Vec<i64> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    (0..n)
        .map(|i| {
            if ignore_every > 0 && i % ignore_every == ignore_every - 1 {
                ignore_index
            } else {
                rng.random_range(0..v as i64)
            }
        })
        .collect()
}

/// Every option alone and together.
fn option_sets() -> Vec<CeConfig> {
    let base = CeConfig::default();
    let all = CeConfig {
        ignore_index: 7,
        label_smoothing: 0.1,
        z_loss: 1e-3,
        softcap: Some(3.0),
        reduction: Reduction::Sum,
        temperature: 0.8,
    };
    vec![
        base.clone(),
        CeConfig {
            label_smoothing: 0.2,
            ..base.clone()
        },
        CeConfig {
            z_loss: 1e-2,
            ..base.clone()
        },
        CeConfig {
            softcap: Some(2.5),
            ..base.clone()
        },
        CeConfig {
            reduction: Reduction::Sum,
            temperature: 1.3,
            ..base.clone()
        },
        CeConfig {
            reduction: Reduction::None,
            label_smoothing: 1.0,
            ..base.clone()
        },
        all.clone(),
        CeConfig {
            reduction: Reduction::Mean,
            ..all
        },
    ]
}

/// Fused kernel vs reference on one case. `shape` = (N, H, V).
fn check<E: Element>(
    cfg: &CeConfig,
    shape: (usize, usize, usize),
    bias: bool,
    mode: Mode,
    seed: u64,
) {
    let (n, h, v) = shape;
    let ce = CrossEntropy::new(cfg.clone()).unwrap();
    let head = Head::<E>::random(n, h, v, bias, seed);
    let y = targets(n, v, cfg.ignore_index, 4, seed + 1);
    let grad_rows: Option<Vec<f32>> = (cfg.reduction == Reduction::None)
        .then(|| (0..n).map(|i| 0.5 + (i % 3) as f32 * 0.25).collect());
    let opts = FusedOptions {
        bf16_products: Default::default(),
        mode,
        budget_bytes: Some(flashloss::cpu::gemm_reserve_bytes() + (1 << 20)),
        grad_output: 0.75,
        head_grad: Default::default(),
    };
    let case = format!(
        "{cfg:?} {:?} {mode:?} [N={n},H={h},V={v}] bias={bias}",
        E::DTYPE
    );
    let mut grads = LinearGrads::zeros(&head.inputs());
    let out = ce_linear_into(
        &ce,
        &y,
        grad_rows.as_deref(),
        &head.inputs(),
        &opts,
        &mut Workspace::new(),
        &mut grads,
    )
    .unwrap_or_else(|e| panic!("{case}: {e}"));
    let z = linear_logits(&head.inputs());
    let r = ce_reference(&ce, &y, &z, v, 0.75, grad_rows.as_deref());
    let (dh, dw, db) = linear_grads(&head.inputs(), &r.dlogits);
    // f16 inputs widen exactly: the f32 bounds hold on the rounded inputs.
    let exact = matches!(E::DTYPE, flashloss::DType::F32 | flashloss::DType::F16);
    let (loss_tol, grad_tol) = if exact && out.plan.compact {
        (1e-5, COMPACT_GRAD_TOL)
    } else if exact {
        (1e-5, 1e-4)
    } else {
        (1e-3, 1e-2)
    };
    assert_eq!(out.count, r.count, "{case}: count");
    assert!(
        (out.loss - r.loss).abs() <= loss_tol * r.loss.abs().max(1.0),
        "{case}: loss {} vs {}",
        out.loss,
        r.loss
    );
    assert!(
        (out.z_loss - r.z_loss).abs() <= loss_tol * r.z_loss.abs().max(1.0),
        "{case}: z-loss {} vs {}",
        out.z_loss,
        r.z_loss
    );
    for i in 0..n {
        let tol = 1e-5 * r.row_loss[i].abs().max(1.0);
        assert!(
            (out.row_loss[i] as f64 - r.row_loss[i]).abs() <= tol,
            "{case}: row {i} loss {} vs {}",
            out.row_loss[i],
            r.row_loss[i]
        );
        assert!(
            (out.stats[i].logp as f64 - r.logp[i]).abs() <= 1e-5 * r.logp[i].abs().max(1.0),
            "{case}: row {i} logp"
        );
    }
    assert_close(&format!("{case} dH"), &grads.dhidden, &dh, grad_tol);
    assert_close(&format!("{case} dW"), &grads.dweight, &dw, grad_tol);
    match (&grads.dbias, bias) {
        (Some(got), true) => assert_close(&format!("{case} dbias"), got, &db, grad_tol),
        (None, false) => {}
        _ => panic!("{case}: dbias presence"),
    }
}

#[test]
fn every_option_both_modes_f32() {
    for cfg in option_sets() {
        for mode in [
            Mode::Auto,
            Mode::AutoF32,
            Mode::TwoPass,
            Mode::SinglePass,
            Mode::Compact,
        ] {
            check::<f32>(&cfg, (13, 37, 2053), true, mode, 1);
            check::<f32>(&cfg, (1, 19, 301), false, mode, 2);
        }
    }
}

#[test]
fn bf16_inputs() {
    for cfg in option_sets().into_iter().step_by(3) {
        check::<bf16>(&cfg, (14, 45, 1031), true, Mode::Auto, 3);
        check::<bf16>(&cfg, (14, 45, 1031), false, Mode::TwoPass, 4);
    }
}

/// float16 inputs (issue 33), widened as bf16 is: the f32 bounds against the reference
/// on the same f16-rounded inputs, every option, single-pass and two-pass.
#[test]
fn f16_inputs() {
    for cfg in option_sets() {
        check::<half::f16>(&cfg, (14, 45, 1031), true, Mode::Auto, 5);
        check::<half::f16>(&cfg, (14, 45, 1031), false, Mode::TwoPass, 6);
    }
}

#[test]
fn reference_gradients_match_central_differences() {
    let (n, v) = (5, 9);
    let mut checked = 0;
    for cfg in option_sets() {
        let ce = CrossEntropy::new(cfg.clone()).unwrap();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        let z: Vec<f64> = (0..n * v).map(|_| rng.random_range(-4.0..4.0)).collect();
        let y = targets(n, v, cfg.ignore_index, 3, 4);
        let grad_rows: Option<Vec<f32>> =
            (cfg.reduction == Reduction::None).then(|| vec![0.5, 1.0, 2.0, 1.5, 0.25]);
        let r = ce_reference(&ce, &y, &z, v, 1.0, grad_rows.as_deref());
        let loss_at = |zz: &[f64]| ce_reference(&ce, &y, zz, v, 1.0, grad_rows.as_deref()).loss;
        let scale = r.dlogits.iter().fold(0.0f64, |m, x| m.max(x.abs()));
        let step = 1e-6;
        for k in 0..z.len() {
            let (mut zp, mut zm) = (z.clone(), z.clone());
            zp[k] += step;
            zm[k] -= step;
            let fd = (loss_at(&zp) - loss_at(&zm)) / (2.0 * step);
            assert!(
                (fd - r.dlogits[k]).abs() <= 1e-6 * scale.max(1e-3),
                "{cfg:?} logit {k}: fd {fd} vs reference {}",
                r.dlogits[k]
            );
            checked += 1;
        }
    }
    assert!(checked >= 8 * 45, "checked {checked}");
}

/// f64 loss of the LM head at hidden/weight given in f64 (through the reference).
fn head_loss(
    ce: &CrossEntropy,
    y: &[i64],
    hidden: &[f64],
    weight: &[f64],
    n: usize,
    h: usize,
    v: usize,
) -> f64 {
    let z: Vec<f64> = (0..n * v)
        .map(|k| {
            let (i, j) = (k / v, k % v);
            (0..h).map(|c| hidden[i * h + c] * weight[j * h + c]).sum()
        })
        .collect();
    ce_reference(ce, y, &z, v, 1.0, None).loss
}

#[test]
fn kernel_gradients_match_finite_differences_of_the_head_loss() {
    let (n, h, v) = (6, 11, 53);
    let cfg = CeConfig {
        label_smoothing: 0.1,
        z_loss: 1e-3,
        softcap: Some(4.0),
        temperature: 0.9,
        ..CeConfig::default()
    };
    let ce = CrossEntropy::new(cfg.clone()).unwrap();
    let head = Head::<f32>::random(n, h, v, false, 21);
    let y = targets(n, v, cfg.ignore_index, 5, 22);
    let out = ce_linear(&ce, &y, &head.inputs(), &FusedOptions::default()).unwrap();
    let hidden: Vec<f64> = head.hidden.iter().map(|&x| x as f64).collect();
    let weight: Vec<f64> = head.weight.iter().map(|&x| x as f64).collect();
    let step = 1e-5;
    let fd = |which: usize, k: usize| {
        let (mut hp, mut hm, mut wp, mut wm) = (
            hidden.clone(),
            hidden.clone(),
            weight.clone(),
            weight.clone(),
        );
        if which == 0 {
            hp[k] += step;
            hm[k] -= step;
        } else {
            wp[k] += step;
            wm[k] -= step;
        }
        (head_loss(&ce, &y, &hp, &wp, n, h, v) - head_loss(&ce, &y, &hm, &wm, n, h, v))
            / (2.0 * step)
    };
    let dh_scale = max_abs(
        &out.grads
            .dhidden
            .iter()
            .map(|&x| x as f64)
            .collect::<Vec<_>>(),
    );
    let dw_scale = max_abs(
        &out.grads
            .dweight
            .iter()
            .map(|&x| x as f64)
            .collect::<Vec<_>>(),
    );
    for k in [0, 5, 17, 40, n * h - 1] {
        let want = fd(0, k);
        assert!(
            (out.grads.dhidden[k] as f64 - want).abs() <= 1e-4 * dh_scale,
            "dH[{k}]: {} vs fd {want}",
            out.grads.dhidden[k]
        );
    }
    for k in [0, 3, 100, 250, v * h - 1] {
        let want = fd(1, k);
        assert!(
            (out.grads.dweight[k] as f64 - want).abs() <= 1e-4 * dw_scale,
            "dW[{k}]: {} vs fd {want}",
            out.grads.dweight[k]
        );
    }
}

#[test]
fn single_pass_equals_two_pass_and_threads_do_not_change_bits() {
    let cfg = CeConfig {
        label_smoothing: 0.1,
        z_loss: 1e-4,
        softcap: Some(20.0),
        ..CeConfig::default()
    };
    let ce = CrossEntropy::new(cfg.clone()).unwrap();
    let head = Head::<f32>::random(80, 64, 3001, true, 5);
    let y = targets(80, 3001, cfg.ignore_index, 7, 6);
    assert_modes_agree_and_threads_invariant(&|opts| {
        let out = ce_linear(&ce, &y, &head.inputs(), opts).unwrap();
        FusedRun {
            loss: out.loss,
            grads: out.grads,
            single_pass: out.plan.single_pass,
        }
    });
}

#[test]
fn baseline_matches_the_reference() {
    for cfg in option_sets() {
        let ce = CrossEntropy::new(cfg.clone()).unwrap();
        let head = Head::<f32>::random(12, 23, 1501, true, 11);
        let y = targets(12, 1501, cfg.ignore_index, 4, 12);
        let mut grads = LinearGrads::zeros(&head.inputs());
        let value = ce_linear_baseline_into(
            &ce,
            &y,
            &head.inputs(),
            0.5,
            &mut BaselineWorkspace::default(),
            &mut grads,
        )
        .unwrap();
        let z = linear_logits(&head.inputs());
        let r = ce_reference(&ce, &y, &z, 1501, 0.5, None);
        assert!(
            (value - r.loss).abs() <= 1e-5 * r.loss.abs().max(1.0),
            "{cfg:?}: {value} vs {}",
            r.loss
        );
        let (dh, dw, db) = linear_grads(&head.inputs(), &r.dlogits);
        assert_close("baseline dH", &grads.dhidden, &dh, 1e-4);
        assert_close("baseline dW", &grads.dweight, &dw, 1e-4);
        assert_close("baseline dbias", grads.dbias.as_ref().unwrap(), &db, 1e-4);
    }
}

#[test]
fn all_rows_ignored_gives_zero_loss_and_gradients() {
    let ce = CrossEntropy::new(CeConfig::default()).unwrap();
    let head = Head::<f32>::random(4, 8, 50, true, 13);
    let out = ce_linear(&ce, &[-100; 4], &head.inputs(), &FusedOptions::default()).unwrap();
    assert_eq!((out.loss, out.count), (0.0, 0));
    assert!(
        out.grads
            .dhidden
            .iter()
            .chain(&out.grads.dweight)
            .all(|&x| x == 0.0)
    );
}

#[test]
fn dweight_in_the_weight_dtype() {
    let ce = CrossEntropy::new(CeConfig::default()).unwrap();
    let head = Head::<bf16>::random(6, 16, 300, false, 14);
    let y = targets(6, 300, -100, 0, 15);
    let out = ce_linear(&ce, &y, &head.inputs(), &FusedOptions::default()).unwrap();
    let dw: Vec<bf16> = out.grads.dweight_as();
    assert_eq!(dw.len(), out.grads.dweight.len());
    for (a, b) in dw.iter().zip(&out.grads.dweight) {
        assert_eq!(*a, bf16::from_f32(*b));
    }
}

#[test]
fn bad_input_is_a_clear_error() {
    let head = Head::<f32>::random(4, 8, 50, false, 16);
    let ce = CrossEntropy::new(CeConfig::default()).unwrap();
    let opts = FusedOptions::default();
    let err = |r: flashloss::Result<flashloss::CeLinearOutput>| r.unwrap_err().to_string();
    assert_eq!(
        err(ce_linear(&ce, &[1, 2, 50, 3], &head.inputs(), &opts)),
        "argument `target_ids`: id 50 at index 2 (sequence 0, position 2) is outside [0, 50)"
    );
    assert_eq!(
        err(ce_linear(&ce, &[1, 2, 3], &head.inputs(), &opts)),
        "argument `target_ids`: expected 4 elements for shape [B=1, T=4], got 3"
    );
    let mut grads = LinearGrads::zeros(&head.inputs());
    let r = ce_linear_into(
        &ce,
        &[1, 2, 3, 4],
        Some(&[1.0; 4]),
        &head.inputs(),
        &opts,
        &mut Workspace::new(),
        &mut grads,
    );
    assert_eq!(
        err(r),
        "argument `grad_rows`: per-row upstream gradients need reduction `none`"
    );
    for (cfg, msg) in [
        (
            CeConfig {
                label_smoothing: 1.5,
                ..CeConfig::default()
            },
            "invalid loss config: `label_smoothing`: must be in [0, 1], got 1.5",
        ),
        (
            CeConfig {
                softcap: Some(0.0),
                ..CeConfig::default()
            },
            "invalid loss config: `softcap`: must be finite and > 0, got 0",
        ),
        (
            CeConfig {
                z_loss: f64::NAN,
                ..CeConfig::default()
            },
            "invalid loss config: `z_loss`: must be finite and >= 0, got NaN",
        ),
    ] {
        assert_eq!(CrossEntropy::new(cfg).unwrap_err().to_string(), msg);
    }
    let mut nan_head = Head::<f32>::random(4, 8, 50, false, 17);
    nan_head.hidden[9] = f32::NAN;
    assert_eq!(
        err(ce_linear(&ce, &[1, 2, 3, 4], &nan_head.inputs(), &opts)),
        "argument `hidden`: value NaN at index 9 is not finite"
    );
}

/// Cut Cross-Entropy's `return_lse` (issue 33): the gradients of
/// `grad_output·L + Σ_i g_i·lse_i` for every option, against the reference, whose own
/// gradient is checked against central differences of that sum.
#[test]
fn lse_upstream_gradients_match_the_reference() {
    use flashloss::reference::ce_reference_lse;
    let (n, h, v) = (13, 8, 301);
    let g: Vec<f32> = (0..n).map(|i| [0.5, -1.0, 0.0, 2.0][i % 4]).collect();
    for cfg in option_sets() {
        let ce = CrossEntropy::new(cfg.clone()).unwrap();
        let head = Head::<f32>::random(n, h, v, true, 21);
        let y = targets(n, v, cfg.ignore_index, 4, 22);
        let grad_rows: Option<Vec<f32>> = (cfg.reduction == Reduction::None).then(|| vec![0.5; n]);
        let opts = FusedOptions {
            grad_output: 0.75,
            ..FusedOptions::default()
        };
        let mut grads = LinearGrads::zeros(&head.inputs());
        let inputs = head.inputs();
        let args = flashloss::HeadArgs::Host {
            inputs: &inputs,
            grads: grads.view(),
        };
        let out = flashloss::Device::cpu()
            .cross_entropy(
                args,
                CeCall::new(&ce, &y, &opts).upstream(CeUpstream {
                    rows: grad_rows.as_deref(),
                    lse: Some(&g),
                }),
            )
            .unwrap();
        let z = linear_logits(&inputs);
        let r = ce_reference_lse(&ce, &y, &z, v, (0.75, grad_rows.as_deref()), Some(&g));
        for i in 0..n {
            let lse = out.stats[i].lse as f64;
            assert!(
                (lse - r.lse[i]).abs() <= 1e-5 * r.lse[i].abs().max(1.0),
                "{cfg:?} lse {i}"
            );
        }
        let (dh, dw, db) = linear_grads(&inputs, &r.dlogits);
        assert_close(&format!("{cfg:?} dH"), &grads.dhidden, &dh, 1e-4);
        assert_close(&format!("{cfg:?} dW"), &grads.dweight, &dw, 1e-4);
        assert_close(
            &format!("{cfg:?} dbias"),
            grads.dbias.as_ref().unwrap(),
            &db,
            1e-4,
        );

        // The reference's gradient of the sum, by central differences on a small case.
        let (ns, vs) = (4, 7);
        let zs: Vec<f64> = (0..ns * vs)
            .map(|k| ((k * 37 % 17) as f64 - 8.0) * 0.4)
            .collect();
        let ys = targets(ns, vs, cfg.ignore_index, 3, 5);
        let rows = grad_rows.as_ref().map(|_| vec![0.5f32; ns]);
        let total = |zz: &[f64]| {
            let r = ce_reference_lse(&ce, &ys, zz, vs, (0.75, rows.as_deref()), Some(&g[..ns]));
            0.75 * r.loss + (0..ns).map(|i| g[i] as f64 * r.lse[i]).sum::<f64>()
        };
        let r = ce_reference_lse(&ce, &ys, &zs, vs, (0.75, rows.as_deref()), Some(&g[..ns]));
        for k in 0..zs.len() {
            let (mut zp, mut zm) = (zs.clone(), zs.clone());
            zp[k] += 1e-6;
            zm[k] -= 1e-6;
            let fd = (total(&zp) - total(&zm)) / 2e-6;
            assert!(
                (fd - r.dlogits[k]).abs() <= 1e-6,
                "{cfg:?} logit {k}: {fd} vs {}",
                r.dlogits[k]
            );
        }
    }
    // A bad grad_lse is an error naming it.
    let ce = CrossEntropy::new(CeConfig::default()).unwrap();
    let head = Head::<f32>::random(3, 4, 11, false, 1);
    let inputs = head.inputs();
    for bad in [vec![1.0f32; 2], vec![1.0, f32::NAN, 1.0]] {
        let mut grads = LinearGrads::zeros(&inputs);
        let args = flashloss::HeadArgs::Host {
            inputs: &inputs,
            grads: grads.view(),
        };
        let err = flashloss::Device::cpu()
            .cross_entropy(
                args,
                CeCall::new(&ce, &[0, 1, 2], &FusedOptions::default()).upstream(CeUpstream {
                    rows: None,
                    lse: Some(&bad),
                }),
            )
            .unwrap_err();
        assert!(err.to_string().starts_with("argument `grad_lse`"), "{err}");
    }
}
