//! The candle ops against the same losses written with candle's own ops: loss values
//! and the gradients that reach hidden states and the LM head.

use candle_core::{DType, Device, Tensor, Var};
use flashloss::{
    CeConfig, CrossEntropy, GrpoBatchData, GrpoLoss, GrpoLossConfig, LossType, PerSeqOrTokenBuf,
    Reduction,
};
use flashloss_candle::ops::{self, baseline};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn random(rng: &mut ChaCha8Rng, shape: (usize, usize), scale: f32) -> Var {
    let v: Vec<f32> = (0..shape.0 * shape.1)
        .map(|_| rng.random_range(-1.0..1.0) * scale)
        .collect();
    Var::from_tensor(&Tensor::from_vec(v, shape, &Device::Cpu).unwrap()).unwrap()
}

fn inputs(rng: &mut ChaCha8Rng, b: usize, t: usize, v: usize) -> GrpoBatchData {
    let n = b * t;
    // Right-padded completions of random lengths; sequence 1 fully masked.
    let mask: Vec<bool> = (0..n)
        .map(|i| i / t != 1 && i % t < 1 + (i / t * 3) % t)
        .collect();
    GrpoBatchData {
        batch: b,
        seq_len: t,
        target_ids: (0..n)
            .map(|i| {
                if mask[i] {
                    rng.random_range(0..v as i64)
                } else {
                    -1
                }
            })
            .collect(),
        mask,
        advantages: PerSeqOrTokenBuf::Sequence(
            (0..b).map(|_| rng.random_range(-1.5..1.5)).collect(),
        ),
        old_logp: Some((0..n).map(|_| rng.random_range(-4.0..-2.0)).collect()),
        ref_logp: Some((0..n).map(|_| rng.random_range(-4.0..-2.0)).collect()),
        sampler_ratio: None,
        policy_mask: None,
        entropy_mask: None,
    }
}

fn max_rel(a: &Tensor, b: &Tensor) -> f32 {
    let a = a.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let b = b.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
    assert!(a.iter().all(|x| x.is_finite()), "non-finite gradient");
    a.iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs() / scale)
        .fold(0.0, f32::max)
}

/// Loss and the gradients of hidden and weight of `f(hidden, weight)`.
fn value_and_grads(
    hidden: &Var,
    weight: &Var,
    f: impl Fn(&Tensor, &Tensor) -> Tensor,
) -> (f32, Tensor, Tensor) {
    let loss = f(hidden.as_tensor(), weight.as_tensor());
    let grads = loss.backward().unwrap();
    (
        loss.to_scalar::<f32>().unwrap(),
        grads.get(hidden.as_tensor()).expect("dhidden").clone(),
        grads.get(weight.as_tensor()).expect("dweight").clone(),
    )
}

