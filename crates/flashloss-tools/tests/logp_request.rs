//! Log-prob requests (`LogpRequest`) against the f64 reference (`logp_reference`):
//! `Σπ²`, the max logit, `lse` and the candidates' `logp_ik` (ids at tile edges,
//! repeats, the target itself) in the forward call, and the gradients of `logp`,
//! entropy, `lse` and `logp_ik` w.r.t. hidden, weight and bias, on odd shapes with a
//! ragged last vocabulary tile, masked rows, temperatures, extreme logits, f32 and bf16,
//! both weight layouts, full and frozen heads, and every mode (the candidates' gradients
//! single-pass too) at a tight and a roomy budget.

use crate::common;
use common::*;
use flashloss::device::LogpCall;
use flashloss::fused::{GatherIds, LogpOutput, LogpRequest, LogpRows, LogpUpstream};
use flashloss::reference::{
    LogpRefRows, LogpRefUpstream, LogpReference, linear_grads, linear_logits, logp_reference,
};
use flashloss::{
    Bf16Products, DType, Device, Element, FusedOptions, HeadArgs, HeadGrad, LinearGrads,
    LinearInputs, Mode, Temperature, WeightLayout,
};
use half::bf16;

/// One head and its rows: targets, mask, candidates `[N, K]` and upstream gradients.
struct Case<E> {
    head: Head<E>,
    /// The weight as `[H, V]`.
    wt: Vec<E>,
    targets: Vec<i64>,
    mask: Vec<bool>,
    k: usize,
    ids: Vec<i64>,
    temperature: f64,
    g_logp: Vec<f32>,
    g_entropy: Vec<f32>,
    g_lse: Vec<f32>,
    g_gathered: Vec<f32>,
}

impl<E: Element> Case<E> {
    /// `[n, h] × [v, h]` with `k` candidates per row: tile edges (0, 2047, 2048, V-1),
    /// the target, repeats, and ids anywhere; masked rows hold out-of-range ids (never
    /// read). `logit_scale` multiplies the weight (extreme logits).
    fn new((n, h, v, k): (usize, usize, usize, usize), temperature: f64, logit_scale: f32) -> Self {
        let mut head = Head::<E>::random(n, h, v, true, (n * 31 + v) as u64);
        for w in head.weight.iter_mut() {
            *w = E::from_f32(w.to_f32() * logit_scale);
        }
        let wt = (0..h)
            .flat_map(|c| (0..v).map(move |j| (j, c)))
            .map(|(j, c)| head.weight[j * h + c])
            .collect();
        let targets: Vec<i64> = (0..n as i64).map(|i| (i * 977 + 11) % v as i64).collect();
        let mask: Vec<bool> = (0..n).map(|i| n < 3 || i % 4 != 2).collect();
        let edges = [0, 2047, 2048, v as i64 - 1];
        let ids = (0..n)
            .flat_map(|i| {
                let targets = &targets;
                let mask = &mask;
                (0..k).map(move |kk| match (mask[i], kk % 5) {
                    (false, _) => -7,
                    (_, 0) => targets[i],
                    (_, 1) => edges[(i + kk) % 4].min(v as i64 - 1),
                    (_, 2) if kk > 2 => targets[i],
                    _ => ((i * 131 + kk * 4099) % v) as i64,
                })
            })
            .collect();
        let wave =
            |a: f32, b: f32, m: usize| (0..m).map(move |i| a + b * ((i * 7 % 11) as f32 - 5.0));
        Case {
            head,
            wt,
            targets,
            mask,
            k,
            ids,
            temperature,
            g_logp: wave(0.3, 0.1, n).collect(),
            g_entropy: wave(-0.1, 0.05, n).collect(),
            g_lse: wave(0.2, -0.07, n).collect(),
            g_gathered: wave(0.1, 0.03, n * k).collect(),
        }
    }

    fn inputs(&self, layout: WeightLayout) -> LinearInputs<'_, E> {
        match layout {
            WeightLayout::VocabMajor => self.head.inputs(),
            WeightLayout::HiddenMajor => LinearInputs {
                weight: &self.wt,
                layout,
                ..self.head.inputs()
            },
        }
    }

    fn rows(&self) -> LogpRows<'_> {
        LogpRows {
            targets: &self.targets,
            mask: Some(&self.mask),
            temperature: Temperature::new(self.temperature).unwrap(),
        }
    }

    fn request(&self, sum_p2: bool, gather: bool) -> LogpRequest<'_> {
        LogpRequest {
            sum_p2,
            gather_ids: gather.then_some(GatherIds {
                ids: &self.ids,
                k: self.k,
            }),
            support: None,
        }
    }

    fn upstream(&self, gather: bool) -> LogpUpstream<'_> {
        LogpUpstream {
            logp: &self.g_logp,
            entropy: Some(&self.g_entropy),
            lse: Some(&self.g_lse),
            gathered: gather.then_some(&self.g_gathered[..]),
        }
    }

    /// The reference of the whole call (`grad_output` 0.75).
    fn reference(&self, gather: bool) -> (LogpReference, Vec<f64>) {
        let z = linear_logits(&self.head.inputs());
        let none: &[f32] = &[];
        let r = logp_reference(
            &z,
            self.head.v,
            LogpRefRows {
                targets: &self.targets,
                live: &self.mask,
                temperature: self.temperature,
                gather_ids: &self.ids,
                k: self.k,
            },
            LogpRefUpstream {
                logp: &self.g_logp,
                entropy: &self.g_entropy,
                lse: &self.g_lse,
                gathered: if gather { &self.g_gathered } else { none },
                grad_output: 0.75,
            },
        );
        (r, z)
    }
}

