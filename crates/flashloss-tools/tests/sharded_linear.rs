//! Sharded fused LM-head losses over the in-process collective, P ∈ {1, 2, 3, 4}:
//! token-parallel, vocab-parallel and 2-D grid GRPO (token and sequence level) and CE
//! equal the single-rank run within f32 rounding, with uneven shards and a rank whose
//! rows are all masked; bad input on one rank is the same error on every rank; a rank
//! that panics, leaves or hangs makes its peers fail instead of hang; split groups are
//! independent.

use crate::common;
use common::cpu_steps::{
    VocabShard, ce_linear, ce_linear_grid, ce_linear_token_parallel, ce_linear_vocab_parallel,
    grpo_linear, grpo_linear_grid, grpo_linear_token_parallel, grpo_linear_vocab_parallel,
};
use common::*;
use flashloss::collective::{Collective, run_in_process};
use flashloss::reference::linear_logits;
use flashloss::shard_range;
use flashloss::{
    CeConfig, CrossEntropy, Error, GrpoLoss, GrpoLossConfig, ImportanceSamplingLevel, LossType,
};
use flashloss::{FusedOptions, Grid, LinearGrads, Mode};
use flashloss_tools::inputs::GrpoInputs;
use std::time::Duration;

const TIMEOUT: Duration = Duration::from_secs(60);
const B: usize = 5;
const T: usize = 6;
const H: usize = 29;
const V: usize = 1031;

fn opts() -> FusedOptions {
    FusedOptions {
        bf16_products: Default::default(),
        mode: Mode::TwoPass,
        budget_bytes: Some(flashloss::cpu::gemm_reserve_bytes() + (1 << 20)),
        grad_output: 0.75,
        head_grad: Default::default(),
    }
}

/// Inputs whose sequence 1 is entirely masked (rank 1's only sequence at P = 4 is
/// sequence 1 or 2, depending on the split; both cases are covered across P).
fn inputs() -> (Head<f32>, GrpoInputs) {
    let head = Head::<f32>::random(B * T, H, V, true, 31);
    let mut x = draw(B, T, V, 32);
    x.data.mask[T..2 * T].fill(false);
    let z = linear_logits(&head.inputs());
    x.follow_policy(&z, 1.0);
    (head, x)
}

fn close(name: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{name}: length");
    let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-12);
    let err = got
        .iter()
        .zip(want)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(
        err <= 1e-5 * scale,
        "{name}: max error {err:e}, scale {scale:e}"
    );
}

fn close_loss(name: &str, got: f64, want: f64) {
    assert!(
        (got - want).abs() <= 1e-6 * want.abs().max(1e-3),
        "{name}: loss {got} vs {want}"
    );
}

fn grpo_losses() -> Vec<GrpoLoss> {
    [
        ImportanceSamplingLevel::Token,
        ImportanceSamplingLevel::Sequence,
    ]
    .into_iter()
    .map(|level| {
        GrpoLoss::new(GrpoLossConfig {
            importance_sampling_level: level,
            beta: 0.04,
            entropy_coef: 0.01,
            loss_type: LossType::Grpo,
            ..GrpoLossConfig::default()
        })
        .unwrap()
    })
    .collect()
}

#[test]
fn grpo_token_parallel_matches_one_rank() {
    let (head, x) = inputs();
    for loss in grpo_losses() {
        let one = grpo_linear(&loss, &x.batch(), &head.inputs(), &opts()).unwrap();
        for p in 1..=4 {
            let results = run_in_process(p, TIMEOUT, |comm| {
                let seqs = shard_range(B, comm.world_size(), comm.rank());
                let rows = seqs.start * T..seqs.end * T;
                let part = x.sequences(seqs);
                let local_head = head.rows(rows.clone());
                let out = grpo_linear_token_parallel(
                    comm,
                    &loss,
                    &part.batch(),
                    &local_head.inputs(),
                    &opts(),
                )?;
                Ok((rows, out))
            });
            for (rank, r) in results.into_iter().enumerate() {
                let (rows, out) = r.unwrap();
                let case = format!(
                    "token P={p} rank {rank} {:?}",
                    loss.config().importance_sampling_level
                );
                close_loss(&case, out.loss, one.loss);
                assert!(
                    (out.metrics.kl_mean - one.metrics.kl_mean).abs() < 1e-6,
                    "{case}"
                );
                assert!(
                    (out.metrics.entropy_mean - one.metrics.entropy_mean).abs() < 1e-5,
                    "{case}"
                );
                close(
                    &format!("{case} dW"),
                    &out.grads.dweight,
                    &one.grads.dweight,
                );
                close(
                    &format!("{case} dbias"),
                    out.grads.dbias.as_ref().unwrap(),
                    one.grads.dbias.as_ref().unwrap(),
                );
                close(
                    &format!("{case} dH"),
                    &out.grads.dhidden,
                    &one.grads.dhidden[rows.start * H..rows.end * H],
                );
            }
        }
    }
}

