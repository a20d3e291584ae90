//! The front door (`flashloss::Device`): a kept workspace changes no bit of any result;
//! inputs are validated and gradients checked on every call; log-probs need no gradient
//! buffers; sharded runs fail together; split passes and sharded calls equal the whole head.

use crate::common;
use common::*;
use flashloss::collective::{Collective, Solo, run_in_process};
use flashloss::device::{CeCall, CeUpstream, GrpoCall, LogpCall};
use flashloss::fused::{LinearGradsMut, LogpRows};
use flashloss::{
    Device, FusedOptions, Grid, GrpoLoss, GrpoLossConfig, HeadArgs, LinearInputs, LossType, Mode,
    Shard, Temperature,
};
use std::time::Duration;

fn loss() -> GrpoLoss {
    GrpoLoss::new(GrpoLossConfig {
        loss_type: LossType::Dapo,
        beta: 0.04,
        ..Default::default()
    })
    .unwrap()
}

fn opts(mode: Mode) -> FusedOptions {
    FusedOptions {
        bf16_products: Default::default(),
        mode,
        budget_bytes: Some(flashloss::cpu::gemm_reserve_bytes() + (1 << 20)),
        grad_output: 1.0,
        head_grad: Default::default(),
    }
}

#[test]
fn a_kept_workspace_changes_no_bit_of_any_result() {
    let kept = Device::cpu();
    // Shapes that grow, shrink and grow the workspace, in both modes.
    for (i, (b, t, h, v)) in [
        (2, 5, 8, 3001),
        (1, 3, 4, 17),
        (3, 7, 16, 4099),
        (2, 5, 8, 3001),
    ]
    .into_iter()
    .enumerate()
    {
        for mode in [Mode::SinglePass, Mode::TwoPass, Mode::Compact] {
            let head = Head::<f32>::random(b * t, h, v, i % 2 == 0, 7 + i as u64);
            let x = draw(b, t, v, 11 + i as u64);
            let (batch, inputs) = (x.batch(), head.inputs());
            let again = kept
                .with_host_grads(&inputs, GrpoCall::new(&loss(), &batch, &opts(mode)))
                .unwrap();
            let fresh = Device::cpu()
                .with_host_grads(&inputs, GrpoCall::new(&loss(), &batch, &opts(mode)))
                .unwrap();
            let case = format!("{mode:?} [B={b},T={t},H={h},V={v}]");
            assert_eq!(again.loss.to_bits(), fresh.loss.to_bits(), "{case}");
            assert_eq!(again.grads.dhidden, fresh.grads.dhidden, "{case}: dH");
            assert_eq!(again.grads.dweight, fresh.grads.dweight, "{case}: dW");
            assert_eq!(again.grads.dbias, fresh.grads.dbias, "{case}: dbias");
            assert!(kept.workspace_bytes().unwrap() > 0, "{case}: nothing kept");
        }
    }
}

#[test]
fn a_nan_in_a_masked_row_and_an_empty_head_are_errors_on_every_entry_point() {
    let (b, t, h, v) = (2, 4, 8, 33);
    let mut head = Head::<f32>::random(b * t, h, v, false, 3);
    let mut x = draw(b, t, v, 4);
    x.data.mask[t - 1] = false;
    head.hidden[(t - 1) * h] = f32::NAN;
    let device = Device::cpu();
    let batch = x.batch();
    let err = device
        .with_host_grads(
            &head.inputs(),
            GrpoCall::new(&loss(), &batch, &opts(Mode::Auto)),
        )
        .unwrap_err();
    assert!(err.to_string().contains("`hidden`"), "{err}");
    let mut grads = flashloss::LinearGrads::zeros(&head.inputs());
    let inputs = head.inputs();
    let args = HeadArgs::Host {
        inputs: &inputs,
        grads: grads.view(),
    };
    let err = device
        .grpo(args, GrpoCall::new(&loss(), &batch, &opts(Mode::Auto)))
        .unwrap_err();
    assert!(err.to_string().contains("`hidden`"), "{err}");
    // N = 0 through log-probs (no gradient buffers): an error, never a panic.
    let empty = LinearInputs::<f32> {
        hidden: &[],
        weight: &head.weight,
        layout: flashloss::WeightLayout::VocabMajor,
        bias: None,
        tokens: 0,
        hidden_size: h,
        vocab: v,
    };
    let t1 = Temperature::new(1.0).unwrap();
    let err = device
        .logprobs(
            HeadArgs::host(&empty),
            LogpCall::forward(
                LogpRows {
                    targets: &[],
                    mask: None,
                    temperature: t1,
                },
                &FusedOptions::forward(1 << 24),
                1,
            ),
        )
        .map(|o| o.stats)
        .unwrap_err();
    assert!(err.to_string().contains("must be >= 1"), "{err}");
}

