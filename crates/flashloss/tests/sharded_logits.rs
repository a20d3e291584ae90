//! The logits-level GRPO kernel sharded over a grid of in-process ranks (token-,
//! vocab-parallel, 2-D) gives what one rank gives on the whole batch: the loss and
//! metrics on every rank, each rank's rows' statistics, and each rank's shard of the
//! gradient (poisoned with NaN first, so an unwritten entry fails).

use flashloss::Grid;
use flashloss::collective::{Collective, run_in_process};
use flashloss::cpu::{grpo_logits_forward, grpo_logits_forward_sharded};
use flashloss::shard_range;
use flashloss::{
    GrpoBatch, GrpoLoss, GrpoLossConfig, ImportanceSamplingLevel, LogitsLayout, LossType, Parallel,
    PerSeqOrToken, Shard,
};
use std::time::Duration;

/// A small deterministic generator (xorshift64*), uniform in [0, 1).
struct Draw(u64);

impl Draw {
    fn next(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Inputs of a `[B, T, V]` batch: logits, targets, mask (some rows and one whole
/// sequence masked), advantages, old and reference logp.
struct Inputs {
    b: usize,
    t: usize,
    v: usize,
    logits: Vec<f32>,
    targets: Vec<i64>,
    mask: Vec<bool>,
    adv: Vec<f32>,
    old: Vec<f32>,
    reference: Vec<f32>,
    policy_mask: Vec<bool>,
    entropy_mask: Vec<bool>,
    /// Whether parts carry the policy and entropy masks.
    masks: bool,
}

impl Inputs {
    fn new(b: usize, t: usize, v: usize, seed: u64) -> Self {
        let mut d = Draw(seed);
        let n = b * t;
        let logits = (0..n * v).map(|_| (d.next() * 8.0 - 4.0) as f32).collect();
        let targets = (0..n).map(|_| (d.next() * v as f64) as i64).collect();
        let mask = (0..n).map(|i| i / t != 1 && d.next() > 0.2).collect();
        let adv = (0..b).map(|_| (d.next() * 2.0 - 1.0) as f32).collect();
        let old = (0..n).map(|_| (-3.0 - d.next()) as f32).collect();
        let reference = (0..n).map(|_| (-3.0 - d.next()) as f32).collect();
        // Uneven over sequences, so that each token group's count differs.
        let policy_mask = (0..n).map(|i| i / t != 0 && d.next() > 0.2).collect();
        let entropy_mask = (0..n).map(|i| i / t != 3 && d.next() > 0.5).collect();
        Inputs {
            b,
            t,
            v,
            logits,
            targets,
            mask,
            adv,
            old,
            reference,
            policy_mask,
            entropy_mask,
            masks: false,
        }
    }

    /// Sequences `seqs` with vocabulary entries `cols`: the batch and a dense logits shard.
    fn part(&self, seqs: std::ops::Range<usize>, cols: std::ops::Range<usize>) -> (Part, Vec<f32>) {
        let rows = seqs.start * self.t..seqs.end * self.t;
        let logits = rows
            .clone()
            .flat_map(|i| self.logits[i * self.v + cols.start..i * self.v + cols.end].to_vec())
            .collect();
        let part = Part {
            b: seqs.len(),
            t: self.t,
            targets: self.targets[rows.clone()].to_vec(),
            mask: self.mask[rows.clone()].to_vec(),
            adv: self.adv[seqs].to_vec(),
            old: self.old[rows.clone()].to_vec(),
            reference: self.reference[rows.clone()].to_vec(),
            masks: self.masks.then(|| {
                (
                    self.policy_mask[rows.clone()].to_vec(),
                    self.entropy_mask[rows].to_vec(),
                )
            }),
        };
        (part, logits)
    }
}

/// A rank's sequences.
struct Part {
    b: usize,
    t: usize,
    targets: Vec<i64>,
    mask: Vec<bool>,
    adv: Vec<f32>,
    old: Vec<f32>,
    reference: Vec<f32>,
    /// Policy and entropy masks, when the case has them.
    masks: Option<(Vec<bool>, Vec<bool>)>,
}

impl Part {
    fn batch(&self) -> GrpoBatch<'_> {
        GrpoBatch {
            batch: self.b,
            seq_len: self.t,
            target_ids: &self.targets,
            mask: &self.mask,
            advantages: PerSeqOrToken::Sequence(&self.adv),
            old_logp: Some(&self.old),
            ref_logp: Some(&self.reference),
            sampler_ratio: None,
            policy_mask: self.masks.as_ref().map(|m| &m.0[..]),
            entropy_mask: self.masks.as_ref().map(|m| &m.1[..]),
        }
    }
}

fn close(a: f64, b: f64, what: &str) {
    assert!(
        (a - b).abs() <= 1e-5 * b.abs().max(1e-3),
        "{what}: {a} vs {b}"
    );
}

/// Runs `parallel` on `ranks` ranks (`vocab_groups` for 2-D) and checks every rank's
/// part against one rank.
fn check(loss: &GrpoLoss, parallel: Parallel, ranks: usize, vocab_groups: usize, masks: bool) {
    let mut inputs = Inputs::new(4, 6, 37, 7);
    inputs.masks = masks;
    let (b, t, v) = (inputs.b, inputs.t, inputs.v);
    let (whole, logits) = inputs.part(0..b, 0..v);
    let layout = LogitsLayout::contiguous(b, t, v);
    let one = grpo_logits_forward(loss, &whole.batch(), &logits, &layout).unwrap();
    let mut one_grad = vec![f32::NAN; b * t * v];
    one.backward(&logits, 1.0, &mut one_grad).unwrap();
    let (token_groups, groups) = parallel
        .grid_shape(ranks, Some(vocab_groups), b, v)
        .unwrap();
    let results = run_in_process(ranks, Duration::from_secs(30), |comm| {
        let grid = Grid::of(comm, parallel, groups)?;
        let (tg, vg) = (grid.token_group(), grid.vocab_group());
        let seqs = shard_range(b, token_groups, tg);
        let cols = shard_range(v, groups, vg);
        let (part, shard_logits) = inputs.part(seqs.clone(), cols.clone());
        let layout = LogitsLayout::contiguous(part.b, t, cols.len());
        let shard = Shard::of_rank(v, groups, vg);
        let fwd =
            grpo_logits_forward_sharded(&grid, shard, loss, &part.batch(), &shard_logits, &layout)?;
        let mut grad = vec![f32::NAN; shard_logits.len()];
        fwd.backward(&shard_logits, 1.0, &mut grad)?;
        Ok((comm.rank(), seqs, cols, fwd, grad))
    });
    let max_grad = one_grad.iter().fold(0.0f32, |m, g| m.max(g.abs())) as f64;
    for r in results {
        let (rank, seqs, cols, fwd, grad) = r.unwrap();
        let case = format!("{parallel:?} rank {rank}");
        close(fwd.loss, one.loss, &format!("{case} loss"));
        close(
            fwd.metrics.kl_mean,
            one.metrics.kl_mean,
            &format!("{case} kl"),
        );
        close(
            fwd.metrics.entropy_mean,
            one.metrics.entropy_mean,
            &format!("{case} entropy"),
        );
        let rows = seqs.start * t..seqs.end * t;
        for (local, i) in rows.clone().enumerate() {
            let (a, e) = (fwd.stats[local], one.stats[i]);
            close(
                a.logp as f64,
                e.logp as f64,
                &format!("{case} logp row {i}"),
            );
            close(a.lse as f64, e.lse as f64, &format!("{case} lse row {i}"));
            for (c, j) in cols.clone().enumerate() {
                let (g, want) = (grad[local * cols.len() + c], one_grad[i * v + j]);
                assert!(
                    ((g - want).abs() as f64) <= 1e-5 * max_grad + 1e-7,
                    "{case} dlogits[{i}, {j}] = {g}, one rank {want}"
                );
            }
        }
    }
}

#[test]
fn sharded_logits_match_one_rank() {
    let configs = [
        GrpoLossConfig {
            beta: 0.04,
            loss_type: LossType::Grpo,
            ..GrpoLossConfig::default()
        },
        GrpoLossConfig {
            loss_type: LossType::Dapo,
            entropy_coef: 0.01,
            ..GrpoLossConfig::default()
        },
        GrpoLossConfig {
            importance_sampling_level: ImportanceSamplingLevel::Sequence,
            temperature: 0.7,
            loss_type: LossType::Grpo,
            ..GrpoLossConfig::default()
        },
        // TRL 1.16: the entropy bonus's Σ m' is global, luspo and sapo at sequence level.
        GrpoLossConfig {
            loss_type: LossType::Luspo,
            beta: 0.04,
            entropy_coef: 0.05,
            ..GrpoLossConfig::default()
        },
        GrpoLossConfig {
            loss_type: LossType::Sapo,
            importance_sampling_level: ImportanceSamplingLevel::Sequence,
            beta: 0.04,
            entropy_coef: 0.05,
            ..GrpoLossConfig::default()
        },
    ];
    for config in configs {
        let loss = GrpoLoss::new(config).unwrap();
        for masks in [false, true] {
            check(&loss, Parallel::Token, 2, 1, masks);
            check(&loss, Parallel::Vocab, 3, 3, masks);
            check(&loss, Parallel::Grid2d, 4, 2, masks);
        }
    }
}

#[test]
fn a_bad_shard_is_the_same_error_on_every_rank() {
    let inputs = Inputs::new(2, 3, 11, 3);
    let loss = GrpoLoss::new(GrpoLossConfig {
        loss_type: LossType::Grpo,
        ..GrpoLossConfig::default()
    })
    .unwrap();
    let results = run_in_process(2, Duration::from_secs(30), |comm| {
        let grid = Grid::vocab(comm);
        let (part, logits) = inputs.part(0..2, 0..6);
        let layout = LogitsLayout::contiguous(2, 3, 6);
        // Rank 1 claims entries 6..12 of a vocabulary of 11.
        let shard = Shard {
            offset: 6 * comm.rank(),
            vocab: 11,
        };
        grpo_logits_forward_sharded(&grid, shard, &loss, &part.batch(), &logits, &layout)
            .map(|f| f.loss)
    });
    for r in results {
        let e = r.unwrap_err().to_string();
        assert!(
            e.starts_with("rank 1: argument `shard`: rows 6..12 lie outside the vocabulary of 11"),
            "{e}"
        );
    }
}
