//! Fused linear GRPO under the sampler's truncated support (the loss config's `top_k`,
//! `top_p`, `min_p`; spec, flashloss addition 13) vs the f64 reference: loss, metrics,
//! `logp^K`, the targets outside the support (masked), dH, dW and dbias, on heads of
//! exact logits (so the kernel and the reference decide the same support, ties
//! included), for several loss types, both ratio levels, temperature ≠ 1, masked rows and
//! a frozen head; bad filters and a single-pass mode are typed errors; vocab-parallel
//! and token-parallel runs equal the single rank.

use crate::common;
use crate::support_common;
use common::cpu_steps::{
    VocabShard, grpo_linear, grpo_linear_token_parallel, grpo_linear_vocab_parallel,
};
use common::{assert_close, base_config, draw};
use flashloss::collective::{Collective, run_in_process};
use flashloss::policy::Normalizers;
use flashloss::reference::{grpo_reference, linear_grads, linear_logits};
use flashloss::{
    Element, Error, FusedOptions, GrpoLoss, GrpoLossConfig, HeadGrad, ImportanceSamplingLevel,
    LossType, Mode, shard_range,
};
use flashloss_tools::inputs::GrpoInputs;
use half::bf16;
use std::time::Duration;
use support_common::{ExactHead, shard_of, small_budget};

fn opts(mode: Mode, head_grad: HeadGrad) -> FusedOptions {
    FusedOptions {
        bf16_products: Default::default(),
        mode,
        budget_bytes: Some(small_budget()),
        grad_output: 0.75,
        head_grad,
    }
}

/// Batch inputs for `head`: every other live row's target is its row's argmax (inside
/// any support), the others random ids (often outside); old and reference log-probs
/// near the full softmax's.
fn batch_for<E: Element>(head: &ExactHead<E>, (b, t): (usize, usize), seed: u64) -> GrpoInputs {
    let mut x = draw(b, t, head.v, seed);
    let z = linear_logits(&head.inputs());
    for i in (0..b * t).step_by(2) {
        let row = &z[i * head.v..(i + 1) * head.v];
        let argmax = (0..head.v).fold(0, |m, j| if row[j] > row[m] { j } else { m });
        x.data.target_ids[i] = argmax as i64;
    }
    x.follow_policy(&z, 0.9);
    x
}

fn with_support(
    mut cfg: GrpoLossConfig,
    filter: (Option<usize>, Option<f64>, Option<f64>),
) -> GrpoLoss {
    (cfg.top_k, cfg.top_p, cfg.min_p) = filter;
    (cfg.beta, cfg.entropy_coef, cfg.temperature) = (0.04, 0.01, 0.9);
    GrpoLoss::new(cfg).unwrap()
}

