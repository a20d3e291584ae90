//! The log-prob calls of a [`Device`]: per-row `logp`, `lse`, entropy and max logit of an
//! LM head's scaled logits, what a [`LogpRequest`] adds (`Σp²`, candidate sets, the
//! truncated support), and their gradients, on one rank or a [`Grid`] (see
//! [`crate::fused::logp_linear_with`]).

use super::{Device, HeadArgs};
use crate::element::Element;
use crate::error::Result;
use crate::fused::{self, FusedOptions, LogpOutput, LogpRequest, LogpRows, LogpUpstream};
use crate::rows::RowStats;
use crate::sharding::{Grid, Shard};
use crate::temperature::Temperature;

impl Device {
    /// Per-row `logp`, `lse` and entropy of `(hidden · weightᵀ + bias) / temperature`
    /// at `targets` (see [`fused::logp_linear`]); no gradient buffer is made.
    pub fn logp_linear<E: Element>(
        &self,
        head: HeadArgs<E>,
        targets: &[i64],
        mask: Option<&[bool]>,
        temperature: Temperature,
        budget_bytes: usize,
        seq_len: usize,
    ) -> Result<Vec<RowStats>> {
        self.run(head, |h| {
            fused::logp_linear(h, targets, mask, temperature, budget_bytes, seq_len)
        })
    }

    /// The gradient of [`Device::logp_linear`]'s `logp` and entropy for `upstream`
    /// (see [`fused::logp_linear_grads`]), added into the caller's buffers; returns the
    /// rows' statistics.
    pub fn logp_linear_grads_into<E: Element>(
        &self,
        head: HeadArgs<E>,
        rows: LogpRows,
        upstream: LogpUpstream,
        opts: &FusedOptions,
        seq_len: usize,
    ) -> Result<Vec<RowStats>> {
        self.run(head, |h| {
            fused::logp_linear_grads(h, rows, upstream, opts, seq_len)
        })
    }

    /// [`Device::logp_linear`] with what `request` asks beyond the statistics (see
    /// [`fused::logp_linear_with`]).
    pub fn logp_linear_with<E: Element>(
        &self,
        head: HeadArgs<E>,
        rows: LogpRows,
        request: &LogpRequest,
        budget_bytes: usize,
        seq_len: usize,
    ) -> Result<LogpOutput> {
        self.run(head, |h| {
            fused::logp_linear_with(h, rows, request, budget_bytes, seq_len)
        })
    }

    /// [`Device::logp_linear_grads_into`] with what `request` asks and the upstream
    /// gradients of `lse` and the candidates (see [`fused::logp_linear_grads_with`]).
    pub fn logp_linear_grads_with_into<E: Element>(
        &self,
        head: HeadArgs<E>,
        (rows, request): (LogpRows, &LogpRequest),
        upstream: LogpUpstream,
        opts: &FusedOptions,
        seq_len: usize,
    ) -> Result<LogpOutput> {
        self.run(head, |h| {
            fused::logp_linear_grads_with(h, rows, request, upstream, opts, seq_len)
        })
    }

    /// [`Device::logp_linear_with`] of a head split over `grid`'s vocab groups (see
    /// [`fused::logp_linear_sharded_with`]).
    #[allow(clippy::too_many_arguments)]
    pub fn logp_linear_sharded_with<E: Element>(
        &self,
        grid: &Grid,
        shard: Shard,
        head: HeadArgs<E>,
        (rows, request): (LogpRows, &LogpRequest),
        budget_bytes: usize,
        seq_len: usize,
    ) -> Result<LogpOutput> {
        self.run(head, |h| {
            fused::logp_linear_sharded_with(grid, h, shard, rows, request, budget_bytes, seq_len)
        })
    }

    /// [`Device::logp_linear_grads_with_into`] of a head split over `grid` (see
    /// [`fused::logp_linear_grads_sharded_with`]).
    #[allow(clippy::too_many_arguments)]
    pub fn logp_linear_grads_sharded_with_into<E: Element>(
        &self,
        grid: &Grid,
        shard: Shard,
        head: HeadArgs<E>,
        (rows, request): (LogpRows, &LogpRequest),
        upstream: LogpUpstream,
        opts: &FusedOptions,
        seq_len: usize,
    ) -> Result<LogpOutput> {
        self.run(head, |h| {
            let call = (rows, request, upstream);
            fused::logp_linear_grads_sharded_with(grid, h, shard, call, opts, seq_len)
        })
    }

    /// [`Device::logp_linear_grads_into`] of a head split over `grid` (see
    /// [`fused::logp_linear_grads_sharded`]).
    #[allow(clippy::too_many_arguments)]
    pub fn logp_linear_grads_sharded_into<E: Element>(
        &self,
        grid: &Grid,
        shard: Shard,
        head: HeadArgs<E>,
        rows: LogpRows,
        upstream: LogpUpstream,
        opts: &FusedOptions,
        seq_len: usize,
    ) -> Result<Vec<RowStats>> {
        self.run(head, |h| {
            fused::logp_linear_grads_sharded(grid, h, shard, rows, upstream, opts, seq_len)
        })
    }

    /// [`Device::logp_linear`] of a head split over `grid`'s vocab groups (see
    /// [`fused::logp_linear_sharded`]).
    #[allow(clippy::too_many_arguments)]
    pub fn logp_linear_sharded<E: Element>(
        &self,
        grid: &Grid,
        shard: Shard,
        head: HeadArgs<E>,
        targets: &[i64],
        mask: Option<&[bool]>,
        temperature: Temperature,
        budget_bytes: usize,
        seq_len: usize,
    ) -> Result<Vec<RowStats>> {
        self.run(head, |h| {
            fused::logp_linear_sharded(
                grid,
                h,
                shard,
                targets,
                mask,
                temperature,
                budget_bytes,
                seq_len,
            )
        })
    }
}
