//! Log-probs under the sampler's truncated support (docs/spec/losses.md, "Truncated
//! support", and flashloss addition 12): per row the support `K = {j : (s_j, j) ≥ cut}`
//! of vLLM V1's min-p, top-k and top-p, `lse^K = log Σ_{j∈K} e^{s_j}`,
//! `logp^K = s_y - lse^K` (`-inf` where `y ∉ K`), `|K|`, and the gradient with `K` held
//! fixed, `∂logp^K/∂s_j = (1[j=y] - p^K_j)·1[j∈K]`, with no `[N, V]` array.
//!
//! Streaming, on a two-pass plan (the cut needs each row's max and log-sum first):
//! - pass A (2NHV) computes the softmax states as usual and a [`TileVisitor`] keeps per
//!   row its top `C = clamp(top_k + 1, 256, 4096)` keys (`pass_a::TopBuffer`:
//!   amortized O(V); `8·C` bytes a row once its tiles are seen, `8·2C` while they are,
//!   beyond the workspace budget); where top-p is the only filter, it also bins each
//!   row on an absolute grid of `s` (`histogram`: 2048 bins of 1/64 below the
//!   running max, 24 KiB a row while its sweep is in flight) and, once the row is
//!   swept, reduces it to the bin where the descending mass reaches `top_p·mass`;
//! - each row's cut is then decided from its buffer where the buffer provably holds it:
//!   min-p's threshold is exact from the max; top-k's k-th value is the buffer's k-th key
//!   (`C > k`); top-p needs the mass of what min-p and top-k left, known where that set
//!   lies in the buffer (then the ascending cumulative sums are the reference's own) or
//!   where nothing was cut before it (the full mass of pass A), and the cut where the
//!   buffer's descending mass reaches `top_p·mass`;
//! - rows the buffer cannot decide (top-p on flat rows, more ties at the k-th value than
//!   the buffer holds, min-p or top-k cuts below it, `top_k ≥ 4096`) run a
//!   `search::Search` over extra passes (`visit_tiles`, 2NHV each): key
//!   histograms of 2048 bins narrowed onto the cut, then the keys of one bin collected
//!   (typically 2 or 3 passes), counted per call; top-p alone starts from pass A's bin,
//!   whose keys one pass collects (more where the bin holds over 4096 keys, the cut lies
//!   32 units below the max, or `|s_max| ≥ 2^17`);
//! - `lse^K` from the kept mass (f64, relative to the max), and the gradient is pass B's
//!   [`super::RowGrad`] with a [`SupportTerm`] `coef·p^K_j·1[key_j ≥ cut]`.
//!
//! Vocab-parallel, keys carry ids of the whole vocabulary; the buffers and pass A's
//! histograms are merged and each extra pass's tallies summed over the shards
//! (`shards`), so every rank decides alike.
//!
//! FLOPs: `2NHV·(1 + extra)` for log-probs, `2NHV·(1 + extra) + 6NHV` with gradients
//! (`4NHV` on a frozen head). The entropy stays the full softmax's, its gradient too.
//! Masses are `exp(s_j - s_max)` of the f32 scaled logits that decide the support, so
//! with `T ≠ 1` `lse^K` carries their rounding (`|s|·2^-24` absolute).

use super::key::{key_value, order_key, rel_mass, scaled, value_floor};
use super::logp_request::SupportStats;
use super::passes::FusedPasses;
use super::terms::{DeviceSinks, SupportTerm, TileVisitor};
use crate::error::Result;
use crate::rows::{OnlineSoftmax, PartialStats, RowInputs, RowStats};
use crate::sharding::VocabSplit;
use crate::support_filter::SupportFilter;
use histogram::{BinCut, HistogramRow};
use pass_a::BufferPass;
use search::{Found, Goal, Search, SearchPass, Tally};
use shards::{combine_pass, merge_buffers, merge_histograms};

#[cfg(test)]
pub(crate) mod device_top;
mod histogram;
#[cfg(test)]
mod histogram_tests;
mod pass_a;
mod search;
mod shards;
#[cfg(test)]
mod tests;

/// The sampler's filters with the unset ones as `None` (`top_k ≥ V`, `top_p = 1` and
/// `min_p = 0` keep every entry); validated by the caller.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Truncation {
    top_k: Option<usize>,
    top_p: Option<f64>,
    min_p: Option<f64>,
}

/// Fewest keys a row's buffer holds.
const MIN_BUFFER: usize = 256;
/// Most keys a row's buffer holds (a larger `top_k` is searched for).
const MAX_BUFFER: usize = 4096;

