//! A frozen head (`HeadGrad::Frozen`): GRPO and CE give the trainable head's loss and dH
//! (bitwise where both plans cut the same blocks, else within f32 rounding, and the f64
//! reference's dH) with no dW or dbias buffer, on every CPU mode, f32 and bf16 on each
//! product path, both weight layouts, with and without a bias, vocab-parallel too; the
//! planner leaves the dW bytes and FLOPs out; mismatched buffers are errors. The
//! log-prob gradient (`logp_linear_grads`) against central differences of the f64
//! log-softmax, full and frozen, every mode, sharded against one rank.

use crate::common;
use common::*;
use flashloss::collective::{Collective, run_in_process};
use flashloss::cpu::{CpuHead, Workspace};
use flashloss::device::{CeCall, GrpoCall, LogpCall};
use flashloss::fused::{self, LogpRows, LogpUpstream};
use flashloss::policy::Normalizers;
use flashloss::reference::{grpo_reference, linear_grads, linear_logits, row_softmax};
use flashloss::{
    Bf16Products, CeConfig, CrossEntropy, DType, Device, Element, FusedOptions, Grid, GrpoLoss,
    GrpoLossConfig, HeadArgs, HeadGrad, LinearGrads, LinearInputs, LossType, Mode, Shard,
    Temperature, WeightLayout, shard_range,
};
use half::bf16;
use std::time::Duration;

const MODES: [Mode; 4] = [Mode::SinglePass, Mode::TwoPass, Mode::Compact, Mode::Auto];

fn opts(mode: Mode, products: Bf16Products, head_grad: HeadGrad, budget_mib: f64) -> FusedOptions {
    FusedOptions {
        bf16_products: products,
        head_grad,
        grad_output: 0.75,
        ..FusedOptions::from_mib(mode, budget_mib, 1.0)
    }
}

/// The bf16 product paths this CPU has (f32: its own).
fn paths<E: Element>() -> Vec<Bf16Products> {
    match (E::DTYPE, flashloss::cpu::Avx512Bf16::detect()) {
        (flashloss::DType::F32, _) => vec![Bf16Products::Auto],
        (_, Some(_)) => vec![Bf16Products::Widened, Bf16Products::Avx512Bf16],
        (_, None) => vec![Bf16Products::Widened],
    }
}

/// `head`'s weight `[V, H]` as `[H, V]`.
fn transposed<E: Copy>(head: &Head<E>) -> Vec<E> {
    let (v, h) = (head.v, head.h);
    (0..h)
        .flat_map(|k| (0..v).map(move |j| head.weight[j * h + k]))
        .collect()
}