#[test]
fn log_probs_need_no_gradient_buffers_and_match_the_loss_statistics() {
    let (b, t, h, v) = (2, 5, 8, 301);
    let head = Head::<f32>::random(b * t, h, v, true, 5);
    let x = draw(b, t, v, 6);
    let device = Device::cpu();
    let inputs = head.inputs();
    let stats = device
        .logprobs(
            HeadArgs::host(&inputs),
            LogpCall::forward(
                LogpRows {
                    targets: &x.data.target_ids,
                    mask: Some(&x.data.mask),
                    temperature: Temperature::default(),
                },
                &FusedOptions::forward(1 << 24),
                t,
            ),
        )
        .map(|o| o.stats)
        .unwrap();
    let out = device
        .with_host_grads(
            &inputs,
            GrpoCall::new(&loss(), &x.batch(), &opts(Mode::TwoPass)),
        )
        .unwrap();
    for i in (0..b * t).filter(|&i| x.data.mask[i]) {
        assert_eq!(
            stats[i].logp.to_bits(),
            out.stats[i].logp.to_bits(),
            "row {i}"
        );
    }
    // A head without gradient buffers cannot take a loss with gradients.
    let args = HeadArgs::Host {
        inputs: &inputs,
        grads: LinearGradsMut {
            dhidden: &mut [],
            dweight: &mut [],
            dbias: None,
        },
    };
    let err = device
        .grpo(args, GrpoCall::new(&loss(), &x.batch(), &opts(Mode::Auto)))
        .unwrap_err();
    assert!(err.to_string().contains("dhidden"), "{err}");
}

/// Every row's gradient in range, but dW (a sum over the tokens of both ranks) beyond
/// f32: identical rows of hidden states of 10 with one target and one advantage sign, at
/// `grad_output` 1e38. The sharded step scans the summed gradients and every rank returns
/// the same error (before, the sharded entry points skipped the scan).
#[test]
fn a_summed_gradient_beyond_f32_fails_every_rank_of_a_sharded_step() {
    let (b, t, h, v) = (4, 3, 6, 64);
    let mut head = Head::<f32>::random(b * t, h, v, false, 8);
    head.hidden.fill(10.0);
    let mut x = draw(b, t, v, 9);
    x.data.target_ids.fill(0);
    x.data.mask.fill(true);
    x.data.advantages = flashloss::PerSeqOrTokenBuf::Sequence(vec![1.0; b]);
    (x.data.old_logp, x.data.ref_logp) = (None, None);
    let loss = GrpoLoss::new(GrpoLossConfig {
        loss_type: LossType::Dapo,
        ..Default::default()
    })
    .unwrap();
    let opts = FusedOptions {
        grad_output: 1e38,
        ..opts(Mode::TwoPass)
    };
    let results = run_in_process(2, Duration::from_secs(60), |comm| {
        let rows = comm.rank() * 2..comm.rank() * 2 + 2;
        let mine = x.sequences(rows.clone());
        let n = mine.data.batch * t;
        let inputs = LinearInputs {
            hidden: &head.hidden[rows.start * t * h..rows.start * t * h + n * h],
            tokens: n,
            ..head.inputs()
        };
        let grid = Grid::token(comm);
        Device::cpu()
            .with_host_grads(
                &inputs,
                GrpoCall::new(&loss, &mine.batch(), &opts).sharded(&grid, Shard::whole(v)),
            )
            .map(|o| o.loss)
    });
    let errors: Vec<String> = results
        .into_iter()
        .map(|r| r.expect_err("a gradient beyond f32").to_string())
        .collect();
    assert_eq!(errors[0], errors[1]);
    assert!(errors[0].contains("dweight"), "{}", errors[0]);
}

