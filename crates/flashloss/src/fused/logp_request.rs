//! What a log-prob call asks beyond each row's `logp`, `lse`, entropy and max logit
//! ([`LogpRequest`]), what it returns ([`LogpOutput`]) and the upstream gradients of its
//! differentiable outputs ([`LogpUpstream`]), on the scaled logits `s = z/T` of each row
//! (spec: "Per-token statistics beyond logp and entropy"):
//!
//! - `Σπ²`: `P2_i = Σ_j p_ij² = S₂/S²` (not differentiated);
//! - candidate sets: `logp_ik = s_{i,k_ik} - lse_i` at `gather_ids` `[N, K]`, with
//!   `∂logp_ik/∂s_ij = 1[j = k_ik] - p_ij`;
//! - truncated support (top-k / top-p / min-p, [`SupportFilter`]);
//! - `lse_i`, differentiable: `∂lse_i/∂s_ij = p_ij`.

use crate::error::{Error, Result};
use crate::rows::RowStats;
use crate::support_filter::SupportFilter;

/// Candidate ids `[N, k]` of the whole vocabulary (row-major; repeats allowed, any may be
/// the target), read where the row is live.
#[derive(Debug, Clone, Copy)]
pub struct GatherIds<'a> {
    /// Ids `[N·k]`.
    pub ids: &'a [i64],
    /// Ids per row (≥ 1).
    pub k: usize,
}

/// What a log-prob call computes beyond every row's [`RowStats`] (`logp`, `lse`,
/// entropy, max); `Default`: nothing more.
#[derive(Debug, Clone, Copy, Default)]
pub struct LogpRequest<'a> {
    /// `Σ_j p_ij²` per row.
    pub sum_p2: bool,
    /// `logp_ik = s_{i,k_ik} - lse_i` at these ids.
    pub gather_ids: Option<GatherIds<'a>>,
    /// The truncated support's `logp^K` (see [`SupportFilter`]).
    pub support: Option<SupportFilter>,
}

impl LogpRequest<'_> {
    /// Whether the passes need the pass hooks.
    pub fn needs_hooks(&self) -> bool {
        self.gather_ids.is_some() || self.support.is_some()
    }

    /// Whether a gradient call with this request may run single-pass: all but a
    /// truncated support, whose cut needs each row's whole statistics before its
    /// gradient (candidate sets are gathered and get their one-hot terms in the pass).
    pub fn grads_single_pass_allowed(&self) -> bool {
        self.support.is_none()
    }

    /// Checks the request for `n` rows (`live`) of a vocabulary of `vocab` entries:
    /// `gather_ids` `[N, K]` with `K ≥ 1` and ids in `[0, vocab)` where live; the
    /// support filter's ranges.
    pub fn check(&self, n: usize, vocab: usize, live: &[bool], seq_len: usize) -> Result<()> {
        if let Some(g) = &self.gather_ids {
            if g.k == 0 {
                return Err(Error::InvalidArgument {
                    arg: "gather_ids",
                    reason: "needs at least one id per row (K ≥ 1)".into(),
                });
            }
            if g.ids.len() != n * g.k {
                return Err(Error::ShapeMismatch {
                    arg: "gather_ids",
                    shape: format!("[N={n}, K={}]", g.k),
                    expected: n * g.k,
                    actual: g.ids.len(),
                });
            }
            let bad = (g.ids.iter().enumerate())
                .find(|&(at, &id)| live[at / g.k] && !(0..vocab as i64).contains(&id));
            if let Some((at, &id)) = bad {
                let row = at / g.k;
                return Err(Error::TokenOutOfRange {
                    arg: "gather_ids",
                    index: at,
                    seq: row / seq_len,
                    pos: row % seq_len,
                    id,
                    vocab,
                });
            }
        }
        match &self.support {
            Some(filter) => filter.check(),
            None => Ok(()),
        }
    }
}

/// The truncated support's per-row outputs (filled where [`LogpRequest::support`] is
/// set).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SupportStats {
    /// `logp^K_i = s_{i,y_i} - lse^K_i` (`-inf` where the target is outside `K_i`; 0
    /// where masked).
    pub logp: Vec<f32>,
    /// `lse^K_i = logsumexp_{j∈K_i} s_ij`.
    pub lse: Vec<f32>,
    /// Whether row i's target is outside its support.
    pub outside: Vec<bool>,
    /// `|K_i|` (0 where masked).
    pub size: Vec<u64>,
    /// Passes over the vocabulary beyond the call's own (2NHV FLOPs each) that rows
    /// whose cut the top buffers could not decide took (`fused::support`).
    pub extra_passes: usize,
}

/// The outputs of a log-prob call: every row's statistics and what the
/// [`LogpRequest`] asked (zeros on masked rows).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LogpOutput {
    /// `logp`, `lse`, entropy and the raw max `μ` of every row `[N]`.
    pub stats: Vec<RowStats>,
    /// The max scaled logit `max_j s_ij = fl(μ_i·(1/T))` `[N]`.
    pub max_logit: Vec<f32>,
    /// `Σ_j p_ij²` `[N]`, where asked.
    pub sum_p2: Option<Vec<f32>>,
    /// `logp_ik` `[N, K]`, where `gather_ids` were given.
    pub gathered: Option<Vec<f32>>,
    /// The truncated support's outputs, where asked.
    pub support: Option<SupportStats>,
}

/// The upstream gradients of a log-prob call's outputs `[N]` (`[N, K]` for `gathered`);
/// `None`: the output is not used (zero).
#[derive(Debug, Clone, Copy)]
pub struct LogpUpstream<'a> {
    /// `∂L/∂logp_i`; with a truncated support, of `logp^K_i` (the full softmax's `logp`
    /// is then not differentiated; rows whose target is outside the support take none).
    pub logp: &'a [f32],
    /// `∂L/∂H_i`.
    pub entropy: Option<&'a [f32]>,
    /// `∂L/∂lse_i`.
    pub lse: Option<&'a [f32]>,
    /// `∂L/∂logp_ik` of the gathered log-probs.
    pub gathered: Option<&'a [f32]>,
}

impl<'a> LogpUpstream<'a> {
    /// The upstream of `logp` and (optionally) the entropy alone.
    pub fn new(logp: &'a [f32], entropy: Option<&'a [f32]>) -> Self {
        LogpUpstream {
            logp,
            entropy,
            lse: None,
            gathered: None,
        }
    }
}