impl Truncation {
    /// The filters that cut something on a vocabulary of `vocab` entries, or `None`.
    pub(crate) fn new(
        top_k: Option<usize>,
        top_p: Option<f64>,
        min_p: Option<f64>,
        vocab: usize,
    ) -> Option<Self> {
        let t = Truncation {
            top_k: top_k.filter(|&k| k < vocab),
            top_p: top_p.filter(|&p| p < 1.0),
            min_p: min_p.filter(|&m| m > 0.0),
        };
        (t.top_k.is_some() || t.top_p.is_some() || t.min_p.is_some()).then_some(t)
    }

    /// Top-p where it is the only filter: the cut of a row its buffer cannot decide lies
    /// in the bin of its pass-A histogram where the descending mass of the whole row
    /// reaches `top_p·M`.
    fn top_p_alone(&self) -> Option<f64> {
        self.top_p
            .filter(|_| self.top_k.is_none() && self.min_p.is_none())
    }

    /// Keys a row's buffer holds.
    fn buffer_cap(&self) -> usize {
        self.top_k
            .map_or(MIN_BUFFER, |k| k.saturating_add(1))
            .clamp(MIN_BUFFER, MAX_BUFFER)
    }
}

/// A row's support: the keys `≥ cut`, `kept` their tally.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct SupportCut {
    pub(crate) cut: u64,
    pub(crate) kept: Tally,
}

/// One row's statistics under the truncated support.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct RowSupport {
    /// `logp^K = s_y - lse^K`, `-inf` where the target is outside the support (0 for a
    /// row that takes no part).
    pub logp: f32,
    /// `lse^K = log Σ_{j∈K} exp(s_j)`.
    pub lse: f32,
    /// `|K|`.
    pub size: u64,
    /// Whether the target is outside the support.
    pub outside: bool,
    /// `lse^K - max·inv_temp` in f64 (the gradient's `log_sum`).
    log_sum: f64,
    /// The support's lowest key.
    cut: u64,
}

impl RowSupport {
    /// The support term of the row's gradient for an upstream `scale·g_logp`
    /// (`scale = g/T`): none where the target is outside (its logp is a constant `-inf`).
    pub(crate) fn grad(&self, scale_dlogp: f64) -> Option<SupportTerm> {
        (!self.outside).then(|| SupportTerm {
            coef: (-scale_dlogp) as f32,
            log_sum: self.log_sum as f32,
            cut: self.cut,
            offset: 0,
        })
    }

    /// The support of a row that nothing cuts: its full softmax's statistics.
    fn whole(st: &RowStats, vocab: usize) -> Self {
        RowSupport {
            logp: st.logp,
            lse: st.lse,
            size: vocab as u64,
            outside: false,
            log_sum: st.log_sum as f64,
            cut: 0,
        }
    }

    /// Row `i`'s statistics given its cut, state and target's raw logit `z_y`.
    fn of(cut: &SupportCut, state: &OnlineSoftmax, (z_y, y): (f32, usize)) -> Self {
        let inv_temp = state.inv_temp;
        let shift = state.max as f64 * inv_temp as f64;
        let s_max = scaled(state.max, inv_temp);
        let log_sum = cut.kept.mass.ln() + (s_max as f64 - shift);
        let outside = order_key(scaled(z_y, inv_temp), y) < cut.cut;
        let logp = (z_y as f64 - state.max as f64) * inv_temp as f64 - log_sum;
        RowSupport {
            logp: if outside {
                f32::NEG_INFINITY
            } else {
                logp as f32
            },
            lse: (shift + log_sum) as f32,
            size: cut.kept.count,
            outside,
            log_sum,
            cut: cut.cut,
        }
    }
}

/// Where a row's decision stands between passes.
#[derive(Debug, Clone, Copy)]
enum Pending {
    /// No part in the call.
    Idle,
    Done(SupportCut),
    /// Searching for top-k's k-th key above `l1` (min-p's floor).
    TopK {
        l1: u64,
    },
    /// The final search: a [`Goal::Sum`] keeps the keys `≥ lo`.
    Last {
        lo: u64,
    },
}

/// Pass A's visitor of a truncated support: the top buffers of `n` rows of a head
/// whose entries are the ids `head` of a vocabulary of `vocab` entries, and the rows'
/// histograms where top-p is the only filter (merged over vocabulary shards:
/// `shards`).
pub(crate) fn support_buffers(
    t: &Truncation,
    n: usize,
    inv_temp: f32,
    (head, vocab): (std::ops::Range<usize>, usize),
) -> BufferPass {
    let top_p = t.top_p_alone().map(|p| (p, head.len() < vocab));
    BufferPass::new(n, inv_temp, t.buffer_cap(), (head.start, head.len()), top_p)
}