/// The split passes (for a caller that runs the collective itself, as JAX does) over
/// three vocabulary shards, merged and finished on the host, give the fused step's
/// statistics, loss and gradients.
#[test]
fn split_passes_over_three_shards_equal_the_fused_step() {
    use flashloss::fused::RowGrad;
    use flashloss::policy::{Normalizers, policy_stage};
    use flashloss::rows::{PartialStats, RowInputs, RowTransform};
    let (b, t, h, v) = (2, 5, 8, 301);
    let head = Head::<f32>::random(b * t, h, v, true, 12);
    let x = draw(b, t, v, 13);
    let batch = x.batch();
    let device = Device::cpu();
    let whole = device
        .with_host_grads(
            &head.inputs(),
            GrpoCall::new(&loss(), &batch, &opts(Mode::TwoPass)),
        )
        .unwrap();
    let transform = RowTransform::grpo(&loss());
    let shards = [0..100, 100..201, 201..301];
    let slice = |r: &std::ops::Range<usize>| LinearInputs {
        weight: &head.weight[r.start * h..r.end * h],
        layout: flashloss::WeightLayout::VocabMajor,
        bias: head.bias.as_deref().map(|bb| &bb[r.clone()]),
        vocab: r.len(),
        ..head.inputs()
    };
    let local = |r: &std::ops::Range<usize>| -> Vec<i64> {
        let y = |id: i64| {
            if r.contains(&(id as usize)) {
                id - r.start as i64
            } else {
                -1
            }
        };
        batch.target_ids.iter().map(|&id| y(id)).collect()
    };
    let mut merged = PartialStats::empty(b * t, transform.inv_temp);
    for r in &shards {
        let (inputs, targets) = (slice(r), local(r));
        let rows = RowInputs {
            targets: &targets,
            live: batch.mask,
            transform,
        };
        let part = device
            .partial_row_states(HeadArgs::host(&inputs), rows, &opts(Mode::Auto))
            .unwrap();
        merged.merge(&part);
    }
    let all = RowInputs {
        targets: batch.target_ids,
        live: batch.mask,
        transform,
    };
    let stats = merged.finish(&all, v);
    let logp: Vec<f32> = stats.iter().map(|s| s.logp).collect();
    let entropy: Vec<f32> = stats.iter().map(|s| s.entropy).collect();
    let policy = policy_stage(&loss(), &batch, Normalizers::local(&batch), &logp, &entropy);
    assert!((policy.loss - whole.loss).abs() <= 1e-6 * whole.loss.abs().max(1.0));
    let mut dhidden = vec![0.0f32; b * t * h];
    for r in &shards {
        let (inputs, targets) = (slice(r), local(r));
        let grads: Vec<RowGrad> = (0..b * t)
            .map(|i| {
                let c = transform.grpo_coefs(1.0, policy.dlogp[i], policy.dentropy[i]);
                let g = RowGrad {
                    stats: stats[i],
                    coef_p: c.p,
                    coef_h: c.h,
                    coef_uniform: 0.0,
                    coef_target: c.target,
                    target: batch.target_ids[i] as usize,
                    support: None,
                };
                g.on_shard(r)
            })
            .collect();
        let mut part = flashloss::LinearGrads::zeros(&inputs);
        let rows = RowInputs {
            targets: &targets,
            live: batch.mask,
            transform,
        };
        let args = HeadArgs::Host {
            inputs: &inputs,
            grads: part.view(),
        };
        device
            .accumulate_row_grads(args, rows, &grads, &opts(Mode::Auto), t)
            .unwrap();
        dhidden
            .iter_mut()
            .zip(&part.dhidden)
            .for_each(|(a, p)| *a += p);
        assert_close(
            "dweight",
            &part.dweight,
            &f64s(&whole.grads.dweight[r.start * h..r.end * h]),
            1e-5,
        );
        let db = &whole.grads.dbias.as_ref().unwrap()[r.clone()];
        assert_close("dbias", part.dbias.as_ref().unwrap(), &f64s(db), 1e-5);
    }
    assert_close("dhidden", &dhidden, &f64s(&whole.grads.dhidden), 1e-5);
}

