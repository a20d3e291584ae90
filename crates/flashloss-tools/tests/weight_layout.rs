//! An `[H, V]` weight (`WeightLayout::HiddenMajor`, a Flax kernel) read as it lies:
//! GRPO and CE on `Wᵀ` equal the `[V, H]` run on `W` within f32 rounding (dW transposed)
//! and the f64 reference (dW in `[H, V]`), f32 and bf16 on every product path this CPU
//! has, every mode, odd shapes, a ragged last vocabulary tile over several tiles (both
//! lanes of a single-pass block), masked and ignored rows; the baseline; vocab-parallel
//! shards `[H, V_r]`; shape errors name `weight` and `dweight` in the layout.

use crate::common;
use common::cpu_steps::{VocabShard, ce_linear_into, grpo_linear, grpo_linear_vocab_parallel};
use common::*;
use flashloss::collective::{Collective, run_in_process};
use flashloss::cpu::{Workspace, grpo_linear_baseline};
use flashloss::policy::Normalizers;
use flashloss::reference::{ce_reference, grpo_reference, linear_grads, linear_logits};
use flashloss::{
    Bf16Products, CeConfig, CrossEntropy, Element, FusedOptions, GrpoLoss, GrpoLossConfig,
    LinearGrads, LinearInputs, LossType, Mode, Plan, Reduction, WeightLayout, shard_range,
};
use half::bf16;
use std::time::Duration;

/// `head`'s weight `[V, H]` as `[H, V]`.
fn transposed<E: Copy>(head: &Head<E>) -> Vec<E> {
    let (v, h) = (head.v, head.h);
    (0..h)
        .flat_map(|k| (0..v).map(move |j| head.weight[j * h + k]))
        .collect()
}

/// `head` with its weight `wt` `[H, V]`.
fn hidden_major<'a, E: Element>(head: &'a Head<E>, wt: &'a [E]) -> LinearInputs<'a, E> {
    LinearInputs {
        weight: wt,
        layout: WeightLayout::HiddenMajor,
        ..head.inputs()
    }
}

/// The product paths of `E` on this CPU: f32's own, or bf16 widened and (with
/// AVX512-BF16) on `vdpbf16ps`.
fn paths<E: Element>() -> Vec<Bf16Products> {
    if E::DTYPE == flashloss::DType::F32 {
        return vec![Bf16Products::Auto];
    }
    let mut paths = vec![Bf16Products::Widened];
    match flashloss::cpu::Avx512Bf16::detect() {
        Some(_) => paths.push(Bf16Products::Avx512Bf16),
        None => eprintln!("skipped: bf16 products on avx512bf16 (this CPU has no AVX512-BF16)"),
    }
    paths
}

/// `max|a - b| ≤ rel·max|b|` (and whether they are bitwise equal, printed).
fn assert_near(case: &str, a: &[f32], b: &[f32], rel: f32) {
    assert_eq!(a.len(), b.len(), "{case}: length");
    let scale = b.iter().fold(0.0f32, |m, x| m.max(x.abs())).max(1e-30);
    let err = a
        .iter()
        .zip(b)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(err <= rel * scale, "{case}: max error {err:e} of {scale:e}");
}

/// The `[H, V]` run's gradients against the `[V, H]` run's within `rel` of the largest
/// entry: dH and dbias alike, dW transposed. Returns whether every entry is bitwise
/// equal.
fn assert_layouts_agree(
    case: &str,
    vh: &LinearGrads,
    hv: &LinearGrads,
    (v, h): (usize, usize),
    rel: f32,
) -> bool {
    let dw_t: Vec<f32> = (0..h)
        .flat_map(|k| (0..v).map(move |j| vh.dweight[j * h + k]))
        .collect();
    assert_near(&format!("{case} dH"), &hv.dhidden, &vh.dhidden, rel);
    assert_near(&format!("{case} dW"), &hv.dweight, &dw_t, rel);
    assert_eq!(
        hv.dbias.is_some(),
        vh.dbias.is_some(),
        "{case}: dbias presence"
    );
    if let (Some(a), Some(b)) = (&hv.dbias, &vh.dbias) {
        assert_near(&format!("{case} dbias"), a, b, rel);
    }
    hv.dhidden == vh.dhidden && hv.dweight == dw_t && hv.dbias == vh.dbias
}

