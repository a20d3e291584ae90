//! The sharded logits-level GRPO kernel against one rank: each rank holds its token
//! group's sequences and a vocabulary shard of their logits, and compares the loss,
//! its rows' logp and its shard of `dlogits`.

use super::rank::{RankReport, SHARDED_REL, before_step, grid_shape};
use crate::gradcheck::{
    Gate, GradcheckConfig, GradcheckReport, Tolerance, grad_gate, inject_fault,
};
use crate::inputs::GrpoInputs;
use flashloss::collective::Collective;
use flashloss::cpu::{grpo_logits_forward, grpo_logits_forward_sharded};
use flashloss::shard_range;
use flashloss::{Element, Grid, GrpoLogitsForward, GrpoLoss, LogitsLayout, Result, Shard};
use std::ops::Range;
use std::time::Instant;

/// The inputs and the single-rank forward and gradient every rank compares with.
pub(super) struct LogitsCheck<'c, E> {
    cfg: &'c GradcheckConfig,
    inputs: GrpoInputs,
    logits: Vec<E>,
    loss: GrpoLoss,
    one: GrpoLogitsForward,
    one_grad: Vec<E>,
}

impl<'c, E: Element> LogitsCheck<'c, E> {
    /// The inputs gradcheck draws for kernel `logits`, and one rank's run on them.
    pub(super) fn new(cfg: &'c GradcheckConfig) -> Result<Self> {
        let loss = GrpoLoss::new(cfg.loss.clone())?;
        let inputs = GrpoInputs::try_random(&cfg.input_spec(), cfg.seed)?;
        let logits: Vec<E> = inputs.logits.iter().map(|&x| E::from_f32(x)).collect();
        let batch = inputs.batch();
        let layout = LogitsLayout::contiguous(batch.batch, batch.seq_len, inputs.vocab);
        let one = grpo_logits_forward(&loss, &batch, &logits, &layout)?;
        let mut one_grad = vec![E::from_f32(f32::NAN); logits.len()];
        one.backward(&logits, cfg.grad_output as f32, &mut one_grad)?;
        Ok(LogitsCheck {
            cfg,
            inputs,
            logits,
            loss,
            one,
            one_grad,
        })
    }

    /// Rows `rows` × entries `cols` of `m` (a dense `[N, V]` buffer).
    fn block(&self, m: &[E], rows: &Range<usize>, cols: &Range<usize>) -> Vec<E> {
        let v = self.inputs.vocab;
        rows.clone()
            .flat_map(|i| m[i * v + cols.start..i * v + cols.end].iter().copied())
            .collect()
    }

    /// Runs this rank's sharded forward and backward and gates them against one rank.
    pub(super) fn rank(&self, comm: &dyn Collective) -> Result<RankReport> {
        let (cfg, t, v) = (self.cfg, self.cfg.seq_len, self.inputs.vocab);
        before_step(cfg, comm)?;
        let start = Instant::now();
        let (token_groups, vocab_groups) = grid_shape(cfg, comm.world_size())?;
        let grid = Grid::of(comm, cfg.parallel, vocab_groups)?;
        let seqs = shard_range(cfg.batch, token_groups, grid.token_group());
        let rows = seqs.start * t..seqs.end * t;
        let cols = shard_range(v, vocab_groups, grid.vocab_group());
        let part = self.inputs.sequences(seqs.clone());
        let mut logits = self.block(&self.logits, &rows, &cols);
        if let Some(f) = cfg.fault.filter(|f| f.rank == comm.rank()) {
            inject_fault(f.kind, &mut logits);
        }
        let layout = LogitsLayout::contiguous(seqs.len(), t, cols.len());
        let shard = Shard {
            offset: cols.start,
            vocab: v,
        };
        let batch = part.batch();
        let fwd = grpo_logits_forward_sharded(&grid, shard, &self.loss, &batch, &logits, &layout)?;
        let mut grad = vec![E::from_f32(f32::NAN); logits.len()];
        fwd.backward(&logits, cfg.grad_output as f32, &mut grad)?;
        let seconds = start.elapsed().as_secs_f64();
        let tol = Tolerance {
            grad_rel: Some(SHARDED_REL),
            grad_atol: Some(0.0),
            ..Tolerance::default()
        };
        let want: Vec<f64> = self
            .block(&self.one_grad, &rows, &cols)
            .iter()
            .map(|x| x.to_f32() as f64)
            .collect();
        let logp = rows
            .clone()
            .enumerate()
            .filter(|&(_, i)| self.inputs.data.mask[i])
            .map(|(r, i)| (fwd.stats[r].logp - self.one.stats[i].logp).abs() as f64)
            .fold(0.0, f64::max);
        let gates = vec![
            Gate::new(
                "loss",
                (fwd.loss - self.one.loss).abs() / self.one.loss.abs().max(1.0),
                SHARDED_REL,
            ),
            Gate::new("logp", logp, SHARDED_REL),
            grad_gate(
                "dlogits",
                grad.iter().map(|x| x.to_f32() as f64),
                &want,
                &tol,
                1.0,
            ),
        ];
        let kernel = format!("logits grpo {:?} {:?}-parallel", E::DTYPE, cfg.parallel);
        Ok(RankReport {
            rank: comm.rank(),
            world_size: comm.world_size(),
            parallel: cfg.parallel,
            report: GradcheckReport::new(
                kernel,
                (self.one.loss, fwd.loss),
                Some((self.one.metrics, fwd.metrics)),
                seconds,
                gates,
            ),
        })
    }
}
