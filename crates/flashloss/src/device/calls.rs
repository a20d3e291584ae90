//! The call structs of a [`Device`](super::Device): one per loss ([`GrpoCall`], [`CeCall`],
//! [`LogpCall`]), each saying where the vocabulary is ([`Vocab`]: this rank's whole head,
//! or its [`Shard`] of a head split over a [`Grid`]) and, where a loss has a choice, what
//! to return ([`Returns`]: the forward alone, or also the gradients of an upstream).
//! The LM head and the gradient buffers travel beside the call, as
//! [`HeadArgs`](super::HeadArgs).

use crate::batch::GrpoBatch;
use crate::cross_entropy::CrossEntropy;
use crate::fused::{FusedOptions, LogpRequest, LogpRows, LogpUpstream};
use crate::grpo_config::GrpoLoss;
use crate::sharding::{Grid, Shard};

/// Where a call's vocabulary is.
#[derive(Clone, Copy)]
pub enum Vocab<'a> {
    /// The head holds the whole vocabulary (one rank, or ranks that only split rows
    /// and sum their own way).
    Whole,
    /// The head holds `shard` of a vocabulary split over `grid`'s vocab groups; its
    /// token groups split the rows (see [`crate::fused::grpo_linear_sharded`]).
    Sharded {
        /// Every rank, its token group and its vocab group.
        grid: &'a Grid<'a>,
        /// Which vocabulary ids this rank's weight rows hold.
        shard: Shard,
    },
}

/// What a call returns: the forward's outputs alone (no gradient buffer is read or
/// written), or also `∂L/∂(hidden, weight, bias)` for the upstream gradients `U`, added
/// into the head's buffers.
#[derive(Clone, Copy, Debug)]
pub enum Returns<U> {
    /// The forward only.
    Forward,
    /// The forward and the gradients of `Σ upstream · output`.
    Grads(U),
}

/// The GRPO loss of `batch` (N = B·T rows) on the head's logits; the forward and its
/// gradients (scaled by `opts.grad_output`) in one call. On [`Vocab::Whole`] the
/// normalizers are the batch's own; sharded, the grid's token groups agree on them.
#[derive(Clone, Copy)]
pub struct GrpoCall<'a> {
    /// The loss's configuration.
    pub loss: &'a GrpoLoss,
    /// This rank's rows.
    pub batch: &'a GrpoBatch<'a>,
    /// Where the vocabulary is.
    pub vocab: Vocab<'a>,
    /// Mode, budget, `grad_output`, which head gradients.
    pub opts: &'a FusedOptions,
}

impl<'a> GrpoCall<'a> {
    /// GRPO on a head that holds the whole vocabulary.
    pub fn new(loss: &'a GrpoLoss, batch: &'a GrpoBatch<'a>, opts: &'a FusedOptions) -> Self {
        GrpoCall {
            loss,
            batch,
            vocab: Vocab::Whole,
            opts,
        }
    }

    /// This call on `shard` of a vocabulary split over `grid`.
    pub fn sharded(self, grid: &'a Grid<'a>, shard: Shard) -> Self {
        GrpoCall {
            vocab: Vocab::Sharded { grid, shard },
            ..self
        }
    }
}

/// The upstream gradients of a cross-entropy call beyond `opts.grad_output`.
#[derive(Clone, Copy, Debug, Default)]
pub struct CeUpstream<'a> {
    /// `∂L/∂ℓ_i` `[N]` for reduction `none` (`None`: ones).
    pub rows: Option<&'a [f32]>,
    /// `∂L/∂lse_i` `[N]` of each row's log-sum-exp (`None`: zero; one rank only).
    pub lse: Option<&'a [f32]>,
}