#[test]
fn grpo_ops_match_candle_ops_for_every_token_level_loss_type() {
    let (b, t, h, v) = (4, 7, 24, 203);
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let hidden = random(&mut rng, (b * t, h), 1.0);
    let weight = random(&mut rng, (v, h), 0.5);
    let plain = inputs(&mut rng, b, t, v);
    // TRL 1.16's policy (off-policy) and top-entropy masks; sequence 0 fully off-policy.
    let mut masked = plain.clone();
    masked.policy_mask = Some((0..b * t).map(|i| i / t != 0 && i % 3 != 1).collect());
    masked.entropy_mask = Some((0..b * t).map(|i| i % 4 != 2).collect());
    let types = [
        LossType::Grpo,
        LossType::Bnpo,
        LossType::DrGrpo,
        LossType::Dapo,
        LossType::Cispo,
        LossType::Sapo,
    ];
    for (loss_type, batch) in types
        .into_iter()
        .flat_map(|t| [(t, plain.clone()), (t, masked.clone())])
    {
        for (delta, bias_kl) in [(None, false), (Some(1.5), true)] {
            let delta = delta.filter(|_| loss_type.is_clipped());
            let loss = GrpoLoss::new(GrpoLossConfig {
                loss_type,
                beta: 0.1,
                delta,
                use_bias_correction_kl: bias_kl,
                entropy_coef: 0.01,
                temperature: 0.9,
                epsilon_high: if loss_type == LossType::Cispo {
                    3.0
                } else {
                    0.28
                },
                max_completion_length: Some(t),
                ..GrpoLossConfig::default()
            })
            .unwrap();
            let base = value_and_grads(&hidden, &weight, |x, w| {
                let logits = baseline::head_logits(x, w).unwrap();
                let (logp, ent, _) =
                    baseline::log_softmax_stats(&logits, &baseline::live_targets(&batch), 0.9)
                        .unwrap();
                baseline::grpo_loss(&logp, &ent, &loss, &batch).unwrap()
            });
            let fused = value_and_grads(&hidden, &weight, |x, w| {
                ops::grpo_linear(
                    x,
                    w,
                    &loss,
                    batch.clone(),
                    flashloss::cpu::gemm_reserve_bytes() + 4096,
                )
                .unwrap()
                .0
            });
            let logits = value_and_grads(&hidden, &weight, |x, w| {
                ops::grpo_logits(&baseline::head_logits(x, w).unwrap(), &loss, batch.clone())
                    .unwrap()
                    .0
            });
            for (name, got) in [("fused", &fused), ("logits", &logits)] {
                let masks = batch.policy_mask.is_some();
                let what =
                    format!("{name} {loss_type:?} delta {delta:?} bias_kl {bias_kl} masks {masks}");
                let rel = (got.0 - base.0).abs() / base.0.abs().max(1e-3);
                assert!(rel < 1e-4, "{what}: loss {} vs {}", got.0, base.0);
                assert!(
                    max_rel(&got.1, &base.1) < 2e-4,
                    "{what}: dhidden {}",
                    max_rel(&got.1, &base.1)
                );
                assert!(
                    max_rel(&got.2, &base.2) < 2e-4,
                    "{what}: dweight {}",
                    max_rel(&got.2, &base.2)
                );
            }
        }
    }
}

#[test]
fn the_op_scales_its_gradients_by_the_upstream_gradient() {
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let hidden = random(&mut rng, (10, 8), 1.0);
    let weight = random(&mut rng, (33, 8), 1.0);
    let batch = inputs(&mut rng, 2, 5, 33);
    let loss = GrpoLoss::new(GrpoLossConfig {
        loss_type: LossType::Grpo,
        ..GrpoLossConfig::default()
    })
    .unwrap();
    let once = value_and_grads(&hidden, &weight, |x, w| {
        ops::grpo_linear(x, w, &loss, batch.clone(), 64 << 20)
            .unwrap()
            .0
    });
    let scaled = value_and_grads(&hidden, &weight, |x, w| {
        (ops::grpo_linear(x, w, &loss, batch.clone(), 64 << 20)
            .unwrap()
            .0
            * -2.5)
            .unwrap()
    });
    let expected = (once.1 * -2.5).unwrap();
    assert!(max_rel(&scaled.1, &expected) < 1e-6);
}