/// GRPO and CE, full against frozen, for one dtype, at `[B, T, H, V]` over several
/// vocabulary tiles (a ragged last one) with masked rows.
fn check_grpo_and_ce<E: Element>() {
    let (b, t, h, v) = (3, 5, 24, 4500);
    for bias in [false, true] {
        let head = Head::<E>::random(b * t, h, v, bias, 7);
        let wt = transposed(&head);
        let mut x = draw(b, t, v, 11);
        x.data.mask[4] = false;
        x.data.mask[9] = false;
        let loss = GrpoLoss::new(GrpoLossConfig {
            loss_type: LossType::Grpo,
            ..GrpoLossConfig::default()
        })
        .unwrap();
        let z = linear_logits(&head.inputs());
        x.follow_policy(&z, 1.0);
        let batch = x.batch();
        let r = grpo_reference(&loss, &batch, Normalizers::local(&batch), &z, v, 0.75);
        let (dh_ref, _, _) = linear_grads(&head.inputs(), &r.dlogits);
        let ce = CrossEntropy::new(CeConfig::default()).unwrap();
        let layouts = [
            head.inputs(),
            LinearInputs {
                weight: &wt,
                layout: WeightLayout::HiddenMajor,
                ..head.inputs()
            },
        ];
        for (inputs, products, mode) in layouts
            .iter()
            .flat_map(|i| paths::<E>().into_iter().map(move |p| (i, p)))
            .flat_map(|(i, p)| MODES.map(|m| (i, p, m)))
        {
            // 1.5 MiB beyond the reserve: blocks of a few rows, several per step.
            let budget = flashloss::cpu::gemm_reserve_bytes() as f64 / (1 << 20) as f64 + 1.5;
            let case = format!(
                "{:?} {:?} {products:?} {mode:?} bias={bias}",
                E::DTYPE,
                inputs.layout
            );
            let device = Device::cpu();
            let run = |head_grad| {
                let o = opts(mode, products, head_grad, budget);
                let grpo = device
                    .with_host_grads(inputs, GrpoCall::new(&loss, &batch, &o))
                    .unwrap();
                let ce = device
                    .with_host_grads(inputs, CeCall::new(&ce, batch.target_ids, &o))
                    .unwrap();
                (grpo, ce)
            };
            let (full, full_ce) = run(HeadGrad::Full);
            let (frozen, frozen_ce) = run(HeadGrad::Frozen);
            for (g, what) in [(&frozen.grads, "grpo"), (&frozen_ce.grads, "ce")] {
                assert!(
                    g.dweight.is_empty() && g.dbias.is_none(),
                    "{case} {what}: head grads"
                );
            }
            assert_eq!(frozen.plan.head_grad, HeadGrad::Frozen);
            assert_eq!(full.loss.to_bits(), frozen.loss.to_bits(), "{case}: loss");
            assert_eq!(
                full_ce.loss.to_bits(),
                frozen_ce.loss.to_bits(),
                "{case}: ce loss"
            );
            let same_blocks = |a: &flashloss::Plan, b: &flashloss::Plan| {
                (a.single_pass, a.compact, a.block_rows, a.vocab_tile)
                    == (b.single_pass, b.compact, b.block_rows, b.vocab_tile)
            };
            if same_blocks(&full.plan, &frozen.plan) {
                assert_eq!(
                    full.grads.dhidden, frozen.grads.dhidden,
                    "{case}: grpo dH bits"
                );
                assert_eq!(
                    full_ce.grads.dhidden, frozen_ce.grads.dhidden,
                    "{case}: ce dH bits"
                );
            } else {
                let near = |a: &[f32], b: &[f32]| {
                    let scale = a.iter().fold(0.0f32, |m, x| m.max(x.abs()));
                    a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 1e-5 * scale)
                };
                assert!(
                    near(&full.grads.dhidden, &frozen.grads.dhidden),
                    "{case}: grpo dH"
                );
                assert!(
                    near(&full_ce.grads.dhidden, &frozen_ce.grads.dhidden),
                    "{case}: ce dH"
                );
            }
            let tol = match (E::DTYPE, frozen.plan.compact) {
                (flashloss::DType::F32, false) => 1e-4,
                (flashloss::DType::F32, true) => COMPACT_GRAD_TOL,
                _ => 1e-2,
            };
            assert_close(
                &format!("{case} frozen dH"),
                &frozen.grads.dhidden,
                &dh_ref,
                tol,
            );
        }
    }
}

#[test]
fn frozen_head_f32_gives_the_trainable_loss_and_dh_without_dw() {
    check_grpo_and_ce::<f32>();
}

#[test]
fn frozen_head_bf16_on_each_product_path() {
    check_grpo_and_ce::<bf16>();
}

#[test]
fn planner_leaves_out_dw_bytes_and_flops() {
    let (n, h, v) = (2048, 1024, 151_936);
    for layout in [WeightLayout::VocabMajor, WeightLayout::HiddenMajor] {
        for dtype in [DType::F32, DType::Bf16] {
            let plan = |head_grad, mode| {
                let o = opts(mode, Bf16Products::Widened, head_grad, 160.0);
                flashloss::cpu::plan(n, h, v, (dtype, layout), &o, true).unwrap()
            };
            for mode in [Mode::SinglePass, Mode::TwoPass] {
                let (full, frozen) = (plan(HeadGrad::Full, mode), plan(HeadGrad::Frozen, mode));
                let case = format!("{layout:?} {dtype:?} {mode:?}");
                assert!(frozen.block_rows >= full.block_rows, "{case}: rows");
                let per_row = |p: &flashloss::Plan| p.workspace_bytes as f64 / p.block_rows as f64;
                // Fewer where the trainable plan holds dW-only buffers: the two-pass
                // `dZᵀ`, an `[H, V]` lane's dW tile (f32 `[V, H]` single-pass has none).
                let dw_only = mode == Mode::TwoPass || layout == WeightLayout::HiddenMajor;
                match dw_only {
                    true => assert!(per_row(&frozen) < per_row(&full), "{case}: bytes per row"),
                    false => assert!(per_row(&frozen) <= per_row(&full), "{case}: bytes per row"),
                }
                let nhv = (n * h * v) as f64;
                let (f, z) = (full.flops(n, h, v) / nhv, frozen.flops(n, h, v) / nhv);
                let want = if mode == Mode::SinglePass {
                    (6.0, 4.0)
                } else {
                    (8.0, 6.0)
                };
                assert_eq!((f, z), want, "{case}: FLOPs");
            }
        }
    }
}