/// `|got - want| ≤ rel·max(|want|, 1)` entry by entry.
fn assert_rel(name: &str, got: &[f32], want: &[f64], rel: f64) {
    assert_eq!(got.len(), want.len(), "{name}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g as f64 - w).abs() <= rel * w.abs().max(1.0),
            "{name}[{i}]: {g} vs {w}"
        );
    }
}

/// The forward outputs against the reference: statistics, max logit, `Σπ²`, the
/// candidates (an id equal to the target gives the target's `logp` bitwise), zeros on
/// masked rows.
fn check_outputs<E: Element>(case: &Case<E>, out: &LogpOutput, r: &LogpReference, what: &str) {
    let n = case.targets.len();
    let stat = |f: fn(&flashloss::RowStats) -> f32| out.stats.iter().map(f).collect::<Vec<_>>();
    assert_rel(&format!("{what} logp"), &stat(|s| s.logp), &r.logp, 1e-5);
    assert_rel(&format!("{what} lse"), &stat(|s| s.lse), &r.lse, 1e-5);
    assert_rel(
        &format!("{what} entropy"),
        &stat(|s| s.entropy),
        &r.entropy,
        1e-5,
    );
    assert_rel(&format!("{what} max"), &out.max_logit, &r.max_logit, 1e-6);
    if let Some(p2) = &out.sum_p2 {
        for (i, (&g, &w)) in p2.iter().zip(&r.sum_p2).enumerate() {
            let g = g as f64;
            assert!((g - w).abs() <= 1e-5 * w, "{what} sum_p2[{i}]: {g} vs {w}");
        }
    }
    if let Some(got) = &out.gathered {
        assert_rel(&format!("{what} gathered"), got, &r.gathered, 1e-5);
        for i in (0..n).filter(|&i| case.mask[i]) {
            for kk in (0..case.k).filter(|&kk| case.ids[i * case.k + kk] == case.targets[i]) {
                let g = got[i * case.k + kk];
                assert_eq!(g, out.stats[i].logp, "{what}: [{i}, {kk}] is the target");
            }
        }
        for i in (0..n).filter(|&i| !case.mask[i]) {
            assert!(got[i * case.k..(i + 1) * case.k].iter().all(|&x| x == 0.0));
        }
    }
    for i in (0..n).filter(|&i| !case.mask[i]) {
        let p2 = out.sum_p2.as_ref().map_or(0.0, |p| p[i]);
        assert_eq!(
            (out.max_logit[i], out.stats[i].lse, p2),
            (0.0, 0.0, 0.0),
            "{what}: masked {i}"
        );
    }
}

fn paths<E: Element>() -> Vec<Bf16Products> {
    match (E::DTYPE, flashloss::cpu::Avx512Bf16::detect()) {
        (DType::F32, _) => vec![Bf16Products::Auto],
        (_, Some(_)) => vec![Bf16Products::Widened, Bf16Products::Avx512Bf16],
        (_, None) => vec![Bf16Products::Widened],
    }
}

/// A budget of `mib` beyond the GEMM reserve.
fn budget(mib: f64) -> f64 {
    flashloss::cpu::gemm_reserve_bytes() as f64 / (1 << 20) as f64 + mib
}

