"""The truncated support (:mod:`.support`) over a head split over a mesh axis
(``vocab_axis``): each device holds an equal contiguous block of the vocabulary in axis
order, global id ``j = offset + local index``. The FFI path's, plain JAX over blocks of
rows (the Pallas path streams it over the vocabulary: :mod:`..pallas.support`).

Per block of rows each device forms its logits ``s`` ``[rows, V_r]``, then:

- min-p: ``exp(s_j - max) ≥ min_p`` with the global ``max`` (``pmax``);
- top-k: each device's ``min(k, V_r)`` largest left, ``all_gather``-ed: their k-th is the
  global k-th value (ties kept, so a value threshold is exact);
- top-p: the dropped entries are a prefix of the ascending ``(s_j, j)`` order, those whose
  ascending cumulative mass ``C`` is ``≤ (1 - top_p)·M`` (masses ``e^{s_j - max}`` of what
  is left, ``M`` their sum). A bisection on the f32 bits (32 rounds, each a ``psum`` of
  ``[rows]``) finds the largest value ``c`` with ``C(≤ c) ≤ (1 - top_p)·M``, all dropped;
  in the next value's run of ties the first ``r`` global ids are dropped, ``r`` the count
  with ``C(≤ c) + r·e^{s - max} ≤ (1 - top_p)·M`` (ids ranked over devices by an
  ``all_gather`` of the run's counts); the largest ``(s_j, j)`` is always kept. The sums
  are f32 sums in another order than the one-device ``cumsum``: a support may differ
  where a cumulative mass is within f32 rounding of ``(1 - top_p)·M``;
- ``lse^K = max + log psum Σ_{j∈K} e^{s_j - max}``, ``logp^K = s_y - lse^K`` (``s_y`` and
  ``y ∈ K`` from the device holding ``y``, by ``psum``): the same on every device.

The backward holds the support fixed: ``∂logp^K/∂s_j = 1[j = y] - p^K_j`` on ``K``, each
device on its block; its ``dhidden`` is its part (``hidden`` is cast to varying over the
axis by the caller, whose transpose sums the parts), ``dweight``/``dbias`` its block's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from .. import _policy
from . import vocab
from .fused import _values
from .ops import vocab_size
from .support import Filters, _blocks, _row_logits, _zeros
from .. import _checks as checks

_BITS = 32  # bisection rounds over the uint32 keys


def _key(s: jax.Array) -> jax.Array:
    """A uint32 key of f32 ``s`` (no ``-0``) with the order of the values."""
    bits = jax.lax.bitcast_convert_type(s, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _top_p_drop(s, keep, top, top_p: float, axis: str) -> jax.Array:
    """The entries of ``keep`` that top-p drops, over the whole vocabulary."""
    mass = jnp.where(keep, jnp.exp(s - top[:, None]), 0.0)
    key = jnp.where(keep, _key(s), jnp.uint32(0))

    def below(c):  # Σ over the vocabulary of what is left with a key ≤ c, [rows]
        return jax.lax.psum(jnp.where(key <= c[:, None], mass, 0.0).sum(-1), axis)

    bound = jax.lax.psum(mass.sum(-1), axis) * jnp.float32(1.0 - top_p)
    k_top = _key(top)

    def halve(_, lo_hi):  # below(lo) ≤ bound < below(hi)
        lo, hi = lo_hi
        mid = lo + (hi - lo) // 2
        ok = below(mid) <= bound
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo, _ = jax.lax.fori_loop(0, _BITS, halve, (jnp.zeros_like(k_top), k_top + 1))
    cut = jnp.minimum(lo, k_top - 1)  # the largest value's run is never wholly dropped
    base = below(cut)
    nxt = jax.lax.pmin(jnp.where(keep & (key > cut[:, None]), key, jnp.uint32(0xFFFFFFFF)).min(-1), axis)
    run = keep & (key == nxt[:, None])
    unit = jax.lax.pmax(jnp.where(run, mass, 0.0).max(-1), axis)
    counts = jax.lax.all_gather(run.sum(-1, dtype=jnp.int32), axis)  # [devices, rows]
    n = counts.sum(0)
    before = jnp.where(jnp.arange(counts.shape[0])[:, None] < jax.lax.axis_index(axis), counts, 0).sum(0)
    r = jnp.floor((bound - base) / jnp.where(unit > 0, unit, 1.0))
    r = jnp.where(base + r * unit > bound, r - 1, r)
    r = jnp.where(base + (r + 1) * unit <= bound, r + 1, r)
    r = jnp.where(unit > 0, jnp.clip(r, 0, n), n).astype(jnp.int32)
    r = jnp.minimum(r, n - (nxt == k_top))  # the largest (s_j, j) stays
    rank = before[:, None] + jnp.cumsum(run, -1, dtype=jnp.int32)
    return keep & ((key <= cut[:, None]) | (run & (rank <= r[:, None])))


def keep_block(s: jax.Array, f: Filters, axis: str):
    """``(K, max)``: this device's part ``[rows, V_r]`` of each row's support (vLLM's
    filters in its order on the whole vocabulary's ``s``) and the rows' global max."""
    s = s + 0.0  # -0 is +0: equal values tie
    top = jax.lax.pmax(s.max(-1), axis)
    keep = jnp.ones(s.shape, bool)
    if f.min_p is not None:
        keep = jnp.exp(s - top[:, None]) >= jnp.float32(f.min_p)
    if f.top_k is not None:
        left = jnp.where(keep, s, -jnp.inf)
        mine = jax.lax.top_k(left, min(f.top_k, s.shape[-1]))[0]
        every = jax.lax.all_gather(mine, axis, axis=1, tiled=True)
        keep = keep & (s >= jax.lax.top_k(every, f.top_k)[0][:, -1:])
    if f.top_p is not None:
        keep = keep & ~_top_p_drop(s, keep, top, f.top_p, axis)
    return keep, top


def _offset(weight, axis: str, layout: str) -> jax.Array:
    return (jax.lax.axis_index(axis) * vocab_size(weight, layout)).astype(jnp.int32)


def _block_stats(s, y, spec, axis, offset):
    """``(K, lse^K, s_y, y ∈ K, local y, y here)`` of a block's logits ``s``."""
    keep, top = keep_block(s, spec[0], axis)
    lse = top + jnp.log(jax.lax.psum(jnp.where(keep, jnp.exp(s - top[:, None]), 0.0).sum(-1), axis))
    local = y - offset
    here = (local >= 0) & (local < s.shape[-1])
    local = jnp.clip(local, 0, s.shape[-1] - 1)[:, None]
    s_y = jax.lax.psum(jnp.where(here, jnp.take_along_axis(s, local, -1)[:, 0], 0.0), axis)
    inside = jax.lax.psum((here & jnp.take_along_axis(keep, local, -1)[:, 0]).astype(jnp.int32), axis) > 0
    return keep, lse, s_y, inside, local[:, 0], here


def _logits(layout, transform):
    return jax.vmap(lambda h, w, b: _row_logits(h, w, b, layout, transform), (0, None, None))


def _split(n: int, v: int, *arrays):
    """``arrays`` ``[N, ...]`` padded to whole blocks of rows, ``[blocks, rows, ...]``."""
    rows = _blocks(n, v)
    pad = -n % rows
    return [jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)).reshape(-1, rows, *a.shape[1:]) for a in arrays]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def truncated_logp(x, weight, bias, ids, live, spec, axis):
    """``(logp^K, outside)`` ``[N]`` of rows ``x`` ``[N, H]`` at global ``ids`` under this
    device's block of the head (``axis``: the mesh axis it is split over; ``spec``:
    (Filters, layout, Transform)), the same on every device; 0 and False where not
    ``live``. Differentiable in ``logp^K`` with the support held fixed."""
    n = x.shape[0]
    if n == 0:
        return jnp.zeros((0,), jnp.float32), jnp.zeros((0,), bool)
    layout, transform = spec[1], spec[2]
    offset = _offset(weight, axis, layout)

    def block(args):
        xb, yb, lb = args
        _, lse, s_y, inside, _, _ = _block_stats(_logits(layout, transform)(xb, weight, bias), yb, spec, axis, offset)
        return jnp.where(lb, jnp.where(inside, s_y - lse, -jnp.inf), 0.0), lb & ~inside

    logp, outside = jax.lax.map(block, tuple(_split(n, vocab_size(weight, layout), x, ids, live)))
    return logp.reshape(-1)[:n], outside.reshape(-1)[:n]


