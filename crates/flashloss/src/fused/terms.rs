//! The terms the fused passes are written in, a leaf of `fused/`: a row's gradient
//! ([`RowGrad`], with a truncated support's [`SupportTerm`]) and the visitor of a pass's
//! logits tiles ([`TileVisitor`]). `passes.rs` (what a backend offers) and `support/`
//! (the truncated support) both build on them, and neither on the other's.

use super::key::key_value;
use crate::rows::RowStats;
use std::ops::Range;

/// What turns a row's logits into its gradient: with
/// `p_j = exp((z_j - max)·inv_temp - log_sum)`,
/// `dz_j = (coef_p·p_j + coef_h·p_j·(log p_j + H) + coef_uniform + [j = target]·coef_target)
/// · slope_j`, where `slope_j` is the soft-cap's `1 - (z_j/cap)²` (1 without one), plus
/// a truncated support's `coef·p^K_j·1[j∈K]·slope_j` where the row has a [`SupportTerm`].
#[derive(Debug, Clone, Copy, Default)]
pub struct RowGrad {
    /// Softmax statistics of the row.
    pub stats: RowStats,
    /// Multiplies `p_j`.
    pub coef_p: f32,
    /// Multiplies `p_j·(log p_j + H)`.
    pub coef_h: f32,
    /// Added to every entry.
    pub coef_uniform: f32,
    /// Added at the target.
    pub coef_target: f32,
    /// Target id, local to the head's vocabulary (unused when `coef_target` is 0).
    pub target: usize,
    /// The truncated support's term (log-probs with top-k/top-p/min-p; two-pass plans
    /// only, on the backends with the pass hooks).
    pub support: Option<SupportTerm>,
}

impl RowGrad {
    /// Whether every coefficient is 0 (the row's gradient is zero).
    pub fn is_zero(&self) -> bool {
        self.coef_p == 0.0
            && self.coef_h == 0.0
            && self.coef_uniform == 0.0
            && self.coef_target == 0.0
            && self.support.is_none_or(|s| s.coef == 0.0)
    }

    /// The gradient restricted to a vocabulary shard `range`: the target term stays
    /// with the shard that holds the target, as a shard-local id; a support term learns
    /// the shard's offset.
    pub fn on_shard(mut self, range: &Range<usize>) -> RowGrad {
        if let Some(term) = self.support.as_mut() {
            term.offset = range.start;
        }
        if range.contains(&self.target) {
            self.target -= range.start;
        } else {
            self.coef_target = 0.0;
            self.target = 0;
        }
        self
    }
}

/// The truncated-support term of a row's gradient: `dz_j += coef·p^K_j` for
/// `key_j ≥ cut` (times the soft-cap slope), `p^K_j = exp((z_j - max)·inv_temp - log_sum)`
/// with the row's `max` of [`RowGrad::stats`]; `coef` holds `g/T` like the other terms.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct SupportTerm {
    /// Multiplies `p^K_j`.
    pub coef: f32,
    /// `log Σ_{j∈K} exp((z_j - max)·inv_temp)`.
    pub log_sum: f32,
    /// The support's lowest key (`key::order_key`, ids of the whole
    /// vocabulary).
    pub cut: u64,
    /// The head's first id in the whole vocabulary (a vocabulary shard's offset): entry
    /// `j` of the head has id `offset + j`.
    pub offset: usize,
}

impl SupportTerm {
    /// The scaled logit of the cut: every entry of `K` has `s_j ≥` it.
    pub fn cut_value(&self) -> f32 {
        key_value(self.cut)
    }
}

/// Sees the logits tiles of a pass: `z` `[rows.len(), vocab.len()]` with row stride `ld`,
/// the logits after bias and soft-cap and before 1/T (scaled logits
/// `s = fl(z·inv_temp)`); `rows` are the tile's global row ids (live rows), `vocab` the
/// tile's entries in the head's own (shard-local) vocabulary. Called once per tile,
/// serially; an implementation may parallelize over the rows itself (rayon).
///
/// A plan whose passes need a visited row's whole statistics before its gradient (a
/// truncated support) must be two-pass (planned with `single_pass_allowed = false`): a
/// single pass forms each block's gradients before the next block is visited. In a
/// single pass ([`FusedPasses::single_pass_hooked`]) the lanes hand their tiles over in
/// turn, under a lock and in no fixed order: a visitor there must not wait on rayon work.
pub trait TileVisitor: Send {
    /// One tile.
    fn visit(&mut self, rows: &[usize], vocab: Range<usize>, z: &[f32], ld: usize);

    /// For a backend whose tiles stay on its device (CUDA): what this visitor's pass can
    /// do there instead of [`TileVisitor::visit`] (candidate sets' gathers, a truncated
    /// support's top keys). None of them (the default): the visitor needs every tile on
    /// the host, which such a backend refuses unless [`TileVisitor::rows_wanted`] names
    /// the few rows it needs.
    fn device_sinks(&mut self) -> DeviceSinks<'_> {
        DeviceSinks::default()
    }

    /// The rows (global ids, `[N]` flags) whose tiles the visitor reads, for a backend
    /// that hands the host only those rows' tiles (an extra pass of a truncated support:
    /// the rows still searching); `None` (the default): every row.
    fn rows_wanted(&self) -> Option<Vec<bool>> {
        None
    }
}

/// What a visitor's pass does on a backend's device ([`TileVisitor::device_sinks`]).
#[derive(Default)]
pub struct DeviceSinks<'v> {
    /// Candidate sets gathered from each tile.
    pub gather: Option<DeviceGatherSink<'v>>,
    /// A truncated support's per-row top keys, selected from each tile.
    pub top: Option<DeviceTopSink<'v>>,
}

/// What a truncated support's pass-A visitor keeps, for a backend that selects it on its
/// device: per row its top `cap` keys (`key::order_key` of the scaled logits
/// `s = fl(x·inv_temp) + 0` after bias and soft-cap, ids of the whole vocabulary: entry
/// `j` of the head has id `offset + j`), and whether they are the whole row (every
/// entry seen, none dropped). Masked rows keep none.
pub struct DeviceTopSink<'v> {
    /// Keys a row keeps.
    pub cap: usize,
    /// The head's first id in the whole vocabulary.
    pub offset: usize,
    /// Set by the backend after the pass: per row its keys (any order, at most `cap`)
    /// and whether they are the whole row.
    pub tops: &'v mut Option<Vec<(Vec<u64>, bool)>>,
}

/// What a candidate-set visitor gathers, for a backend that gathers on its device: per
/// row `k` slots, the id local to the head's vocabulary of each (`-1`: not gathered, a
/// masked row or an id another shard holds), and where the gathered logits go (the
/// logits `visit` would have seen: after bias and soft-cap, before `1/T`; entries whose
/// id is `-1` keep their values).
pub struct DeviceGatherSink<'v> {
    /// Slots per row.
    pub k: usize,
    /// `[N, k]` ids local to the head (`-1`: none).
    pub local_ids: &'v [i64],
    /// `[N, k]` gathered logits.
    pub z: &'v mut [f32],
}
