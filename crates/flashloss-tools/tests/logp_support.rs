//! Log-probs under the sampler's truncated support (top-k / top-p / min-p in vLLM V1's
//! order) through `logp_linear_with` and `logp_linear_grads_with` on the CPU head,
//! against the f64 reference (`reference::support_row`): `logp^K`, `lse^K`, the support
//! size, targets outside the support (`-inf`, zero gradient, counted), and dH, dW, dbias.
//! Exact inputs (small integers scaled by powers of two, temperatures 1 and 1/2) make
//! every f32 logit exact in any summation order, so ties reproduce and the kernel and the
//! reference decide on the same values; random floats compare the rows away from a
//! boundary (the reference's margin).

use crate::common;
use crate::support_common;
use common::assert_close;
use flashloss::SupportFilter;
use flashloss::cpu::{CpuHead, Workspace};
use flashloss::fused::{self, LogpRequest, LogpUpstream};
use flashloss::reference::{linear_grads, linear_logits, row_softmax, support_row};
use flashloss::{Element, Error, FusedOptions, HeadGrad, LinearGrads, Mode};
use half::bf16;
use support_common::*;

#[test]
fn exact_rows_every_combination_of_the_filters() {
    let (n, h, v) = (7, 12, 2311);
    for (bias, ties) in [(false, false), (true, true), (false, true)] {
        let head = ExactHead::<f32>::new((n, h, v), bias, ties, 3);
        let inputs = head.inputs();
        let z = linear_logits(&inputs);
        let targets: Vec<i64> = (0..n as i64).map(|i| (i * 577 + 11) % v as i64).collect();
        let mask: Vec<bool> = (0..n).map(|i| i != 2).collect();
        for temperature in [1.0, 0.5] {
            let call = Call {
                targets: &targets,
                mask: Some(&mask),
                temperature,
            };
            let plain = forward(&inputs, &call, filter(None, None, None));
            for f in combinations(v) {
                let case = format!("bias={bias} ties={ties} T={temperature} {f:?}");
                let out = forward(&inputs, &call, f);
                check_forward(&case, &out, &z, &call, f, 1e-9);
                let s = out.support.as_ref().unwrap();
                let cuts = f.top_k.is_some_and(|k| k < v)
                    || f.top_p.is_some_and(|p| p < 1.0)
                    || f.min_p.is_some_and(|m| m > 0.0);
                if !cuts {
                    // Unset filters: the plain call's statistics, bitwise.
                    for i in (0..n).filter(|&i| mask[i]) {
                        assert_eq!(s.logp[i].to_bits(), plain.stats[i].logp.to_bits(), "{case}");
                        assert_eq!(s.size[i], v as u64, "{case}");
                    }
                }
            }
        }
    }
}

/// The reference gradient `g_out·(g_logp·∂logp^K/∂z + g_H·∂H/∂z)` `[N, V]` (the entropy
/// the full softmax's), zero on masked rows.
fn reference_dz(
    z: &[f64],
    call: &Call,
    f: SupportFilter,
    (g_logp, g_h): (&[f32], &[f32]),
    g_out: f64,
) -> Vec<f64> {
    let (n, v) = (call.targets.len(), z.len() / call.targets.len());
    let t = call.temperature;
    let mut dz = vec![0.0; n * v];
    for i in (0..n).filter(|&i| call.mask.is_none_or(|m| m[i])) {
        let row = &z[i * v..(i + 1) * v];
        let sup = support_row(row, t, call.targets[i] as usize, f);
        let sm = row_softmax(row, t);
        for j in 0..v {
            let (lp, p) = (sm.log_probs[j], sm.log_probs[j].exp());
            let dh = if p > 0.0 {
                -p * (lp + sm.entropy) / t
            } else {
                0.0
            };
            dz[i * v + j] = g_out * (g_logp[i] as f64 * sup.dlogp[j] + g_h[i] as f64 * dh);
        }
    }
    dz
}

