"""The head's backward kernels: from per-row coefficients to ``dH``, ``dW`` and ``dc``,
recomputing each logits tile in VMEM (never an ``[N, V]`` array).

A row's statistics are functions of its softmax ``p = softmax(s)``: with cotangents
``ā`` (of the target's logit ``s_y``, so also of ``logp``), ``b̄`` (of ``lse``), ``c̄``
(of the entropy) and ``d̄`` (of the plain sum of logits), the gradient of the tile is

    ∂L/∂s_ij = ā_i·1[j = y_i] + p_ij·(b̄_i - c̄_i·(s_ij - lse_i + H_i)) + d̄_i,
    ∂L/∂z_ij = ∂L/∂s_ij · ∂s/∂z        (1/T, times 1 - tanh² under a soft-cap),

(:mod:`.stats` forms the four coefficients from the cotangents of lse, logp, entropy
and the mean logit). A row with no gradient passes ``lse = +inf``, so its ``p`` is 0.
Under a truncated support (:mod:`.support`) the rows also pass ``lse^K``, a coefficient
``ē`` and a cut ``κ = (c_v, c_j)``, and the tile's gradient gains
``ē_i·p^K_ij`` with ``p^K_ij = e^{s_ij - lse^K_i}·1[(s_ij, j) ≥ κ_i]`` (``ē = -g``, ``ā``
gaining ``g``, for ``g`` the cotangent of ``logp^K``): one pass for every statistic.

Two kernels, not one (the choice, with its FLOPs and bytes, is in ``docs/jax_design.md``):
``dH = dZ·W`` over grid ``(row blocks "parallel", vocabulary tiles "arbitrary")`` with an
f32 ``[bn, H]`` accumulator in VMEM, and ``dW = dZᵀ·H`` (with ``dc = Σ_rows dZ``) over grid
``(vocabulary tiles "parallel", row blocks "arbitrary")`` with an f32 ``[bv, H]``
accumulator: each gradient is written once, in its input's dtype, and a frozen head runs
no dW kernel at all. ``dZ`` enters both products in the input's dtype (bf16 products on
bf16, as the GPU and CPU paths do), with f32 accumulation.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import _chips, cost
from .head import Transform, bias_spec, launch, plan, row_spec, tail, tile_logits, to_lanes, vocab_size, weight_spec

#: Per-row inputs of the backward kernels, in order (after ``ids``).
COEFFICIENTS = ("lse", "entropy", "target", "softmax", "entropy_term", "uniform")
#: Per-row inputs after them under a truncated support.
SUPPORT = ("support_lse", "support", "cut_value", "cut_column")


def _dlogits(s, col, v: int, rows, transform: Transform):
    """``∂L/∂z`` of a tile from its transformed logits ``s`` and the per-row vectors."""
    ids, lse, entropy, a, b, c, d, *support = rows
    valid = col < v
    log_p = s - lse
    p = jnp.exp(log_p)
    spread = jnp.where(p > 0, p * (b - c * (log_p + entropy)), 0.0)
    ds = jnp.where(col == ids, a, 0.0) + spread + d
    if support:  # ē·p^K, zero below the cut's key (s, j)
        lse_k, e, cv, cj = support
        ds = ds + jnp.where((s > cv) | ((s == cv) & (col >= cj)), jnp.exp(s - lse_k) * e, 0.0)
    return jnp.where(valid, ds * transform.slope(s), 0.0)


def _dh_kernel(*refs, rows: int, v: int, bv: int, layout: str, transform: Transform, has_bias: bool):
    row_refs, (x_ref, w_ref) = refs[:rows], refs[rows : rows + 2]
    bias_ref = refs[rows + 2] if has_bias else None
    dh_ref, acc_ref = refs[-2:]
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    s, w = tile_logits(x_ref, w_ref, bias_ref, layout, transform, tail(v, bv, j))
    col = j * bv + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
    dz = _dlogits(s, col, v, [r[:, :1] for r in row_refs], transform).astype(w.dtype)
    contract = 0 if layout == "vh" else 1
    precision = jax.lax.Precision.HIGHEST if w.dtype == jnp.float32 else None
    acc_ref[...] += jax.lax.dot_general(
        dz, w, (((1,), (contract,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
    )

    @pl.when(j == pl.num_programs(1) - 1)
    def _store():
        dh_ref[...] = acc_ref[...].astype(dh_ref.dtype)


def _dw_kernel(*refs, rows: int, n: int, bn: int, v: int, bv: int, layout: str, transform: Transform, has_bias: bool):
    row_refs, (x_ref, w_ref) = refs[:rows], refs[rows : rows + 2]
    bias_ref = refs[rows + 2] if has_bias else None
    dw_ref, db_ref, acc_ref = refs[-3:]
    j, i = pl.program_id(0), pl.program_id(1)

    @pl.when(i == 0)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
        db_ref[...] = jnp.zeros(db_ref.shape, jnp.float32)

    s, _ = tile_logits(x_ref, w_ref, bias_ref, layout, transform, None)
    col = j * bv + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
    dz = _dlogits(s, col, v, [r[:, :1] for r in row_refs], transform)
    x = x_ref[...]
    if n % bn:  # rows past N hold whatever the last block read: keep them out of the sums
        row = i * bn + jax.lax.broadcasted_iota(jnp.int32, s.shape, 0)
        dz = jnp.where(row < n, dz, 0.0)
        keep = i * bn + jax.lax.broadcasted_iota(jnp.int32, x.shape, 0) < n
        x = jnp.where(keep, x, jnp.zeros_like(x))
    db_ref[...] += jnp.sum(dz, axis=0, keepdims=True)
    dz = dz.astype(x.dtype)
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    if layout == "vh":  # dW tile [bv, H] = dZᵀ·X
        acc_ref[...] += jax.lax.dot_general(
            dz, x, (((0,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
        )
    else:  # [H, bv] = Xᵀ·dZ
        acc_ref[...] += jax.lax.dot_general(
            x, dz, (((0,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
        )

    @pl.when(i == pl.num_programs(1) - 1)
    def _store():
        dw_ref[...] = acc_ref[...].astype(dw_ref.dtype)


def _inputs(x, weight, bias, ids, rows, layout, blocks, row_axis, vocab_axis):
    n, hidden = x.shape
    v = vocab_size(weight, layout)
    bn, bv = blocks.rows, blocks.vocab
    x_spec = pl.BlockSpec((bn, hidden), lambda *g: (g[row_axis], 0))
    in_specs = [row_spec(bn, row_axis) for _ in range(1 + len(rows))]
    in_specs += [x_spec, weight_spec(layout, bv, hidden, vocab_axis)]
    args = [to_lanes(ids), *(to_lanes(r) for r in rows), x, weight]
    if bias is not None:
        in_specs.append(bias_spec(bv, vocab_axis))
        args.append(bias.reshape(1, v))
    return in_specs, args


@functools.partial(jax.jit, static_argnames=("layout", "transform", "chip", "interpret", "max_rows", "max_vocab"))
def dhidden(
    x: jax.Array,
    weight: jax.Array,
    bias: Optional[jax.Array],
    ids: jax.Array,
    rows: tuple[jax.Array, ...],
    *,
    layout: str,
    transform: Transform,
    chip: Optional[str] = None,
    interpret: Any = False,
    max_rows: Optional[int] = None,
    max_vocab: Optional[int] = None,
) -> jax.Array:
    """``dH = dZ·W`` ``[N, H]`` in ``x``'s dtype; ``rows``: :data:`COEFFICIENTS` ``[N]``, then
    :data:`SUPPORT` (the cut's column an int32 of this head) under a truncated support."""
    n, hidden, v, target, blocks = plan("dh", x, weight, layout, chip, max_rows, max_vocab)
    in_specs, args = _inputs(x, weight, bias, ids, rows, layout, blocks, 0, 1)
    grid = (pl.cdiv(n, blocks.rows), pl.cdiv(v, blocks.vocab))
    kernel = functools.partial(
        _dh_kernel, rows=1 + len(rows), v=v, bv=blocks.vocab, layout=layout, transform=transform,
        has_bias=bias is not None,
    )  # fmt: skip
    out_specs = [pl.BlockSpec((blocks.rows, hidden), lambda i, j: (i, 0))]
    results = [(x.shape, x.dtype)]
    est = cost.estimate(4 * n * hidden * v, n * v, grid, in_specs, args, out_specs, results)

    def make(out_shape):
        return pl.pallas_call(
            kernel,
            grid=grid,
            in_specs=in_specs,
            out_specs=out_specs,
            out_shape=out_shape,
            scratch_shapes=[pltpu.VMEM((blocks.rows, hidden), jnp.float32)],
            compiler_params=_chips.compiler_params(target, ("parallel", "arbitrary")),
            cost_estimate=est,
            interpret=interpret,
            name="flashloss_head_dhidden",
        )

    return launch(make, results, args, interpret)[0]


@functools.partial(jax.jit, static_argnames=("layout", "transform", "chip", "interpret", "max_rows", "max_vocab"))
def dweight(
    x: jax.Array,
    weight: jax.Array,
    bias: Optional[jax.Array],
    ids: jax.Array,
    rows: tuple[jax.Array, ...],
    *,
    layout: str,
    transform: Transform,
    chip: Optional[str] = None,
    interpret: Any = False,
    max_rows: Optional[int] = None,
    max_vocab: Optional[int] = None,
) -> tuple[jax.Array, jax.Array]:
    """``(dW, dc)``: ``dW = dZᵀ·H`` in ``weight``'s shape and dtype, ``dc = Σ_rows dZ``
    ``[V]`` f32; ``rows`` as for :func:`dhidden`."""
    n, hidden, v, target, blocks = plan("dw", x, weight, layout, chip, max_rows, max_vocab)
    bn, bv = blocks.rows, blocks.vocab
    in_specs, args = _inputs(x, weight, bias, ids, rows, layout, blocks, 1, 0)
    grid = (pl.cdiv(v, bv), pl.cdiv(n, bn))
    kernel = functools.partial(
        _dw_kernel, rows=1 + len(rows), n=n, bn=bn, v=v, bv=bv, layout=layout, transform=transform,
        has_bias=bias is not None,
    )  # fmt: skip
    dw_block = (bv, hidden) if layout == "vh" else (hidden, bv)
    dw_spec = weight_spec(layout, bv, hidden, 0)
    out_specs = [dw_spec, bias_spec(bv, 0)]
    results = [(weight.shape, weight.dtype), ((1, v), jnp.float32)]
    est = cost.estimate(4 * n * hidden * v, n * v, grid, in_specs, args, out_specs, results)

    def make(out_shape):
        return pl.pallas_call(
            kernel,
            grid=grid,
            in_specs=in_specs,
            out_specs=out_specs,
            out_shape=out_shape,
            scratch_shapes=[pltpu.VMEM(dw_block, jnp.float32)],
            compiler_params=_chips.compiler_params(target, ("parallel", "arbitrary")),
            cost_estimate=est,
            interpret=interpret,
            name="flashloss_head_dweight",
        )

    dw, db = launch(make, results, args, interpret)
    return dw, db.reshape(v)
