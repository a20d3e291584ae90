//! A tour of the library (docs/rust.md): the logits-level GRPO kernel, the fused LM-head GRPO
//! and cross-entropy on a `Device`, and cross-entropy sharded over the vocabulary of two
//! in-process ranks. Run with `cargo run --release -p flashloss --example library`.

use flashloss::collective::{Collective, run_in_process};
use flashloss::shard_range;
use flashloss::{
    CeCall, CeConfig, CrossEntropy, Device, FusedOptions, Grid, GrpoBatch, GrpoCall, GrpoLoss,
    GrpoLossConfig, LinearInputs, LogitsLayout, LossType, PerSeqOrToken, Shard,
};

fn main() -> flashloss::Result<()> {
    let (b, t, v, hdim) = (2, 3, 50, 8);
    let wave = |n: usize, k: f32| (0..n).map(|i| (i as f32 * k).sin()).collect::<Vec<f32>>();
    let (h, w, mut logits) = (
        wave(b * t * hdim, 0.7),
        wave(v * hdim, 0.3),
        wave(b * t * v, 0.9),
    );
    let ids: Vec<i64> = (0..b * t).map(|i| (i * 7 % v) as i64).collect();
    let (mask, adv) = (vec![true; b * t], vec![1.0f32, -0.5]);
    let (old, reference) = (vec![-3.9f32; b * t], vec![-4.0f32; b * t]);

    // The GRPO loss on materialized logits `[B, T, V]`, gradient written over them.
    let loss = GrpoLoss::new(GrpoLossConfig {
        loss_type: LossType::Dapo,
        beta: 0.04,
        ..Default::default()
    })?;
    let batch = GrpoBatch {
        batch: b,
        seq_len: t,
        target_ids: &ids,
        mask: &mask,
        advantages: PerSeqOrToken::Sequence(&adv),
        old_logp: Some(&old),
        ref_logp: Some(&reference),
        sampler_ratio: None,
        policy_mask: None,
        entropy_mask: None,
    };
    let layout = LogitsLayout::contiguous(b, t, v);
    // One device per process: it keeps its workspace between calls.
    let device = Device::cpu();
    let fwd = device.grpo_logits_in_place(&loss, &batch, &mut logits, &layout, 1.0)?;
    println!("logits-level GRPO loss {:.6}", fwd.loss); // logits now hold dL/dlogits

    // From hidden states and the LM head, within the default 160 MiB workspace, on any device
    // (`Device::parse("cuda:0")` in a build with `--features cuda`):
    let head = LinearInputs {
        hidden: &h,
        weight: &w,
        layout: flashloss::WeightLayout::VocabMajor,
        bias: None,
        tokens: b * t,
        hidden_size: hdim,
        vocab: v,
    };
    let opts = FusedOptions::default();
    // One call struct per loss; `with_host_grads` makes and returns the gradient buffers
    // (`device.grpo(HeadArgs::Host { inputs, grads }, call)` adds into the caller's).
    let out = device.with_host_grads(&head, GrpoCall::new(&loss, &batch, &opts))?;
    println!(
        "fused GRPO loss {:.6}, |dW| = {}",
        out.loss,
        out.grads.dweight.len()
    );

    // Cross-entropy from the LM head (ignore_index, label smoothing, z-loss, soft-cap):
    let ce = CrossEntropy::new(CeConfig {
        label_smoothing: 0.1,
        softcap: Some(30.0),
        ..Default::default()
    })?;
    let one = device.with_host_grads(&head, CeCall::new(&ce, &ids, &opts))?;

    // Vocab-parallel over 2 in-process ranks, each holding half of the head:
    let results = run_in_process(2, std::time::Duration::from_secs(60), |comm| {
        let r = shard_range(v, 2, comm.rank());
        let shard_head = LinearInputs {
            weight: &w[r.start * hdim..r.end * hdim],
            layout: flashloss::WeightLayout::VocabMajor,
            vocab: r.len(),
            ..head
        };
        let shard = Shard {
            offset: r.start,
            vocab: v,
        };
        let grid = Grid::vocab(comm);
        device.with_host_grads(
            &shard_head,
            CeCall::new(&ce, &ids, &opts).sharded(&grid, shard),
        )
    });
    for r in results {
        println!("sharded CE loss {:.6} (one rank: {:.6})", r?.loss, one.loss);
    }
    Ok(())
}