/// The filters of the gradient checks.
const GRAD_FILTERS: [SupportFilter; 4] = [
    filter(Some(5), None, None),
    filter(None, Some(0.6), None),
    filter(Some(300), Some(0.8), Some(0.01)),
    filter(None, None, Some(0.2)),
];

/// Gradients of `E` against the reference for each filter, full and frozen heads.
fn check_grads<E: Element>(bias: bool, ties: bool, tol: f64) {
    let (n, h, v) = (6, 10, 2077);
    let head = ExactHead::<E>::new((n, h, v), bias, ties, 17);
    assert_eq!(
        check_grads_of(&head, (0.5, true), tol, &GRAD_FILTERS),
        GRAD_FILTERS.len()
    );
}

/// Gradients of `head` at `temperature` against the reference for each filter, full and
/// frozen heads, with an upstream of the entropy where `entropy`; a filter that puts a
/// live row's cut on a boundary (the reference's margin below 1e-9: top-p's cumulative
/// sum equal to `1 - top_p` up to rounding) is left out. Returns the filters compared.
fn check_grads_of<E: Element>(
    head: &ExactHead<E>,
    (temperature, entropy): (f64, bool),
    tol: f64,
    filters: &[SupportFilter],
) -> usize {
    let mut compared = 0;
    let (n, h, v, bias) = (head.n, head.h, head.v, head.bias.is_some());
    let inputs = head.inputs();
    let z = linear_logits(&inputs);
    let targets: Vec<i64> = (0..n as i64).map(|i| (i * 331 + 64) % v as i64).collect();
    let mask: Vec<bool> = (0..n).map(|i| i != 1).collect();
    let g_logp: Vec<f32> = (0..n).map(|i| 0.75 - 0.25 * i as f32).collect();
    let g_h: Vec<f32> = (0..n)
        .map(|i| {
            if entropy {
                0.125 * (i % 3) as f32 - 0.125
            } else {
                0.0
            }
        })
        .collect();
    let call = Call {
        targets: &targets,
        mask: Some(&mask),
        temperature,
    };
    for &f in filters {
        let on_boundary = (0..n).filter(|&i| mask[i]).any(|i| {
            let row = &z[i * v..(i + 1) * v];
            support_row(row, temperature, targets[i] as usize, f).margin < 1e-9
        });
        if on_boundary {
            continue;
        }
        compared += 1;
        let dz = reference_dz(&z, &call, f, (&g_logp, &g_h), 0.75);
        let (dh, dw, db) = linear_grads(&inputs, &dz);
        for head_grad in [HeadGrad::Full, HeadGrad::Frozen] {
            let case = format!(
                "{:?} bias={bias} T={temperature} {f:?} {head_grad:?}",
                E::DTYPE
            );
            let opts = FusedOptions {
                head_grad,
                budget_bytes: Some(small_budget()),
                grad_output: 0.75,
                ..FusedOptions::from_mib(Mode::Auto, 1.0, 1.0)
            };
            let mut grads = LinearGrads::zeros_for(&inputs, head_grad);
            grads.dhidden[h..2 * h].fill(7.0); // the masked row stays as it was
            let mut ws = Workspace::new();
            let mut cpu = CpuHead {
                inputs: &inputs,
                ws: &mut ws,
                grads: grads.view(),
            };
            let request = LogpRequest {
                support: Some(f),
                ..LogpRequest::default()
            };
            let up = LogpUpstream::new(&g_logp, Some(&g_h));
            let out = fused::logp_linear_grads_with(&mut cpu, call.rows(), &request, up, &opts, n)
                .unwrap_or_else(|e| panic!("{case}: {e}"));
            check_forward(&case, &out, &z, &call, f, 1e-9);
            assert!(
                grads.dhidden[h..2 * h].iter().all(|&x| x == 7.0),
                "{case}: masked row"
            );
            grads.dhidden[h..2 * h].fill(0.0);
            assert_close(&format!("{case} dH"), &grads.dhidden, &dh, tol);
            if head_grad == HeadGrad::Full {
                assert_close(&format!("{case} dW"), &grads.dweight, &dw, tol);
                if let Some(got) = &grads.dbias {
                    assert_close(&format!("{case} dbias"), got, &db, tol);
                }
            }
        }
    }
    compared
}