/// A log-prob call's truncated support on a vocabulary of `vocab` entries: the filters
/// that cut (`None` where the request's filters cut nothing: its outputs are then the
/// full softmax's).
pub(crate) struct SupportCall {
    cuts: Option<Truncation>,
    vocab: usize,
}

/// What a call's support found: every row's [`RowSupport`] (`None`: nothing cut) and the
/// extra passes.
pub(crate) struct SupportRun {
    pub(crate) rows: Option<Vec<RowSupport>>,
    extra_passes: usize,
    vocab: usize,
}

impl SupportCall {
    /// The support of a request's `filter` (validated), if it has one.
    pub(crate) fn new(filter: Option<SupportFilter>, vocab: usize) -> Option<Self> {
        filter.map(|f| SupportCall {
            cuts: Truncation::new(f.top_k, f.top_p, f.min_p, vocab),
            vocab,
        })
    }

    /// Pass A's visitor for `rows` of a head whose entries are the ids `head`, where the
    /// filters cut.
    pub(crate) fn buffers(
        &self,
        rows: &RowInputs,
        head: std::ops::Range<usize>,
    ) -> Option<BufferPass> {
        let t = self.cuts.as_ref()?;
        let (n, inv_temp) = (rows.live.len(), rows.transform.inv_temp);
        Some(support_buffers(t, n, inv_temp, (head, self.vocab)))
    }

    /// After pass A (`partial`, `buffers` its visitor): every row's support
    /// ([`support_passes`]; `targets` of the whole vocabulary).
    pub(crate) fn run(
        self,
        passes: &mut dyn FusedPasses,
        (buffers, partial): (Option<BufferPass>, &PartialStats),
        (rows, targets): (&RowInputs, &[i64]),
        split: Option<&VocabSplit>,
    ) -> Result<SupportRun> {
        let (rows, extra_passes) = match (self.cuts, buffers) {
            (Some(t), Some(b)) => {
                let found = support_passes(passes, (b, partial), (rows, targets), &t, split)?;
                (Some(found.0), found.1)
            }
            _ => (None, 0),
        };
        Ok(SupportRun {
            rows,
            extra_passes,
            vocab: self.vocab,
        })
    }
}

impl SupportRun {
    /// The call's support outputs; where nothing was cut, the full softmax's `stats`
    /// (zeros where a row is not `live`).
    pub(crate) fn stats(&self, stats: &[RowStats], live: &[bool]) -> SupportStats {
        let rows = self.rows.clone().unwrap_or_else(|| {
            (stats.iter().zip(live))
                .map(|(st, &live)| match live {
                    true => RowSupport::whole(st, self.vocab),
                    false => RowSupport::default(),
                })
                .collect()
        });
        SupportStats {
            logp: rows.iter().map(|r| r.logp).collect(),
            lse: rows.iter().map(|r| r.lse).collect(),
            outside: rows.iter().map(|r| r.outside).collect(),
            size: rows.iter().map(|r| r.size).collect(),
            extra_passes: self.extra_passes,
        }
    }
}

/// Both visitors see each tile (pass A of a call with candidates and a support).
pub(crate) struct VisitBoth<'v>(
    pub(crate) &'v mut dyn TileVisitor,
    pub(crate) &'v mut dyn TileVisitor,
);

impl TileVisitor for VisitBoth<'_> {
    fn visit(&mut self, rows: &[usize], vocab: std::ops::Range<usize>, z: &[f32], ld: usize) {
        self.0.visit(rows, vocab.clone(), z, ld);
        self.1.visit(rows, vocab, z, ld);
    }

    fn device_sinks(&mut self) -> DeviceSinks<'_> {
        let (a, b) = (self.0.device_sinks(), self.1.device_sinks());
        DeviceSinks {
            gather: a.gather.or(b.gather),
            top: a.top.or(b.top),
        }
    }
}

