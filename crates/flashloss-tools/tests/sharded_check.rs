//! `flashloss gradcheck --ranks P` as a library call: the sharded check passes on every
//! rank for token, vocab and 2-D splits, a bad split is an error naming the key, and an
//! injected fault (NaN, exit, panic, hang) on one rank ends the run on every rank.

use flashloss::Parallel;
use flashloss_tools::gradcheck::{Fault, FaultKind, GradcheckConfig, Kernel, Objective};
use flashloss_tools::sharded_check;

#[test]
fn sharded_gradcheck_passes_on_every_rank() {
    for objective in [Objective::Grpo, Objective::Ce] {
        for parallel in [Parallel::Token, Parallel::Vocab] {
            let cfg = GradcheckConfig {
                kernel: Kernel::Linear,
                objective,
                parallel,
                batch: 4,
                seq_len: 5,
                hidden: 21,
                vocab: 701,
                ..GradcheckConfig::default()
            };
            let results = sharded_check::run(&cfg, 3).unwrap();
            assert_eq!(results.len(), 3);
            for (rank, r) in results.into_iter().enumerate() {
                let r = r.unwrap();
                assert_eq!(r.rank, rank);
                assert!(
                    r.report.passed,
                    "{objective:?} {parallel:?} rank {rank}: {:?}",
                    r.report.gates
                );
                assert!(r.report.gate("dweight").is_some() && r.report.gate("dhidden").is_some());
            }
            // Five token groups for four sequences; vocab-parallel has one token group.
            let five = sharded_check::run(&cfg, 5);
            if parallel == Parallel::Vocab {
                assert!(
                    five.unwrap()
                        .iter()
                        .all(|r| r.as_ref().unwrap().report.passed)
                );
                continue;
            }
            let err = five.unwrap_err().to_string();
            assert!(
                err.starts_with("argument `ranks`: ")
                    && err.contains("every token group needs a sequence (B = 4)"),
                "{err}"
            );
        }
        let cfg = GradcheckConfig {
            kernel: Kernel::Linear,
            objective,
            parallel: Parallel::Grid2d,
            vocab_groups: Some(2),
            batch: 3,
            seq_len: 5,
            hidden: 21,
            vocab: 701,
            ..GradcheckConfig::default()
        };
        for r in sharded_check::run(&cfg, 4).unwrap() {
            assert!(r.unwrap().report.passed, "{objective:?} 2d");
        }
        let err = sharded_check::run(&cfg, 3).unwrap_err().to_string();
        assert!(err.starts_with("argument `vocab_groups`: "), "{err}");
    }
}

#[test]
fn injected_faults_end_the_sharded_gradcheck_on_every_rank() {
    for kind in [
        FaultKind::Nan,
        FaultKind::Exit,
        FaultKind::Panic,
        FaultKind::Hang,
    ] {
        let cfg = GradcheckConfig {
            kernel: Kernel::Linear,
            parallel: Parallel::Grid2d,
            vocab_groups: Some(2),
            batch: 2,
            seq_len: 5,
            hidden: 21,
            vocab: 301,
            timeout_s: 0.5,
            fault: Some(Fault { rank: 1, kind }),
            ..GradcheckConfig::default()
        };
        let results = sharded_check::run(&cfg, 4).unwrap();
        let errors: Vec<String> = results
            .into_iter()
            .map(|r| r.unwrap_err().to_string())
            .collect();
        if kind == FaultKind::Nan {
            for e in &errors {
                assert_eq!(
                    e,
                    "rank 1: argument `hidden`: value NaN at index 0 is not finite"
                );
            }
        } else {
            for (rank, e) in errors.iter().enumerate().filter(|&(r, _)| r != 1) {
                assert!(
                    e.starts_with("collective: rank "),
                    "{kind:?} rank {rank}: {e}"
                );
            }
        }
    }
}

#[test]
fn sharded_logits_gradcheck_passes_and_a_nan_ends_every_rank() {
    for (parallel, ranks, vocab_groups) in [
        (Parallel::Token, 2, None),
        (Parallel::Vocab, 3, None),
        (Parallel::Grid2d, 4, Some(2)),
    ] {
        let cfg = GradcheckConfig {
            kernel: Kernel::Logits,
            parallel,
            vocab_groups,
            batch: 4,
            seq_len: 5,
            vocab: 301,
            ..GradcheckConfig::default()
        };
        for r in sharded_check::run(&cfg, ranks).unwrap() {
            let r = r.unwrap();
            assert!(
                r.report.passed,
                "{parallel:?} rank {}: {:?}",
                r.rank, r.report.gates
            );
            assert!(r.report.gate("dlogits").is_some());
        }
        let bad = GradcheckConfig {
            fault: Some(Fault {
                rank: 1,
                kind: FaultKind::Nan,
            }),
            ..cfg
        };
        for r in sharded_check::run(&bad, ranks).unwrap() {
            let e = r.unwrap_err().to_string();
            assert!(e.starts_with("rank 1: "), "{parallel:?}: {e}");
        }
    }
}

/// The entropy bonus's count `Σ m'` and B are global: with uneven policy and entropy
/// masks over token groups (luspo at token level, sapo and cispo at sequence level,
/// vespo with a sampler ratio), every rank still matches the one-rank reference.
#[test]
fn sharded_gradcheck_with_trl_masks() {
    use flashloss::{GrpoLossConfig, ImportanceSamplingLevel::*, LossType::*};
    for (t, level) in [
        (Luspo, Token),
        (Sapo, Sequence),
        (Cispo, Sequence),
        (Vespo, Token),
    ] {
        for parallel in [Parallel::Token, Parallel::Grid2d] {
            let cfg = GradcheckConfig {
                kernel: Kernel::Linear,
                parallel,
                vocab_groups: (parallel == Parallel::Grid2d).then_some(2),
                batch: 4,
                seq_len: 5,
                hidden: 21,
                vocab: 701,
                sampler_ratio: true,
                policy_mask_fraction: 0.3,
                entropy_mask_fraction: 0.5,
                loss: GrpoLossConfig {
                    loss_type: t,
                    importance_sampling_level: level,
                    epsilon_high: if t == Cispo { 5.0 } else { 0.2 },
                    beta: 0.04,
                    entropy_coef: 0.05,
                    ..GrpoLossConfig::default()
                },
                ..GradcheckConfig::default()
            };
            for (rank, r) in sharded_check::run(&cfg, 4).unwrap().into_iter().enumerate() {
                let r = r.unwrap();
                assert!(
                    r.report.passed,
                    "{t:?} {level:?} {parallel:?} rank {rank}: {:?}",
                    r.report.gates
                );
            }
        }
    }
}
