//! The pass hooks of `FusedPasses` on the CPU: a `TileVisitor` sees every live row's
//! logits (after bias and soft-cap, before 1/T) exactly once, in pass A
//! (`row_states_visiting`, whose states equal `row_states`') and in `visit_tiles`; the
//! sparse terms of `accumulate_grads_sparse` equal the same one-hot terms given as
//! `RowGrad::coef_target` (bitwise), repeats add up, and ids of other shards add nothing.

use crate::common;
use common::*;
use flashloss::cpu::{CpuHead, Workspace};
use flashloss::fused::{Head as _, RowGrad, SparseGrads, TileVisitor};
use flashloss::reference::linear_logits;
use flashloss::rows::{RowInputs, RowTransform};
use flashloss::{FusedOptions, HeadGrad, LinearGrads, Mode, Temperature};
use std::ops::Range;

/// Copies each tile it sees into a dense `[N, V]` matrix, counting visits per entry.
struct Dense {
    v: usize,
    z: Vec<f32>,
    seen: Vec<u32>,
}

impl TileVisitor for Dense {
    fn visit(&mut self, rows: &[usize], vocab: Range<usize>, z: &[f32], ld: usize) {
        for (r, &i) in rows.iter().enumerate() {
            for (c, j) in vocab.clone().enumerate() {
                self.z[i * self.v + j] = z[r * ld + c];
                self.seen[i * self.v + j] += 1;
            }
        }
    }
}

fn transform(softcap: Option<f32>) -> RowTransform {
    RowTransform {
        softcap,
        ..RowTransform::with_temperature(Temperature::new(0.8).unwrap())
    }
}

fn two_pass(budget_mib: f64) -> FusedOptions {
    FusedOptions::from_mib(Mode::TwoPass, budget_mib, 1.0)
}

#[test]
fn visitor_sees_every_live_logit_once() {
    let (n, h, v) = (7, 13, 2500);
    let head = Head::<f32>::random(n, h, v, true, 5);
    let inputs = head.inputs();
    let z_ref = linear_logits(&inputs);
    let targets: Vec<i64> = (0..n as i64).map(|i| i * 301 % v as i64).collect();
    let live: Vec<bool> = (0..n).map(|i| i != 2 && i != 5).collect();
    let budget = flashloss::cpu::gemm_reserve_bytes() as f64 / (1 << 20) as f64 + 0.2;
    for softcap in [None, Some(3.0f32)] {
        let rows = RowInputs {
            targets: &targets,
            live: &live,
            transform: transform(softcap),
        };
        let mut ws = Workspace::new();
        let mut grads = LinearGrads::zeros_for(&inputs, HeadGrad::Full);
        let mut cpu = CpuHead {
            inputs: &inputs,
            ws: &mut ws,
            grads: grads.view(),
        };
        let plan = cpu.plan(&two_pass(budget), false).unwrap();
        assert!(!plan.single_pass && plan.vocab_tile < v, "{plan:?}");
        let mut passes = cpu.passes(rows, plan).unwrap();
        let plain = passes.row_states().unwrap();
        for extra_pass in [false, true] {
            let mut dense = Dense {
                v,
                z: vec![f32::NAN; n * v],
                seen: vec![0; n * v],
            };
            if extra_pass {
                passes.visit_tiles(&mut dense).unwrap();
            } else {
                assert_eq!(passes.row_states_visiting(&mut dense).unwrap(), plain);
            }
            let case = format!("softcap {softcap:?} extra pass {extra_pass}");
            for i in 0..n {
                for j in 0..v {
                    let (got, seen) = (dense.z[i * v + j], dense.seen[i * v + j]);
                    if !live[i] {
                        assert!(seen == 0 && got.is_nan(), "{case}: masked row {i}");
                        continue;
                    }
                    let zz = z_ref[i * v + j];
                    let want = softcap.map_or(zz, |c| c as f64 * (zz / c as f64).tanh());
                    assert_eq!(seen, 1, "{case}: ({i}, {j}) seen {seen} times");
                    assert!(
                        (got as f64 - want).abs() <= 1e-5 * want.abs().max(1.0),
                        "{case}: ({i}, {j}) {got} vs {want}"
                    );
                }
            }
        }
    }
}

