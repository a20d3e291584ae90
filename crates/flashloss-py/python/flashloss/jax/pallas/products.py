"""The single pass's two products over the head as Pallas kernels, for the chips whose XLA
copies a bfloat16 head into its own tiling before an XLA dot over it
(:data:`._chips.RELAYOUTS_BF16_HEAD`: v7x, a 1.16 GiB copy of a ``[151936, 4096]`` head):
Mosaic reads the head as it lies, so the stored-dZ plan holds no copy there.

- :func:`logits`: ``Z = X·Wᵀ`` f32 ``[R, V]``, grid over vocabulary tiles (the row block
  read once, the head once);
- :func:`hidden_grad`: ``dX = dZ·W`` ``[N, H]``, grid (row blocks "parallel", vocabulary
  tiles "arbitrary") with an f32 ``[bn, H]`` accumulator; the columns of the ragged last
  tile past ``V`` (and the head's rows there) are zeroed before the product.

Products on the head's dtype with f32 accumulation, as XLA's dots in
:mod:`.single_pass`. Bytes declared from the specs (:mod:`.cost`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import _chips, cost
from .head import weight_spec

#: Vocabulary tiles tried, widest first, and the row block of :func:`hidden_grad`.
_TILES = (2048, 1024, 512, 256, 128)
_GRAD_ROWS = (512, 256, 128)


def _tile(v: int, need: Callable[[int], int], budget: int) -> int:
    """The widest tile (or ``v`` when narrower) whose ``need(bv)`` bytes fit ``budget``."""
    for bv in ([v] if v <= _TILES[0] else []) + [b for b in _TILES if b < v]:
        if need(bv) <= budget:
            return bv
    raise ValueError(f"argument `hidden`: no vocabulary tile of the head's products fits {budget >> 20} MiB of VMEM")


def _logits_kernel(x_ref, w_ref, o_ref, *, layout: str):
    contract = ((1,), (1,)) if layout == "vh" else ((1,), (0,))
    o_ref[...] = jax.lax.dot_general(x_ref[...], w_ref[...], (contract, ((), ())), preferred_element_type=jnp.float32)


def logits(x: jax.Array, weight: jax.Array, layout: str, chip: Any = None, interpret: Any = False) -> jax.Array:
    """``Z = X·Wᵀ`` f32 ``[R, V]`` of rows ``x`` ``[R, H]`` over ``weight`` (``[V, H]``, or
    ``[H, V]`` with ``layout="hv"``)."""
    r, hidden = x.shape
    v = weight.shape[0] if layout == "vh" else weight.shape[1]
    target, e = _chips.chip(chip), x.dtype.itemsize
    bv = _tile(v, lambda bv: 2 * r * hidden * e + 2 * bv * hidden * e + 3 * r * bv * 4, target.block_budget_bytes)
    grid = (pl.cdiv(v, bv),)
    in_specs = [pl.BlockSpec((r, hidden), lambda j: (0, 0)), weight_spec(layout, bv, hidden, 0)]
    out_specs, results = [pl.BlockSpec((r, bv), lambda j: (0, j))], [((r, v), jnp.float32)]
    return pl.pallas_call(
        functools.partial(_logits_kernel, layout=layout),
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs[0],
        out_shape=jax.ShapeDtypeStruct((r, v), jnp.float32),
        compiler_params=_chips.compiler_params(target, ("parallel",)),
        cost_estimate=cost.estimate(2 * r * hidden * v, 0, grid, in_specs, [x, weight], out_specs, results),
        interpret=interpret,
        name="flashloss_head_logits",
    )(x, weight)


def _grad_kernel(dz_ref, w_ref, o_ref, acc_ref, *, v: int, bv: int, layout: str):
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    cols = j * bv + jax.lax.broadcasted_iota(jnp.int32, (1, bv), 1)
    dz = jnp.where(cols < v, dz_ref[...], 0).astype(dz_ref.dtype)
    w = w_ref[...]
    if layout == "vh":
        rows = j * bv + jax.lax.broadcasted_iota(jnp.int32, (bv, 1), 0)
        w = jnp.where(rows < v, w, 0).astype(w.dtype)
        contract = ((1,), (0,))
    else:
        w = jnp.where(cols < v, w, 0).astype(w.dtype)
        contract = ((1,), (1,))
    acc_ref[...] += jax.lax.dot_general(dz, w, (contract, ((), ())), preferred_element_type=jnp.float32)

    @pl.when(j == pl.num_programs(1) - 1)
    def _():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def hidden_grad(dz: jax.Array, weight: jax.Array, layout: str, dtype: Any, chip: Any = None,
                interpret: Any = False) -> jax.Array:  # fmt: skip
    """``dX = dZ·W`` ``[N, H]`` in ``dtype`` of ``dz`` ``[N, V]`` (the head's dtype) over
    ``weight`` (as for :func:`logits`)."""
    n, v = dz.shape
    hidden = weight.shape[1] if layout == "vh" else weight.shape[0]
    target, e = _chips.chip(chip), weight.dtype.itemsize
    bn = next((b for b in _GRAD_ROWS if b <= n), n)
    out_e = jnp.dtype(dtype).itemsize

    def need(bv):
        return 2 * bn * bv * e + 2 * bv * hidden * e + 2 * bn * hidden * out_e + bn * hidden * 4 + 2 * bn * bv * 4

    bv = _tile(v, need, target.block_budget_bytes)
    grid = (pl.cdiv(n, bn), pl.cdiv(v, bv))
    in_specs = [pl.BlockSpec((bn, bv), lambda i, j: (i, j)), weight_spec(layout, bv, hidden, 1)]
    out_specs, results = [pl.BlockSpec((bn, hidden), lambda i, j: (i, 0))], [((n, hidden), dtype)]
    return pl.pallas_call(
        functools.partial(_grad_kernel, v=v, bv=bv, layout=layout),
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs[0],
        out_shape=jax.ShapeDtypeStruct((n, hidden), dtype),
        scratch_shapes=[pltpu.VMEM((bn, hidden), jnp.float32)],
        compiler_params=_chips.compiler_params(target, ("parallel", "arbitrary")),
        cost_estimate=cost.estimate(2 * n * hidden * v, 0, grid, in_specs, [dz, weight], out_specs, results),
        interpret=interpret,
        name="flashloss_head_dhidden_of_dz",
    )(dz, weight)
