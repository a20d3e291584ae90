"""The truncated support's tally kernel: per row, the mass of the keys at or above a cut,
and the target's logit and whether its key is, streamed over vocabulary tiles.

With keys ``(s_j, j)`` as in :mod:`.support_topc`, a per-row cut ``κ_i = (c_v, c_j)`` and
a per-row shift ``μ_i`` (the row's max, so that no term overflows and none is rescaled):

    M_i = Σ_j 1[(s_ij, j) ≥ κ_i]·e^{s_ij - μ_i},   t_i = s_{i,y_i},
    in_i = Σ_j 1[j = y_i]·1[(s_ij, j) ≥ κ_i]                       (0 or 1)

Grid ``(row blocks "parallel", vocabulary tiles "arbitrary")``, the three sums
accumulated in the output blocks; columns past ``V`` in the last tile count nothing.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from . import _chips, cost
from .head import LANES, Transform, bias_spec, from_lanes, launch, plan, row_spec, tile_logits, to_lanes, weight_spec


def _kernel(*refs, v: int, bv: int, layout: str, transform: Transform, has_bias: bool):
    ids_ref, cv_ref, cj_ref, mu_ref, x_ref, w_ref = refs[:6]
    bias_ref = refs[6] if has_bias else None
    mass_ref, t_ref, in_ref = refs[7 if has_bias else 6 :]
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        for r in (mass_ref, t_ref, in_ref):
            r[...] = jnp.zeros(r.shape, jnp.float32)

    s, _ = tile_logits(x_ref, w_ref, bias_ref, layout, transform, None)
    col = j * bv + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
    s = s + 0.0
    cv, cj = cv_ref[:, :1], cj_ref[:, :1]
    kept = (col < v) & ((s > cv) | ((s == cv) & (col >= cj)))
    target = col == ids_ref[:, :1]
    shape = mass_ref.shape

    def add(ref, terms):
        ref[...] += jnp.broadcast_to(jnp.sum(terms, axis=1, keepdims=True), shape)

    add(mass_ref, jnp.where(kept, jnp.exp(s - mu_ref[:, :1]), 0.0))
    add(t_ref, jnp.where(target, s, 0.0))
    add(in_ref, jnp.where(target & kept, 1.0, 0.0))


@functools.partial(jax.jit, static_argnames=("layout", "transform", "chip", "interpret", "max_rows", "max_vocab"))
def tally(
    x: jax.Array,
    weight: jax.Array,
    bias: Optional[jax.Array],
    ids: jax.Array,
    cut_v: jax.Array,
    cut_j: jax.Array,
    shift: jax.Array,
    *,
    layout: str,
    transform: Transform,
    chip: Optional[str] = None,
    interpret: Any = False,
    max_rows: Optional[int] = None,
    max_vocab: Optional[int] = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(M, t, in)`` ``[N]`` f32 (module header) of rows ``x`` ``[N, H]`` over ``weight``
    at target columns ``ids``, cut ``(cut_v, cut_j)`` (f32, int32: columns of this head)
    and ``shift`` ``[N]``."""
    n, hidden, v, target, blocks = plan("forward", x, weight, layout, chip, max_rows, max_vocab)
    bn, bv = blocks.rows, blocks.vocab
    grid = (pl.cdiv(n, bn), pl.cdiv(v, bv))
    x_spec = pl.BlockSpec((bn, hidden), lambda i, j: (i, 0))
    in_specs = [row_spec(bn) for _ in range(4)] + [x_spec, weight_spec(layout, bv, hidden, 1)]
    args = [to_lanes(ids), to_lanes(cut_v), to_lanes(cut_j), to_lanes(shift), x, weight]
    if bias is not None:
        in_specs.append(bias_spec(bv, 1))
        args.append(bias.reshape(1, v))
    kernel = functools.partial(_kernel, v=v, bv=bv, layout=layout, transform=transform, has_bias=bias is not None)
    out_specs, results = [row_spec(bn) for _ in range(3)], [((n, LANES), jnp.float32)] * 3
    est = cost.estimate(2 * n * hidden * v, n * v, grid, in_specs, args, out_specs, results)

    def make(out_shape):
        return pl.pallas_call(
            kernel,
            grid=grid,
            in_specs=in_specs,
            out_specs=out_specs,
            out_shape=out_shape,
            compiler_params=_chips.compiler_params(target, ("parallel", "arbitrary")),
            cost_estimate=est,
            interpret=interpret,
            name="flashloss_support_tally",
        )

    out = launch(make, results, args, interpret)
    return tuple(from_lanes(y) for y in out)
