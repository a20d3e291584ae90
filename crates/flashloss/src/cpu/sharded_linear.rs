//! Sharded fused LM-head losses over a [`Collective`]: token-parallel (each rank holds
//! some sequences and the whole head) and vocab-parallel (each rank holds all tokens
//! and a shard `[V_r, H]` of the head). Inputs are checked on every rank and any
//! failure becomes the same error everywhere ([`agree`]).
//!
//! Token-parallel: the normalizers (B, token count, CE's counted rows) are all-reduced
//! first, each rank runs the fused kernel on its rows, then dW and dbias are
//! all-reduced. Per step: `4·(V·H + V)` bytes each way, plus O(1).
//!
//! Vocab-parallel: each rank streams its shard for per-row partial softmax states,
//! which are all-gathered and merged in rank order (`lse`, entropy, the target logit
//! from its owner, the logit sum), so every rank holds the same global statistics and
//! loss; each rank then recomputes its shard's tiles for dZ and adds
//! `dH += dZ·W_r`, `dW_r += dZᵀ·H`; dH is all-reduced, dW stays local. Always two-pass
//! (the global lse is needed before any gradient). Per step: `40·N` bytes of states
//! gathered from each rank and `4·N·H` bytes of dH each way.

use super::ce_linear::{CeLinearOutput, CeRows, ce_rows_into};
use super::fused_linear::{
    FusedOptions, LinearGrads, Mode, PartialStats, Plan, Problem, RowGrad, Workspace,
    accumulate_grads, plan, row_states,
};
use super::grpo_linear::{GrpoLinearOutput, check_inputs, grpo_linear_checked, row_grads};
use super::online_softmax::OnlineSoftmax;
use super::selective_log_softmax::check_row_stats;
use crate::batch::{GrpoBatch, LinearInputs};
use crate::collective::{Collective, Solo, agree};
use crate::config::GrpoLoss;
use crate::cross_entropy::CrossEntropy;
use crate::element::Element;
use crate::error::{Error, Result};
use crate::policy::{GrpoMetrics, Normalizers, policy_stage};
use serde::{Deserialize, Serialize};
use std::ops::Range;

/// How a sharded run splits the work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Parallel {
    /// Each rank holds some sequences (rows) and the whole LM head.
    #[default]
    Token,
    /// Each rank holds every row and a vocabulary shard of the LM head.
    Vocab,
    /// A grid of token groups × vocab groups ([`Grid`]).
    #[serde(rename = "2d")]
    Grid2d,
}

impl Parallel {
    /// `(token groups, vocab groups)` of `ranks` ranks in this mode (`vocab_groups` is
    /// the 2-D grid's), checked so that every token group holds one of `batch`
    /// sequences and every vocab group one of `vocab` entries.
    pub fn grid_shape(
        self,
        ranks: usize,
        vocab_groups: Option<usize>,
        batch: usize,
        vocab: usize,
    ) -> Result<(usize, usize)> {
        if ranks == 0 {
            return Err(Error::InvalidArgument {
                arg: "ranks",
                reason: "must be at least 1".into(),
            });
        }
        let (token_groups, vocab_groups) = match self {
            Parallel::Token => (ranks, 1),
            Parallel::Vocab => (1, ranks),
            Parallel::Grid2d => match vocab_groups {
                Some(g) if g > 0 && ranks.is_multiple_of(g) => (ranks / g, g),
                other => {
                    return Err(Error::InvalidArgument {
                        arg: "vocab_groups",
                        reason: format!(
                            "parallel 2d needs vocab_groups dividing the {ranks} ranks, got {other:?}"
                        ),
                    });
                }
            },
        };
        if token_groups > batch || vocab_groups > vocab {
            return Err(Error::InvalidArgument {
                arg: "ranks",
                reason: format!(
                    "{token_groups} token groups x {vocab_groups} vocab groups: every token group needs a sequence (B = {batch}) and every vocab group a vocabulary entry (V = {vocab})"
                ),
            });
        }
        Ok((token_groups, vocab_groups))
    }
}

/// The vocabulary range of `rank` when V is split over `world` ranks as evenly as
/// possible (the first `V mod world` ranks hold one entry more).
pub fn shard_range(vocab: usize, world: usize, rank: usize) -> Range<usize> {
    let (base, extra) = (vocab / world, vocab % world);
    let start = rank * base + rank.min(extra);
    start..start + base + usize::from(rank < extra)
}