/// The kernel against the reference; returns how many live tokens were outside.
fn check<E: Element>(
    case: &str,
    loss: &GrpoLoss,
    head: &ExactHead<E>,
    x: &GrpoInputs,
    o: &FusedOptions,
) -> usize {
    let batch = x.batch();
    let out =
        grpo_linear(loss, &batch, &head.inputs(), o).unwrap_or_else(|e| panic!("{case}: {e}"));
    let z = linear_logits(&head.inputs());
    let r = grpo_reference(
        loss,
        &batch,
        Normalizers::local(&batch),
        &z,
        head.v,
        o.grad_output as f64,
    );
    let support = out
        .support
        .as_ref()
        .unwrap_or_else(|| panic!("{case}: no support outputs"));
    assert_eq!(support.outside, r.outside, "{case}: outside");
    let tol = if E::DTYPE == flashloss::DType::F32 {
        1e-5
    } else {
        1e-3
    };
    assert!(
        (out.loss - r.loss).abs() <= tol * r.loss.abs().max(1.0),
        "{case}: loss {} vs {}",
        out.loss,
        r.loss
    );
    for i in (0..batch.rows()).filter(|&i| batch.mask[i]) {
        let (got, want) = (out.stats[i].logp as f64, r.logp[i]);
        let close = |a: f32, b: f64| (a as f64 - b).abs() <= 1e-5 * b.abs().max(1.0);
        let st = out.stats[i];
        assert!(
            close(st.entropy, r.entropy[i]) && close(st.lse, r.lse[i]),
            "{case}: row {i} stats"
        );
        match r.outside[i] {
            true => assert_eq!(got, f64::NEG_INFINITY, "{case}: logp row {i}"),
            false => assert!(
                (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                "{case}: logp row {i}: {got} vs {want}"
            ),
        }
    }
    let m = (out.metrics, r.metrics);
    assert!(
        (m.0.entropy_mean - m.1.entropy_mean).abs() < 1e-5,
        "{case}: entropy mean"
    );
    assert!((m.0.kl_mean - m.1.kl_mean).abs() < 1e-5, "{case}: kl mean");
    assert!(
        (m.0.clip_ratio_region - m.1.clip_ratio_region).abs() < 1e-9,
        "{case}: clip ratio"
    );
    let (dh, dw, db) = linear_grads(&head.inputs(), &r.dlogits);
    let grad_tol = if E::DTYPE == flashloss::DType::F32 {
        1e-4
    } else {
        1e-2
    };
    assert_close(&format!("{case} dH"), &out.grads.dhidden, &dh, grad_tol);
    match o.head_grad {
        HeadGrad::Full => {
            assert_close(&format!("{case} dW"), &out.grads.dweight, &dw, grad_tol);
            match (&out.grads.dbias, head.bias.is_some()) {
                (Some(got), true) => assert_close(&format!("{case} dbias"), got, &db, grad_tol),
                (None, false) => {}
                _ => panic!("{case}: dbias presence"),
            }
        }
        HeadGrad::Frozen => assert!(out.grads.dweight.is_empty(), "{case}: a frozen head's dW"),
    }
    (0..batch.rows())
        .filter(|&i| batch.mask[i] && r.outside[i])
        .count()
}

const FILTERS: [(Option<usize>, Option<f64>, Option<f64>); 5] = [
    (Some(37), None, None),
    (None, Some(0.9), None),
    (None, None, Some(0.05)),
    (Some(37), Some(0.35), None),
    (Some(5), Some(0.9), Some(0.02)),
];

#[test]
fn every_filter_and_loss_type_matches_the_reference() {
    let types = [
        (LossType::Grpo, ImportanceSamplingLevel::Token),
        (LossType::Grpo, ImportanceSamplingLevel::Sequence),
        (LossType::Bnpo, ImportanceSamplingLevel::Token),
        (LossType::Dapo, ImportanceSamplingLevel::Token),
        (LossType::Cispo, ImportanceSamplingLevel::Token),
        (LossType::Vespo, ImportanceSamplingLevel::Token),
    ];
    let mut outside = [0; FILTERS.len()];
    for (ties, (b, t, h, v)) in [(true, (3, 5, 24, 2053)), (false, (2, 3, 16, 301))] {
        let head = ExactHead::<f32>::new((b * t, h, v), true, ties, 7);
        let mut x = batch_for(&head, (b, t), 8);
        // An entropy mask: the bonus's count differs from the token count.
        x.data.entropy_mask = Some((0..b * t).map(|i| i % 3 != 1).collect());
        for (ty, level) in types {
            for (f, filter) in FILTERS.into_iter().enumerate() {
                let loss = with_support(base_config(ty, level), filter);
                let case = format!("{} {level:?} {filter:?} [V={v}] ties={ties}", ty.name());
                outside[f] += check(&case, &loss, &head, &x, &opts(Mode::Auto, HeadGrad::Full));
            }
        }
    }
    assert!(
        outside.iter().all(|&n| n > 0),
        "{outside:?}: a filter with no target outside its support leaves the masking untested"
    );
}

#[test]
fn frozen_head_bf16_and_two_pass() {
    let head = ExactHead::<bf16>::new((12, 20, 1031), false, true, 3);
    let x = batch_for(&head, (3, 4), 4);
    for filter in FILTERS {
        let loss = with_support(
            GrpoLossConfig {
                loss_type: LossType::Grpo,
                ..GrpoLossConfig::default()
            },
            filter,
        );
        for o in [
            opts(Mode::TwoPass, HeadGrad::Frozen),
            opts(Mode::Auto, HeadGrad::Full),
        ] {
            check(
                &format!("bf16 {filter:?} {:?}", o.head_grad),
                &loss,
                &head,
                &x,
                &o,
            );
        }
    }
}

/// An unset filter (`top_k = 0`, `top_p = 1`, `min_p = 0`, TRL's defaults) is the full
/// softmax, run as without one.
#[test]
fn unset_filters_are_the_full_softmax() {
    let cfg = GrpoLossConfig {
        top_k: Some(0),
        top_p: Some(1.0),
        min_p: Some(0.0),
        loss_type: LossType::Grpo,
        ..GrpoLossConfig::default()
    };
    let loss = GrpoLoss::new(cfg).unwrap();
    assert_eq!(loss.support(), None);
    let head = ExactHead::<f32>::new((6, 8, 300), true, false, 5);
    let x = batch_for(&head, (2, 3), 6);
    let out = grpo_linear(
        &loss,
        &x.batch(),
        &head.inputs(),
        &opts(Mode::Auto, HeadGrad::Full),
    )
    .unwrap();
    assert!(out.support.is_none());
}

#[test]
fn bad_filters_and_single_pass_are_typed_errors() {
    for (cfg, field) in [
        (
            GrpoLossConfig {
                top_p: Some(0.0),
                ..Default::default()
            },
            "top_p",
        ),
        (
            GrpoLossConfig {
                top_p: Some(1.5),
                ..Default::default()
            },
            "top_p",
        ),
        (
            GrpoLossConfig {
                min_p: Some(-0.1),
                ..Default::default()
            },
            "min_p",
        ),
        (
            GrpoLossConfig {
                min_p: Some(f64::NAN),
                ..Default::default()
            },
            "min_p",
        ),
    ] {
        match GrpoLoss::new(cfg) {
            Err(Error::InvalidConfig { field: f, .. }) => assert_eq!(f, field),
            other => panic!("{field}: {other:?}"),
        }
    }
    let head = ExactHead::<f32>::new((6, 8, 300), false, false, 5);
    let x = batch_for(&head, (2, 3), 6);
    let loss = with_support(
        GrpoLossConfig {
            loss_type: LossType::Grpo,
            ..GrpoLossConfig::default()
        },
        (Some(4), None, None),
    );
    for mode in [Mode::SinglePass, Mode::Compact] {
        match grpo_linear(
            &loss,
            &x.batch(),
            &head.inputs(),
            &opts(mode, HeadGrad::Full),
        ) {
            Err(Error::InvalidArgument {
                arg: "mode",
                reason,
            }) => assert!(reason.contains("top_k"), "{reason}"),
            other => panic!("{mode:?}: {other:?}"),
        }
    }
}

/// Vocab-parallel (P = 3, uneven shards) and token-parallel (P = 2) runs give the
/// single rank's loss, metrics and gradients.
#[test]
fn sharded_runs_equal_the_single_rank() {
    const TIMEOUT: Duration = Duration::from_secs(60);
    let (b, t, h, v) = (4, 3, 16, 1031);
    let head = ExactHead::<f32>::new((b * t, h, v), true, true, 11);
    let x = batch_for(&head, (b, t), 12);
    let o = opts(Mode::Auto, HeadGrad::Full);
    for filter in FILTERS {
        let loss = with_support(
            base_config(LossType::Bnpo, ImportanceSamplingLevel::Token),
            filter,
        );
        let one = grpo_linear(&loss, &x.batch(), &head.inputs(), &o).unwrap();
        let ranks = run_in_process(3, TIMEOUT, |comm| {
            let range = shard_range(v, 3, comm.rank());
            let part = shard_of(&head, range.clone());
            let shard = VocabShard {
                inputs: part.inputs(),
                offset: range.start,
                vocab: v,
            };
            grpo_linear_vocab_parallel(comm, &loss, &x.batch(), &shard, &o)
        });
        for (rank, got) in ranks.into_iter().enumerate() {
            let got = got.unwrap_or_else(|e| panic!("{filter:?} rank {rank}: {e}"));
            let case = format!("vocab {filter:?} rank {rank}");
            assert!(
                (got.loss - one.loss).abs() <= 1e-6 * one.loss.abs().max(1e-3),
                "{case}: loss"
            );
            assert_eq!(
                got.support.as_ref().map(|s| &s.outside),
                one.support.as_ref().map(|s| &s.outside),
                "{case}"
            );
            assert!(
                (got.metrics.entropy_mean - one.metrics.entropy_mean).abs() < 1e-6,
                "{case}: entropy mean"
            );
            let want: Vec<f64> = one.grads.dhidden.iter().map(|&g| g as f64).collect();
            assert_close(&format!("{case} dH"), &got.grads.dhidden, &want, 1e-5);
        }
        let ranks = run_in_process(2, TIMEOUT, |comm| {
            let seqs = [0..1, 1..b][comm.rank()].clone();
            let rows = seqs.start * t..seqs.end * t;
            let part = x.sequences(seqs);
            let local = ExactHead {
                hidden: head.hidden[rows.start * h..rows.end * h].to_vec(),
                n: rows.len(),
                ..shard_of(&head, 0..v)
            };
            let out = grpo_linear_token_parallel(comm, &loss, &part.batch(), &local.inputs(), &o);
            out.map(|out| (rows, out))
        });
        for (rank, got) in ranks.into_iter().enumerate() {
            let (rows, got) = got.unwrap_or_else(|e| panic!("{filter:?} token rank {rank}: {e}"));
            let case = format!("token {filter:?} rank {rank}");
            let outside =
                |o: &flashloss::GrpoLinearOutput| o.support.as_ref().map(|s| s.outside.clone());
            let want_outside = outside(&one).map(|o| o[rows.clone()].to_vec());
            assert_eq!(outside(&got), want_outside, "{case}: outside");
            let (m, w) = (got.metrics, one.metrics);
            assert!(
                (m.entropy_mean - w.entropy_mean).abs() < 1e-6,
                "{case}: entropy mean"
            );
            assert!(
                (m.clip_ratio_region - w.clip_ratio_region).abs() < 1e-9,
                "{case}: clip ratio"
            );
            let dh: Vec<f64> = one.grads.dhidden[rows.start * h..rows.end * h]
                .iter()
                .map(|&g| g as f64)
                .collect();
            assert_close(&format!("{case} dH"), &got.grads.dhidden, &dh, 1e-5);
            assert!(
                (got.loss - one.loss).abs() <= 1e-6 * one.loss.abs().max(1e-3),
                "{case}: loss"
            );
            assert!(
                (got.metrics.kl_mean - one.metrics.kl_mean).abs() < 1e-6,
                "{case}: kl mean"
            );
            let want: Vec<f64> = one.grads.dweight.iter().map(|&g| g as f64).collect();
            assert_close(&format!("{case} dW"), &got.grads.dweight, &want, 1e-5);
        }
    }
}

/// The logits-level kernel takes no support: a typed error naming the filter.
#[test]
fn logits_level_kernel_refuses_a_support() {
    let x = draw(2, 3, 50, 1);
    let layout = flashloss::LogitsLayout::contiguous(2, 3, 50);
    let logits = vec![0.5f32; 2 * 3 * 50];
    let mut dlogits = vec![0.0f32; logits.len()];
    for (filter, name) in [
        ((Some(3), None, None), "top_k"),
        ((None, Some(0.5), None), "top_p"),
        ((None, None, Some(0.1)), "min_p"),
    ] {
        let loss = with_support(
            GrpoLossConfig {
                loss_type: LossType::Grpo,
                ..GrpoLossConfig::default()
            },
            filter,
        );
        let cpu = flashloss::Device::cpu();
        match cpu.grpo_logits(&loss, &x.batch(), &logits, &layout, 1.0, &mut dlogits) {
            Err(Error::Unsupported { feature, .. }) => assert_eq!(feature, name),
            other => panic!("{name}: {other:?}"),
        }
    }
}

/// `flashloss gradcheck` on `configs/gradcheck/linear_grpo_support.yaml` passes for
/// several loss types and both ratio levels (its `support_outside` gate among them), and
/// a perturbed kernel input fails it.
#[test]
fn gradcheck_under_a_support_passes_and_can_fail() {
    use flashloss_tools::gradcheck::{self, Fault, FaultKind, GradcheckConfig};
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../configs/gradcheck/linear_grpo_support.yaml"
    );
    let base: GradcheckConfig =
        flashloss_tools::config_file::load(std::path::Path::new(path), &[]).unwrap();
    for (ty, level) in [
        (LossType::Dapo, ImportanceSamplingLevel::Token),
        (LossType::Grpo, ImportanceSamplingLevel::Sequence),
        (LossType::Cispo, ImportanceSamplingLevel::Token),
        (LossType::Vespo, ImportanceSamplingLevel::Token),
    ] {
        let mut cfg = base.clone();
        (cfg.loss.loss_type, cfg.loss.importance_sampling_level) = (ty, level);
        if ty == LossType::Cispo {
            cfg.loss.epsilon_high = 5.0;
        }
        let r = gradcheck::run(&cfg).unwrap();
        assert!(r.passed, "{ty:?} {level:?}: {:?}", r.gates);
        assert!(
            r.gate("support_outside").is_some_and(|g| g.passed),
            "{ty:?}"
        );
    }
    let faulty = GradcheckConfig {
        fault: Some(Fault {
            rank: 0,
            kind: FaultKind::Perturb,
        }),
        ..base
    };
    let r = gradcheck::run(&faulty).unwrap();
    assert!(
        !r.passed && !r.gate("dhidden").unwrap().passed,
        "{:?}",
        r.gates
    );
}