/// How close the two layouts' runs must be: within f32 rounding on the same blocks and
/// tiles. An `[H, V]` single-pass lane also holds its tile's dW, so at a small budget
/// its blocks can hold fewer rows (auto can take another mode, its tiles be narrower):
/// then the reference gate.
fn layout_tol<E: Element>(case: &str, mode: Mode, vh: &Plan, hv: &Plan) -> f32 {
    let kind = |p: &Plan| (p.single_pass, p.compact, p.bf16_products);
    let blocks = |p: &Plan| (kind(p), p.block_rows, p.vocab_tile);
    if mode != Mode::Auto {
        assert_eq!(kind(hv), kind(vh), "{case}: the plans' kind");
    }
    eprintln!(
        "{case}: [H, V] plan {:?}, [V, H] {:?}",
        blocks(hv),
        blocks(vh)
    );
    match blocks(hv) == blocks(vh) {
        true => 1e-5,
        false => grad_tol::<E>(hv.compact || vh.compact) as f32,
    }
}

/// The gradient gate against the reference (of the largest reference entry).
fn grad_tol<E: Element>(compact: bool) -> f64 {
    match (E::DTYPE, compact) {
        (flashloss::DType::F32, true) => COMPACT_GRAD_TOL,
        (flashloss::DType::F32, false) => 1e-4,
        _ => 1e-2,
    }
}

/// GRPO (token-level DAPO with KL and entropy terms) at `[B, T, H, V]` in `mode`: the
/// `[H, V]` run against the `[V, H]` one and the reference.
fn check_grpo<E: Element>(shape: (usize, usize, usize, usize), bias: bool, mode: Mode, seed: u64) {
    let (b, t, h, v) = shape;
    let loss = GrpoLoss::new(GrpoLossConfig {
        loss_type: LossType::Dapo,
        beta: 0.04,
        entropy_coef: 0.01,
        temperature: 0.9,
        ..Default::default()
    })
    .unwrap();
    let head = Head::<E>::random(b * t, h, v, bias, seed);
    let wt = transposed(&head);
    let hv_inputs = hidden_major(&head, &wt);
    let mut x = draw(b, t, v, seed + 100);
    x.data.mask[1] = false;
    let z = linear_logits(&head.inputs());
    assert_eq!(
        z,
        linear_logits(&hv_inputs),
        "the reference's logits in both layouts"
    );
    x.follow_policy(&z, 0.9);
    let batch = x.batch();
    let r = grpo_reference(&loss, &batch, Normalizers::local(&batch), &z, v, 0.75);
    let (dh, dw, db) = linear_grads(&hv_inputs, &r.dlogits);
    for products in paths::<E>() {
        let opts = FusedOptions {
            bf16_products: products,
            mode,
            budget_bytes: Some(flashloss::cpu::gemm_reserve_bytes() + (2 << 20)),
            grad_output: 0.75,
            head_grad: Default::default(),
        };
        let case = format!(
            "grpo {:?} {products:?} {mode:?} [B={b},T={t},H={h},V={v}] bias={bias}",
            E::DTYPE
        );
        let vh = grpo_linear(&loss, &batch, &head.inputs(), &opts)
            .unwrap_or_else(|e| panic!("{case}: {e}"));
        let hv =
            grpo_linear(&loss, &batch, &hv_inputs, &opts).unwrap_or_else(|e| panic!("{case}: {e}"));
        let rel = layout_tol::<E>(&case, mode, &vh.plan, &hv.plan);
        assert!(
            (hv.loss - vh.loss).abs() <= 1e-6 * vh.loss.abs().max(1.0),
            "{case}: loss"
        );
        let bitwise = assert_layouts_agree(&case, &vh.grads, &hv.grads, (v, h), rel);
        eprintln!("{case}: layouts bitwise equal: {bitwise}");
        let tol = if E::DTYPE == flashloss::DType::F32 {
            1e-5
        } else {
            1e-3
        };
        assert!(
            (hv.loss - r.loss).abs() <= tol * r.loss.abs().max(1.0),
            "{case}: loss vs reference"
        );
        let g = &hv.grads;
        let gate = grad_tol::<E>(hv.plan.compact);
        assert_close(&format!("{case} dH vs reference"), &g.dhidden, &dh, gate);
        assert_close(
            &format!("{case} dW [H, V] vs reference"),
            &g.dweight,
            &dw,
            gate,
        );
        if let Some(got) = &g.dbias {
            assert_close(&format!("{case} dbias vs reference"), got, &db, gate);
        }
    }
}

