"""The truncated support's narrowing kernel: per row, the count and mass of the entries at or
above each of ``T`` thresholds at once, and the range of the values in an interval, streamed
over vocabulary tiles (the TPU's form of the Rust kernels' histogram pass: no scatter).

With a row's thresholds ``t_0 ≤ t_1 ≤ … ≤ t_{T-1}`` (f32, ``T ≤ 64``), an upper value
``u`` and a shift ``μ`` (the row's max):

    N_ik = Σ_j 1[s_ij ≥ t_ik],   G_ik = Σ_j 1[s_ij ≥ t_ik]·e^{s_ij - μ_i},
    lo_i = min {s_ij : t_i0 ≤ s_ij ≤ u_i},   hi_i = max {s_ij : t_i0 ≤ s_ij ≤ u_i}

(``+inf`` / ``-inf`` where the interval is empty; columns past ``V`` count nothing). Counts
are f32 (exact below ``2^24`` entries a row). Each threshold's sums run the same reduction
over the same terms, a term being larger or equal at a lower threshold: since f32 rounding
is monotone, ``N`` and ``G`` are non-increasing in ``t`` on every row, bit for bit, so the
decisions that :mod:`.support_search` takes on them never contradict one another.

Cost per logit on the VPU, besides the ``2H``-FLOP product on the MXU and the one ``exp``:
per threshold a compare, a select and an add for the count and a select and an add for the
mass (``with_mass``), about ``5T + 8`` operations (``3T + 8`` without the mass). At ``T``
= 16 that is ~90 operations a logit against ``2H`` = 8192 MXU FLOPs at ``H`` = 4096. An
estimate, not a measurement: with 2 to 4 VPU ALU slots of 8×128 lanes a cycle, the VPU
keeps up with an MXU of up to ~23-45k FLOPs a cycle (v5e's 131k FLOPs a cycle by the bf16
peak: ~16 logits a cycle, the VPU's 90 ops then ~0.35-0.7 of the MXU time, hidden), but
v6e's ~524k FLOPs a cycle (918 TFLOP/s at ~1.75 GHz, ~64 logits a cycle) leaves the VPU
~1.4-2.8x the MXU time: on v6e a narrowing pass costs more than a tally pass, perhaps 2x.

Grid ``(row blocks "parallel", vocabulary tiles "arbitrary")``, blocks as
:mod:`.support_tally`'s (the forward plan); the thresholds, sums and range travel as
``[N, 128]`` arrays (lanes ``0..T-1``: counts; ``64..64+T-1``: masses; range: lane 0
``lo``, lane 1 ``-hi``), accumulated in the output blocks. The thresholds run in a
``fori_loop`` (one ``[bn, bv]`` compare live at a time; unrolled, the interpreted kernel
under ``shard_map`` on simulated CPU devices deadlocked XLA's host thread pool).
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from . import _chips, cost
from .head import LANES, Transform, bias_spec, launch, plan, row_spec, tile_logits, to_lanes, weight_spec

#: Most thresholds a pass takes (the mass lanes start at this one).
MAX_THRESHOLDS = 64


def _kernel(*refs, v: int, bv: int, size: int, with_mass: bool, layout: str, transform: Transform, has_bias: bool):
    th_ref, up_ref, mu_ref, x_ref, w_ref = refs[:5]
    bias_ref = refs[5] if has_bias else None
    sums_ref, range_ref = refs[6 if has_bias else 5 :]
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        sums_ref[...] = jnp.zeros(sums_ref.shape, jnp.float32)
        range_ref[...] = jnp.full(range_ref.shape, jnp.inf, jnp.float32)

    s, _ = tile_logits(x_ref, w_ref, bias_ref, layout, transform, None)
    col = j * bv + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
    s = jnp.where(col < v, s + 0.0, jnp.nan)  # past V: every compare false
    th = th_ref[...]
    lane = jax.lax.broadcasted_iota(jnp.int32, th.shape, 1)
    e = jnp.exp(s - mu_ref[:, :1]) if with_mass else None

    def one(k, acc):
        t = jnp.max(jnp.where(lane == k, th, -jnp.inf), axis=1, keepdims=True)
        ge = s >= t
        acc = jnp.where(lane == k, jnp.sum(jnp.where(ge, 1.0, 0.0), axis=1, keepdims=True), acc)
        if with_mass:
            acc = jnp.where(lane == MAX_THRESHOLDS + k, jnp.sum(jnp.where(ge, e, 0.0), axis=1, keepdims=True), acc)
        return acc

    acc = jax.lax.fori_loop(0, size, one, jnp.zeros(th.shape, jnp.float32))
    sums_ref[...] += acc
    inside = (s >= th_ref[:, :1]) & (s <= up_ref[:, :1])
    low = jnp.min(jnp.where(inside, s, jnp.inf), axis=1, keepdims=True)
    neg_high = jnp.min(jnp.where(inside, -s, jnp.inf), axis=1, keepdims=True)
    range_ref[...] = jnp.minimum(range_ref[...], jnp.where(lane == 0, low, neg_high))


@functools.partial(
    jax.jit, static_argnames=("with_mass", "layout", "transform", "chip", "interpret", "max_rows", "max_vocab")
)
def narrow(
    x: jax.Array,
    weight: jax.Array,
    bias: Optional[jax.Array],
    thresholds: jax.Array,
    up: jax.Array,
    shift: jax.Array,
    *,
    with_mass: bool,
    layout: str,
    transform: Transform,
    chip: Optional[str] = None,
    interpret: Any = False,
    max_rows: Optional[int] = None,
    max_vocab: Optional[int] = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """``(N [N, T], G [N, T], lo [N], hi [N])`` (module header; ``G`` zeros unless
    ``with_mass``) of rows ``x`` ``[N, H]`` over ``weight`` at ``thresholds`` ``[N, T]``
    (ascending), upper values ``up`` and shifts ``shift`` ``[N]``."""
    n, hidden, v, target, blocks = plan("forward", x, weight, layout, chip, max_rows, max_vocab)
    size = thresholds.shape[1]
    if not 1 <= size <= MAX_THRESHOLDS:
        raise ValueError(f"support_narrow: 1 to {MAX_THRESHOLDS} thresholds a row, got {size}")
    bn, bv = blocks.rows, blocks.vocab
    grid = (pl.cdiv(n, bn), pl.cdiv(v, bv))
    x_spec = pl.BlockSpec((bn, hidden), lambda i, j: (i, 0))
    in_specs = [row_spec(bn) for _ in range(3)] + [x_spec, weight_spec(layout, bv, hidden, 1)]
    th = jnp.pad(thresholds.astype(jnp.float32), ((0, 0), (0, LANES - size)), constant_values=jnp.inf)
    args = [th, to_lanes(up), to_lanes(shift), x, weight]
    if bias is not None:
        in_specs.append(bias_spec(bv, 1))
        args.append(bias.reshape(1, v))
    kernel = functools.partial(
        _kernel, v=v, bv=bv, size=size, with_mass=with_mass, layout=layout, transform=transform,
        has_bias=bias is not None,
    )  # fmt: skip
    out_specs, results = [row_spec(bn), row_spec(bn)], [((n, LANES), jnp.float32)] * 2
    est = cost.estimate(2 * n * hidden * v, n * v if with_mass else 0, grid, in_specs, args, out_specs, results)

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
            name="flashloss_support_narrow",
        )

    sums, rng = launch(make, results, args, interpret)
    return sums[:, :size], sums[:, MAX_THRESHOLDS : MAX_THRESHOLDS + size], rng[:, 0], -rng[:, 1]