/// After pass A (`partial`, the whole vocabulary's states, with `buffers` its visitor):
/// decides each live row's cut from its buffer and runs extra passes until every cut
/// is known; returns each row's [`RowSupport`] (default where the row takes no part)
/// and the extra passes. `targets` are ids of the whole vocabulary; on a vocabulary
/// shard (`split`) the buffers and each pass's tallies are combined over the shards
/// (`shards`).
pub(crate) fn support_passes(
    passes: &mut dyn FusedPasses,
    (buffers, partial): (BufferPass, &PartialStats),
    (rows, targets): (&RowInputs, &[i64]),
    t: &Truncation,
    split: Option<&VocabSplit>,
) -> Result<(Vec<RowSupport>, usize)> {
    use rayon::prelude::*;
    let n = rows.live.len();
    let inv_temp = rows.transform.inv_temp;
    let cap = t.buffer_cap();
    let mass_exact = buffers.pass_a_mass_exact();
    let s_max: Vec<f32> = (partial.states.iter())
        .map(|st| scaled(st.max, inv_temp))
        .collect();
    let (mut tops, histograms) = buffers.finish();
    if let Some(s) = split {
        tops = merge_buffers(s.comm, tops, cap)?;
    }
    let bins: Vec<Option<BinCut>> = match (histograms, split) {
        (Some(h), Some(s)) => merge_histograms(s.comm, h.rows, h.top_p)?,
        (Some(h), None) => h.rows.iter().map(HistogramRow::cut).collect(),
        (None, _) => vec![None; n],
    };
    let offset = split.map_or(0, |s| s.range.start);
    type Decided = ((Pending, Option<Search>), Option<Vec<u64>>);
    let decided: Vec<Decided> = (tops.into_par_iter().zip(bins).enumerate())
        .map(|(i, ((keys, complete), bin))| {
            let st = &partial.states[i];
            if !rows.live[i] || !st.max.is_finite() {
                return ((Pending::Idle, None), None);
            }
            // Pass A's mass relative to `exp(s_max)` instead of `exp(max·inv_temp)`.
            let total = (mass_exact)
                .then(|| st.sum * (st.max as f64 * inv_temp as f64 - s_max[i] as f64).exp());
            let bin = bin.filter(|b| b.s_max == s_max[i]);
            let decision = decide(&keys, complete, (s_max[i], total, bin), t);
            // A top-p search that sums the mass first may find the cut among the keys.
            let sums_first = matches!(&decision.1, Some(s) if s.sums_mass_first());
            (decision, sums_first.then_some(keys))
        })
        .collect();
    let (decisions, held): (Vec<_>, Vec<_>) = decided.into_iter().unzip();
    let (mut pending, mut searches): (Vec<Pending>, Vec<Option<Search>>) =
        decisions.into_iter().unzip();
    let mut extra_passes = 0;
    while searches.iter().any(Option::is_some) {
        let mut pass = SearchPass::new(inv_temp, offset, searches);
        passes.visit_tiles(&mut pass)?;
        if let Some(s) = split {
            combine_pass(s.comm, &mut pass)?;
        }
        extra_passes += 1;
        let (found, rest) = pass.finish();
        searches = rest;
        for (i, found) in found.into_iter().enumerate() {
            let Some(found) = found else { continue };
            (pending[i], searches[i]) = match (pending[i], found) {
                (Pending::TopK { l1 }, Found::Kth(kth)) => {
                    let l2 = kth.map_or(l1, |k| value_floor(key_value(k)).max(l1));
                    last_search(l2, (0, u64::MAX), Tally::default(), (s_max[i], None), t)
                }
                (Pending::Last { lo }, Found::Sum(kept)) => {
                    (Pending::Done(SupportCut { cut: lo, kept }), None)
                }
                (Pending::Last { .. }, Found::Cut { cut, kept }) => {
                    (Pending::Done(SupportCut { cut, kept }), None)
                }
                (Pending::Last { .. }, Found::Above { target }) => {
                    let keys = held[i].as_deref().unwrap_or_default();
                    let cut = top_p_descending(keys, target, s_max[i]);
                    // Rounding aside the keys reach the target; else they are all kept.
                    let all = || SupportCut {
                        cut: keys.last().copied().unwrap_or(0),
                        kept: Tally::of(keys, s_max[i]),
                    };
                    (Pending::Done(cut.unwrap_or_else(all)), None)
                }
                (p, f) => unreachable!("a search of {p:?} found {f:?}"),
            };
        }
    }
    let out = (0..n)
        .map(|i| match pending[i] {
            Pending::Done(cut) => {
                let y = targets[i] as usize;
                let target = (partial.target_logits[i], y);
                RowSupport::of(&cut, &partial.states[i], target)
            }
            _ => RowSupport::default(),
        })
        .collect();
    Ok((out, extra_passes))
}

