//! `flashloss gradcheck --ranks P`: the sharded fused LM-head kernel (token- or
//! vocab-parallel, in-process ranks) against a single-rank run of the same inputs.
//! Each rank compares what it holds (loss, its dH rows or the full dH, the full dW or
//! its shard) and reports its own gates; sharding changes only summation order, so the
//! gates are f32 rounding: 1e-5 relative to the largest entry.

use super::gradcheck::{
    Gate, GradcheckConfig, GradcheckReport, Kernel, LinearCase, Objective, Tolerance, ce_targets,
    grad_gate,
};
use crate::collective::{Collective, run_in_process};
use crate::config::GrpoLoss;
use crate::cpu::{
    LinearGrads, Parallel, VocabShard, ce_linear, ce_linear_token_parallel,
    ce_linear_vocab_parallel, grpo_linear, grpo_linear_token_parallel, grpo_linear_vocab_parallel,
    shard_range,
};
use crate::cross_entropy::CrossEntropy;
use crate::element::{DType, Element};
use crate::error::{Error, Result};
use half::bf16;
use serde::Serialize;
use std::ops::Range;
use std::time::{Duration, Instant};

/// Relative gate of sharded vs single-rank values (f32 rounding).
const SHARDED_REL: f64 = 1e-5;

/// How long a rank waits for its peers in one collective.
const TIMEOUT: Duration = Duration::from_secs(600);

/// One rank's result.
#[derive(Debug, Clone, Serialize)]
pub struct RankReport {
    /// This rank.
    pub rank: usize,
    /// Ranks in the run.
    pub world_size: usize,
    /// The split.
    pub parallel: Parallel,
    /// Gates against the single-rank run (`loss_ref` is the single-rank loss).
    #[serde(flatten)]
    pub report: GradcheckReport,
}

/// Runs the sharded check on `ranks` in-process ranks; one result per rank (a failure
/// on any rank is the same error on all).
pub fn run(cfg: &GradcheckConfig, ranks: usize) -> Result<Vec<Result<RankReport>>> {
    if cfg.kernel != Kernel::Linear {
        return Err(Error::InvalidArgument {
            arg: "ranks",
            reason: "sharded runs need kernel `linear`".into(),
        });
    }
    if ranks == 0 || ranks > cfg.batch.min(cfg.vocab) {
        return Err(Error::InvalidArgument {
            arg: "ranks",
            reason: format!(
                "must be in 1..={} (every rank holds a sequence and a vocabulary entry), got {ranks}",
                cfg.batch.min(cfg.vocab)
            ),
        });
    }
    match cfg.dtype {
        DType::F32 => run_typed::<f32>(cfg, ranks),
        DType::Bf16 => run_typed::<bf16>(cfg, ranks),
    }
}

/// What one rank returns, with the parts of the single-rank run it corresponds to.
struct Held {
    loss: f64,
    grads: LinearGrads,
    /// Rows of dH this rank holds.
    rows: Range<usize>,
    /// Vocabulary rows of dW and dbias this rank holds.
    vocab: Range<usize>,
}

fn run_typed<E: Element>(cfg: &GradcheckConfig, ranks: usize) -> Result<Vec<Result<RankReport>>> {
    let case = LinearCase::<E>::new(cfg);
    let (t, h, v) = (cfg.seq_len, cfg.hidden, cfg.vocab);
    let n = cfg.batch * t;
    let batch = case.tokens.batch();
    let grpo = GrpoLoss::new(cfg.loss.clone())?;
    let ce = CrossEntropy::new(cfg.ce.clone())?;
    let targets = ce_targets(&case.tokens, &ce);
    let (one_loss, one) = match cfg.objective {
        Objective::Grpo => {
            let out = grpo_linear(&grpo, &batch, &case.head.inputs(), &case.opts)?;
            (out.loss, out.grads)
        }
        Objective::Ce => {
            let out = ce_linear(&ce, &targets, &case.head.inputs(), &case.opts)?;
            (out.loss, out.grads)
        }
    };
    let rank_step = |comm: &dyn Collective| -> Result<Held> {
        let (p, r) = (comm.world_size(), comm.rank());
        match cfg.parallel {
            Parallel::Token => {
                let seqs = shard_range(cfg.batch, p, r);
                let rows = seqs.start * t..seqs.end * t;
                let part = case.tokens.sequences(seqs);
                let head = case.head.rows(rows.clone());
                let (loss, grads) = match cfg.objective {
                    Objective::Grpo => {
                        let o = grpo_linear_token_parallel(
                            comm,
                            &grpo,
                            &part.batch(),
                            &head.inputs(),
                            &case.opts,
                        )?;
                        (o.loss, o.grads)
                    }
                    Objective::Ce => {
                        let o = ce_linear_token_parallel(
                            comm,
                            &ce,
                            &targets[rows.clone()],
                            &head.inputs(),
                            &case.opts,
                        )?;
                        (o.loss, o.grads)
                    }
                };
                Ok(Held {
                    loss,
                    grads,
                    rows,
                    vocab: 0..v,
                })
            }
            Parallel::Vocab => {
                let range = shard_range(v, p, r);
                let part = case.head.vocab_shard(range.clone());
                let shard = VocabShard {
                    inputs: part.inputs(),
                    offset: range.start,
                    vocab: v,
                };
                let (loss, grads) = match cfg.objective {
                    Objective::Grpo => {
                        let o =
                            grpo_linear_vocab_parallel(comm, &grpo, &batch, &shard, &case.opts)?;
                        (o.loss, o.grads)
                    }
                    Objective::Ce => {
                        let o = ce_linear_vocab_parallel(comm, &ce, &targets, &shard, &case.opts)?;
                        (o.loss, o.grads)
                    }
                };
                Ok(Held {
                    loss,
                    grads,
                    rows: 0..n,
                    vocab: range,
                })
            }
        }
    };
    let results = run_in_process(ranks, TIMEOUT, |comm| {
        let start = Instant::now();
        let held = rank_step(comm)?;
        let seconds = start.elapsed().as_secs_f64();
        let tol = Tolerance {
            grad_rel: Some(SHARDED_REL),
            grad_atol: Some(0.0),
            ..Tolerance::default()
        };
        let gate = |name: &'static str, got: &[f32], want: &[f32]| {
            let want: Vec<f64> = want.iter().map(|&x| x as f64).collect();
            grad_gate(name, got.iter().map(|&x| x as f64), &want, &tol)
        };
        let mut gates = vec![
            Gate::new(
                "loss",
                (held.loss - one_loss).abs() / one_loss.abs().max(1.0),
                SHARDED_REL,
            ),
            gate(
                "dhidden",
                &held.grads.dhidden,
                &one.dhidden[held.rows.start * h..held.rows.end * h],
            ),
            gate(
                "dweight",
                &held.grads.dweight,
                &one.dweight[held.vocab.start * h..held.vocab.end * h],
            ),
        ];
        if let (Some(got), Some(want)) = (&held.grads.dbias, &one.dbias) {
            gates.push(gate("dbias", got, &want[held.vocab.clone()]));
        }
        let kernel = format!(
            "linear {:?} {:?} {:?}-parallel",
            cfg.objective,
            E::DTYPE,
            cfg.parallel
        );
        Ok(RankReport {
            rank: comm.rank(),
            world_size: comm.world_size(),
            parallel: cfg.parallel,
            report: GradcheckReport::new(kernel, (one_loss, held.loss), None, seconds, gates),
        })
    });
    Ok(results)
}