#[test]
fn buffers_must_match_the_head_grad() {
    let head = Head::<f32>::random(4, 8, 50, true, 3);
    let inputs = head.inputs();
    let x = draw(1, 4, 50, 5);
    let loss = GrpoLoss::new(GrpoLossConfig {
        loss_type: LossType::Grpo,
        ..GrpoLossConfig::default()
    })
    .unwrap();
    let mut ws = Workspace::new();
    let mut run = |grads: &mut LinearGrads, head_grad| {
        let o = opts(Mode::Auto, Bf16Products::Auto, head_grad, 64.0);
        let head = &mut CpuHead {
            inputs: &inputs,
            ws: &mut ws,
            grads: grads.view(),
        };
        fused::grpo_linear(head, &loss, &x.batch(), Normalizers::local(&x.batch()), &o)
            .map(|_| ())
            .map_err(|e| e.to_string())
    };
    let mut full = LinearGrads::zeros(&inputs);
    let mut frozen = LinearGrads::zeros_for(&inputs, HeadGrad::Frozen);
    assert!(run(&mut full, HeadGrad::Full).is_ok());
    assert!(run(&mut frozen, HeadGrad::Frozen).is_ok());
    let err = run(&mut full, HeadGrad::Frozen).unwrap_err();
    assert!(err.contains("dweight") && err.contains("frozen"), "{err}");
    let err = run(&mut frozen, HeadGrad::Full).unwrap_err();
    assert!(err.contains("dweight"), "{err}");
    frozen.dbias = Some(vec![0.0; 50]);
    let err = run(&mut frozen, HeadGrad::Frozen).unwrap_err();
    assert!(err.contains("dbias") && err.contains("frozen"), "{err}");
}

#[test]
fn frozen_vocab_parallel_matches_one_rank() {
    let (b, t, h, v) = (2, 6, 16, 301);
    let head = Head::<f32>::random(b * t, h, v, true, 21);
    let x = draw(b, t, v, 22);
    let loss = GrpoLoss::new(GrpoLossConfig {
        loss_type: LossType::Grpo,
        ..GrpoLossConfig::default()
    })
    .unwrap();
    let o = opts(Mode::Auto, Bf16Products::Auto, HeadGrad::Frozen, 64.0);
    let one = Device::cpu()
        .with_host_grads(&head.inputs(), GrpoCall::new(&loss, &x.batch(), &o))
        .unwrap();
    for p in [2, 3] {
        let results = run_in_process(p, Duration::from_secs(60), |comm| {
            let range = shard_range(v, comm.world_size(), comm.rank());
            let part = head.vocab_shard(range.clone());
            let shard = Shard {
                offset: range.start,
                vocab: v,
            };
            let grid = Grid::vocab(comm);
            Device::cpu().with_host_grads(
                &part.inputs(),
                GrpoCall::new(&loss, &x.batch(), &o).sharded(&grid, shard),
            )
        });
        for (rank, r) in results.into_iter().enumerate() {
            let out = r.unwrap();
            let case = format!("P={p} rank {rank}");
            assert!(
                out.grads.dweight.is_empty() && out.grads.dbias.is_none(),
                "{case}"
            );
            assert!(
                (out.loss - one.loss).abs() <= 1e-6 * one.loss.abs().max(1.0),
                "{case}"
            );
            let want: Vec<f64> = one.grads.dhidden.iter().map(|&x| x as f64).collect();
            assert_close(&format!("{case} dH"), &out.grads.dhidden, &want, 1e-5);
        }
    }
}

