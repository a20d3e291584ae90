"""The truncated support's collecting kernel: per row, the ``C`` largest keys below a bound,
streamed over vocabulary tiles (a running top-``C``), with the row's softmax sum.

Keys order the entries of a row by ``(s_j, j)`` lexicographically (``docs/spec/losses.md``,
flashloss addition 12; ``s`` the f32 scaled logit, ``-0 = +0``, ``j`` the column), so
every support is ``{j : (s_j, j) ≥ cut}``. Given per row an exclusive bound ``β = (b_v,
b_j)`` (``+inf``: none), the kernel returns

    L_i = the C largest keys (s_ij, j) < β_i,   as values [N, C] and columns [N, C],
    m_i = max_j s_ij,   σ_i = Σ_j e^{s_ij - m_i},   t_i = s_{i,y_i}     (every column)

in no order (``values = -inf`` where the row has fewer than ``C`` keys below ``β``).

Grid ``(row blocks "parallel", vocabulary tiles "arbitrary")``. The list lives in VMEM
scratch ``[bn, C]`` (values, columns; empty slots ``(-inf, -1 - slot)``, distinct keys).
Each tile's keys below ``β`` (others, and columns past ``V``, at ``-inf``) go into a
scratch copy of the tile, and a loop inserts the tile's largest key while, for some row
of the block, it is above the list's smallest (``floor``): one round replaces that row's
floor by its tile's top and takes it out of the tile. Invariant after each tile: the list
holds the ``C`` largest keys below ``β`` seen so far, so a tile whose top is below every
floor costs one compare. A round reads the ``[bn, bv]`` tile ~4 times (max, argmax by
column, removal); rounds per tile are the most keys any row of the block adds (``C`` on
the first tile, ``≈ C/t`` in expectation on the ``t``-th for a row in random order).
``m``, ``σ`` are the online softmax of :mod:`.head` (rescaled when ``m`` grows).
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import _chips, cost
from .head import (
    LANES,
    Transform,
    bias_spec,
    from_lanes,
    launch,
    online_max,
    plan,
    row_spec,
    tile_logits,
    to_lanes,
    weight_spec,
)

#: Most rows of a block: a round runs until the block's busiest row has its keys in.
MAX_ROWS = 512


def below(s, col, bound_v, bound_j):
    """Whether the keys ``(s, col)`` are below ``(bound_v, bound_j)``."""
    return (s < bound_v) | ((s == bound_v) & (col < bound_j))


def _top(t, col):
    """The largest key ``(value, column)`` ``[bn, 1]`` of each row of the tile ``t``."""
    mv = jnp.max(t, axis=1, keepdims=True)
    return mv, jnp.max(jnp.where(t == mv, col, -1), axis=1, keepdims=True)


def _floor(lv, lj):
    """The smallest key ``(value, column)`` ``[bn, 1]`` of each row's list."""
    fv = jnp.min(lv, axis=1, keepdims=True)
    return fv, jnp.min(jnp.where(lv == fv, lj, jnp.iinfo(jnp.int32).max), axis=1, keepdims=True)


def _above(mv, mj, fv, fj):
    return (mv > -jnp.inf) & ((mv > fv) | ((mv == fv) & (mj > fj)))