/// CE with every option (ignored rows, label smoothing, z-loss, soft-cap, temperature)
/// at `[N, H, V]` in `mode`, reduction `reduction`.
fn check_ce<E: Element>(shape: (usize, usize, usize), reduction: Reduction, mode: Mode, seed: u64) {
    let (n, h, v) = shape;
    let cfg = CeConfig {
        ignore_index: -100,
        label_smoothing: 0.1,
        z_loss: 1e-3,
        softcap: Some(3.0),
        reduction,
        temperature: 0.8,
    };
    let ce = CrossEntropy::new(cfg).unwrap();
    let head = Head::<E>::random(n, h, v, true, seed);
    let wt = transposed(&head);
    let hv_inputs = hidden_major(&head, &wt);
    let y: Vec<i64> = (0..n)
        .map(|i| {
            if i % 4 == 3 {
                -100
            } else {
                ((i * 7919 + 13) % v) as i64
            }
        })
        .collect();
    let grad_rows: Option<Vec<f32>> = (reduction == Reduction::None)
        .then(|| (0..n).map(|i| 0.5 + (i % 3) as f32 * 0.25).collect());
    let z = linear_logits(&hv_inputs);
    let r = ce_reference(&ce, &y, &z, v, 0.75, grad_rows.as_deref());
    let (dh, dw, db) = linear_grads(&hv_inputs, &r.dlogits);
    for products in paths::<E>() {
        let opts = FusedOptions {
            bf16_products: products,
            mode,
            budget_bytes: Some(flashloss::cpu::gemm_reserve_bytes() + (2 << 20)),
            grad_output: 0.75,
            head_grad: Default::default(),
        };
        let case = format!(
            "ce {:?} {products:?} {mode:?} {reduction:?} [N={n},H={h},V={v}]",
            E::DTYPE
        );
        let run = |inputs: &LinearInputs<E>| {
            let mut grads = LinearGrads::zeros(inputs);
            let out = ce_linear_into(
                &ce,
                &y,
                grad_rows.as_deref(),
                inputs,
                &opts,
                &mut Workspace::new(),
                &mut grads,
            )
            .unwrap_or_else(|e| panic!("{case}: {e}"));
            (out, grads)
        };
        let ((vh, vh_grads), (hv, hv_grads)) = (run(&head.inputs()), run(&hv_inputs));
        let rel = layout_tol::<E>(&case, mode, &vh.plan, &hv.plan);
        assert!(
            (hv.loss - vh.loss).abs() <= 1e-6 * vh.loss.abs().max(1.0),
            "{case}: loss"
        );
        let bitwise = assert_layouts_agree(&case, &vh_grads, &hv_grads, (v, h), rel);
        eprintln!("{case}: layouts bitwise equal: {bitwise}");
        let tol = if E::DTYPE == flashloss::DType::F32 {
            1e-5
        } else {
            1e-3
        };
        assert!(
            (hv.loss - r.loss).abs() <= tol * r.loss.abs().max(1.0),
            "{case}: loss vs reference"
        );
        let gate = grad_tol::<E>(hv.plan.compact);
        assert_close(
            &format!("{case} dH vs reference"),
            &hv_grads.dhidden,
            &dh,
            gate,
        );
        assert_close(
            &format!("{case} dW [H, V] vs reference"),
            &hv_grads.dweight,
            &dw,
            gate,
        );
        assert_close(
            &format!("{case} dbias vs reference"),
            hv_grads.dbias.as_ref().unwrap(),
            &db,
            gate,
        );
    }
}

