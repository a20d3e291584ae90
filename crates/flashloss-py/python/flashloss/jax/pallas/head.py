"""The head's forward kernel: per-row softmax statistics of ``s = cap(h·Wᵀ + c) / T``
over a vocabulary (or this device's block of it), one logits tile at a time in VMEM.

Grid ``(row blocks, vocabulary tiles)``: rows "parallel", tiles "arbitrary". For each
row ``i`` the kernel keeps a running softmax state over the tiles seen,

    m_i = max_j s_ij,   σ_i = Σ_j e^{s_ij - m_i},   u_i = Σ_j e^{s_ij - m_i}·(s_ij - m_i),
    t_i = Σ_j 1[j = y_i]·s_ij,   ζ_i = Σ_j s_ij,

rescaled when ``m`` grows (``σ ← σ·e^{m-m'}``, ``u ← (u + σ·(m - m'))·e^{m-m'}``), from
which ``lse = m + log σ``, ``logp = t - lse``, entropy ``= log σ - u/σ`` and the mean
logit ``ζ/V`` follow; on request (``sum_p2``) also ``σ₂_i = Σ_j e^{2(s_ij - m_i)}``
(``σ₂ ← σ₂·e^{2(m-m')}``), so that ``Σ_j p_ij² = σ₂/σ²`` (:mod:`.stats`; states of several devices merge first). The
target's logit is taken by an iota compare (no gather). Columns past ``V`` in the last
tile (151936 = 128·1187, 1187 prime: every tile wider than 128 leaves a ragged tail) are
``-inf``; rows past ``N`` in the last row block are never written back. Never an
``[N, V]`` array: a ``[bn, bv]`` f32 tile lives in VMEM for one grid step.

``layout``: ``"vh"`` for a head ``[V, H]`` (PyTorch, tied embeddings), ``"hv"`` for a
Flax kernel ``[H, V]``; a tile is a block of rows or of columns, never a transposed copy.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from .._head import Transform, vocab_size
from . import _chips, cost

#: Per-row vectors of the forward kernel's state, in order (``sum_exp2`` last, with
#: ``sum_p2`` only).
STATE = ("max", "sum_exp", "sum_exp_shift", "target", "sum")
SUM_EXP2 = "sum_exp2"
#: Per-row vectors cross the kernels' boundary as ``[N, LANES]`` arrays, the value
#: repeated along the lanes: a block ``(bn, 128)`` is the TPU's native tile (a 1-D block
#: needs multiples of 1024 rows and, lowered on a host without a TPU, fails in jax
#: 0.10.2), and the kernels read a ``(bn, 1)`` column of it.
LANES = 128


def same_axes(*arrays: Optional[jax.Array]) -> list:
    """``arrays`` cast to vary over the same mesh axes (the union of theirs; inside a
    ``shard_map``): a ``pallas_call``'s operands and results must agree on them."""
    axes = frozenset().union(*(jax.typeof(a).manual_axis_type.varying for a in arrays if a is not None))
    out = []
    for a in arrays:
        missing = tuple(sorted(axes - jax.typeof(a).manual_axis_type.varying)) if a is not None else ()
        out.append(jax.lax.pcast(a, missing, to="varying") if missing else a)
    return out


def out_struct(shape: tuple, dtype, *like: jax.Array) -> jax.ShapeDtypeStruct:
    """A ``pallas_call`` result of ``shape`` and ``dtype`` that varies over the mesh axes of
    the operand in ``like`` that varies over the most (operands that disagree are cast
    first, :func:`same_axes`)."""
    widest = max(like, key=lambda a: len(jax.typeof(a).manual_axis_type.varying))
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.typeof(widest).manual_axis_type)


