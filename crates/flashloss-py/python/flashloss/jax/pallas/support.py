"""``logp^K`` under vLLM V1's truncated support on the Pallas kernels, streamed over the
vocabulary: no ``[N, V]`` array, also with the head split over ``vocab_axis``.

Keys order a row by ``(s_j, j)`` (``s`` the f32 scaled logit, ``j`` the column of the
whole vocabulary); every support is ``K_i = {j : (s_ij, j) ≥ κ_i}`` (docs/spec/losses.md,
additions 12-13, vLLM's order min-p → top-k → top-p). Per row ``i``:

- pass A (:mod:`.support_topc`, bound ``+inf``): the ``C`` largest keys ``L`` (``C`` =
  ``top_k`` rounded up to 128, within [128, 512]), ``m = max s`` and ``σ = Σ e^{s - m}``;
- min-p: ``τ_min`` = the least f32 ``s`` with ``s - m ≥ log(min_p)`` (``log(min_p)`` in
  f64 as two f32, ``s - m`` exact by a two-sum; the f64 test ``e^{s - m} ≥ min_p`` of the
  reference up to f64 rounding), from ``m`` alone;
- top-k: ``v_k`` = the ``k``-th largest value (with repeats) of the row, from ``L`` where
  ``k ≤ C`` (else past it, :mod:`.support_search`); ``τ = max(τ_min, v_k)`` (ties at
  ``v_k`` kept; fewer than ``k`` entries left by min-p: all of them), the set left
  ``{s ≥ τ}``;
- top-p: with ``M = Σ_{s ≥ τ} e^{s - m}`` (``σ`` where nothing was cut, else a
  :mod:`.support_tally` pass) and ``A(e) = Σ_{keys > e, s ≥ τ} e^{s - m}`` the mass above
  key ``e``, the reference drops the ascending prefix with cumulative mass
  ``M - A(e) ≤ (1 - top_p)·M``, so ``κ`` is the smallest key of the set left with
  ``M - A(κ) > (1 - top_p)·M`` (the largest key at least): walked down ``L`` and, where
  ``L`` runs out first (flat rows: a nucleus of more than ``C`` keys), found by
  :mod:`.support_search`: narrowing passes (:mod:`.support_narrow`, counts and masses at
  16 thresholds a row at once) onto an interval of at most ``C`` keys, then one
  collecting pass and the same walk;
- a :mod:`.support_tally` pass at ``κ``: ``M^K = Σ_{K} e^{s - m}``, ``s_y``, ``y ∈ K``;
  ``lse^K = m + log M^K``, ``logp^K = s_y - lse^K`` (``-inf`` where ``y ∉ K``).

Passes over the head (each ``2NHV`` FLOPs, the head read ``⌈N/bn⌉`` times): ``2`` (A and
the tally at ``κ``), ``+1`` for top-p after min-p or top-k (``M``); where a row's search
runs past ``L`` (the slowest row of the batch sets the count, dead rows take none): top-k
with ``k > C``, ``⌈(k - C)/C⌉`` collecting passes up to 3, else narrowing; top-p past
``L``, on a row whose values spread smoothly, ``⌈log_16(n/C)⌉ + 1`` narrowing passes
(``n`` the entries in the first interval, ``≤ V``) and one collecting pass: at ``V`` =
151936, ``C`` = 128, at most 4 + 1; on any row at most 12 + 1, plus ``⌈t/C⌉ - 1`` where
the cut lies inside a tie of ``t > C`` entries of one value (:mod:`.support_search`).
Peaked rows (a cut inside ``L``) take none. Besides, the statistics
kernel of :mod:`.stats` (entropy, lse). :func:`row_stats` is one ``custom_vjp`` for all of
them, so the backward is :mod:`.head_grads` once (``4NHV``): the statistics' coefficients,
with ``∂logp^K/∂s_j = 1[j = y] - p^K_j`` added (``lse^K``, ``-g`` and ``κ`` as row inputs;
the support held fixed, none for an outside row). Two ``custom_vjp`` would each write a
``[V, H]`` dW, one of them an XLA temporary.
Sums are f32 (the reference's f64): a top-p support may differ where a cumulative mass is
within f32 rounding of ``(1 - top_p)·M``; min-p and top-k decisions are exact.

Over ``vocab_axis`` each device runs the kernels on its block (global column ``offset +
local``): the lists are ``all_gather``-ed and merged, ``m`` by ``pmax``, the sums by
``psum``, so every device decides the same ``κ``.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from . import stats, support_narrow, support_search, support_tally, support_topc
from .head import vocab_size
from .stats import HeadSpec, _primal
from .support_search import NO_COLUMN


def list_size(top_k: Optional[int]) -> int:
    """``C``: keys per row of a collecting pass."""
    return 128 if top_k is None else min(max(-(-top_k // 128) * 128, 128), 512)


class _Head:
    """The kernels' calls on this device's block, merged over ``spec.vocab_axis``."""

    def __init__(self, x, weight, ids, spec: HeadSpec, bias=None):
        self.x, self.weight, self.bias, self.axis = x, weight, bias, spec.vocab_axis
        self.kw = spec.kernel_args()
        self.size = list_size(spec.support.top_k)
        self.vocab = spec.vocab
        block = vocab_size(weight, spec.layout)
        self.offset = 0 if self.axis is None else (jax.lax.axis_index(self.axis) * block).astype(jnp.int32)
        self.local_ids = ids - self.offset

    def _sum(self, a):
        return a if self.axis is None else jax.lax.psum(a, self.axis)

    def collect(self, bound_v, bound_j):
        """``(values, columns)`` ``[N, C]`` descending, ``m``, ``σ``, ``s_y``."""
        vals, cols, m, sigma, t = support_topc.collect(
            self.x, self.weight, self.bias, self.local_ids, bound_v, bound_j - self.offset, size=self.size, **self.kw
        )
        cols = jnp.where(vals > -jnp.inf, cols + self.offset, cols)
        if self.axis is not None:
            vals, cols = (jax.lax.all_gather(a, self.axis, axis=1, tiled=True) for a in (vals, cols))
            top = jax.lax.pmax(m, self.axis)
            sigma = jax.lax.psum(
                jnp.where(sigma > 0, sigma * jnp.exp(m - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0), self.axis
            )
            m = top
        neg_v, neg_c = jax.lax.sort((-vals, -cols), dimension=1, num_keys=2)
        return -neg_v[:, : self.size], -neg_c[:, : self.size], m, sigma, self._sum(t)

    def tally(self, cut_v, cut_j, m):
        """``(M, s_y, y ∈ K)`` at the cut ``(cut_v, cut_j)``, masses relative to ``m``."""
        shift = jnp.where(jnp.isfinite(m), m, 0.0)
        mass, t, inside = support_tally.tally(
            self.x, self.weight, self.bias, self.local_ids, cut_v, cut_j - self.offset, shift, **self.kw
        )
        return self._sum(mass), self._sum(t), self._sum(inside) > 0

    def narrow(self, thresholds, up, m, with_mass):
        """``(N, G)`` ``[N, T]`` at ``thresholds`` and the least and largest value in
        ``[thresholds[:, 0], up]`` (:mod:`.support_narrow`), masses relative to ``m``."""
        shift = jnp.where(jnp.isfinite(m), m, 0.0)
        cnt, mass, least, most = support_narrow.narrow(
            self.x, self.weight, self.bias, thresholds, up, shift, with_mass=with_mass, **self.kw
        )
        if self.axis is not None:
            cnt, mass = self._sum(cnt), self._sum(mass)
            least, most = jax.lax.pmin(least, self.axis), jax.lax.pmax(most, self.axis)
        return cnt, mass, least, most


def min_p_cut(m: jax.Array, min_p: float) -> jax.Array:
    """The least f32 ``s`` with ``s - m ≥ log(min_p)`` (exactly), ``-inf`` where ``m`` is."""
    log = math.log(min_p)
    hi = np.float32(log)
    lo = np.float32(log - float(hi))
    a = m + hi
    bb = a - m
    r = ((m - (a - bb)) + (hi - bb)) + lo  # m + log = a + r
    c = a + r
    down, up = jnp.nextafter(c, -jnp.inf), jnp.nextafter(c, jnp.inf)
    cut = jnp.where(down - a >= r, down, jnp.where(c - a >= r, c, up))
    cut = jnp.where(jnp.abs(cut) < np.finfo(np.float32).tiny, 0.0, cut)  # subnormals flush, as on a TPU
    return jnp.where(jnp.isfinite(m), cut, -jnp.inf)


def _forward(x, weight, bias, ids, live, spec: HeadSpec):
    """``(logp^K, outside, lse^K, cut_v, cut_j)`` ``[N]`` and the passes over the head
    past pass A and the tally at ``κ`` (the searches' and the tally of ``M``)."""
    f = spec.support
    h = _Head(x, weight, ids, spec, bias)
    n = x.shape[0]
    vals, cols, m, sigma, _ = h.collect(jnp.full((n,), jnp.inf, jnp.float32), jnp.zeros((n,), jnp.int32))
    tau = jnp.full((n,), -jnp.inf, jnp.float32) if f.min_p is None else min_p_cut(m, f.min_p)
    passes = jnp.int32(0)
    if f.top_k is not None:
        kth, passes = support_search.kth(h, (vals, cols), f.top_k, live)
        tau = jnp.maximum(tau, kth)
    cut_v, cut_j = tau, jnp.full((n,), NO_COLUMN, jnp.int32)
    if f.top_p is not None:
        total = sigma
        if f.min_p is not None or f.top_k is not None:
            total = h.tally(tau, cut_j, m)[0]
            passes = passes + 1
        cut_v, cut_j, more = support_search.top_p(h, (vals, cols), m, tau, total, f.top_p, live)
        passes = passes + more
    mass, s_y, inside = h.tally(cut_v, cut_j, m)
    lse = jnp.where(jnp.isfinite(m), m, 0.0) + jnp.log(mass)
    logp = jnp.where(live, jnp.where(inside, s_y - lse, -jnp.inf), 0.0)
    return (logp, live & ~inside, lse, cut_v, cut_j), passes


def search_passes(x, weight, bias, ids, live, spec: HeadSpec) -> jax.Array:
    """The passes over the head that :func:`row_stats`' forward runs besides pass A and the
    tally at ``κ`` (int32 scalar; a diagnostic, the same decisions)."""
    return _forward(x, weight, bias, ids, live, spec)[1]


def _stats(x, weight, bias, ids, live, spec: HeadSpec):
    """:class:`.stats.RowStats` with ``logp_k``, ``outside``, and ``(lse^K, κ)``."""
    full = stats._forward(x, weight, bias, ids, live, spec)
    (logp, outside, lse, cut_v, cut_j), _ = _forward(x, weight, bias, ids, live, spec)
    return full._replace(logp_k=logp, outside=outside), (lse, cut_v, cut_j)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _row_stats(x, weight, bias, ids, live, spec):
    return _stats(x, weight, bias, ids, live, spec)[0]


def _fwd(x, weight, bias, ids, live, spec):
    (x, want_dh), (weight, want_dw), (bias, want_db) = _primal(x), _primal(weight), _primal(bias)
    (ids, _), (live, _) = _primal(ids), _primal(live)
    out, support = _stats(x, weight, bias, ids, live, spec)
    wants = tuple(() if w else None for w in (want_dh, want_dw, want_db and bias is not None))
    return out, (x, weight, bias, ids, live, out.lse, out.entropy, out.outside, support, wants)


def _bwd(spec, res, cts):
    x, weight, bias, ids, live, lse, entropy, outside, (lse_k, cut_v, cut_j), wants = res
    h = _Head(x, weight, ids, spec)
    rows = stats.coefficients(cts[:4], lse, entropy, live, spec)  # max and sum_p2 take none
    g = cts.logp_k
    g = jnp.zeros_like(lse) if isinstance(g, SymbolicZero) else jnp.where(live & ~outside, g, 0.0)
    g = g.astype(jnp.float32)
    rows = (*rows[:2], rows[2] + g, *rows[3:], jnp.where(g != 0, lse_k, jnp.inf), -g, cut_v, cut_j - h.offset)
    return (*stats.grads(x, weight, bias, h.local_ids, rows, wants, spec), None, None)


_row_stats.defvjp(_fwd, _bwd, symbolic_zeros=True)


def row_stats(x, weight, bias, ids, live, spec: HeadSpec) -> stats.RowStats:
    """:func:`.stats.row_stats` with ``logp_k`` and ``outside`` under ``spec.support``
    (``logp^K`` 0 and ``outside`` False where not ``live``), in one backward pass:
    differentiable in ``x``, ``weight``, ``bias`` through every statistic, ``logp^K`` with
    the support held fixed."""
    return _row_stats(x, weight, bias, ids, live, spec)