const MODES: [Mode; 4] = [Mode::Auto, Mode::TwoPass, Mode::SinglePass, Mode::Compact];

#[test]
fn grpo_f32_every_mode_both_layouts() {
    for mode in MODES {
        // Three vocabulary tiles (the last 77 wide), several row blocks.
        check_grpo::<f32>((4, 30, 40, 2 * 2048 + 77), true, mode, 1);
        check_grpo::<f32>((1, 3, 19, 301), false, mode, 2);
    }
}

#[test]
fn grpo_bf16_every_product_path_and_mode_both_layouts() {
    for mode in MODES {
        check_grpo::<bf16>((3, 20, 45, 2 * 2048 + 77), true, mode, 3);
        check_grpo::<bf16>((1, 2, 33, 129), false, mode, 4);
    }
}

#[test]
fn ce_f32_and_bf16_every_mode_both_layouts() {
    for mode in MODES {
        check_ce::<f32>((90, 37, 2 * 2048 + 77), Reduction::Mean, mode, 5);
        check_ce::<f32>((5, 19, 301), Reduction::None, mode, 6);
        check_ce::<bf16>((60, 45, 2 * 2048 + 77), Reduction::Sum, mode, 7);
    }
}

/// One row, `H = 2`, `V = 3`, CE without options: `dW[k, j] = (p_j - [j = y])·h_k` at
/// `k·V + j`.
#[test]
fn dweight_comes_back_hidden_major() {
    let hidden = [1.0f32, -2.0];
    // W as [H, V]: W[j, k] at k·3 + j.
    let wt = [0.5f32, -1.0, 0.25, 2.0, 0.0, -0.5];
    let inputs = LinearInputs {
        hidden: &hidden,
        weight: &wt,
        layout: WeightLayout::HiddenMajor,
        bias: None,
        tokens: 1,
        hidden_size: 2,
        vocab: 3,
    };
    let ce = CrossEntropy::new(CeConfig::default()).unwrap();
    let opts = FusedOptions::default();
    let mut grads = LinearGrads::zeros(&inputs);
    ce_linear_into(
        &ce,
        &[2],
        None,
        &inputs,
        &opts,
        &mut Workspace::new(),
        &mut grads,
    )
    .unwrap();
    let z: Vec<f64> = (0..3)
        .map(|j| {
            (0..2)
                .map(|k| hidden[k] as f64 * wt[k * 3 + j] as f64)
                .sum()
        })
        .collect();
    let lse = z.iter().map(|x| x.exp()).sum::<f64>().ln();
    for (k, &x) in hidden.iter().enumerate() {
        for (j, &zj) in z.iter().enumerate() {
            let dz = (zj - lse).exp() - (j == 2) as u8 as f64;
            let want = dz * x as f64;
            let got = grads.dweight[k * 3 + j] as f64;
            assert!(
                (got - want).abs() < 1e-6,
                "dW[{k}, {j}] = {got}, want {want}"
            );
        }
    }
}