#[test]
fn ce_op_matches_candle_ops() {
    let (n, h, v) = (29, 16, 157);
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let hidden = random(&mut rng, (n, h), 1.0);
    let weight = random(&mut rng, (v, h), 1.0);
    let targets: Vec<i64> = (0..n)
        .map(|i| {
            if i % 5 == 2 {
                -100
            } else {
                rng.random_range(0..v as i64)
            }
        })
        .collect();
    let configs = [
        CeConfig::default(),
        CeConfig {
            label_smoothing: 0.1,
            z_loss: 1e-3,
            reduction: Reduction::Sum,
            ..CeConfig::default()
        },
        CeConfig {
            softcap: Some(3.0),
            temperature: 1.3,
            ..CeConfig::default()
        },
    ];
    for config in configs {
        let ce = CrossEntropy::new(config.clone()).unwrap();
        let base = value_and_grads(&hidden, &weight, |x, w| {
            baseline::ce_loss(&baseline::head_logits(x, w).unwrap(), &targets, &ce).unwrap()
        });
        let fused = value_and_grads(&hidden, &weight, |x, w| {
            ops::ce_linear(
                x,
                w,
                &ce,
                targets.clone(),
                flashloss::cpu::gemm_reserve_bytes() + 4096,
            )
            .unwrap()
        });
        assert!(
            (fused.0 - base.0).abs() / base.0.abs() < 1e-5,
            "{config:?}: {} vs {}",
            fused.0,
            base.0
        );
        assert!(max_rel(&fused.1, &base.1) < 2e-4, "{config:?}: dhidden");
        assert!(max_rel(&fused.2, &base.2) < 2e-4, "{config:?}: dweight");
    }
}

#[test]
fn bf16_inputs_run_and_give_bf16_gradients() {
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let hidden = random(&mut rng, (12, 8), 1.0);
    let weight = random(&mut rng, (40, 8), 1.0);
    let ce = CrossEntropy::new(CeConfig::default()).unwrap();
    let targets: Vec<i64> = (0..12).map(|i| i % 40).collect();
    let f32_loss = ops::ce_linear(&hidden, &weight, &ce, targets.clone(), 64 << 20).unwrap();
    let (x, w) = (
        Var::from_tensor(&hidden.to_dtype(DType::BF16).unwrap()).unwrap(),
        Var::from_tensor(&weight.to_dtype(DType::BF16).unwrap()).unwrap(),
    );
    let loss = ops::ce_linear(&x, &w, &ce, targets, 64 << 20).unwrap();
    let grads = loss.backward().unwrap();
    assert_eq!(grads.get(x.as_tensor()).unwrap().dtype(), DType::BF16);
    let (a, b) = (
        loss.to_scalar::<f32>().unwrap(),
        f32_loss.to_scalar::<f32>().unwrap(),
    );
    assert!((a - b).abs() / b < 2e-2, "{a} vs {b}");
}

#[test]
fn bad_inputs_are_errors_that_name_the_argument() {
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let hidden = random(&mut rng, (6, 8), 1.0);
    let weight = random(&mut rng, (20, 7), 1.0);
    let ce = CrossEntropy::new(CeConfig::default()).unwrap();
    let e = ops::ce_linear(&hidden, &weight, &ce, vec![0; 6], 64 << 20).unwrap_err();
    assert!(e.to_string().contains("weight"), "{e}");
    let weight = random(&mut rng, (20, 8), 1.0);
    let e = ops::ce_linear(&hidden, &weight, &ce, vec![0, 1, 2, 99, 0, 0], 64 << 20).unwrap_err();
    assert!(e.to_string().contains("99"), "{e}");
    let batch = inputs(&mut rng, 2, 4, 20);
    let loss = GrpoLoss::new(GrpoLossConfig {
        loss_type: LossType::Grpo,
        ..GrpoLossConfig::default()
    })
    .unwrap();
    let e = ops::grpo_linear(&hidden, &weight, &loss, batch, 64 << 20).unwrap_err();
    assert!(e.to_string().contains("hidden"), "{e}");
    let vespo = GrpoLoss::new(GrpoLossConfig {
        loss_type: LossType::Vespo,
        ..GrpoLossConfig::default()
    })
    .unwrap();
    let batch = inputs(&mut rng, 2, 3, 20);
    let e = baseline::grpo_loss(
        &Tensor::zeros(6, DType::F32, &Device::Cpu).unwrap(),
        &Tensor::zeros(6, DType::F32, &Device::Cpu).unwrap(),
        &vespo,
        &batch,
    )
    .unwrap_err();
    assert!(e.to_string().contains("loss.impl = fused"), "{e}");
}