def _kernel(*refs, v: int, bv: int, layout: str, transform: Transform, has_bias: bool):
    ids_ref, bv_ref, bj_ref, x_ref, w_ref = refs[:5]
    bias_ref = refs[5] if has_bias else None
    val_ref, col_ref, m_ref, sum_ref, t_ref, tile_ref, lv_ref, lj_ref = refs[6 if has_bias else 5 :]
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        lv_ref[...] = jnp.full(lv_ref.shape, -jnp.inf, jnp.float32)
        lj_ref[...] = -1 - jax.lax.broadcasted_iota(jnp.int32, lj_ref.shape, 1)
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        sum_ref[...] = jnp.zeros(sum_ref.shape, jnp.float32)
        t_ref[...] = jnp.zeros(t_ref.shape, jnp.float32)

    s, _ = tile_logits(x_ref, w_ref, bias_ref, layout, transform, None)
    col = j * bv + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
    s = jnp.where(col < v, s + 0.0, -jnp.inf)
    m_old = m_ref[:, :1]
    m_new, shift, alpha = online_max(m_old, s)
    total = alpha * sum_ref[:, :1] + jnp.sum(jnp.exp(s - shift), axis=1, keepdims=True)
    shape = m_ref.shape
    m_ref[...] = jnp.broadcast_to(m_new, shape)
    sum_ref[...] = jnp.broadcast_to(total, shape)
    t_ref[...] += jnp.broadcast_to(jnp.sum(jnp.where(col == ids_ref[:, :1], s, 0.0), axis=1, keepdims=True), shape)
    tile_ref[...] = jnp.where(below(s, col, bv_ref[:, :1], bj_ref[:, :1]), s, -jnp.inf)

    def state():
        (mv, mj), (fv, fj) = _top(tile_ref[...], col), _floor(lv_ref[...], lj_ref[...])
        return mv, mj, fv, fj, jnp.max(_above(mv, mj, fv, fj).astype(jnp.int32)) > 0

    def insert(carry):
        mv, mj, fv, fj, _ = carry
        ins = _above(mv, mj, fv, fj)
        lv, lj = lv_ref[...], lj_ref[...]
        hit = ins & (lv == fv) & (lj == fj)
        lv_ref[...] = jnp.where(hit, mv, lv)
        lj_ref[...] = jnp.where(hit, mj, lj)
        tile_ref[...] = jnp.where(ins & (col == mj), -jnp.inf, tile_ref[...])
        return state()

    jax.lax.while_loop(lambda carry: carry[-1], insert, state())

    @pl.when(j == pl.num_programs(1) - 1)
    def _store():
        val_ref[...] = lv_ref[...]
        col_ref[...] = lj_ref[...]


@functools.partial(
    jax.jit, static_argnames=("size", "layout", "transform", "chip", "interpret", "max_rows", "max_vocab")
)
def collect(
    x: jax.Array,
    weight: jax.Array,
    bias: Optional[jax.Array],
    ids: jax.Array,
    bound_v: jax.Array,
    bound_j: jax.Array,
    *,
    size: int,
    layout: str,
    transform: Transform,
    chip: Optional[str] = None,
    interpret: Any = False,
    max_rows: Optional[int] = None,
    max_vocab: Optional[int] = None,
) -> tuple[jax.Array, ...]:
    """``(values [N, size], columns [N, size], m, σ, t)`` (module header) of rows ``x``
    ``[N, H]`` over ``weight`` at target columns ``ids`` ``[N]``, keys below ``(bound_v,
    bound_j)`` ``[N]`` (f32, int32; columns of this head). ``size``: a multiple of 128."""
    rows = MAX_ROWS if max_rows is None else min(max_rows, MAX_ROWS)
    n, hidden, v, target, blocks = plan("forward", x, weight, layout, chip, rows, max_vocab)
    bn, bv = blocks.rows, blocks.vocab
    grid = (pl.cdiv(n, bn), pl.cdiv(v, bv))
    x_spec = pl.BlockSpec((bn, hidden), lambda i, j: (i, 0))
    in_specs = [row_spec(bn), row_spec(bn), row_spec(bn), x_spec, weight_spec(layout, bv, hidden, 1)]
    args = [to_lanes(ids), to_lanes(bound_v), to_lanes(bound_j), x, weight]
    if bias is not None:
        in_specs.append(bias_spec(bv, 1))
        args.append(bias.reshape(1, v))
    kernel = functools.partial(_kernel, v=v, bv=bv, layout=layout, transform=transform, has_bias=bias is not None)
    list_spec = pl.BlockSpec((bn, size), lambda i, j: (i, 0))
    out_specs = [list_spec, list_spec, row_spec(bn), row_spec(bn), row_spec(bn)]
    results = [((n, size), jnp.float32), ((n, size), jnp.int32)] + [((n, LANES), jnp.float32)] * 3
    est = cost.estimate(2 * n * hidden * v, n * v, grid, in_specs, args, out_specs, results)

    def make(out_shape):
        return pl.pallas_call(
            kernel,
            grid=grid,
            in_specs=in_specs,
            out_specs=out_specs,
            out_shape=out_shape,
            scratch_shapes=[
                pltpu.VMEM((bn, bv), jnp.float32),
                pltpu.VMEM((bn, size), jnp.float32),
                pltpu.VMEM((bn, size), jnp.int32),
            ],
            compiler_params=_chips.compiler_params(target, ("parallel", "arbitrary")),
            cost_estimate=est,
            interpret=interpret,
            name="flashloss_support_collect",
        )

    values, cols, m, sigma, t = launch(make, results, args, interpret)
    return values, cols, from_lanes(m), from_lanes(sigma), from_lanes(t)
