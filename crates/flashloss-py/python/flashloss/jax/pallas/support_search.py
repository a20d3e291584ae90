"""The truncated support's searches past pass A's list (:mod:`.support`): top-k's ``k``-th
value where ``k > C``, and top-p's cut where the nucleus holds more than the list's ``C``
keys (flat rows), in a bounded number of passes over the head.

A search holds per row a value interval ``[lo, up]`` that holds the value ``κ_v`` sought,
``A_n``, ``A_g`` the count and mass ``e^{s - m}`` of the entries above ``up``, and
``N(lo)``. A narrowing pass (:mod:`.support_narrow`) tallies ``N(t)``, ``G(t)`` (entries
``≥ t``) at ``T`` = :data:`THRESHOLDS` thresholds ``t_0 = lo < t_1 ≤ … ≤ t_{T-1} ≤ up``
and the least and largest value in ``[lo, up]``. With ``hit(t)`` the test that ``κ_v <
t`` — top-k: ``N(t) < k``; top-p: ``M - G(t) > (1 - top_p)·M``, the walk's own test on
the entry just below ``t``, and ``N(t) < N(lo)`` (an empty ``[lo, t)`` holds no cut) —
the first threshold ``t_a`` hit gives ``up = t_a⁻`` (``A_n, A_g = N(t_a), G(t_a)``), the
one before it ``lo = t_{a-1}`` (``N(lo) = N(t_{a-1})``), then both clamped to the values
present (the least and largest). ``N`` and ``G`` are non-increasing in ``t`` bit for bit,
so the tests agree from pass to pass, and the bin kept always holds entries.

- Spacing: linear in the value over ``[lo, up]`` for the first :data:`LINEAR_PASSES`
  passes (each takes the interval ``T``-fold down: on a smooth row its count too), then
  on the f32 order (the ordinal of the bit pattern: the interval's ``≤ 2^32`` floats
  ``T``-fold down a pass). Top-p's first pass spaces over ``[g, up]`` with ``g = m +
  log((1 - top_p)/V)``, the bin below ``g`` one bin: the entries below ``g`` hold at most
  ``V·e^{g - m} = (1 - top_p) ≤ (1 - top_p)·M`` (``M ≥ 1``, the max is kept), so in
  exact arithmetic the cut is not below ``g``; ``g`` only places thresholds, and where
  the f32 sums disagree the next passes search below it.
- A row stops when ``[lo, up]`` holds ``≤ C`` entries (``N(lo) - A_n``) or one value.
  Then top-k's ``v_k`` is that value, or the ``(k - A_n)``-th of the ``C`` keys ``≤ up``
  of one collecting pass; top-p walks those keys down from ``A_g`` (the walk of pass A's
  list, keys below ``lo`` not taken). Where ``[lo, up]`` is one value of more than ``C``
  entries (ties), the walk collects them ``C`` keys a pass, by ``(value, column)``:
  ``⌈ties/C⌉`` passes, bounded by the count of that tie alone.

Passes, each ``2NHV`` FLOPs (a ``lax.while_loop`` runs until the slowest row of the
batch stops; dead rows take none): at most ``LINEAR_PASSES + ⌈32/log2 T⌉`` = 4 + 8 = 12
narrowing passes and one collecting pass, plus ``⌈ties/C⌉ - 1`` where the cut lies in a
tie of more than ``C`` entries; a row of ``n`` entries spread smoothly over the interval
takes ``⌈log_T(n/C)⌉ + 1`` narrowing passes (``V`` = 151936, ``C`` = 128: 4). Top-k
with ``⌈(k - C)/C⌉ ≤`` :data:`WALK_PASSES` walks the keys down instead (that many
collecting passes, exact at ties too).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from .head import same_axes

#: A column below every column (a cut at a value alone), safe to shift by an offset.
NO_COLUMN = -(1 << 30)
#: A column above every column: the bound ``(u, ALL_COLUMNS)`` takes every entry ``≤ u``.
ALL_COLUMNS = 1 << 30
#: Thresholds of a narrowing pass.
THRESHOLDS = 16
#: Narrowing passes spaced linearly in the value before the f32 order.
LINEAR_PASSES = 4
#: Most collecting passes of a top-k walk before a search is cheaper.
WALK_PASSES = 3


def max_narrowing_passes(thresholds: int = THRESHOLDS) -> int:
    """The most narrowing passes a row takes (module header)."""
    return LINEAR_PASSES + math.ceil(32 / math.log2(thresholds))


def take(a, i):
    return jnp.take_along_axis(a, jnp.clip(i, 0, a.shape[1] - 1)[:, None], 1)[:, 0]


def _ordinal(v):
    i = jax.lax.bitcast_convert_type(v, jnp.int32)
    return jnp.where(i < 0, i ^ 0x7FFFFFFF, i)


def _from_ordinal(o):
    return jax.lax.bitcast_convert_type(jnp.where(o < 0, o ^ 0x7FFFFFFF, o), jnp.float32)


def thresholds(lo, up, base, linear):
    """``[N, T]``: ``lo``, then ``T - 1`` thresholds in ``(lo, up]`` ascending, linear over
    ``[base, up]`` (``base`` itself first where ``lo < base < up``, else over ``[lo, up]``)
    where ``linear``, else on the f32 order over ``[lo, up]``."""
    size = THRESHOLDS
    use = (base > lo) & (base < up)
    b = jnp.where(use, base, lo)
    d = jnp.where(use, 1.0, 0.0)[:, None]
    k = jnp.arange(1, size, dtype=jnp.float32)[None]
    lin = b[:, None] + (up - b)[:, None] * ((k - d) / (size - d))
    ol = _ordinal(lo)
    width = jax.lax.bitcast_convert_type(_ordinal(up) - ol, jnp.uint32)  # < 2^32: exact mod 2^32
    ki = jnp.arange(1, size, dtype=jnp.uint32)[None]
    q, r = (width // size)[:, None], (width % size)[:, None]
    off = q * ki + (r * ki + size - 1) // size  # ⌈width·k/T⌉ without overflow
    o = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(ol, jnp.uint32)[:, None] + off, jnp.int32)
    linear = linear & jnp.isfinite(b) & jnp.isfinite(up) & (width > size * size)  # few floats: one bin each
    inner = jnp.where(linear[:, None], lin, _from_ordinal(o))
    inner = jnp.minimum(jnp.maximum(inner, jnp.nextafter(lo, jnp.inf)[:, None]), up[:, None])
    return jnp.concatenate([lo[:, None], inner], axis=1)


def narrow(h, m, state, active, hit, base, with_mass):
    """Narrowing passes until no ``active`` row's interval holds more than ``C`` entries
    and more than one value. ``state``: ``(lo, up, A_n, A_g)`` ``[N]``; ``hit(N, G)`` the
    test ``κ_v < t`` ``[N, T]``; ``base`` the first pass's linear base. Returns
    ``(lo, up, N(lo), A_n, A_g)`` and the passes run."""
    n = m.shape[0]
    lo, up, an, ag = state

    def body(st):
        lo, up, lo_n, an, ag, active, p = st
        th = thresholds(lo, up, jnp.where(p == 0, base, lo), jnp.broadcast_to(p < LINEAR_PASSES, lo.shape))
        cnt, mass, least, most = h.narrow(th, up, m, with_mass)
        hits = hit(cnt, mass) & (cnt < cnt[:, :1])
        hits = hits.at[:, 0].set(False)
        a = jnp.where(jnp.any(hits, axis=1), jnp.argmax(hits, axis=1), THRESHOLDS)
        below = a < THRESHOLDS
        lo2 = jnp.maximum(take(th, a - 1), least)
        up2 = jnp.minimum(jnp.where(below, jnp.nextafter(take(th, a), -jnp.inf), up), most)
        new = (lo2, up2, take(cnt, a - 1), jnp.where(below, take(cnt, a), an), jnp.where(below, take(mass, a), ag))
        lo, up, lo_n, an, ag = (jnp.where(active, x, y) for x, y in zip(new, (lo, up, lo_n, an, ag)))
        active = active & (lo_n - an > h.size) & (lo < up)
        return lo, up, lo_n, an, ag, active, p + 1

    init = (*same_axes(lo, up, jnp.full((n,), jnp.inf, jnp.float32), an, ag, active & (lo < up)), jnp.int32(0))
    lo, up, lo_n, an, ag, _, passes = jax.lax.while_loop(lambda s: jnp.any(s[5]), body, init)
    return (lo, up, lo_n, an, ag), passes


def kth(h, first, k: int, live):
    """The ``k``-th largest value of every row, with repeats (``-inf`` past its end), and
    the passes run."""
    size = h.size

    def step(vals, cols, need, kth, done):
        count = jnp.sum(vals > -jnp.inf, axis=1)
        found = ~done & (need <= count)
        kth = jnp.where(found, take(vals, need - 1), kth)
        done = done | found | (count < size)
        return (vals[:, -1], cols[:, -1]), need - size, kth, done

    vals, cols = first
    n = vals.shape[0]
    init = step(vals, cols, jnp.full((n,), k, jnp.int32), jnp.full((n,), -jnp.inf, jnp.float32), ~live)
    if k <= size:
        return init[2], jnp.int32(0)
    if -(-(k - size) // size) <= WALK_PASSES:

        def body(state):
            (bv, bj), need, kth, done, p = state
            vals, cols = h.collect(jnp.where(done, -jnp.inf, bv), jnp.where(done, NO_COLUMN, bj))[:2]
            return (*step(vals, cols, need, kth, done), p + 1)

        out = jax.lax.while_loop(lambda s: ~jnp.all(s[3]), body, (*init, jnp.int32(0)))
        return out[2], out[4]
    # v_k ≤ the list's last value ℓ: search [-inf, ℓ] by counts (A_n: entries above ℓ).
    last = vals[:, -1]
    above = jnp.sum(vals > last[:, None], axis=1).astype(jnp.float32)
    active = ~init[3]
    state = (jnp.full((n,), -jnp.inf, jnp.float32), last, above, jnp.zeros((n,), jnp.float32))
    m = vals[:, 0]
    (lo, up, lo_n, an, _), passes = narrow(h, m, state, active, lambda cnt, _: cnt < k, last, False)
    one = active & (lo == up)
    result = jnp.where(one, lo, init[2])
    more = active & ~one

    def collect(_):
        vals = h.collect(jnp.where(more, up, -jnp.inf), jnp.where(more, ALL_COLUMNS, NO_COLUMN))[0]
        return jnp.where(more, take(vals, (k - an).astype(jnp.int32) - 1), result)

    result, up, an, more = same_axes(result, up, an, more)  # the branches' types agree under vocab_axis
    result = jax.lax.cond(jnp.any(more), collect, lambda _: result, None)
    return result, passes + jnp.any(more).astype(jnp.int32)


def top_p(h, first, m, tau, total, top_p: float, live):
    """``κ`` ``(value, column)`` of top-p on the keys of value ``≥ tau`` (mass ``total``),
    and the passes run."""
    size = h.size
    threshold = total * np.float32(1.0 - top_p)

    def step(vals, cols, floor, above, cut_v, cut_j, done):
        left = (vals > -jnp.inf) & (vals >= floor[:, None])
        w = jnp.where(left, jnp.exp(vals - m[:, None]), 0.0)
        c = jnp.cumsum(w, axis=1)
        over = above[:, None] + jnp.concatenate([jnp.zeros_like(c[:, :1]), c[:, :-1]], axis=1)  # A(e) of each key
        kept = left & (total[:, None] - over > threshold[:, None])
        nk, nl = jnp.sum(kept, axis=1), jnp.sum(left, axis=1)
        take_ = ~done & (nk > 0)
        cut_v = jnp.where(take_, take(vals, nk - 1), cut_v)
        cut_j = jnp.where(take_, take(cols, nk - 1), cut_j)
        done = done | (nk < nl) | (nl < size)
        return over, above + c[:, -1], cut_v, cut_j, done

    vals, cols = first
    n = vals.shape[0]
    over, after, cut_v, cut_j, done = step(vals, cols, tau, jnp.zeros((n,), jnp.float32), vals[:, 0], cols[:, 0], ~live)
    # Past the list: κ_v ≤ its last value ℓ, above ℓ the mass A_g (the walk's own sum).
    last = vals[:, -1]
    above_n = jnp.sum(vals > last[:, None], axis=1)
    state = (tau, last, above_n.astype(jnp.float32), take(over, above_n))
    base = m + np.float32(math.log((1.0 - top_p) / max(h.vocab, 1)))

    def hit(cnt, mass):
        return total[:, None] - mass > threshold[:, None]

    (lo, up, _, _, above_g), passes = narrow(h, m, state, ~done, hit, base, True)
    tie = lo == up
    # Where no threshold fell below the list's last key, the walk goes on below it.
    on = up == last
    start_v, start_j = up, jnp.where(on, cols[:, -1], ALL_COLUMNS)
    above_g = jnp.where(on, after, above_g)

    def body(state):
        (bv, bj), above, cut_v, cut_j, done, p = state
        vals, cols = h.collect(jnp.where(done, -jnp.inf, bv), jnp.where(done, NO_COLUMN, bj))[:2]
        _, above, cut_v, cut_j, now = step(vals, cols, lo, above, cut_v, cut_j, done)
        return (vals[:, -1], cols[:, -1]), above, cut_v, cut_j, now | ~tie, p + 1

    bv, bj, above_g, cut_v, cut_j, done = same_axes(start_v, start_j, above_g, cut_v, cut_j, done)
    init = ((bv, bj), above_g, cut_v, cut_j, done, passes)
    _, _, cut_v, cut_j, _, passes = jax.lax.while_loop(lambda s: ~jnp.all(s[4]), body, init)
    return cut_v, cut_j, passes