/// One rank's shard of the LM head: `inputs` holds every hidden row and the weight
/// (and bias) rows `offset .. offset + inputs.vocab` of a head of `vocab` entries.
#[derive(Debug, Clone, Copy)]
pub struct VocabShard<'a, E> {
    /// Hidden states `[N, H]`, the shard's weight `[V_r, H]` and bias `[V_r]`.
    pub inputs: LinearInputs<'a, E>,
    /// First vocabulary id of the shard.
    pub offset: usize,
    /// V of the whole head.
    pub vocab: usize,
}

impl<E: Element> VocabShard<'_, E> {
    /// Checks that the shard lies inside the vocabulary (the inputs themselves are
    /// checked with the loss's other inputs).
    fn check(&self) -> Result<()> {
        if self.offset + self.inputs.vocab > self.vocab {
            return Err(Error::InvalidArgument {
                arg: "shard",
                reason: format!(
                    "rows {}..{} lie outside the vocabulary of {}",
                    self.offset,
                    self.offset + self.inputs.vocab,
                    self.vocab
                ),
            });
        }
        Ok(())
    }

    fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.inputs.vocab
    }

    /// Target ids as shard-local ids (-1 where another shard owns the target).
    fn local_targets(&self, targets: &[i64]) -> Vec<i64> {
        let range = self.range();
        targets
            .iter()
            .map(|&y| {
                if y >= 0 && range.contains(&(y as usize)) {
                    y - self.offset as i64
                } else {
                    -1
                }
            })
            .collect()
    }
}

/// A 2-D grid of ranks: `world = token groups × vocab groups`, rank
/// `r = token_group · vocab_groups + vocab_group`. The ranks of a token group hold the
/// same rows and split the vocabulary; the ranks of a vocab group hold the same shard
/// of the head and split the rows.
pub struct Grid<'a> {
    /// Every rank (errors are agreed here).
    pub world: &'a dyn Collective,
    /// This rank's vocab group: one rank per token group, all holding this shard.
    pub tokens: Box<dyn Collective + 'a>,
    /// This rank's token group: one rank per vocab shard, all holding these rows.
    pub vocab: Box<dyn Collective + 'a>,
}

impl<'a> Grid<'a> {
    /// Splits `world` into `world_size / vocab_groups` token groups of `vocab_groups`
    /// ranks each (collective: every rank calls it).
    pub fn split(world: &'a dyn Collective, vocab_groups: usize) -> Result<Self> {
        let p = world.world_size();
        if vocab_groups == 0 || !p.is_multiple_of(vocab_groups) {
            return Err(Error::InvalidArgument {
                arg: "vocab_groups",
                reason: format!("must divide the {p} ranks, got {vocab_groups}"),
            });
        }
        let (token_group, vocab_group) = (world.rank() / vocab_groups, world.rank() % vocab_groups);
        let vocab = world.split(token_group, vocab_group)?;
        let tokens = world.split(vocab_group, token_group)?;
        Ok(Grid {
            world,
            tokens,
            vocab,
        })
    }

    /// Vocab-parallel: one token group of every rank.
    pub fn vocab(world: &'a dyn Collective) -> Self {
        Grid {
            world,
            tokens: Box::new(Solo),
            vocab: Box::new(world),
        }
    }

    /// This rank's token group (which rows it holds), in `0..token_groups`.
    pub fn token_group(&self) -> usize {
        self.tokens.rank()
    }

    /// This rank's vocab group (which shard it holds), in `0..vocab_groups`.
    pub fn vocab_group(&self) -> usize {
        self.vocab.rank()
    }
}

/// The gradient of a row restricted to a shard: the target term stays with its owner.
fn localize(mut g: RowGrad, range: &Range<usize>) -> RowGrad {
    if range.contains(&g.target) {
        g.target -= range.start;
    } else {
        g.coef_target = 0.0;
        g.target = 0;
    }
    g
}

