//! The neutral pieces of a sharded step, for the fused LM-head kernels and the
//! logits-level kernel alike: a [`Grid`] of token groups × vocab groups over a
//! [`Collective`], the [`Shard`] of the vocabulary a rank holds ([`shard_range`] for an
//! even split), the vocabulary split of a rank's head ([`VocabSplit`]), the merge of
//! partial row states in rank order ([`merge_partial`]: `lse`, entropy, the target logit
//! from the shard that holds it, the logit sum; `48·N` bytes gathered from each rank),
//! and the reductions of normalizers, loss and metrics over token groups.

use crate::collective::{Collective, Solo};
use crate::error::{Error, Result};
use crate::policy::{GrpoMetrics, Normalizers};
use crate::rows::{OnlineSoftmax, PartialStats};
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
    /// The ranks across which the rows are split (one per token group), all holding
    /// this rank's shard of the head: normalizers, loss, dW and dbias are summed over
    /// them. (They form this rank's vocab group.)
    pub tokens: Box<dyn Collective + 'a>,
    /// The ranks across which the vocabulary is split (one per vocab group), all
    /// holding this rank's rows: row statistics merge and dH is summed over them. (They
    /// form this rank's token group.)
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

/// The loss (a sum of row terms) summed over token groups, and the metrics (means over
/// each group's `local` tokens, or its sequences for clip metrics taken per sequence:
/// [`crate::policy::clips_per_sequence`]) turned into means over the `global` ones.
pub(crate) fn reduce_policy_outputs(
    tokens: &dyn Collective,
    loss: f64,
    m: &GrpoMetrics,
    (local, global): (Normalizers, Normalizers),
    clips_per_sequence: bool,
) -> Result<(f64, GrpoMetrics)> {
    let clip_count = |n: Normalizers| match clips_per_sequence {
        true => n.batch_size,
        false => n.token_count,
    };
    let (here, clips_here) = (local.token_count, clip_count(local));
    let mut sums = [
        loss,
        m.kl_mean * here,
        m.clip_ratio_low * clips_here,
        m.clip_ratio_high * clips_here,
        m.clip_ratio_region * clips_here,
        m.entropy_mean * here,
    ];
    tokens.all_reduce_sum_f64(&mut sums)?;
    let denom = global.token_count.max(1.0);
    let clip_denom = clip_count(global).max(1.0);
    Ok((
        sums[0],
        GrpoMetrics {
            kl_mean: sums[1] / denom,
            clip_ratio_low: sums[2] / clip_denom,
            clip_ratio_high: sums[3] / clip_denom,
            clip_ratio_region: sums[4] / clip_denom,
            entropy_mean: sums[5] / denom,
        },
    ))
}

/// Where a head's vocabulary sits in a vocab-parallel run: entries `range` of a
/// vocabulary of `vocab`, the ranks of `comm` holding the other shards of the same rows.
pub(crate) struct VocabSplit<'c> {
    /// The ranks that hold the same rows (one shard each).
    pub(crate) comm: &'c dyn Collective,
    /// This shard's entries.
    pub(crate) range: Range<usize>,
    /// V of the whole head.
    pub(crate) vocab: usize,
}

impl VocabSplit<'_> {
    /// Target ids as shard-local ids (-1 where another shard holds the target).
    pub(crate) fn local_targets(&self, targets: &[i64]) -> Vec<i64> {
        local_ids(targets, &self.range)
    }
}

/// `ids` of the whole vocabulary as ids local to the shard `range` (-1 where another
/// shard holds the id, or for negative ids).
pub fn local_ids(ids: &[i64], range: &Range<usize>) -> Vec<i64> {
    ids.iter()
        .map(|&y| match y >= 0 && range.contains(&(y as usize)) {
            true => y - range.start as i64,
            false => -1,
        })
        .collect()
}

/// Merges every rank's partial states in rank order: the same global states on all.
pub(crate) fn merge_partial(
    comm: &dyn Collective,
    local: &PartialStats,
    inv_temp: f32,
) -> Result<PartialStats> {
    let n = local.states.len();
    let mut packed = Vec::with_capacity(6 * n);
    for i in 0..n {
        let st = &local.states[i];
        packed.extend([
            st.max as f64,
            st.sum,
            st.weighted,
            st.sum2,
            local.target_logits[i] as f64,
            local.sums[i],
        ]);
    }
    let gathered = comm.all_gather_f64(&packed)?;
    let mut out = PartialStats::empty(n, inv_temp);
    for part in &gathered {
        for (i, row) in part.chunks_exact(6).enumerate().take(n) {
            out.states[i].merge(OnlineSoftmax {
                inv_temp,
                max: row[0] as f32,
                sum: row[1],
                weighted: row[2],
                sum2: row[3],
            });
            out.target_logits[i] += row[4] as f32;
            out.sums[i] += row[5];
        }
    }
    Ok(out)
}