/// Forward and gradient calls of one case on every layout, mode, budget, product path
/// and head gradient, against the reference.
fn check_case<E: Element>(shape: (usize, usize, usize, usize), temperature: f64, scale: f32) {
    let case = Case::<E>::new(shape, temperature, scale);
    let (n, h) = (shape.0, shape.1);
    let device = Device::cpu();
    let tag = format!("{:?} {shape:?} T={temperature} scale={scale}", E::DTYPE);
    for gather in [false, true] {
        let (r, z) = case.reference(gather);
        let (dh, dw, db) = linear_grads(&case.head.inputs(), &r.dlogits);
        drop(z);
        for layout in [WeightLayout::VocabMajor, WeightLayout::HiddenMajor] {
            let inputs = case.inputs(layout);
            let request = case.request(true, gather);
            for mib in [0.3, 64.0] {
                let out = device
                    .logprobs(
                        HeadArgs::host(&inputs),
                        LogpCall::forward(
                            case.rows(),
                            &FusedOptions::forward((budget(mib) * 1048576.0) as usize),
                            n,
                        )
                        .request(&request),
                    )
                    .unwrap();
                check_outputs(
                    &case,
                    &out,
                    &r,
                    &format!("{tag} forward {layout:?} {mib} MiB"),
                );
            }
            // Gradients with candidates run single-pass too (single and compact force it).
            let modes = [Mode::Auto, Mode::TwoPass, Mode::SinglePass, Mode::Compact];
            for (products, &mode) in paths::<E>()
                .into_iter()
                .flat_map(|p| modes.iter().map(move |m| (p, m)))
            {
                // 0.1 MiB: blocks of a few rows; 0.4 MiB: one block; 64 MiB: roomy.
                let budgets = [
                    (HeadGrad::Full, 0.1),
                    (HeadGrad::Full, 0.4),
                    (HeadGrad::Frozen, 64.0),
                ];
                for (head_grad, mib) in budgets {
                    let o = FusedOptions {
                        bf16_products: products,
                        head_grad,
                        grad_output: 0.75,
                        ..FusedOptions::from_mib(mode, budget(mib), 1.0)
                    };
                    let mut grads = LinearGrads::zeros_for(&inputs, head_grad);
                    // Poison the masked rows' dH: they must stay as they were.
                    let masked: Vec<usize> = (0..n).filter(|&i| !case.mask[i]).collect();
                    for &i in &masked {
                        grads.dhidden[i * h..(i + 1) * h].fill(7.0);
                    }
                    let args = HeadArgs::Host {
                        inputs: &inputs,
                        grads: grads.view(),
                    };
                    let what = format!(
                        "{tag} gather={gather} {layout:?} {products:?} {mode:?} {head_grad:?}"
                    );
                    let out = device
                        .logprobs(
                            args,
                            LogpCall::grads(case.rows(), case.upstream(gather), &o, n)
                                .request(&case.request(true, gather)),
                        )
                        .unwrap_or_else(|e| panic!("{what}: {e}"));
                    check_outputs(&case, &out, &r, &what);
                    for &i in &masked {
                        assert!(
                            grads.dhidden[i * h..(i + 1) * h].iter().all(|&x| x == 7.0),
                            "{what}: masked row {i}"
                        );
                        grads.dhidden[i * h..(i + 1) * h].fill(0.0);
                    }
                    let tol = match (E::DTYPE, mode) {
                        (DType::F32, Mode::Compact | Mode::Auto) => COMPACT_GRAD_TOL,
                        (DType::F32, _) => 1e-4,
                        _ => 1e-2,
                    };
                    assert_close(&format!("{what} dH"), &grads.dhidden, &dh, tol);
                    match head_grad {
                        HeadGrad::Full => {
                            let dw_want = match layout {
                                WeightLayout::VocabMajor => dw.clone(),
                                WeightLayout::HiddenMajor => transpose(&dw, shape.2, h),
                            };
                            assert_close(&format!("{what} dW"), &grads.dweight, &dw_want, tol);
                            assert_close(
                                &format!("{what} dbias"),
                                grads.dbias.as_ref().unwrap(),
                                &db,
                                tol,
                            );
                        }
                        HeadGrad::Frozen => {
                            assert!(grads.dweight.is_empty() && grads.dbias.is_none())
                        }
                    }
                }
            }
        }
    }
}

/// `[rows, cols]` → `[cols, rows]`.
fn transpose(x: &[f64], rows: usize, cols: usize) -> Vec<f64> {
    (0..cols)
        .flat_map(|c| (0..rows).map(move |r| x[r * cols + c]))
        .collect()
}

#[test]
fn f32_odd_shapes_match_the_reference() {
    check_case::<f32>((7, 13, 2500, 5), 0.7, 1.0);
    check_case::<f32>((1, 5, 3, 1), 1.0, 1.0);
    check_case::<f32>((9, 11, 4099, 9), 1.3, 1.0);
}

#[test]
fn bf16_matches_the_reference() {
    check_case::<bf16>((6, 16, 2300, 4), 0.9, 1.0);
}

#[test]
fn extreme_logits_and_small_temperatures() {
    // Logits of std ~30 at T = 0.05: rows nearly one-hot (Σπ² ≈ 1, candidates far below).
    check_case::<f32>((5, 8, 2100, 3), 0.05, 30.0);
    // Flat rows: Σπ² ≈ 1/V.
    check_case::<f32>((4, 8, 2100, 2), 50.0, 0.01);
}