def _fwd(x, weight, bias, ids, live, spec, axis):
    x, weight, bias, ids, live = _values(x, weight, bias, ids, live)
    out = truncated_logp(x, weight, bias, ids, live, spec, axis)
    return out, (x, weight, bias, ids, live, out[1])


def _bwd(spec, axis, res, cts):
    x, weight, bias, ids, live, outside = res
    g = cts[0]
    if isinstance(g, SymbolicZero) or x.shape[0] == 0:
        return None, None, None, None, None
    layout, transform = spec[1], spec[2]
    n, v = x.shape[0], vocab_size(weight, layout)
    g = jnp.where(live & ~outside, g, 0.0).astype(jnp.float32)
    offset = _offset(weight, axis, layout)

    def block(carry, args):
        xb, yb, gb = args
        s, pull = jax.vjp(_logits(layout, transform), xb, weight, bias)
        keep, lse, _, _, local, here = _block_stats(s, yb, spec, axis, offset)
        p_k = jnp.where(keep, jnp.exp(s - lse[:, None]), 0.0)
        onehot = jax.nn.one_hot(jnp.where(here, local, -1), v, dtype=jnp.float32)
        dx, dw, db = pull(gb[:, None] * (onehot - p_k))
        dw_sum, db_sum = carry
        return (dw_sum + dw.astype(jnp.float32), None if bias is None else db_sum + db.astype(jnp.float32)), dx

    varying = (x, weight, bias, ids, g)
    zero = (_zeros(weight.shape, varying), None if bias is None else _zeros(bias.shape, varying))
    (dw, db), dx = jax.lax.scan(block, zero, tuple(_split(n, v, x, ids, g)))
    db = None if bias is None else db.astype(bias.dtype)
    return dx.reshape(-1, x.shape[1])[:n].astype(x.dtype), dw.astype(weight.dtype), db, None, None