#[test]
fn grpo_vocab_parallel_matches_one_rank() {
    let (head, x) = inputs();
    for loss in grpo_losses() {
        let one = grpo_linear(&loss, &x.batch(), &head.inputs(), &opts()).unwrap();
        for p in 1..=4 {
            let results = run_in_process(p, TIMEOUT, |comm| {
                let range = shard_range(V, comm.world_size(), comm.rank());
                let part = head.vocab_shard(range.clone());
                let shard = VocabShard {
                    inputs: part.inputs(),
                    offset: range.start,
                    vocab: V,
                };
                let out = grpo_linear_vocab_parallel(comm, &loss, &x.batch(), &shard, &opts())?;
                Ok((range, out))
            });
            for (rank, r) in results.into_iter().enumerate() {
                let (range, out) = r.unwrap();
                let case = format!("vocab P={p} rank {rank}");
                close_loss(&case, out.loss, one.loss);
                close(
                    &format!("{case} dH"),
                    &out.grads.dhidden,
                    &one.grads.dhidden,
                );
                close(
                    &format!("{case} dW"),
                    &out.grads.dweight,
                    &one.grads.dweight[range.start * H..range.end * H],
                );
                close(
                    &format!("{case} dbias"),
                    out.grads.dbias.as_ref().unwrap(),
                    &one.grads.dbias.as_ref().unwrap()[range.clone()],
                );
                for i in 0..B * T {
                    assert!(
                        (out.stats[i].logp - one.stats[i].logp).abs() < 1e-5,
                        "{case} logp {i}"
                    );
                }
            }
        }
    }
}

#[test]
fn ce_token_and_vocab_parallel_match_one_rank() {
    let (head, x) = inputs();
    let ce = CrossEntropy::new(CeConfig {
        label_smoothing: 0.1,
        z_loss: 1e-3,
        softcap: Some(5.0),
        temperature: 0.9,
        ..CeConfig::default()
    })
    .unwrap();
    // Sequence 1 is masked: its rows are ignored.
    let targets: Vec<i64> = (0..B * T)
        .map(|i| {
            if x.data.mask[i] {
                x.data.target_ids[i]
            } else {
                -100
            }
        })
        .collect();
    let one = ce_linear(&ce, &targets, &head.inputs(), &opts()).unwrap();
    let empty = LinearGrads::zeros(&head.inputs());
    assert_ne!(one.grads.dweight, empty.dweight);
    for p in 1..=4 {
        let token = run_in_process(p, TIMEOUT, |comm| {
            let seqs = shard_range(B, comm.world_size(), comm.rank());
            let rows = seqs.start * T..seqs.end * T;
            let out = ce_linear_token_parallel(
                comm,
                &ce,
                &targets[rows.clone()],
                &head.rows(rows.clone()).inputs(),
                &opts(),
            )?;
            Ok((rows, out))
        });
        for (rank, r) in token.into_iter().enumerate() {
            let (rows, out) = r.unwrap();
            let case = format!("ce token P={p} rank {rank}");
            close_loss(&case, out.loss, one.loss);
            close(
                &format!("{case} dW"),
                &out.grads.dweight,
                &one.grads.dweight,
            );
            close(
                &format!("{case} dH"),
                &out.grads.dhidden,
                &one.grads.dhidden[rows.start * H..rows.end * H],
            );
        }
        let vocab = run_in_process(p, TIMEOUT, |comm| {
            let range = shard_range(V, comm.world_size(), comm.rank());
            let part = head.vocab_shard(range.clone());
            let shard = VocabShard {
                inputs: part.inputs(),
                offset: range.start,
                vocab: V,
            };
            Ok((
                range,
                ce_linear_vocab_parallel(comm, &ce, &targets, &shard, &opts())?,
            ))
        });
        for (rank, r) in vocab.into_iter().enumerate() {
            let (range, out) = r.unwrap();
            let case = format!("ce vocab P={p} rank {rank}");
            close_loss(&case, out.loss, one.loss);
            close(
                &format!("{case} dH"),
                &out.grads.dhidden,
                &one.grads.dhidden,
            );
            close(
                &format!("{case} dW"),
                &out.grads.dweight,
                &one.grads.dweight[range.start * H..range.end * H],
            );
            close(&format!("{case} row loss"), &out.row_loss, &one.row_loss);
        }
    }
}