#[test]
fn gradients_hold_the_support_fixed_f32() {
    check_grads::<f32>(true, false, 1e-4);
    check_grads::<f32>(false, true, 1e-4);
    // Random floats at T = 0.7: pass B must recompute pass A's logits bitwise (rows
    // outside the support take no gradient, yet keep their place in the row blocks).
    let head = ExactHead::random((6, 10, 2077), 19);
    assert_eq!(
        check_grads_of(&head, (0.7, false), 1e-4, &GRAD_FILTERS),
        GRAD_FILTERS.len()
    );
}

#[test]
fn gradients_hold_the_support_fixed_bf16() {
    check_grads::<bf16>(true, true, 1e-2);
}

#[test]
fn targets_outside_the_support_get_minus_inf_and_no_gradient() {
    let (n, h, v) = (5, 8, 999);
    let head = ExactHead::<f32>::new((n, h, v), true, false, 23);
    let inputs = head.inputs();
    let z = linear_logits(&inputs);
    // Each row's smallest logit as its target: outside any top-k below V.
    let targets: Vec<i64> = (0..n)
        .map(|i| {
            let row = &z[i * v..(i + 1) * v];
            (0..v).min_by(|&a, &b| row[a].total_cmp(&row[b])).unwrap() as i64
        })
        .collect();
    let call = Call {
        targets: &targets,
        mask: None,
        temperature: 1.0,
    };
    let f = filter(Some(10), None, None);
    let g_logp = vec![1.0f32; n];
    let opts = FusedOptions::from_mib(Mode::TwoPass, 64.0, 1.0);
    let mut grads = LinearGrads::zeros_for(&inputs, HeadGrad::Full);
    let mut ws = Workspace::new();
    let mut cpu = CpuHead {
        inputs: &inputs,
        ws: &mut ws,
        grads: grads.view(),
    };
    let request = LogpRequest {
        support: Some(f),
        ..LogpRequest::default()
    };
    let up = LogpUpstream::new(&g_logp, None);
    let out = fused::logp_linear_grads_with(&mut cpu, call.rows(), &request, up, &opts, n).unwrap();
    let s = out.support.as_ref().unwrap();
    assert!(s.outside.iter().all(|&o| o));
    assert!(s.logp.iter().all(|&l| l == f32::NEG_INFINITY));
    assert!(s.lse.iter().all(|l| l.is_finite()));
    assert!(
        out.stats.iter().all(|st| st.logp.is_finite()),
        "the plain logp stays"
    );
    let all_zero = |x: &[f32]| x.iter().all(|&g| g == 0.0);
    assert!(
        all_zero(&grads.dhidden) && all_zero(&grads.dweight),
        "no gradient, no NaN"
    );
    assert!(all_zero(grads.dbias.as_deref().unwrap()));
}

#[test]
fn random_rows_away_from_a_boundary() {
    let (n, h, v) = (24, 32, 3001);
    let head = flashloss_tools::inputs::HeadInputs::<f32>::random(n, h, v, true, 41);
    let inputs = head.inputs();
    let z = linear_logits(&inputs);
    let targets: Vec<i64> = (0..n as i64).map(|i| (i * 997 + 3) % v as i64).collect();
    let call = Call {
        targets: &targets,
        mask: None,
        temperature: 0.7,
    };
    for f in combinations(v) {
        let out = forward(&inputs, &call, f);
        let compared = check_forward(&format!("random {f:?}"), &out, &z, &call, f, 1e-5);
        assert!(compared >= n / 2, "{f:?}: {compared} rows compared");
    }
}