#[test]
fn baseline_reads_hidden_major() {
    let loss = GrpoLoss::new(GrpoLossConfig {
        beta: 0.04,
        loss_type: LossType::Grpo,
        ..GrpoLossConfig::default()
    })
    .unwrap();
    let head = Head::<bf16>::random(2 * 6, 23, 1501, true, 11);
    let wt = transposed(&head);
    let mut x = draw(2, 6, 1501, 12);
    x.follow_policy(&linear_logits(&head.inputs()), 1.0);
    let (value, vh) = grpo_linear_baseline(&loss, &x.batch(), &head.inputs(), 1.0).unwrap();
    let (value_hv, hv) =
        grpo_linear_baseline(&loss, &x.batch(), &hidden_major(&head, &wt), 1.0).unwrap();
    assert!((value - value_hv).abs() <= 1e-6 * value.abs().max(1.0));
    assert_layouts_agree("baseline", &vh, &hv, (1501, 23), 1e-5);
}

/// Vocab-parallel shards `[H, V_r]` (each rank's columns of `Wᵀ`, its own buffer, as a
/// Flax kernel sharded along V is) against the one-rank `[V, H]` run.
#[test]
fn vocab_parallel_hidden_major_shards_match_one_rank() {
    let (b, t, h, v) = (3, 5, 29, 1031);
    let loss = GrpoLoss::new(GrpoLossConfig {
        beta: 0.04,
        entropy_coef: 0.01,
        ..Default::default()
    })
    .unwrap();
    let head = Head::<f32>::random(b * t, h, v, true, 31);
    let mut x = draw(b, t, v, 32);
    x.follow_policy(&linear_logits(&head.inputs()), 1.0);
    let opts = FusedOptions {
        mode: Mode::TwoPass,
        budget_bytes: Some(flashloss::cpu::gemm_reserve_bytes() + (1 << 20)),
        ..FusedOptions::default()
    };
    let one = grpo_linear(&loss, &x.batch(), &head.inputs(), &opts).unwrap();
    for p in [2, 3] {
        let results = run_in_process(p, Duration::from_secs(60), |comm| {
            let range = shard_range(v, comm.world_size(), comm.rank());
            let part = head.vocab_shard(range.clone());
            let wt = transposed(&part);
            let shard = VocabShard {
                inputs: hidden_major(&part, &wt),
                offset: range.start,
                vocab: v,
            };
            let out = grpo_linear_vocab_parallel(comm, &loss, &x.batch(), &shard, &opts)?;
            Ok((range, out))
        });
        for (rank, r) in results.into_iter().enumerate() {
            let (range, out) = r.unwrap();
            let case = format!("vocab P={p} rank {rank}");
            assert!(
                (out.loss - one.loss).abs() <= 1e-6 * one.loss.abs().max(1.0),
                "{case}: loss"
            );
            let part = LinearGrads {
                dhidden: one.grads.dhidden.clone(),
                dweight: one.grads.dweight[range.start * h..range.end * h].to_vec(),
                dbias: one.grads.dbias.as_ref().map(|d| d[range.clone()].to_vec()),
            };
            assert_layouts_agree(&case, &part, &out.grads, (range.len(), h), 1e-5);
        }
    }
}

#[test]
fn shape_errors_name_the_weight_in_its_layout() {
    let head = Head::<f32>::random(4, 8, 50, false, 13);
    let wt = transposed(&head);
    let short = LinearInputs {
        weight: &wt[..wt.len() - 1],
        ..hidden_major(&head, &wt)
    };
    let err = short.validate().unwrap_err().to_string();
    assert!(
        err.starts_with("argument `weight`: expected 400 elements for shape [H=8, V=50]"),
        "{err}"
    );
    let inputs = hidden_major(&head, &wt);
    let mut grads = LinearGrads::zeros(&inputs);
    grads.dweight.pop();
    let err = grads
        .check(&inputs, Default::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("argument `dweight`: expected 400 elements for shape [H=8, V=50]"),
        "{err}"
    );
    assert_eq!(
        WeightLayout::from_name("hv").unwrap(),
        WeightLayout::HiddenMajor
    );
    let err = WeightLayout::from_name("kernel").unwrap_err().to_string();
    assert!(err.starts_with("argument `weight_layout`"), "{err}");
}