def launch(make: Callable[[list], Callable], results: list, args: list, interpret: Any) -> list:
    """Runs the ``pallas_call`` that ``make(out_shape)`` builds on ``args``, cast to vary
    over the same mesh axes, its ``results`` (``(shape, dtype)`` pairs) varying over them
    too. Inside a ``shard_map`` that checks them, the interpreter cannot evaluate a kernel
    on varying values (a literal and a varying block do not multiply), so interpret mode
    there runs each device's kernel in a host callback, outside the ``shard_map``."""
    args = same_axes(*args)
    mat = jax.typeof(args[0]).manual_axis_type
    structs = [jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat) for shape, dtype in results]
    if not (interpret and mat.varying):
        return make(structs)(*args)
    if not isinstance(interpret, bool):
        raise ValueError(
            "argument `interpret`: TPU interpret mode (pltpu.InterpretParams) keeps one interpreter state for all "
            "devices and fails or hangs when each device's kernel runs on its own inside jax.shard_map; use "
            "interpret=True there"
        )
    inner = jax.jit(make([jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in results]))
    out = jax.pure_callback(lambda *xs: [np.asarray(y) for y in inner(*xs)], structs, *args, vmap_method="sequential")
    axes = tuple(sorted(mat.varying))  # the callback's results come back invariant: say what they are
    return [jax.lax.pcast(y, axes, to="varying") for y in out]


def to_lanes(x: jax.Array) -> jax.Array:
    """``[N]`` → ``[N, LANES]``."""
    return jnp.broadcast_to(x[:, None], (x.shape[0], LANES))


def from_lanes(x: jax.Array) -> jax.Array:
    """``[N, LANES]`` → ``[N]``, materialized: XLA would otherwise fuse the slice into each
    consumer and keep the ``[N, LANES]`` kernel output (4 MiB at N = 8192, 128 times the
    vector) alive until the last one, which for a residual is the backward pass (seen in the
    truncated support's buffer assignment for v5p)."""
    return jax.lax.optimization_barrier(x[:, 0])