/// `∂/∂z` of `Σ_i g_i·logp_i + e_i·H_i` of the f64 log-softmax of `z / T` `[N, V]` by
/// central differences (rows where `live` is false: zero).
fn logp_dlogits_fd(
    z: &[f64],
    v: usize,
    rows: (&[i64], &[bool], f64),
    up: (&[f32], &[f32]),
) -> Vec<f64> {
    let (targets, live, temp) = rows;
    let f = |row: &[f64], i: usize| {
        let s = row_softmax(row, temp);
        up.0[i] as f64 * s.log_probs[targets[i] as usize] + up.1[i] as f64 * s.entropy
    };
    let mut d = vec![0.0; z.len()];
    for i in (0..live.len()).filter(|&i| live[i]) {
        let mut row = z[i * v..(i + 1) * v].to_vec();
        for j in 0..v {
            let (x, step) = (row[j], 1e-5 * row[j].abs().max(1.0));
            row[j] = x + step;
            let hi = f(&row, i);
            row[j] = x - step;
            let lo = f(&row, i);
            row[j] = x;
            d[i * v + j] = (hi - lo) / (2.0 * step);
        }
    }
    d
}

/// The log-prob gradient, full and frozen, of `E` at temperature 0.7 with a mask.
fn check_logp_grads<E: Element>(bias: bool, layout: WeightLayout) {
    let (n, h, v) = (9, 16, 2100);
    let head = Head::<E>::random(n, h, v, bias, 31);
    let wt = transposed(&head);
    let inputs = match layout {
        WeightLayout::VocabMajor => head.inputs(),
        WeightLayout::HiddenMajor => LinearInputs {
            weight: &wt,
            layout,
            ..head.inputs()
        },
    };
    let targets: Vec<i64> = (0..n as i64).map(|i| (i * 211 + 5) % v as i64).collect();
    let mask: Vec<bool> = (0..n).map(|i| i != 3).collect();
    let g_logp: Vec<f32> = (0..n).map(|i| 0.5 - 0.1 * i as f32).collect();
    let g_entropy: Vec<f32> = (0..n).map(|i| 0.2 * (i % 3) as f32 - 0.1).collect();
    let temp = 0.7;
    let rows = LogpRows {
        targets: &targets,
        mask: Some(&mask),
        temperature: Temperature::new(temp).unwrap(),
    };
    let up = LogpUpstream::new(&g_logp, Some(&g_entropy));
    let z = linear_logits(&inputs);
    let mut dz = logp_dlogits_fd(&z, v, (&targets, &mask, temp), (&g_logp, &g_entropy));
    dz.iter_mut().for_each(|x| *x *= 0.75); // grad_output
    let (dh, dw, db) = linear_grads(&inputs, &dz);
    let stats_only = Device::cpu()
        .logprobs(
            HeadArgs::host(&inputs),
            LogpCall::forward(
                LogpRows {
                    targets: &targets,
                    mask: Some(&mask),
                    temperature: rows.temperature,
                },
                &FusedOptions::forward(64 << 20),
                n,
            ),
        )
        .map(|o| o.stats)
        .unwrap();
    for (products, mode) in paths::<E>().into_iter().flat_map(|p| MODES.map(|m| (p, m))) {
        for head_grad in [HeadGrad::Full, HeadGrad::Frozen] {
            let o = opts(mode, products, head_grad, 64.0);
            let mut grads = LinearGrads::zeros_for(&inputs, head_grad);
            // Poison the rows the mask leaves out: they must stay as they were.
            grads.dhidden[3 * h..4 * h].fill(7.0);
            let args = HeadArgs::Host {
                inputs: &inputs,
                grads: grads.view(),
            };
            let stats = Device::cpu()
                .logprobs(args, LogpCall::grads(rows, up, &o, n))
                .map(|o| o.stats)
                .unwrap();
            let case = format!(
                "{:?} {layout:?} bias={bias} {products:?} {mode:?} {head_grad:?}",
                E::DTYPE
            );
            assert!(
                grads.dhidden[3 * h..4 * h].iter().all(|&x| x == 7.0),
                "{case}: masked row"
            );
            grads.dhidden[3 * h..4 * h].fill(0.0);
            for i in 0..n {
                let (a, b) = (stats[i].logp, stats_only[i].logp);
                assert!(
                    (a - b).abs() <= 1e-5 * b.abs().max(1.0),
                    "{case}: logp row {i}"
                );
            }
            let tol = match (E::DTYPE, mode) {
                (flashloss::DType::F32, Mode::Compact | Mode::Auto) => COMPACT_GRAD_TOL,
                (flashloss::DType::F32, _) => 1e-4,
                _ => 1e-2,
            };
            assert_close(&format!("{case} dH"), &grads.dhidden, &dh, tol);
            match head_grad {
                HeadGrad::Full => {
                    assert_close(&format!("{case} dW"), &grads.dweight, &dw, tol);
                    if let Some(got) = &grads.dbias {
                        assert_close(&format!("{case} dbias"), got, &db, tol);
                    }
                }
                HeadGrad::Frozen => assert!(grads.dweight.is_empty() && grads.dbias.is_none()),
            }
        }
    }
}