/// The cross-entropy of the head's logits at `targets` `[N]` (see
/// [`crate::fused::ce_linear_lse`]).
#[derive(Clone, Copy)]
pub struct CeCall<'a> {
    /// Label smoothing, z-loss, ignore index, reduction, softcap.
    pub ce: &'a CrossEntropy,
    /// Target ids `[N]` of the whole vocabulary.
    pub targets: &'a [i64],
    /// Where the vocabulary is.
    pub vocab: Vocab<'a>,
    /// The per-row losses alone (one rank), or the gradients too.
    pub returns: Returns<CeUpstream<'a>>,
    /// Mode, budget, `grad_output`, which head gradients.
    pub opts: &'a FusedOptions,
}

impl<'a> CeCall<'a> {
    /// Cross-entropy and its gradients (upstream `opts.grad_output` alone) on a head that
    /// holds the whole vocabulary.
    pub fn new(ce: &'a CrossEntropy, targets: &'a [i64], opts: &'a FusedOptions) -> Self {
        CeCall {
            ce,
            targets,
            vocab: Vocab::Whole,
            returns: Returns::Grads(CeUpstream::default()),
            opts,
        }
    }

    /// This call with the per-row losses only: no gradient buffer is read or written.
    pub fn forward(self) -> Self {
        CeCall {
            returns: Returns::Forward,
            ..self
        }
    }

    /// This call with the gradients of `upstream`.
    pub fn upstream(self, upstream: CeUpstream<'a>) -> Self {
        CeCall {
            returns: Returns::Grads(upstream),
            ..self
        }
    }

    /// This call on `shard` of a vocabulary split over `grid`.
    pub fn sharded(self, grid: &'a Grid<'a>, shard: Shard) -> Self {
        CeCall {
            vocab: Vocab::Sharded { grid, shard },
            ..self
        }
    }
}

/// Per-row `logp`, `lse`, entropy and max logit of the head's scaled logits at
/// `rows.targets`, what `request` adds (`Σp²`, candidate sets, the truncated support),
/// and, given upstream gradients, their gradients (see
/// [`crate::fused::logp_linear_grads_with`]).
#[derive(Clone, Copy)]
pub struct LogpCall<'a> {
    /// Targets, mask, temperature.
    pub rows: LogpRows<'a>,
    /// What is computed beyond the statistics.
    pub request: LogpRequest<'a>,
    /// Where the vocabulary is.
    pub vocab: Vocab<'a>,
    /// The forward alone, or the gradients of these upstreams too.
    pub returns: Returns<LogpUpstream<'a>>,
    /// Budget (all a forward reads: it runs two-pass), and for gradients mode,
    /// `grad_output` and which head gradients.
    pub opts: &'a FusedOptions,
    /// T, to name positions in errors (N for a flat batch).
    pub seq_len: usize,
}

impl<'a> LogpCall<'a> {
    /// The forward of `rows` on a head that holds the whole vocabulary, nothing requested
    /// beyond the statistics.
    pub fn forward(rows: LogpRows<'a>, opts: &'a FusedOptions, seq_len: usize) -> Self {
        LogpCall {
            rows,
            request: LogpRequest::default(),
            vocab: Vocab::Whole,
            returns: Returns::Forward,
            opts,
            seq_len,
        }
    }

    /// [`LogpCall::forward`] with the gradients of `upstream`.
    pub fn grads(
        rows: LogpRows<'a>,
        upstream: LogpUpstream<'a>,
        opts: &'a FusedOptions,
        seq_len: usize,
    ) -> Self {
        LogpCall {
            returns: Returns::Grads(upstream),
            ..Self::forward(rows, opts, seq_len)
        }
    }

    /// This call with what `request` asks.
    pub fn request(self, request: &LogpRequest<'a>) -> Self {
        LogpCall {
            request: *request,
            ..self
        }
    }

    /// This call on `shard` of a vocabulary split over `grid`.
    pub fn sharded(self, grid: &'a Grid<'a>, shard: Shard) -> Self {
        LogpCall {
            vocab: Vocab::Sharded { grid, shard },
            ..self
        }
    }
}
