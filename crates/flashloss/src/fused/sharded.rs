//! Sharded fused LM-head losses over a [`Collective`], on any backend's [`Head`]: a
//! [`Grid`] of token groups × vocab groups. Token-parallel (one vocab group) gives each
//! rank some sequences and the whole head; vocab-parallel (one token group) gives each
//! rank every row and a shard `[V_r, H]` of the head; 2-D does both. Inputs are checked
//! on every rank and any failure becomes the same error everywhere ([`agree`]).
//!
//! The normalizers (B, token count, CE's counted rows) are all-reduced over token
//! groups first. A rank holding the whole vocabulary runs the ordinary fused step
//! (single-pass where the plan allows); vocabulary shards run two-pass and merge their
//! row statistics within the token group ([`super::two_pass`]), then all-reduce dH
//! there. dW and dbias are all-reduced over token groups, and the loss and metrics
//! summed. Per step: `4·(V_r·H + V_r)` bytes each way over token groups, `40·N` bytes
//! of states and `4·N·H` of dH over vocab groups.

use super::ce::{CeLinearOutput, CeRows, ce_linear_checked};
use super::grpo::{GrpoLinearOutput, check_batch, grpo_linear_checked};
use super::passes::{GradPart, Head, check_head};
use super::plan::{FusedOptions, Mode, Plan};
use super::two_pass::VocabSplit;
use crate::batch::GrpoBatch;
use crate::collective::{Collective, Solo, agree};
use crate::config::GrpoLoss;
use crate::cross_entropy::CrossEntropy;
use crate::error::{Error, Result};
use crate::policy::{GrpoMetrics, Normalizers};
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

/// Where a rank's head sits in the whole LM head: its weight rows are the vocabulary
/// entries `offset .. offset + V_r` of a head of `vocab` entries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    /// First vocabulary id of the rank's head.
    pub offset: usize,
    /// V of the whole head.
    pub vocab: usize,
}

impl Shard {
    /// A head that holds the whole vocabulary of `vocab` entries.
    pub fn whole(vocab: usize) -> Self {
        Shard { offset: 0, vocab }
    }

    /// Rank `rank`'s shard of [`shard_range`] when `vocab` entries are split over `world`.
    pub fn of_rank(vocab: usize, world: usize, rank: usize) -> Self {
        Shard {
            offset: shard_range(vocab, world, rank).start,
            vocab,
        }
    }