#[test]
fn logp_grads_match_differences_of_the_f64_log_softmax() {
    for layout in [WeightLayout::VocabMajor, WeightLayout::HiddenMajor] {
        check_logp_grads::<f32>(true, layout);
        check_logp_grads::<bf16>(false, layout);
    }
}

#[test]
fn logp_grads_vocab_parallel_match_one_rank() {
    let (n, h, v) = (10, 12, 257);
    let head = Head::<f32>::random(n, h, v, true, 41);
    let targets: Vec<i64> = (0..n as i64).map(|i| (i * 37) % v as i64).collect();
    let g_logp: Vec<f32> = (0..n).map(|i| 1.0 - 0.15 * i as f32).collect();
    let rows = LogpRows {
        targets: &targets,
        mask: None,
        temperature: Temperature::new(1.3).unwrap(),
    };
    let up = LogpUpstream::new(&g_logp, None);
    for head_grad in [HeadGrad::Full, HeadGrad::Frozen] {
        let o = opts(Mode::Auto, Bf16Products::Auto, head_grad, 64.0);
        let mut one = LinearGrads::zeros_for(&head.inputs(), head_grad);
        let args = HeadArgs::Host {
            inputs: &head.inputs(),
            grads: one.view(),
        };
        Device::cpu()
            .logprobs(args, LogpCall::grads(rows, up, &o, n))
            .map(|o| o.stats)
            .unwrap();
        let results = run_in_process(3, Duration::from_secs(60), |comm| {
            let range = shard_range(v, comm.world_size(), comm.rank());
            let part = head.vocab_shard(range.clone());
            let inputs = part.inputs();
            let mut grads = LinearGrads::zeros_for(&inputs, head_grad);
            let args = HeadArgs::Host {
                inputs: &inputs,
                grads: grads.view(),
            };
            let shard = Shard {
                offset: range.start,
                vocab: v,
            };
            let device = Device::cpu();
            device
                .logprobs(
                    args,
                    LogpCall::grads(rows, up, &o, n).sharded(&Grid::vocab(comm), shard),
                )
                .map(|o| o.stats)?;
            Ok((range, grads))
        });
        let want = |x: &[f32]| x.iter().map(|&x| x as f64).collect::<Vec<_>>();
        for (rank, r) in results.into_iter().enumerate() {
            let (range, grads) = r.unwrap();
            let case = format!("{head_grad:?} rank {rank}");
            assert_close(
                &format!("{case} dH"),
                &grads.dhidden,
                &want(&one.dhidden),
                1e-5,
            );
            if head_grad == HeadGrad::Full {
                let dw = &one.dweight[range.start * h..range.end * h];
                assert_close(&format!("{case} dW"), &grads.dweight, &want(dw), 1e-5);
                let db = &one.dbias.as_ref().unwrap()[range];
                assert_close(
                    &format!("{case} dbias"),
                    grads.dbias.as_ref().unwrap(),
                    &want(db),
                    1e-5,
                );
            }
        }
    }
}
