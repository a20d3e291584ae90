//! `flashloss gradcheck --ranks P` (in-process ranks) and `--collective mpi` (one
//! process per rank): the sharded fused LM-head kernel (token-parallel, vocab-parallel
//! or a 2-D grid) against a single-rank run of the same inputs. Each rank compares what
//! it holds (loss, its dH rows or the full dH, the full dW or its shard) and reports
//! its own gates; sharding changes only summation order, so the gates are f32
//! rounding: 1e-5 relative to the largest entry.

use crate::gradcheck::{
    FaultKind, Gate, GradcheckConfig, GradcheckReport, Kernel, LinearCase, Objective, Tolerance,
    ce_targets, grad_gate,
};
use crate::inputs::HeadInputs;
use flashloss::collective::{Collective, agree, run_in_process};
use flashloss::config::GrpoLoss;
use flashloss::cross_entropy::CrossEntropy;
use flashloss::element::{DType, Element};
use flashloss::fused::shard_range;
use flashloss::policy::Normalizers;
use flashloss::{Error, Result};
use flashloss::{Grid, LinearGrads, Parallel, Shard};
use half::bf16;
use serde::Serialize;
use std::ops::Range;
use std::time::{Duration, Instant};

/// Relative gate of sharded vs single-rank values (f32 rounding).
const SHARDED_REL: f64 = 1e-5;

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
pub fn run(cfg: &GradcheckConfig, ranks: usize) -> crate::Result<Vec<crate::Result<RankReport>>> {
    check_ranks(cfg, ranks)?;
    let results = match cfg.dtype {
        DType::F32 => {
            let check = Check::<f32>::new(cfg)?;
            run_in_process(ranks, timeout(cfg), |comm| check.rank(comm))
        }
        DType::Bf16 => {
            let check = Check::<bf16>::new(cfg)?;
            run_in_process(ranks, timeout(cfg), |comm| check.rank(comm))
        }
    };
    Ok(results
        .into_iter()
        .map(|r| r.map_err(crate::Error::from))
        .collect())
}

/// How long a rank waits for its peers in one collective (config `timeout_s`).
pub fn timeout(cfg: &GradcheckConfig) -> Duration {
    Duration::from_secs_f64(cfg.timeout_s.max(0.0))
}

/// Runs this rank's part of the sharded check over `comm`, a group of processes (every
/// rank of `comm` calls it; an injected `exit` fault ends this process). A bad config
/// is the same error on every rank.
pub fn run_on(cfg: &GradcheckConfig, comm: &dyn Collective) -> crate::Result<RankReport> {
    if cfg
        .fault
        .is_some_and(|f| f.rank == comm.rank() && f.kind == FaultKind::Exit)
    {
        eprintln!("flashloss: injected fault: rank {} exits", comm.rank());
        std::process::exit(1);
    }
    agree(comm, check_ranks(cfg, comm.world_size()))?;
    let report = match cfg.dtype {
        DType::F32 => Check::<f32>::new(cfg)?.rank(comm),
        DType::Bf16 => Check::<bf16>::new(cfg)?.rank(comm),
    };
    Ok(report?)
}

/// `(token groups, vocab groups)` of `ranks` in the config's mode, checked.
fn grid_shape(cfg: &GradcheckConfig, ranks: usize) -> Result<(usize, usize)> {
    cfg.parallel
        .grid_shape(ranks, cfg.vocab_groups, cfg.batch, cfg.vocab)
}

fn check_ranks(cfg: &GradcheckConfig, ranks: usize) -> Result<()> {
    if cfg.kernel != Kernel::Linear {
        return Err(Error::InvalidArgument {
            arg: "ranks",
            reason: "sharded runs need kernel `linear`".into(),
        });
    }
    grid_shape(cfg, ranks).map(|_| ())
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

/// The inputs and the single-rank result every rank compares with.
struct Check<'c, E> {
    cfg: &'c GradcheckConfig,
    case: LinearCase<E>,
    grpo: GrpoLoss,
    ce: CrossEntropy,
    targets: Vec<i64>,
    one_loss: f64,
    one: LinearGrads,
}