truncated_logp.defvjp(_fwd, _bwd, symbolic_zeros=True)


def truncated(x, weight, bias, ids, live, spec, axis: str):
    """``(logp^K, outside)`` of :func:`truncated_logp` over ``axis`` (the FFI path's
    vocab-parallel support; the Pallas path's is :mod:`..pallas.support`)."""
    return truncated_logp(x, weight, bias, ids, live, spec, axis)


def grpo(hidden, weight, bias, ids, mask, adv, old, ref, ratio, args: _policy.GrpoArgs, spec, stats):
    """The FFI path's GRPO loss under the truncated support with the head split over
    ``stats``'s axis (the Pallas path's is ``pallas.losses.grpo``): ``(loss, (logp^K,
    entropy, kl, metrics))`` from the entropy of :func:`.vocab.logprobs` (``stats``: its
    static arguments ``(axis, temperature, budget, mode, layout)``), :func:`truncated_logp`
    (``spec`` as there) and the policy loss in JAX on the kept tokens (docs/spec/losses.md,
    flashloss addition 13). The batch's values are checked by host callbacks (the FFI
    policy handler, which takes no support, is not run)."""
    axis = stats[0]
    b, t = ids.shape
    for name, values in (("advantages", adv), ("old_per_token_logps", old), ("ref_per_token_logps", ref)):
        checks.finite(name, values, None if name == "advantages" else mask, True)
    checks.sampler_ratio(ratio, mask, True)
    x, flat_ids, flat_mask = hidden.reshape(b * t, hidden.shape[-1]), ids.reshape(-1), mask.reshape(-1)
    entropy = vocab.logprobs(x, weight, bias, flat_ids, flat_mask, *stats)[1].reshape(b, t)
    logp_k, outside = (y.reshape(b, t) for y in truncated_logp(x, weight, bias, flat_ids, flat_mask, spec, axis))
    kept = mask & ~outside
    loss, kl, metrics = _policy.grpo_policy_loss(
        jnp.where(kept, logp_k, 0.0), entropy, kept, adv, old, ref, args, ratio
    )
    return loss, (logp_k, entropy, kl, metrics)