/// Merges every rank's partial states in rank order: the same global states on all.
fn merge_partial(
    comm: &dyn Collective,
    local: &PartialStats,
    inv_temp: f32,
) -> Result<PartialStats> {
    let n = local.states.len();
    let mut packed = Vec::with_capacity(5 * n);
    for i in 0..n {
        let st = &local.states[i];
        packed.extend([
            st.max as f64,
            st.sum,
            st.weighted,
            local.target_logits[i] as f64,
            local.sums[i],
        ]);
    }
    let gathered = comm.all_gather_f64(&packed)?;
    let mut out = PartialStats {
        states: vec![OnlineSoftmax::empty(inv_temp); n],
        target_logits: vec![0.0; n],
        sums: vec![0.0; n],
    };
    for part in &gathered {
        for (i, row) in part.chunks_exact(5).enumerate().take(n) {
            out.states[i].merge(OnlineSoftmax {
                inv_temp,
                max: row[0] as f32,
                sum: row[1],
                weighted: row[2],
            });
            out.target_logits[i] += row[3] as f32;
            out.sums[i] += row[4];
        }
    }
    Ok(out)
}

/// The two-pass plan of a shard (vocab-parallel has no single-pass mode).
fn shard_plan<E: Element>(inputs: &LinearInputs<E>, opts: &FusedOptions) -> Result<Plan> {
    if opts.mode == Mode::SinglePass {
        return Err(Error::InvalidArgument {
            arg: "mode",
            reason: "vocab-parallel runs two-pass (the global lse comes before any gradient); use auto or two_pass".into(),
        });
    }
    let widen = E::as_f32(inputs.weight).is_none();
    plan(
        inputs.tokens,
        inputs.hidden_size,
        inputs.vocab,
        widen,
        opts,
        false,
    )
}

/// Vocab-parallel core: global statistics from the shards, `grads_of` maps them to
/// every row's gradient (global target ids), then the shard's dH part, dW and dbias;
/// dH is all-reduced. Returns the global statistics and the plan.
fn vocab_parallel<E: Element>(
    comm: &dyn Collective,
    shard: &VocabShard<E>,
    p: &Problem<E>,
    plan: &Plan,
    grads_of: &mut dyn FnMut(&[super::RowStats]) -> Vec<RowGrad>,
    grads: &mut LinearGrads,
) -> Result<Vec<super::RowStats>> {
    let mut ws = Workspace::new();
    let local = row_states(p, plan, &mut ws);
    let global = merge_partial(comm, &local, p.inv_temp)?;
    let stats = global.finish(p, shard.vocab);
    let range = shard.range();
    let row_grads: Vec<RowGrad> = grads_of(&stats)
        .into_iter()
        .map(|g| localize(g, &range))
        .collect();
    accumulate_grads(p, plan, &row_grads, &mut ws, grads);
    comm.all_reduce_sum_f32(&mut grads.dhidden)?;
    Ok(stats)
}

/// Token-parallel: every rank's dW and dbias summed.
fn all_reduce_head_grads(comm: &dyn Collective, grads: &mut LinearGrads) -> Result<()> {
    comm.all_reduce_sum_f32(&mut grads.dweight)?;
    if let Some(db) = grads.dbias.as_mut() {
        comm.all_reduce_sum_f32(db)?;
    }
    Ok(())
}

/// The batch's normalizers over every token group: `B` and the token count summed.
fn global_normalizers(tokens: &dyn Collective, local: Normalizers) -> Result<Normalizers> {
    let mut totals = [local.batch_size, local.token_count];
    tokens.all_reduce_sum_f64(&mut totals)?;
    Ok(Normalizers {
        batch_size: totals[0],
        token_count: totals[1],
    })
}

/// The loss (a sum of row terms) summed over token groups, and the metrics (masked
/// means over each group's `local_tokens`) turned into means over `global_tokens`.
fn reduce_policy_outputs(
    tokens: &dyn Collective,
    loss: f64,
    m: &GrpoMetrics,
    local_tokens: f64,
    global_tokens: f64,
) -> Result<(f64, GrpoMetrics)> {
    let mut sums = [
        loss,
        m.kl_mean * local_tokens,
        m.clip_ratio_low * local_tokens,
        m.clip_ratio_high * local_tokens,
        m.clip_ratio_region * local_tokens,
        m.entropy_mean * local_tokens,
    ];
    tokens.all_reduce_sum_f64(&mut sums)?;
    let denom = global_tokens.max(1.0);
    Ok((
        sums[0],
        GrpoMetrics {
            kl_mean: sums[1] / denom,
            clip_ratio_low: sums[2] / denom,
            clip_ratio_high: sums[3] / denom,
            clip_ratio_region: sums[4] / denom,
            entropy_mean: sums[5] / denom,
        },
    ))
}