def tile_logits(x_ref, w_ref, bias_ref, layout: str, transform: Transform, mask_weight: Optional[int]) -> tuple:
    """``(s, w)``: the transformed f32 logits tile ``[bn, bv]`` and the weight tile read
    (its rows or columns past the vocabulary zeroed when ``mask_weight`` gives how many
    are valid, so that a product with it stays finite)."""
    x, w = x_ref[...], w_ref[...]
    if mask_weight is not None:
        axis = 0 if layout == "vh" else 1
        keep = jax.lax.broadcasted_iota(jnp.int32, w.shape, axis) < mask_weight
        w = jnp.where(keep, w, jnp.zeros_like(w))
    contract = 1 if layout == "vh" else 0
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    z = jax.lax.dot_general(
        x, w, (((1,), (contract,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
    )
    if bias_ref is not None:
        z = z + bias_ref[...].astype(jnp.float32)
    return transform.apply(z), w


def tail(v: int, bv: int, j) -> Optional[Any]:
    """How many entries of vocabulary tile ``j`` are valid, where the last tile is
    ragged (``None`` when every tile is whole)."""
    return None if v % bv == 0 else v - j * bv


def online_max(m_old, s):
    """The online softmax's step over a tile ``s`` ``[bn, bv]`` of rows whose running max
    is ``m_old`` ``[bn, 1]``: ``(m_new, shift, alpha)``, the new max, the shift the tile's
    exponentials take (0 for a row of -inf so far: all zeros) and the rescale
    ``e^{m_old - shift}`` of the sums so far. Every streamed kernel's one rule."""
    m_new = jnp.maximum(m_old, jnp.max(s, axis=1, keepdims=True))
    shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    return m_new, shift, jnp.exp(m_old - shift)


def _forward_kernel(*refs, v: int, bv: int, layout: str, transform: Transform, has_bias: bool, sum_p2: bool):
    ids_ref, x_ref, w_ref = refs[:3]
    bias_ref = refs[3] if has_bias else None
    m_ref, s_ref, u_ref, t_ref, sum_ref, *s2_ref = refs[4 if has_bias else 3 :]
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        for r in (s_ref, u_ref, t_ref, sum_ref, *s2_ref):
            r[...] = jnp.zeros(r.shape, jnp.float32)

    s, _ = tile_logits(x_ref, w_ref, bias_ref, layout, transform, None)
    col = j * bv + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
    s = jnp.where(col < v, s, -jnp.inf)
    m_old, sum_old = m_ref[:, :1], s_ref[:, :1]
    m_new, shift, alpha = online_max(m_old, s)
    d = s - shift
    e = jnp.exp(d)
    rescale = jnp.where(sum_old > 0, sum_old * (m_old - shift), 0.0)
    u_new = alpha * (u_ref[:, :1] + rescale) + jnp.sum(jnp.where(e > 0, e * d, 0.0), axis=1, keepdims=True)
    target = jnp.sum(jnp.where(col == ids_ref[:, :1], s, 0.0), axis=1, keepdims=True)
    total = jnp.sum(jnp.where(col < v, s, 0.0), axis=1, keepdims=True)
    shape = m_ref.shape
    m_ref[...] = jnp.broadcast_to(m_new, shape)
    s_ref[...] = jnp.broadcast_to(alpha * sum_old + jnp.sum(e, axis=1, keepdims=True), shape)
    u_ref[...] = jnp.broadcast_to(u_new, shape)
    t_ref[...] += jnp.broadcast_to(target, shape)
    sum_ref[...] += jnp.broadcast_to(total, shape)
    if sum_p2:
        (s2,) = s2_ref
        s2[...] = jnp.broadcast_to(alpha * alpha * s2[:, :1] + jnp.sum(e * e, axis=1, keepdims=True), shape)


def row_spec(bn: int, axis: int = 0) -> pl.BlockSpec:
    """A per-row ``[N, LANES]`` vector's block: rows of grid axis ``axis``."""
    return pl.BlockSpec((bn, LANES), lambda *g: (g[axis], 0))


def weight_spec(layout: str, bv: int, hidden: int, axis: int) -> pl.BlockSpec:
    """The weight's tile of grid axis ``axis``: rows ``[bv, H]`` or columns ``[H, bv]``."""
    if layout == "vh":
        return pl.BlockSpec((bv, hidden), lambda *g: (g[axis], 0))
    return pl.BlockSpec((hidden, bv), lambda *g: (0, g[axis]))


def bias_spec(bv: int, axis: int) -> pl.BlockSpec:
    return pl.BlockSpec((1, bv), lambda *g: (0, g[axis]))


def plan(kernel: str, x: jax.Array, weight: jax.Array, layout: str, chip, max_rows, max_vocab) -> tuple:
    """``(n, hidden, v, chip, blocks)`` of ``kernel`` on rows ``x`` and ``weight``."""
    n, hidden = x.shape
    v = vocab_size(weight, layout)
    target = _chips.chip(chip)
    return n, hidden, v, target, _chips.choose(kernel, n, v, hidden, x.dtype.itemsize, target, max_rows, max_vocab)


@functools.partial(
    jax.jit, static_argnames=("layout", "transform", "chip", "interpret", "max_rows", "max_vocab", "sum_p2")
)
def forward_state(
    x: jax.Array,
    weight: jax.Array,
    bias: Optional[jax.Array],
    ids: jax.Array,
    *,
    layout: str,
    transform: Transform,
    chip: Optional[str] = None,
    interpret: Any = False,
    max_rows: Optional[int] = None,
    max_vocab: Optional[int] = None,
    sum_p2: bool = False,
) -> tuple[jax.Array, ...]:
    """The state :data:`STATE` ``[N]`` f32 of rows ``x`` ``[N, H]`` over the head
    ``weight`` (``ids`` ``[N]`` int32: the target columns of this head; others, e.g.
    another device's ids, match no column), and :data:`SUM_EXP2` last when ``sum_p2``."""
    n, hidden, v, target, blocks = plan("forward", x, weight, layout, chip, max_rows, max_vocab)
    bn, bv = blocks.rows, blocks.vocab
    grid = (pl.cdiv(n, bn), pl.cdiv(v, bv))
    in_specs = [row_spec(bn), pl.BlockSpec((bn, hidden), lambda i, j: (i, 0)), weight_spec(layout, bv, hidden, 1)]
    args = [to_lanes(ids), x, weight]
    if bias is not None:
        in_specs.append(bias_spec(bv, 1))
        args.append(bias.reshape(1, v))
    kernel = functools.partial(
        _forward_kernel, v=v, bv=bv, layout=layout, transform=transform, has_bias=bias is not None, sum_p2=sum_p2
    )
    outputs = len(STATE) + int(sum_p2)
    results = [((n, LANES), jnp.float32)] * outputs
    out_specs = [row_spec(bn) for _ in range(outputs)]
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
            name="flashloss_head_forward",
        )

    return tuple(from_lanes(x) for x in launch(make, results, args, interpret))