/// dH, dW and dbias of pass B with `grads` and optional sparse terms.
fn pass_b(
    head: &Head<f32>,
    rows: RowInputs,
    grads: &[RowGrad],
    sparse: Option<&SparseGrads>,
) -> LinearGrads {
    let inputs = head.inputs();
    let mut ws = Workspace::new();
    let mut out = LinearGrads::zeros_for(&inputs, HeadGrad::Full);
    let mut cpu = CpuHead {
        inputs: &inputs,
        ws: &mut ws,
        grads: out.view(),
    };
    let budget = flashloss::cpu::gemm_reserve_bytes() as f64 / (1 << 20) as f64 + 0.3;
    let plan = cpu.plan(&two_pass(budget), false).unwrap();
    let mut passes = cpu.passes(rows, plan).unwrap();
    match sparse {
        Some(s) => passes.accumulate_grads_sparse(grads, s).unwrap(),
        None => passes.accumulate_grads(grads).unwrap(),
    }
    drop(passes);
    out
}

#[test]
fn sparse_terms_equal_target_terms() {
    let (n, h, v) = (6, 11, 2300);
    let head = Head::<f32>::random(n, h, v, true, 9);
    let targets: Vec<i64> = (0..n as i64).map(|i| (i * 397 + 3) % v as i64).collect();
    let live = vec![true; n];
    for softcap in [None, Some(2.5f32)] {
        let rows = RowInputs {
            targets: &targets,
            live: &live,
            transform: transform(softcap),
        };
        let mut ws = Workspace::new();
        let inputs = head.inputs();
        let mut scratch = LinearGrads::zeros_for(&inputs, HeadGrad::Full);
        let mut cpu = CpuHead {
            inputs: &inputs,
            ws: &mut ws,
            grads: scratch.view(),
        };
        let plan = cpu.plan(&two_pass(64.0), false).unwrap();
        let stats = cpu
            .passes(rows, plan)
            .unwrap()
            .row_states()
            .unwrap()
            .finish(&rows, v);
        let coef = |i: usize| 0.3 - 0.1 * i as f32;
        let with_target: Vec<RowGrad> = (0..n)
            .map(|i| RowGrad {
                stats: stats[i],
                coef_p: -coef(i),
                coef_target: coef(i),
                target: targets[i] as usize,
                ..RowGrad::default()
            })
            .collect();
        let without: Vec<RowGrad> = (with_target.iter())
            .map(|g| RowGrad {
                coef_target: 0.0,
                ..*g
            })
            .collect();
        // K = 3: the target, an id of another shard (-1), and a zero coefficient.
        let sparse = SparseGrads {
            k: 3,
            ids: (0..n).flat_map(|i| [targets[i], -1, 7]).collect(),
            coefs: (0..n).flat_map(|i| [coef(i), 5.0, 0.0]).collect(),
        };
        let want = pass_b(&head, rows, &with_target, None);
        let got = pass_b(&head, rows, &without, Some(&sparse));
        let case = format!("softcap {softcap:?}");
        assert_eq!(got.dhidden, want.dhidden, "{case} dH");
        assert_eq!(got.dweight, want.dweight, "{case} dW");
        assert_eq!(got.dbias, want.dbias, "{case} dbias");
        // A repeated id adds up: two halves equal the whole.
        let halves = SparseGrads {
            k: 2,
            ids: (0..n).flat_map(|i| [targets[i], targets[i]]).collect(),
            coefs: (0..n)
                .flat_map(|i| [coef(i) * 0.5, coef(i) * 0.5])
                .collect(),
        };
        let got = pass_b(&head, rows, &without, Some(&halves));
        assert_close(
            &format!("{case} dH halves"),
            &got.dhidden,
            &want.dhidden.iter().map(|&x| x as f64).collect::<Vec<_>>(),
            1e-6,
        );
        // A row with only sparse terms still gets its gradient.
        let zero = vec![RowGrad::default(); n];
        let only = pass_b(&head, rows, &zero, Some(&sparse));
        assert!(
            only.dhidden.iter().any(|&x| x != 0.0),
            "{case}: sparse only"
        );
        // Ids beyond the head are an error naming them.
        let bad = SparseGrads {
            k: 1,
            ids: vec![v as i64; n],
            coefs: vec![1.0; n],
        };
        let mut ws = Workspace::new();
        let mut out = LinearGrads::zeros_for(&inputs, HeadGrad::Full);
        let mut cpu = CpuHead {
            inputs: &inputs,
            ws: &mut ws,
            grads: out.view(),
        };
        let err = cpu
            .passes(rows, plan)
            .unwrap()
            .accumulate_grads_sparse(&without, &bad)
            .unwrap_err();
        assert!(err.to_string().contains("sparse ids"), "{err}");
    }
}