/// A row's decision from its top keys (`keys`, descending; `complete` when they are
/// the whole row), its largest scaled logit, pass A's mass relative to it (`None`: not
/// exact enough to cut by, a device's f32 sums) and, for top-p alone, its histogram's cut
/// bin: the cut, or the search that finds it.
fn decide(
    keys: &[u64],
    complete: bool,
    (s_max, total, bin): (f32, Option<f64>, Option<BinCut>),
    t: &Truncation,
) -> (Pending, Option<Search>) {
    // Whether every key `≥ l` is held.
    let holds = |l: u64| complete || keys.last().is_some_and(|&m| l >= m);
    let l1 = t.min_p.map_or(0, |m| min_p_floor(s_max, m));
    let l2 = match t.top_k {
        None => l1,
        Some(k) => {
            let n1 = keys.partition_point(|&key| key >= l1);
            if n1 >= k {
                value_floor(key_value(keys[k - 1]))
            } else if holds(l1) {
                l1
            } else {
                let goal = Goal::Count(k as u64);
                let search = Search::new(goal, (l1, u64::MAX), Tally::default(), s_max);
                return (Pending::TopK { l1 }, Some(search));
            }
        }
    };
    let held = &keys[..keys.partition_point(|&key| key >= l2)];
    if holds(l2) {
        let cut = match t.top_p {
            None => SupportCut {
                cut: l2,
                kept: Tally::of(held, s_max),
            },
            Some(top_p) => top_p_ascending(held, top_p, s_max),
        };
        return (Pending::Done(cut), None);
    }
    // The buffer lies inside what min-p and top-k keep; the rest is below it. The
    // histogram's mass is exact to f64 rounding (pass A's sum may be f32 exponentials).
    // Without a mass, a top-p search sums it in its first pass.
    let total = bin.map(|b| b.total).or(total);
    let target = (t.top_p.filter(|_| l2 == 0)).and_then(|p| total.map(|m| p * m));
    if let Some(cut) = target.and_then(|m| top_p_descending(keys, m, s_max)) {
        return (Pending::Done(cut), None);
    }
    if let (Some(bin), Some(top_p)) = (bin, t.top_p_alone()) {
        return (Pending::Last { lo: 0 }, Some(bin.search(top_p)));
    }
    let b_min = keys[keys.len() - 1];
    last_search(l2, (l2, b_min), Tally::of(keys, s_max), (s_max, target), t)
}

/// The search for the support within the keys `≥ l2` over the range `[lo, hi)`, with
/// `above` the tally of the keys `≥ hi`: top-p's cut, or the tally of them all.
fn last_search(
    l2: u64,
    (lo, hi): (u64, u64),
    above: Tally,
    (s_max, target): (f32, Option<f64>),
    t: &Truncation,
) -> (Pending, Option<Search>) {
    let lo = lo.max(l2);
    let goal = match t.top_p {
        Some(top_p) => Goal::Mass { top_p, target },
        None => Goal::Sum,
    };
    let search = Search::new(goal, (lo, hi), above, s_max);
    (Pending::Last { lo }, Some(search))
}

/// Min-p's floor: the smallest key of a value `v` with `exp(v - s_max) ≥ min_p` (f64).
fn min_p_floor(s_max: f32, min_p: f64) -> u64 {
    let ord = |s: f32| (order_key(s, 0) >> 32) as u32;
    let value = |o: u32| key_value(u64::from(o) << 32);
    let keeps = |o: u32| rel_mass(value(o), s_max) >= min_p;
    let (mut lo, mut hi) = (ord(f32::NEG_INFINITY), ord(s_max));
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if keeps(mid) { hi = mid } else { lo = mid }
    }
    value_floor(value(hi))
}

/// Top-p over the whole set `held` (keys descending) as the reference sums it: its
/// mass, then ascending cumulative sums of the normalized masses; every entry whose sum
/// is `≤ 1 - top_p` is dropped, the largest always kept.
fn top_p_ascending(held: &[u64], top_p: f64, s_max: f32) -> SupportCut {
    let mass_of = |k: &u64| rel_mass(key_value(*k), s_max);
    let mass: f64 = held.iter().rev().map(mass_of).sum();
    let mut cumulative = 0.0;
    let mut first_kept = 0;
    for (m, k) in held.iter().rev().enumerate() {
        cumulative += mass_of(k) / mass;
        if cumulative > 1.0 - top_p {
            first_kept = held.len() - 1 - m;
            break;
        }
    }
    let kept = &held[..=first_kept];
    SupportCut {
        cut: held[first_kept],
        kept: Tally::of(kept, s_max),
    }
}

/// Top-p from the top of `keys` (descending) against the mass `target = top_p·M`: the
/// first key at which the cumulative mass reaches it, if the keys do.
fn top_p_descending(keys: &[u64], target: f64, s_max: f32) -> Option<SupportCut> {
    let mut kept = Tally::default();
    for &key in keys {
        kept.count += 1;
        kept.mass += rel_mass(key_value(key), s_max);
        if kept.mass >= target {
            return Some(SupportCut { cut: key, kept });
        }
    }
    None
}