#[test]
fn split_cross_entropy_over_three_shards_equals_the_fused_call() {
    use flashloss::rows::PartialStats;
    use flashloss::{CeConfig, CrossEntropy, Reduction};
    let (n, h, v) = (11, 8, 301);
    let head = Head::<f32>::random(n, h, v, true, 21);
    let x = draw(1, n, v, 22);
    let mut targets = x.batch().target_ids.to_vec();
    targets[3] = -100; // an ignored row
    let device = Device::cpu();
    // each row's lse cotangent: ∂lse/∂s_j = p_j joins the row's coefficients on every shard
    let grad_lse: Vec<f32> = (0..n).map(|i| 0.3 - 0.07 * i as f32).collect();
    for (reduction, grad_rows, lse) in [
        (Reduction::Mean, None, None),
        (Reduction::None, Some(vec![0.5f32; n]), None),
        (Reduction::Mean, None, Some(&grad_lse[..])),
        (Reduction::None, Some(vec![0.5f32; n]), Some(&grad_lse[..])),
    ] {
        let ce = CrossEntropy::new(CeConfig {
            label_smoothing: 0.1,
            z_loss: 1e-3,
            softcap: Some(4.0),
            temperature: 0.8,
            reduction,
            ..Default::default()
        })
        .unwrap();
        let g = grad_rows.as_deref();
        let inputs = head.inputs();
        let mut grads = flashloss::LinearGrads::zeros(&inputs);
        let args = HeadArgs::Host {
            inputs: &inputs,
            grads: grads.view(),
        };
        let whole = device
            .cross_entropy(
                args,
                CeCall::new(&ce, &targets, &opts(Mode::TwoPass))
                    .upstream(CeUpstream { rows: g, lse }),
            )
            .unwrap();
        let whole = flashloss::fused::CeLinearOutput { grads, ..whole };
        let shards = [0..100, 100..201, 201..301];
        let slice = |r: &std::ops::Range<usize>| LinearInputs {
            weight: &head.weight[r.start * h..r.end * h],
            layout: flashloss::WeightLayout::VocabMajor,
            bias: head.bias.as_deref().map(|bb| &bb[r.clone()]),
            vocab: r.len(),
            ..head.inputs()
        };
        let shard = |r: &std::ops::Range<usize>| Shard {
            offset: r.start,
            vocab: v,
        };
        let inv_temp = (1.0 / 0.8f64) as f32;
        let mut merged = PartialStats::empty(n, inv_temp);
        for r in &shards {
            let inputs = slice(r);
            let part = device
                .ce_partial_row_states(
                    HeadArgs::host(&inputs),
                    shard(r),
                    &ce,
                    &targets,
                    &opts(Mode::Auto),
                )
                .unwrap();
            merged.merge(&part);
        }
        let live: Vec<bool> = targets.iter().map(|&y| ce.counts(y)).collect();
        let rows = flashloss::rows::RowInputs {
            targets: &targets,
            live: &live,
            transform: flashloss::rows::RowTransform::ce(&ce),
        };
        let stats = merged.finish(&rows, v);
        let mut dhidden = vec![0.0f32; n * h];
        for r in &shards {
            let inputs = slice(r);
            let mut part = flashloss::LinearGrads::zeros(&inputs);
            let args = HeadArgs::Host {
                inputs: &inputs,
                grads: part.view(),
            };
            let out = device
                .ce_accumulate_row_grads(
                    args,
                    shard(r),
                    &ce,
                    &targets,
                    stats.clone(),
                    CeUpstream { rows: g, lse },
                    &opts(Mode::Auto),
                )
                .unwrap();
            assert!((out.loss - whole.loss).abs() <= 1e-6 * whole.loss.abs().max(1.0));
            assert_close("row_loss", &out.row_loss, &f64s(&whole.row_loss), 1e-6);
            dhidden
                .iter_mut()
                .zip(&part.dhidden)
                .for_each(|(a, p)| *a += p);
            let dw = &whole.grads.dweight[r.start * h..r.end * h];
            assert_close("dweight", &part.dweight, &f64s(dw), 1e-5);
            let db = &whole.grads.dbias.as_ref().unwrap()[r.clone()];
            assert_close("dbias", part.dbias.as_ref().unwrap(), &f64s(db), 1e-5);
        }
        assert_close("dhidden", &dhidden, &f64s(&whole.grads.dhidden), 1e-5);
    }
}