#[test]
fn bad_input_on_one_rank_is_the_same_error_everywhere() {
    let (head, x) = inputs();
    let loss = &grpo_losses()[0];
    for p in [2, 3] {
        let results = run_in_process(p, TIMEOUT, |comm| {
            let range = shard_range(V, comm.world_size(), comm.rank());
            let mut part = head.vocab_shard(range.clone());
            if comm.rank() == 1 {
                part.weight[7] = f32::NAN;
            }
            let shard = VocabShard {
                inputs: part.inputs(),
                offset: range.start,
                vocab: V,
            };
            grpo_linear_vocab_parallel(comm, loss, &x.batch(), &shard, &opts())
        });
        for r in results {
            assert_eq!(
                r.unwrap_err(),
                Error::OnRank {
                    rank: 1,
                    reason: "argument `weight`: value NaN at index 7 is not finite".into()
                }
            );
        }
        let results = run_in_process(p, TIMEOUT, |comm| {
            let seqs = shard_range(B, comm.world_size(), comm.rank());
            let mut part = x.sequences(seqs.clone());
            if comm.rank() == p - 1 {
                part.data.target_ids[2] = V as i64;
                part.data.mask[2] = true;
            }
            let local_head = head.rows(seqs.start * T..seqs.end * T);
            grpo_linear_token_parallel(comm, loss, &part.batch(), &local_head.inputs(), &opts())
        });
        for r in results {
            let err = r.unwrap_err().to_string();
            assert!(
                err.starts_with(&format!("rank {}: argument `target_ids`: id {V}", p - 1)),
                "{err}"
            );
        }
    }
}

#[test]
fn a_rank_that_panics_or_leaves_does_not_hang_its_peers() {
    let results = run_in_process(3, TIMEOUT, |comm| {
        if comm.rank() == 2 {
            panic!("injected failure");
        }
        let mut buf = [1.0f32; 4];
        comm.all_reduce_sum_f32(&mut buf)?;
        Ok(buf)
    });
    for (rank, r) in results.iter().enumerate() {
        let err = r.as_ref().unwrap_err().to_string();
        if rank == 2 {
            assert_eq!(err, "collective: rank 2 panicked");
        } else {
            // Rank 2 leaves first; a peer that already failed may be seen leaving too.
            assert!(
                err.starts_with("collective: rank ") && err.contains(" left while rank"),
                "{err}"
            );
        }
    }
    let results = run_in_process(2, Duration::from_millis(200), |comm| {
        if comm.rank() == 0 {
            std::thread::sleep(Duration::from_secs(1));
        }
        comm.barrier()
    });
    let err = results[1].as_ref().unwrap_err().to_string();
    assert!(err.contains("(timeout)"), "{err}");
}

#[test]
fn collectives_combine_in_rank_order() {
    let results = run_in_process(4, TIMEOUT, |comm| {
        let r = comm.rank() as f32;
        let mut sum = vec![r; 3_000_001];
        comm.all_reduce_sum_f32(&mut sum)?;
        let mut max = [r, -r];
        comm.all_reduce_max_f32(&mut max)?;
        let mut b = [r as f64; 2];
        comm.broadcast_f64(&mut b, 2)?;
        let gathered = comm.all_gather_f64(&vec![r as f64; comm.rank()])?;
        Ok((sum[3_000_000], max, b, gathered))
    });
    for r in results {
        let (sum, max, b, gathered) = r.unwrap();
        assert_eq!(sum, 6.0);
        assert_eq!(max, [3.0, 0.0]);
        assert_eq!(b, [2.0, 2.0]);
        assert_eq!(
            gathered.iter().map(Vec::len).collect::<Vec<_>>(),
            [0, 1, 2, 3]
        );
    }
    let results = run_in_process(2, TIMEOUT, |comm| {
        let mut buf = vec![0.0f32; 3 + comm.rank()];
        comm.all_reduce_sum_f32(&mut buf)
    });
    assert!(
        results[0]
            .as_ref()
            .unwrap_err()
            .to_string()
            .contains("different lengths")
    );
}

const GRIDS: [(usize, usize); 8] = [
    (1, 1),
    (2, 1),
    (1, 2),
    (3, 1),
    (1, 3),
    (2, 2),
    (4, 1),
    (1, 4),
];

/// This grid rank's rows (from its token group's sequences) and vocabulary shard.
fn grid_share(
    grid: &Grid,
    token_groups: usize,
    vocab_groups: usize,
) -> (std::ops::Range<usize>, std::ops::Range<usize>) {
    let seqs = shard_range(B, token_groups, grid.token_group());
    (
        seqs.start * T..seqs.end * T,
        shard_range(V, vocab_groups, grid.vocab_group()),
    )
}