impl<'c, E: Element> Check<'c, E> {
    fn new(cfg: &'c GradcheckConfig) -> Result<Self> {
        let case = LinearCase::<E>::new(cfg);
        let grpo = GrpoLoss::new(cfg.loss.clone())?;
        let ce = CrossEntropy::new(cfg.ce.clone())?;
        let targets = ce_targets(&case.tokens, &ce);
        let device = cfg.device.open()?;
        let (batch, inputs) = (case.tokens.batch(), case.head.inputs());
        let (one_loss, one) = match cfg.objective {
            Objective::Grpo => {
                let norm = Normalizers::local(&batch);
                let out = device.grpo_linear(&grpo, &batch, norm, &inputs, &case.opts)?;
                (out.loss, out.grads)
            }
            Objective::Ce => {
                let out = device.ce_linear(&ce, &targets, None, &inputs, &case.opts)?;
                (out.loss, out.grads)
            }
        };
        Ok(Check {
            cfg,
            case,
            grpo,
            ce,
            targets,
            one_loss,
            one,
        })
    }

    /// This rank's copy of `head`, with a NaN where a `nan` fault hits it.
    fn held_head(&self, comm: &dyn Collective, head: HeadInputs<E>) -> HeadInputs<E> {
        let mut head = head;
        if self
            .cfg
            .fault
            .is_some_and(|f| f.rank == comm.rank() && f.kind == FaultKind::Nan)
        {
            head.hidden[0] = E::from_f32(f32::NAN);
        }
        head
    }

    /// Runs the fault that hits this rank before its step, if any.
    fn before_step(&self, comm: &dyn Collective) -> Result<()> {
        let Some(fault) = self.cfg.fault.filter(|f| f.rank == comm.rank()) else {
            return Ok(());
        };
        match fault.kind {
            FaultKind::Panic => panic!("injected fault: rank {} panics", fault.rank),
            FaultKind::Hang => std::thread::sleep(2 * timeout(self.cfg)),
            FaultKind::Exit => {
                return Err(Error::InvalidArgument {
                    arg: "fault",
                    reason: format!("injected: rank {} exits", fault.rank),
                });
            }
            FaultKind::Nan => {}
        }
        Ok(())
    }

    /// This rank's sharded step.
    fn step(&self, comm: &dyn Collective) -> Result<Held> {
        let (cfg, case) = (self.cfg, &self.case);
        let t = cfg.seq_len;
        let (token_groups, vocab_groups) = grid_shape(cfg, comm.world_size())?;
        let grid = Grid::of(comm, cfg.parallel, vocab_groups)?;
        let seqs = shard_range(cfg.batch, token_groups, grid.token_group());
        let rows = seqs.start * t..seqs.end * t;
        let vocab = shard_range(cfg.vocab, vocab_groups, grid.vocab_group());
        let part = case.tokens.sequences(seqs);
        let head = self.held_head(
            comm,
            case.head.rows(rows.clone()).vocab_shard(vocab.clone()),
        );
        let shard = Shard {
            offset: vocab.start,
            vocab: cfg.vocab,
        };
        let (device, opts) = (cfg.device.open()?, &case.opts);
        let (loss, grads) = match cfg.objective {
            Objective::Grpo => {
                let batch = part.batch();
                let o = device.grpo_linear_sharded(
                    &grid,
                    shard,
                    &self.grpo,
                    &batch,
                    &head.inputs(),
                    opts,
                )?;
                (o.loss, o.grads)
            }
            Objective::Ce => {
                let targets = &self.targets[rows.clone()];
                let o = device.ce_linear_sharded(
                    &grid,
                    shard,
                    &self.ce,
                    targets,
                    &head.inputs(),
                    opts,
                )?;
                (o.loss, o.grads)
            }
        };
        Ok(Held {
            loss,
            grads,
            rows,
            vocab,
        })
    }

    /// Runs this rank's step and gates it against the single-rank run.
    fn rank(&self, comm: &dyn Collective) -> Result<RankReport> {
        let (cfg, one) = (self.cfg, &self.one);
        let h = cfg.hidden;
        self.before_step(comm)?;
        let start = Instant::now();
        let held = self.step(comm)?;
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
                (held.loss - self.one_loss).abs() / self.one_loss.abs().max(1.0),
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
            report: GradcheckReport::new(kernel, (self.one_loss, held.loss), None, seconds, gates),
        })
    }
}