#[test]
fn row_losses_without_gradients_equal_the_fused_calls() {
    use flashloss::{CeConfig, CrossEntropy, Reduction};
    let (n, h, v) = (13, 8, 301);
    let head = Head::<f32>::random(n, h, v, true, 41);
    let mut targets = draw(1, n, v, 42).batch().target_ids.to_vec();
    targets[5] = -100;
    let ce = CrossEntropy::new(CeConfig {
        label_smoothing: 0.1,
        z_loss: 1e-3,
        softcap: Some(4.0),
        temperature: 0.8,
        reduction: Reduction::None,
        ..Default::default()
    })
    .unwrap();
    let device = Device::cpu();
    let fused = device
        .with_host_grads(
            &head.inputs(),
            CeCall::new(&ce, &targets, &opts(Mode::Auto)),
        )
        .unwrap();
    let rows = device
        .cross_entropy(
            HeadArgs::host(&head.inputs()),
            CeCall::new(&ce, &targets, &opts(Mode::Auto)).forward(),
        )
        .unwrap();
    assert_close("row_loss", &rows.row_loss, &f64s(&fused.row_loss), 1e-6);
    assert!((rows.loss - fused.loss).abs() <= 1e-6 * fused.loss.abs().max(1.0));
    assert_eq!(rows.row_loss[5], 0.0);
    // Sharded, CE returns gradients of the row losses only; one rank is the whole call.
    let grid = Grid::vocab(&Solo);
    let o = opts(Mode::Auto);
    let sharded = CeCall::new(&ce, &targets, &o).sharded(&grid, Shard::whole(v));
    let err = device.cross_entropy(HeadArgs::host(&head.inputs()), sharded.forward());
    assert!(err.unwrap_err().to_string().contains("returns"));
    let lse = CeUpstream {
        rows: None,
        lse: Some(&fused.row_loss),
    };
    let err = device.with_host_grads(&head.inputs(), sharded.upstream(lse));
    assert!(err.unwrap_err().to_string().contains("grad_lse"));
    let one = device.with_host_grads(&head.inputs(), sharded).unwrap();
    assert_close("sharded", &one.row_loss, &f64s(&fused.row_loss), 1e-6);
}

#[test]
fn sharded_log_probs_over_three_ranks_equal_the_whole_head() {
    let (b, t, h, v) = (2, 5, 8, 301);
    let head = Head::<f32>::random(b * t, h, v, true, 31);
    let x = draw(b, t, v, 32);
    let batch = x.batch();
    let temperature = Temperature::new(0.7).unwrap();
    let budget = opts(Mode::Auto).budget_bytes;
    let rows = LogpRows {
        targets: batch.target_ids,
        mask: Some(batch.mask),
        temperature,
    };
    let whole = Device::cpu()
        .logprobs(
            HeadArgs::host(&head.inputs()),
            LogpCall::forward(rows, &FusedOptions::forward(budget), t),
        )
        .map(|o| o.stats)
        .unwrap();
    let blocks = [0..90, 90..230, 230..301];
    let results = run_in_process(3, Duration::from_secs(60), |comm| {
        let r = blocks[comm.rank()].clone();
        let inputs = LinearInputs {
            weight: &head.weight[r.start * h..r.end * h],
            layout: flashloss::WeightLayout::VocabMajor,
            bias: head.bias.as_deref().map(|bb| &bb[r.clone()]),
            vocab: r.len(),
            ..head.inputs()
        };
        let shard = Shard {
            offset: r.start,
            vocab: v,
        };
        let args = HeadArgs::host(&inputs);
        Device::cpu()
            .logprobs(
                args,
                LogpCall::forward(rows, &FusedOptions::forward(budget), t)
                    .sharded(&Grid::vocab(comm), shard),
            )
            .map(|o| o.stats)
    });
    for stats in results {
        let stats = stats.unwrap();
        for (i, (s, w)) in stats.iter().zip(&whole).enumerate() {
            assert!(
                (s.logp - w.logp).abs() <= 1e-5 * w.logp.abs().max(1.0),
                "row {i}"
            );
            assert!(
                (s.entropy - w.entropy).abs() <= 1e-5 * w.entropy.abs().max(1.0),
                "row {i}"
            );
        }
    }
    let mut bad = batch.target_ids.to_vec();
    let live = batch.mask.iter().position(|&m| m).unwrap();
    bad[live] = v as i64; // beyond the whole vocabulary: the same error on every rank
    let results = run_in_process(3, Duration::from_secs(60), |comm| {
        let r = blocks[comm.rank()].clone();
        let inputs = LinearInputs {
            weight: &head.weight[r.start * h..r.end * h],
            layout: flashloss::WeightLayout::VocabMajor,
            bias: None,
            vocab: r.len(),
            ..head.inputs()
        };
        let shard = Shard {
            offset: r.start,
            vocab: v,
        };
        Device::cpu()
            .logprobs(
                HeadArgs::host(&inputs),
                LogpCall::forward(
                    LogpRows {
                        targets: &bad,
                        ..rows
                    },
                    &FusedOptions::forward(budget),
                    t,
                )
                .sharded(&Grid::vocab(comm), shard),
            )
            .map(|o| o.stats)
    });
    let errors: Vec<String> = results
        .into_iter()
        .map(|r| r.unwrap_err().to_string())
        .collect();
    assert!(
        errors.iter().all(|e| e == &errors[0] && e.contains("301")),
        "{errors:?}"
    );
}

fn f64s(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| v as f64).collect()
}
