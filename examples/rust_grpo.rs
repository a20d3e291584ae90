//! A fused GRPO step from hidden states and the LM head, checked against the same loss on
//! logits materialized by a plain matmul. Run with
//! `cargo run --release -p flashloss --example rust_grpo`.

use flashloss::{
    Device, FusedOptions, GrpoBatch, GrpoCall, GrpoLoss, GrpoLossConfig, LinearInputs,
    LogitsLayout, LossType, PerSeqOrToken, WeightLayout,
};

fn main() -> flashloss::Result<()> {
    let (b, t, v, hdim) = (2, 64, 4096, 128);
    let wave = |n: usize, k: f32| (0..n).map(|i| (i as f32 * k).sin()).collect::<Vec<f32>>();
    let (h, w) = (wave(b * t * hdim, 0.7), wave(v * hdim, 0.013));
    let ids: Vec<i64> = (0..b * t).map(|i| (i * 7919 % v) as i64).collect();
    let mask: Vec<bool> = (0..b * t).map(|i| i % t < t - 5).collect();
    let (adv, old) = (vec![1.0f32, -0.5], vec![-8.0f32; b * t]);

    let loss = GrpoLoss::new(GrpoLossConfig {
        loss_type: LossType::Dapo,
        beta: 0.0,
        ..Default::default()
    })?;
    let batch = GrpoBatch {
        batch: b,
        seq_len: t,
        target_ids: &ids,
        mask: &mask,
        advantages: PerSeqOrToken::Sequence(&adv),
        old_logp: Some(&old),
        ref_logp: None,
        sampler_ratio: None,
        policy_mask: None,
        entropy_mask: None,
    };
    let head = LinearInputs {
        hidden: &h,
        weight: &w,
        layout: WeightLayout::VocabMajor,
        bias: None,
        tokens: b * t,
        hidden_size: hdim,
        vocab: v,
    };
    let device = Device::cpu(); // or Device::parse("cuda:0") in a build with the CUDA backend
    let out = device.with_host_grads(
        &head,
        GrpoCall::new(&loss, &batch, &FusedOptions::default()),
    )?;
    // out.loss, out.metrics, out.stats (logp, lse, entropy), out.grads.{dhidden, dweight}

    // The plain path: logits = H Wᵀ, then the loss on them.
    let mut logits = vec![0.0f32; b * t * v];
    for (row, hr) in logits.chunks_mut(v).zip(h.chunks(hdim)) {
        for (z, wr) in row.iter_mut().zip(w.chunks(hdim)) {
            *z = hr.iter().zip(wr).map(|(x, y)| x * y).sum();
        }
    }
    let plain = device.grpo_logits_in_place(
        &loss,
        &batch,
        &mut logits,
        &LogitsLayout::contiguous(b, t, v),
        1.0,
    )?;

    let rel = ((out.loss - plain.loss) / plain.loss.abs().max(1e-12)).abs();
    let finite = out
        .grads
        .dhidden
        .iter()
        .chain(&out.grads.dweight)
        .all(|g| g.is_finite());
    println!(
        "fused loss {:.6}, plain loss {:.6}, relative difference {rel:.2e}",
        out.loss, plain.loss
    );
    assert!(
        out.loss.is_finite() && finite,
        "the loss and gradients must be finite"
    );
    assert!(rel < 1e-4, "fused and plain losses differ by {rel:e}");
    println!(
        "OK: |dH| = {}, |dW| = {}",
        out.grads.dhidden.len(),
        out.grads.dweight.len()
    );
    Ok(())
}