/// Token-parallel GRPO: this rank's sequences `batch` and their hidden rows in
/// `inputs` (the whole head). Returns the global loss and metrics, this rank's rows'
/// statistics and dH, and the all-reduced dW and dbias.
pub fn grpo_linear_token_parallel<E: Element>(
    comm: &dyn Collective,
    loss: &GrpoLoss,
    batch: &GrpoBatch,
    inputs: &LinearInputs<E>,
    opts: &FusedOptions,
) -> Result<GrpoLinearOutput> {
    agree(comm, check_inputs(loss, batch, inputs, inputs.vocab, opts))?;
    let local = Normalizers::local(batch);
    let norm = global_normalizers(comm, local)?;
    let mut grads = LinearGrads::zeros(inputs);
    let out = grpo_linear_checked(
        loss,
        batch,
        norm,
        inputs,
        opts,
        &mut Workspace::new(),
        &mut grads,
    );
    let mut out = agree(comm, out)?;
    all_reduce_head_grads(comm, &mut grads)?;
    (out.loss, out.metrics) = reduce_policy_outputs(
        comm,
        out.loss,
        &out.metrics,
        local.token_count,
        norm.token_count,
    )?;
    out.grads = grads;
    Ok(out)
}

/// Vocab-parallel GRPO: every rank passes the whole batch and this rank's
/// [`VocabShard`]. Every rank returns the same loss, metrics and statistics, the full
/// (all-reduced) dH, and its shard's dW and dbias. A [`Grid`] of one token group.
pub fn grpo_linear_vocab_parallel<E: Element>(
    comm: &dyn Collective,
    loss: &GrpoLoss,
    batch: &GrpoBatch,
    shard: &VocabShard<E>,
    opts: &FusedOptions,
) -> Result<GrpoLinearOutput> {
    grpo_linear_grid(&Grid::vocab(comm), loss, batch, shard, opts)
}

/// GRPO on a 2-D [`Grid`]: each rank passes its token group's sequences `batch` and its
/// vocab group's [`VocabShard`] (of those rows). Normalizers, loss and metrics are
/// reduced over token groups; statistics are merged and dH all-reduced within the
/// token group; dW and dbias are all-reduced over token groups. Returns the global
/// loss and metrics, the token group's statistics and dH, and the shard's dW and dbias.
pub fn grpo_linear_grid<E: Element>(
    grid: &Grid,
    loss: &GrpoLoss,
    batch: &GrpoBatch,
    shard: &VocabShard<E>,
    opts: &FusedOptions,
) -> Result<GrpoLinearOutput> {
    let inputs = &shard.inputs;
    let checked = shard
        .check()
        .and_then(|_| check_inputs(loss, batch, inputs, shard.vocab, opts))
        .and_then(|_| shard_plan(inputs, opts));
    let plan = agree(grid.world, checked)?;
    let local = Normalizers::local(batch);
    let norm = global_normalizers(grid.tokens.as_ref(), local)?;
    let temperature = loss.config().temperature;
    let targets = shard.local_targets(batch.target_ids);
    let p = Problem {
        inputs,
        targets: &targets,
        live: batch.mask,
        inv_temp: (1.0 / temperature) as f32,
        softcap: None,
        mean_logit: false,
    };
    let scale = (opts.grad_output as f64 / temperature) as f32;
    let mut grads = LinearGrads::zeros(inputs);
    let mut policy = None;
    let stats = vocab_parallel(
        grid.vocab.as_ref(),
        shard,
        &p,
        &plan,
        &mut |stats| {
            let logp: Vec<f32> = stats.iter().map(|s| s.logp).collect();
            let entropy: Vec<f32> = stats.iter().map(|s| s.entropy).collect();
            let pol = policy_stage(loss, batch, norm, &logp, &entropy);
            let g = row_grads(0..batch.rows(), stats, &pol, batch.target_ids, scale);
            policy.get_or_insert(pol);
            g
        },
        &mut grads,
    )?;
    agree(
        grid.world,
        check_row_stats(&stats, |i| batch.mask[i], batch.target_ids, batch.seq_len),
    )?;
    all_reduce_head_grads(grid.tokens.as_ref(), &mut grads)?;
    let policy = policy.expect("grads_of ran");
    let (loss, metrics) = reduce_policy_outputs(
        grid.tokens.as_ref(),
        policy.loss,
        &policy.metrics,
        local.token_count,
        norm.token_count,
    )?;
    Ok(GrpoLinearOutput {
        loss,
        metrics,
        stats,
        kl: policy.kl,
        clip: policy.clip,
        grads,
        plan,
    })
}