#[test]
fn grid_2d_matches_one_rank() {
    let (head, x) = inputs();
    let ce = CrossEntropy::new(CeConfig {
        label_smoothing: 0.1,
        z_loss: 1e-3,
        ..CeConfig::default()
    })
    .unwrap();
    let targets: Vec<i64> = (0..B * T)
        .map(|i| {
            if x.data.mask[i] {
                x.data.target_ids[i]
            } else {
                -100
            }
        })
        .collect();
    let ce_one = ce_linear(&ce, &targets, &head.inputs(), &opts()).unwrap();
    for loss in grpo_losses() {
        let one = grpo_linear(&loss, &x.batch(), &head.inputs(), &opts()).unwrap();
        for (tg, vg) in GRIDS {
            let results = run_in_process(tg * vg, TIMEOUT, |comm| {
                let grid = Grid::split(comm, vg)?;
                let (rows, vocab) = grid_share(&grid, tg, vg);
                let part = x.sequences(shard_range(B, tg, grid.token_group()));
                let local = head.rows(rows.clone()).vocab_shard(vocab.clone());
                let shard = VocabShard {
                    inputs: local.inputs(),
                    offset: vocab.start,
                    vocab: V,
                };
                let grpo = grpo_linear_grid(&grid, &loss, &part.batch(), &shard, &opts())?;
                let ce_out = ce_linear_grid(&grid, &ce, &targets[rows.clone()], &shard, &opts())?;
                Ok((rows, vocab, grpo, ce_out))
            });
            for (rank, r) in results.into_iter().enumerate() {
                let (rows, vocab, out, ce_out) = r.unwrap();
                let case = format!(
                    "grid {tg}x{vg} rank {rank} {:?}",
                    loss.config().importance_sampling_level
                );
                close_loss(&case, out.loss, one.loss);
                assert!(
                    (out.metrics.kl_mean - one.metrics.kl_mean).abs() < 1e-6
                        && (out.metrics.entropy_mean - one.metrics.entropy_mean).abs() < 1e-5,
                    "{case} metrics"
                );
                let dh = &one.grads.dhidden[rows.start * H..rows.end * H];
                let dw = &one.grads.dweight[vocab.start * H..vocab.end * H];
                close(&format!("{case} dH"), &out.grads.dhidden, dh);
                close(&format!("{case} dW"), &out.grads.dweight, dw);
                close(
                    &format!("{case} dbias"),
                    out.grads.dbias.as_ref().unwrap(),
                    &one.grads.dbias.as_ref().unwrap()[vocab.clone()],
                );
                for (k, i) in rows.clone().enumerate() {
                    assert!(
                        (out.stats[k].logp - one.stats[i].logp).abs() < 1e-5,
                        "{case} logp {i}"
                    );
                }
                close_loss(&format!("ce {case}"), ce_out.loss, ce_one.loss);
                close(
                    &format!("ce {case} row loss"),
                    &ce_out.row_loss,
                    &ce_one.row_loss[rows.clone()],
                );
                let dh = &ce_one.grads.dhidden[rows.start * H..rows.end * H];
                let dw = &ce_one.grads.dweight[vocab.start * H..vocab.end * H];
                close(&format!("ce {case} dH"), &ce_out.grads.dhidden, dh);
                close(&format!("ce {case} dW"), &ce_out.grads.dweight, dw);
            }
        }
    }
}

#[test]
fn split_groups_are_independent_and_ordered_by_key() {
    // Ranks 0..4 split by parity, keys reversed: group {0, 2} orders 2 before 0.
    let results = run_in_process(4, TIMEOUT, |comm| {
        let group = comm.split(comm.rank() % 2, 10 - comm.rank())?;
        // The odd group runs one more collective than the even group.
        let rounds = 2 + comm.rank() % 2;
        let mut last = Vec::new();
        for round in 0..rounds {
            last = group.all_gather_f64(&[(comm.rank() * 10 + round) as f64])?;
        }
        comm.barrier()?;
        Ok((group.rank(), group.world_size(), last))
    });
    let got: Vec<_> = results.into_iter().map(Result::unwrap).collect();
    assert_eq!(got[0], (1, 2, vec![vec![21.0], vec![1.0]]));
    assert_eq!(got[2], (0, 2, vec![vec![21.0], vec![1.0]]));
    assert_eq!(got[1], (1, 2, vec![vec![32.0], vec![12.0]]));
    assert_eq!(got[3], (0, 2, vec![vec![32.0], vec![12.0]]));
    // A rank that leaves is seen by its sub-group's peers.
    let results = run_in_process(4, TIMEOUT, |comm| {
        let group = comm.split(comm.rank() / 2, 0)?;
        if comm.rank() == 3 {
            return Ok(());
        }
        group.barrier()
    });
    assert!(results[0].is_ok() && results[1].is_ok() && results[3].is_ok());
    let err = results[2].as_ref().unwrap_err().to_string();
    assert_eq!(
        err,
        "collective: rank 1 left while rank 0 waited in a collective"
    );
}