#[test]
fn flat_rows_take_extra_passes_and_ties_split_by_index() {
    // Every logit of the zero hidden row equal: top-p keeps the upper indices.
    let (n, h, v) = (3, 8, 5003);
    let head = ExactHead::<f32>::new((n, h, v), false, true, 5);
    let inputs = head.inputs();
    let z = linear_logits(&inputs);
    let targets: Vec<i64> = vec![2, 100, v as i64 - 1];
    let call = Call {
        targets: &targets,
        mask: None,
        temperature: 1.0,
    };
    for f in [
        filter(None, Some(0.5), None),
        filter(Some(600), None, None),
        filter(Some(2), Some(0.3), None),
    ] {
        let out = forward(&inputs, &call, f);
        check_forward(&format!("{f:?}"), &out, &z, &call, f, 0.0);
        let s = out.support.as_ref().unwrap();
        assert!(
            s.extra_passes >= 1,
            "{f:?}: the buffer holds no flat row's cut"
        );
    }
    let f = filter(None, Some(0.5), None);
    let s = forward(&inputs, &call, f).support.unwrap();
    // The flat row keeps the upper half of its indices: ⌈V/2⌉ entries, the last inside.
    assert_eq!(s.size[n - 1], v.div_ceil(2) as u64);
    assert!(!s.outside[n - 1]);
}

#[test]
fn bad_filters_are_errors_naming_the_argument() {
    let head = ExactHead::<f32>::new((2, 4, 50), false, false, 1);
    let inputs = head.inputs();
    let targets = [1i64, 2];
    let call = Call {
        targets: &targets,
        mask: None,
        temperature: 1.0,
    };
    for (f, arg) in [
        (filter(Some(0), None, None), "top_k"),
        (filter(None, Some(0.0), None), "top_p"),
        (filter(None, Some(1.5), None), "top_p"),
        (filter(None, Some(f64::NAN), None), "top_p"),
        (filter(None, None, Some(-0.1)), "min_p"),
        (filter(None, None, Some(1.1)), "min_p"),
        (filter(None, None, Some(f64::NAN)), "min_p"),
    ] {
        let mut ws = Workspace::new();
        let mut grads = LinearGrads::zeros_for(&inputs, HeadGrad::Frozen);
        let mut cpu = CpuHead {
            inputs: &inputs,
            ws: &mut ws,
            grads: grads.view(),
        };
        let request = LogpRequest {
            support: Some(f),
            ..LogpRequest::default()
        };
        match fused::logp_linear_with(&mut cpu, call.rows(), &request, 64 << 20, 2) {
            Err(Error::InvalidArgument { arg: got, .. }) => assert_eq!(got, arg, "{f:?}"),
            other => panic!("{f:?}: {other:?}"),
        }
    }
}

#[test]
fn random_exact_heads_and_filters_end_to_end() {
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut draw = |hi: usize| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % hi as u64) as usize
    };
    let mut compared = 0;
    for case in 0..16 {
        let (n, h, v) = (2 + draw(6), 1 + draw(12), 2 + draw(5000));
        let head = ExactHead::<f32>::new((n, h, v), draw(2) == 0, draw(2) == 0, case);
        let top_k = (draw(2) == 0).then(|| 1 + draw(v.min(6000)));
        let top_p = (draw(2) == 0).then(|| [0.05, 0.3, 0.5, 0.77, 0.95][draw(5)]);
        let min_p = (draw(3) == 0).then(|| [0.001, 0.1, 0.5][draw(3)]);
        let temperature = [1.0, 0.5, 2.0][draw(3)];
        let f = filter(top_k, top_p, min_p);
        compared += check_grads_of(&head, (temperature, draw(2) == 0), 1e-4, &[f]);
    }
    assert!(
        compared >= 12,
        "{compared} of 16 cases away from a boundary"
    );
}