    /// The entries of a head (or logits shard) of `entries` vocabulary entries, checked
    /// to lie inside the vocabulary.
    pub(crate) fn range(&self, entries: usize) -> Result<Range<usize>> {
        let end = self.offset + entries;
        if end > self.vocab {
            return Err(Error::InvalidArgument {
                arg: "shard",
                reason: format!(
                    "rows {}..{end} lie outside the vocabulary of {}",
                    self.offset, self.vocab
                ),
            });
        }
        Ok(self.offset..end)
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

    /// Token-parallel: one vocab group of every rank (each holds the whole head).
    pub fn token(world: &'a dyn Collective) -> Self {
        Grid {
            world,
            tokens: Box::new(world),
            vocab: Box::new(Solo),
        }
    }

    /// The grid of `parallel` over `world` (`vocab_groups` for 2-D).
    pub fn of(world: &'a dyn Collective, parallel: Parallel, vocab_groups: usize) -> Result<Self> {
        Ok(match parallel {
            Parallel::Token => Grid::token(world),
            Parallel::Vocab => Grid::vocab(world),
            Parallel::Grid2d => Grid::split(world, vocab_groups)?,
        })
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

/// The batch's normalizers over every token group: `B`, the token count and the
/// entropy bonus's token count `Σ m'` summed.
pub(crate) fn global_normalizers(
    tokens: &dyn Collective,
    local: Normalizers,
) -> Result<Normalizers> {
    let mut totals = [local.batch_size, local.token_count, local.entropy_count];
    tokens.all_reduce_sum_f64(&mut totals)?;
    Ok(Normalizers {
        batch_size: totals[0],
        token_count: totals[1],
        entropy_count: totals[2],
    })
}

/// The loss (a sum of row terms) summed over token groups, and the metrics (masked
/// means over each group's `local_tokens`) turned into means over `global_tokens`.
pub(crate) fn reduce_policy_outputs(
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

/// What a sharded step agrees on before it runs: the plan, and the vocabulary split of
/// a shard (none when the rank holds the whole vocabulary).
fn sharded_plan<'g>(
    grid: &'g Grid,
    head: &dyn Head,
    shard: Shard,
    opts: &FusedOptions,
    single_pass_allowed: bool,
) -> Result<(Plan, Option<VocabSplit<'g>>)> {
    let range = shard.range(head.shape().vocab)?;
    check_head(head, true)?;
    if grid.vocab.world_size() == 1 && range.len() == shard.vocab {
        return Ok((head.plan(opts, single_pass_allowed)?, None));
    }
    if matches!(opts.mode, Mode::SinglePass | Mode::Compact) {
        return Err(Error::InvalidArgument {
            arg: "mode",
            reason: "vocab-parallel runs two-pass (the global lse comes before any gradient); use auto or two_pass".into(),
        });
    }
    let split = VocabSplit {
        comm: grid.vocab.as_ref(),
        range,
        vocab: shard.vocab,
    };
    Ok((head.plan(opts, false)?, Some(split)))
}

/// dH summed over the ranks that split the vocabulary, dW and dbias over those that
/// split the rows (a group of one reduces nothing); then the gradients are checked
/// finite, and a failure on any rank is the same error on every rank.
fn all_reduce_grads(grid: &Grid, head: &mut dyn Head, split: bool, seq_len: usize) -> Result<()> {
    if split && grid.vocab.world_size() > 1 {
        head.all_reduce(grid.vocab.as_ref(), GradPart::Hidden)?;
    }
    if grid.tokens.world_size() > 1 {
        head.all_reduce(grid.tokens.as_ref(), GradPart::Head)?;
    }
    agree(grid.world, head.check_grads(seq_len))
}

/// GRPO on a [`Grid`]: each rank passes its token group's sequences `batch` and its
/// head (its vocab group's [`Shard`] of those rows). Returns the global loss and
/// metrics, the token group's statistics and (in the head's buffers) its dH, and the
/// shard's dW and dbias summed over token groups.
pub fn grpo_linear_sharded(
    grid: &Grid,
    head: &mut dyn Head,
    shard: Shard,
    loss: &GrpoLoss,
    batch: &GrpoBatch,
    opts: &FusedOptions,
) -> Result<GrpoLinearOutput> {
    let checked = check_batch(loss, batch, head.shape(), shard.vocab, opts)
        .and_then(|_| sharded_plan(grid, head, shard, opts, !loss.needs_sequence_reduction()));
    let (plan, split) = agree(grid.world, checked)?;
    let local = Normalizers::local(batch);
    let norm = global_normalizers(grid.tokens.as_ref(), local)?;
    let out = grpo_linear_checked(head, loss, batch, norm, opts, plan, split.as_ref());
    let mut out = agree(grid.world, out)?;
    all_reduce_grads(grid, head, split.is_some(), batch.seq_len)?;
    (out.loss, out.metrics) = reduce_policy_outputs(
        grid.tokens.as_ref(),
        out.loss,
        &out.metrics,
        local.token_count,
        norm.token_count,
    )?;
    Ok(out)
}

/// Cross-entropy on a [`Grid`]: each rank passes its token group's `targets` and its
/// head (its vocab group's [`Shard`] of those rows). The counted rows, loss and z-loss
/// are summed over token groups (the mean divides by the rows counted on all of them);
/// statistics are merged and dH all-reduced within the token group; dW and dbias are
/// all-reduced over token groups. Reduction `none` takes unit upstream gradients.
pub fn ce_linear_sharded(
    grid: &Grid,
    head: &mut dyn Head,
    shard: Shard,
    ce: &CrossEntropy,
    targets: &[i64],
    opts: &FusedOptions,
) -> Result<CeLinearOutput> {
    let shape = head.shape();
    let checked = CeRows::new(
        ce,
        targets,
        shape.tokens,
        shard.vocab,
        opts.grad_output,
        None,
    )
    .and_then(|rows| Ok((rows, sharded_plan(grid, head, shard, opts, true)?)));
    let (rows, (plan, split)) = agree(grid.world, checked)?;
    let mut count = [rows.count as f64];
    grid.tokens.all_reduce_sum_f64(&mut count)?;
    let rows = rows.with_count(count[0] as usize);
    let out = ce_linear_checked(head, &rows, plan, split.as_ref());
    let mut out = agree(grid.world, out)?;
    all_reduce_grads(grid, head, split.is_some(), shape.tokens)?;
    let mut sums = [out.loss, out.z_loss];
    grid.tokens.all_reduce_sum_f64(&mut sums)?;
    (out.loss, out.z_loss) = (sums[0], sums[1]);
    Ok(out)
}
