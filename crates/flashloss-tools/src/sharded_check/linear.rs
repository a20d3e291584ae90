//! The sharded fused LM-head kernel against one rank: each rank compares its loss, its
//! dH rows (or the full dH) and its dW and dbias shard.

use super::logprobs;
use super::rank::{RankReport, SHARDED_REL, before_step, grid_shape};
use crate::gradcheck::{
    Gate, GradcheckConfig, GradcheckReport, LinearCase, Objective, Outputs, Tolerance, ce_targets,
    grad_gate, inject_fault,
};
use crate::inputs::HeadInputs;
use flashloss::GrpoLoss;
use flashloss::collective::Collective;
use flashloss::cross_entropy::CrossEntropy;
use flashloss::device::{CeCall, GrpoCall};
use flashloss::element::Element;
use flashloss::shard_range;
use flashloss::{Grid, LinearGrads, Result, Shard};
use std::ops::Range;
use std::time::Instant;

/// What one rank returns, with the parts of the single-rank run it corresponds to.
struct Held {
    /// The single-rank loss and this rank's (objective `logprobs`: over its rows).
    loss: (f64, f64),
    /// The loss gate, and objective `logprobs`'s outputs against the single-rank run's.
    gates: Vec<Gate>,
    grads: LinearGrads,
    /// Rows of dH this rank holds.
    rows: Range<usize>,
    /// Vocabulary rows of dW and dbias this rank holds.
    vocab: Range<usize>,
}

/// The inputs and the single-rank result every rank compares with.
pub(super) struct Check<'c, E> {
    cfg: &'c GradcheckConfig,
    case: LinearCase<E>,
    grpo: GrpoLoss,
    ce: CrossEntropy,
    targets: Vec<i64>,
    one_loss: f64,
    one: LinearGrads,
    /// Objective `logprobs`: the single-rank run's outputs.
    one_logprobs: Option<Outputs>,
}

impl<'c, E: Element> Check<'c, E> {
    pub(super) fn new(cfg: &'c GradcheckConfig) -> Result<Self> {
        let case = LinearCase::<E>::new(cfg)?;
        let grpo = GrpoLoss::new(cfg.loss.clone())?;
        let ce = CrossEntropy::new(cfg.ce.clone())?;
        let targets = ce_targets(&case.tokens, &ce);
        let device = cfg.device.open()?;
        let (batch, inputs) = (case.tokens.batch(), case.head.inputs());
        let mut one_logprobs = None;
        let (one_loss, one) = match cfg.objective {
            Objective::Grpo => {
                let out =
                    device.with_host_grads(&inputs, GrpoCall::new(&grpo, &batch, &case.opts))?;
                (out.loss, out.grads)
            }
            Objective::Ce => {
                let out =
                    device.with_host_grads(&inputs, CeCall::new(&ce, &targets, &case.opts))?;
                (out.loss, out.grads)
            }
            Objective::Logprobs => {
                let (out, grads) = logprobs::one_rank(cfg, &case)?;
                let lp = case
                    .logprobs
                    .as_ref()
                    .expect("objective logprobs has its case");
                let loss = lp.objective(&out, 0, cfg.grad_output).0;
                one_logprobs = Some(out);
                (loss, grads)
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
            one_logprobs,
        })
    }

    /// This rank's copy of `head`, with the `nan` or `perturb` fault that hits it.
    fn held_head(&self, comm: &dyn Collective, head: HeadInputs<E>) -> HeadInputs<E> {
        let mut head = head;
        if let Some(f) = self.cfg.fault.filter(|f| f.rank == comm.rank()) {
            inject_fault(f.kind, &mut head.hidden);
        }
        head
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
        let loss_gate = |loss: f64| {
            let err = (loss - self.one_loss).abs() / self.one_loss.abs().max(1.0);
            (
                (self.one_loss, loss),
                vec![Gate::new("loss", err, SHARDED_REL)],
            )
        };
        let (loss, gates, grads) = match cfg.objective {
            Objective::Grpo => {
                let batch = part.batch();
                let o = device.with_host_grads(
                    &head.inputs(),
                    GrpoCall::new(&self.grpo, &batch, opts).sharded(&grid, shard),
                )?;
                let (loss, gates) = loss_gate(o.loss);
                (loss, gates, o.grads)
            }
            Objective::Ce => {
                let targets = &self.targets[rows.clone()];
                let o = device.with_host_grads(
                    &head.inputs(),
                    CeCall::new(&self.ce, targets, opts).sharded(&grid, shard),
                )?;
                let (loss, gates) = loss_gate(o.loss);
                (loss, gates, o.grads)
            }
            Objective::Logprobs => {
                let one = self.one_logprobs.as_ref().expect("the single-rank outputs");
                let call = (&grid, shard, rows.clone());
                logprobs::rank_step(cfg, case, call, &head, one)?
            }
        };
        Ok(Held {
            loss,
            gates,
            grads,
            rows,
            vocab,
        })
    }

    /// Runs this rank's step and gates it against the single-rank run.
    pub(super) fn rank(&self, comm: &dyn Collective) -> Result<RankReport> {
        let (cfg, one) = (self.cfg, &self.one);
        let h = cfg.hidden;
        before_step(cfg, comm)?;
        let start = Instant::now();
        let mut held = self.step(comm)?;
        let seconds = start.elapsed().as_secs_f64();
        let tol = Tolerance {
            grad_rel: Some(SHARDED_REL),
            grad_atol: Some(0.0),
            ..Tolerance::default()
        };
        let gate = |name: &'static str, got: &[f32], want: &[f32]| {
            let want: Vec<f64> = want.iter().map(|&x| x as f64).collect();
            grad_gate(name, got.iter().map(|&x| x as f64), &want, &tol, 1.0)
        };
        let mut gates = std::mem::take(&mut held.gates);
        gates.push(gate(
            "dhidden",
            &held.grads.dhidden,
            &one.dhidden[held.rows.start * h..held.rows.end * h],
        ));
        match cfg.head_grad.has_dweight() {
            true => gates.push(gate(
                "dweight",
                &held.grads.dweight,
                &one.dweight[held.vocab.start * h..held.vocab.end * h],
            )),
            // A frozen head: the entries of dW and dbias that came back (none).
            false => {
                let g = &held.grads;
                let returned = g.dweight.len() + g.dbias.as_ref().map_or(0, Vec::len);
                gates.push(Gate::new("frozen_head_grads", returned as f64, 0.0));
            }
        }
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
            report: GradcheckReport::new(kernel, held.loss, None, seconds, gates),
        })
    }
}