/// Token-parallel cross-entropy: this rank's rows. The mean divides by the rows counted
/// on all ranks. Returns the global loss, this rank's per-row outputs and dH, and the
/// all-reduced dW and dbias.
pub fn ce_linear_token_parallel<E: Element>(
    comm: &dyn Collective,
    ce: &CrossEntropy,
    targets: &[i64],
    inputs: &LinearInputs<E>,
    opts: &FusedOptions,
) -> Result<CeLinearOutput> {
    let rows = agree(
        comm,
        inputs.validate().and_then(|_| {
            CeRows::new(
                ce,
                targets,
                inputs.tokens,
                inputs.vocab,
                opts.grad_output,
                None,
            )
        }),
    )?;
    let mut count = [rows.count as f64];
    comm.all_reduce_sum_f64(&mut count)?;
    let rows = rows.with_count(count[0] as usize);
    let mut grads = LinearGrads::zeros(inputs);
    let out = ce_rows_into(&rows, inputs, opts, &mut Workspace::new(), &mut grads);
    let mut out = agree(comm, out)?;
    all_reduce_head_grads(comm, &mut grads)?;
    let mut sums = [out.loss, out.z_loss];
    comm.all_reduce_sum_f64(&mut sums)?;
    (out.loss, out.z_loss) = (sums[0], sums[1]);
    out.grads = grads;
    Ok(out)
}

/// Vocab-parallel cross-entropy: every rank passes all targets and this rank's
/// [`VocabShard`]. Every rank returns the same loss and per-row outputs, the full dH,
/// and its shard's dW and dbias. Reduction `none` takes unit upstream gradients.
pub fn ce_linear_vocab_parallel<E: Element>(
    comm: &dyn Collective,
    ce: &CrossEntropy,
    targets: &[i64],
    shard: &VocabShard<E>,
    opts: &FusedOptions,
) -> Result<CeLinearOutput> {
    ce_linear_grid(&Grid::vocab(comm), ce, targets, shard, opts)
}

/// Cross-entropy on a 2-D [`Grid`]: each rank passes its token group's `targets` and
/// its vocab group's [`VocabShard`] (of those rows). The counted rows, loss and z-loss
/// are summed over token groups; statistics are merged and dH all-reduced within the
/// token group; dW and dbias are all-reduced over token groups.
pub fn ce_linear_grid<E: Element>(
    grid: &Grid,
    ce: &CrossEntropy,
    targets: &[i64],
    shard: &VocabShard<E>,
    opts: &FusedOptions,
) -> Result<CeLinearOutput> {
    let inputs = &shard.inputs;
    let checked = shard.check().and_then(|_| {
        inputs.validate()?;
        let rows = CeRows::new(
            ce,
            targets,
            inputs.tokens,
            shard.vocab,
            opts.grad_output,
            None,
        )?;
        Ok((rows, shard_plan(inputs, opts)?))
    });
    let (rows, plan) = agree(grid.world, checked)?;
    let mut count = [rows.count as f64];
    grid.tokens.all_reduce_sum_f64(&mut count)?;
    let rows = rows.with_count(count[0] as usize);
    let local_targets = shard.local_targets(targets);
    let p = rows.problem_on(inputs, &local_targets);
    let mut grads = LinearGrads::zeros(inputs);
    let stats = vocab_parallel(
        grid.vocab.as_ref(),
        shard,
        &p,
        &plan,
        &mut |stats| {
            (0..targets.len())
                .map(|i| rows.row_grad(i, &stats[i]))
                .collect()
        },
        &mut grads,
    )?;
    let mut out = agree(grid.world, rows.output(stats, plan))?;
    all_reduce_head_grads(grid.tokens.as_ref(), &mut grads)?;
    let mut sums = [out.loss, out.z_loss];
    grid.tokens.all_reduce_sum_f64(&mut sums)?;
    (out.loss, out.z_loss) = (sums[0], sums[1]);
    out.grads = grads;
    Ok(out)
}
