"""Logits-level Pallas (Mosaic TPU) kernels: per-token log-probs, entropy and their
gradient on materialized logits ``[N, V]`` (float32 or bfloat16), and a fused kernel
that forms a token-local loss and ``dlogits`` in one read and one write of the logits
(the place of the original system's Pallas GRPO kernel).

Design (every kernel):

- The grid runs over row blocks only (``"parallel"``). A block holds ``bn`` rows times
  the *whole* vocabulary in VMEM, so each row's statistics are exact in one read of the
  logits from HBM: a max sweep, then a sweep forming ``S = Σ exp(s - μ)``,
  ``U = Σ exp(s - μ)·(s - μ)`` and the target's ``s - μ`` (iota compare, no gather), so
  ``log S``, ``lse = μ + log S``, ``logp = (s_y - μ) - log S``, ``H = log S - U/S``.
  The sweeps walk the VMEM block in lane chunks of ``chunk_lanes(bn)`` columns in a
  ``fori_loop`` (``_sweep``), so the float32 temporaries are a few ``bn x chunk`` tiles,
  not ``bn x V``. (Unrolled in Python, Mosaic kept every chunk's f32 values live from the
  max sweep to the next: 11 bytes per logit of the block, which overflowed VMEM at
  bf16, and took minutes to compile at 64 rows.)
- Per-row arrays ``[N]`` travel as ``[N, 1]`` with ``(bn, 1)`` blocks (the last dim equals
  the array's, ``bn`` a multiple of 8 or ``N``): one value per row, broadcast along lanes.
- Masks: ``mask`` is an explicit ``[N]`` argument (nonzero = live; ``None`` = all live).
  Rows beyond ``N`` in a ragged last block (garbage, NaN in TPU interpret mode) and
  masked rows are zeroed with a select (never a product), so they give zero outputs and
  zero ``dlogits`` whatever their logits hold. ``-inf`` logits (banned tokens) have
  ``p = 0`` and their products with ``-inf`` are selected away: never NaN.
- bfloat16 logits are read as bfloat16 and widened in VMEM per chunk; ``dlogits`` is
  written in the logits' dtype; all math is float32. No float32 copy lives in HBM.
- VMEM: ``logits_vmem_bytes`` (input and output blocks double-buffered, the row
  vectors' ``(bn, 1)`` blocks padded to ``(8, 128)`` tiles, the chunk temporaries);
  the kernels ask Mosaic for the chip's ``vmem_limit_bytes`` (:mod:`._chips`: 3/4 of its
  VMEM) and ``block_rows`` picks the largest ``bn`` in ``BLOCK_ROWS`` whose footprint fits
  the chip's block budget (80% of that). The real TPU compiler checks every choice
  (:mod:`flashloss.jax.tpu_compile`).
- ``ids`` must lie in ``[0, V)``: an id outside matches no column (its ``s_y - μ`` is 0).

Lowering for TPU (``jax.export.export(jax.jit(f), platforms=("tpu",))`` on a CPU host,
jax 0.10.2; nothing here ran on a TPU): all three kernels lower at ``[13, 1003]`` and at
``[8192, 151936]``, float32 and bfloat16. In a ``row_fn`` these lower: exp, log, log1p,
min/max/clip, where, abs, pow, tanh, ``jax.nn.sigmoid`` (logistic), ``jax.nn.softplus``,
``lax.stop_gradient``; these do not: ``jnp.expm1`` ("Unimplemented primitive ... expm1"),
``jnp.sort``, and ``jnp.sign`` (its lowering asks the chip's version: "Unsupported TPU
device kind: cpu" from a CPU host). Mosaic's layout and VMEM passes run in libtpu: the
three kernels compile with it for v5e, v6e, v5p and v7x at ``[8192, 151936]``, f32 and
bf16 (``flashloss.jax.tpu_compile``; compiled, never run on a TPU).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import _chips, cost
from .head import out_struct

__all__ = [
    "BLOCK_ROWS",
    "block_rows",
    "chunk_lanes",
    "logits_fused",
    "logits_grad",
    "logits_logprobs",
    "logits_stats",
    "logits_vmem_bytes",
]

#: Candidate row-block sizes, smallest first (multiples of 8: the f32 sublane tile).
BLOCK_ROWS: tuple[int, ...] = (8, 16, 32, 64, 128, 256)
#: Elements of one float32 chunk temporary (32 vregs of 8 x 128).
_CHUNK_ELEMS = 32 * 1024
#: Live float32 chunk temporaries at the widest point (s, d, e, iota, one-hot select, dlogits).
_TEMPS = 6
#: Per-row ``(bn, 1)`` arrays of the widest kernel besides its row inputs (ids, mask, 3 outputs).
_ROW_ARRAYS = 5

Interpret = Any  # False, True, or pltpu.InterpretParams(...)
RowFn = Callable[..., jax.Array]


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _sublanes(dtype: Any) -> int:
    """Rows of one VMEM tile for ``dtype`` (8 for 32-bit, 16 for 16-bit: packed)."""
    return 8 * max(1, 4 // jnp.dtype(dtype).itemsize)


def chunk_lanes(bn: int) -> int:
    """Columns of one lane chunk of the in-kernel sweeps (a multiple of 128)."""
    return max(128, (_CHUNK_ELEMS // max(bn, 1)) // 128 * 128)


def logits_vmem_bytes(bn: int, v: int, dtype: Any, *, grad: bool = True, row_inputs: int = 3) -> int:
    """VMEM bytes of a kernel on ``bn`` rows of ``v`` logits of ``dtype`` (an upper bound
    of Mosaic's allocation, checked by compiling with libtpu): ``2·R·Vp·isz`` (input block,
    double-buffered) ``+ 2·R·Vp·isz`` (``dlogits`` block, double-buffered; with ``grad``)
    ``+ 2·(5 + row_inputs)·R8·128·4`` (the ``(bn, 1)`` row blocks, each padded to
    ``(8, 128)`` f32 tiles, double-buffered) ``+ 6·R8·C·4`` (float32 chunk temporaries),
    with ``R = bn`` rounded up to the dtype's sublane tile (8 for f32, 16 for bf16),
    ``R8 = bn`` rounded up to 8, ``Vp = v`` rounded up to 128 and
    ``C = min(chunk_lanes(bn), Vp)``."""
    isz = jnp.dtype(dtype).itemsize
    rows, rows8, vp = _round_up(bn, _sublanes(dtype)), _round_up(bn, 8), _round_up(v, 128)
    blocks = 2 * rows * vp * isz * (2 if grad else 1)
    row_blocks = 2 * (_ROW_ARRAYS + row_inputs) * rows8 * 128 * 4
    temps = _TEMPS * rows8 * min(chunk_lanes(bn), vp) * 4
    return blocks + row_blocks + temps


def block_rows(n: int, v: int, dtype: Any, budget: int, *, grad: bool = True, row_inputs: int = 3) -> int:
    """The largest ``bn`` of ``BLOCK_ROWS`` whose ``logits_vmem_bytes`` fits ``budget``
    (``n`` itself when ``n`` rows fit in that block: the block then equals the array)."""
    kw = dict(grad=grad, row_inputs=row_inputs)
    fits = [b for b in BLOCK_ROWS if logits_vmem_bytes(b, v, dtype, **kw) <= budget]
    if not fits:
        need = logits_vmem_bytes(BLOCK_ROWS[0], v, dtype, **kw)
        raise ValueError(f"vocabulary {v} of {jnp.dtype(dtype)} needs {need} bytes of VMEM at bn=8; budget is {budget}")
    bn = fits[-1]
    return n if n <= bn else bn


def _sweep(v: int, c: int, body: Callable, carry: Any) -> Any:
    """``carry = body(lo, width, carry)`` over the lane chunks ``[lo, lo + width)`` of ``v``
    columns: a ``fori_loop`` over the whole chunks of ``c`` (``lo`` a multiple of 128), then
    the ragged tail. A loop, not an unrolled sweep: Mosaic compiles one body, and a chunk's
    values are not kept live from one sweep to the next."""
    whole = v // c

    def step(k, carry):
        return body(pl.multiple_of(k * c, 128), c, carry)

    if whole:
        carry = lax.fori_loop(0, whole, step, carry)
    return body(whole * c, v - whole * c, carry) if v % c else carry


def _scaled(x_ref: Any, lo: Any, width: int, inv_t: float) -> jax.Array:
    s = x_ref[:, pl.ds(lo, width)].astype(jnp.float32)
    return s if inv_t == 1.0 else s * inv_t


def _stats(x_ref: Any, ids: jax.Array, v: int, c: int, inv_t: float):
    """Row statistics of the block in ``x_ref``: ``(μ, log S, logp, H)``, each ``(bn, 1)``."""
    bn = x_ref.shape[0]

    def top(lo, width, mu):
        return jnp.maximum(mu, jnp.max(_scaled(x_ref, lo, width, inv_t), axis=-1, keepdims=True))

    mu = _sweep(v, c, top, jnp.full((bn, 1), -jnp.inf, jnp.float32))

    def sums(lo, width, acc):
        ssum, usum, dy = acc
        d = _scaled(x_ref, lo, width, inv_t) - mu
        e = jnp.exp(d)
        col = lax.broadcasted_iota(jnp.int32, d.shape, 1) + lo
        return (
            ssum + jnp.sum(e, axis=-1, keepdims=True),
            usum + jnp.sum(jnp.where(e > 0, e * d, 0.0), axis=-1, keepdims=True),
            dy + jnp.sum(jnp.where(col == ids, d, 0.0), axis=-1, keepdims=True),
        )

    zero = jnp.zeros((bn, 1), jnp.float32)
    ssum, usum, dy = _sweep(v, c, sums, (zero, zero, zero))
    log_s = jnp.log(ssum)
    return mu, log_s, dy - log_s, log_s - usum / ssum


def _write_grad(
    x_ref: Any,
    o_ref: Any,
    ids: jax.Array,
    shift: jax.Array,
    ent: jax.Array,
    g_logp: jax.Array,
    g_ent: jax.Array,
    live: jax.Array,
    v: int,
    c: int,
    inv_t: float,
) -> None:
    """``o = (g_logp·(1[j=y] - p) - g_ent·p·(log p + H)) / T`` on live rows, 0 elsewhere;
    ``log p = s - shift`` (``shift`` = lse, or μ + log S)."""

    def chunk(lo, width, carry):
        lp = _scaled(x_ref, lo, width, inv_t) - shift
        p = jnp.exp(lp)
        col = lax.broadcasted_iota(jnp.int32, lp.shape, 1) + lo
        dz = jnp.where(col == ids, g_logp, 0.0) - g_logp * p - g_ent * jnp.where(p > 0, p * (lp + ent), 0.0)
        if inv_t != 1.0:
            dz = dz * inv_t
        o_ref[:, pl.ds(lo, width)] = jnp.where(live, dz, 0.0).astype(o_ref.dtype)
        return carry

    _sweep(v, c, chunk, 0)


def _live(mask_ref: Any, n: int) -> jax.Array:
    """``(bn, 1)`` bool: the row is below ``n`` and its mask is nonzero."""
    bn = mask_ref.shape[0]
    row = pl.program_id(0) * bn + lax.broadcasted_iota(jnp.int32, (bn, 1), 0)
    return (row < n) & (mask_ref[...] != 0)


def _stats_kernel(x_ref, ids_ref, mask_ref, lse_ref, logp_ref, ent_ref, *, n: int, v: int, c: int, inv_t: float):
    live = _live(mask_ref, n)
    mu, log_s, logp, ent = _stats(x_ref, ids_ref[...], v, c, inv_t)
    lse_ref[...] = jnp.where(live, mu + log_s, 0.0)
    logp_ref[...] = jnp.where(live, logp, 0.0)
    ent_ref[...] = jnp.where(live, ent, 0.0)


def _grad_kernel(
    x_ref, ids_ref, mask_ref, lse_ref, ent_ref, glp_ref, gent_ref, o_ref, *, n: int, v: int, c: int, inv_t: float
):
    live = _live(mask_ref, n)
    g_logp = jnp.where(live, glp_ref[...], 0.0)
    g_ent = jnp.where(live, gent_ref[...], 0.0)
    _write_grad(x_ref, o_ref, ids_ref[...], lse_ref[...], ent_ref[...], g_logp, g_ent, live, v, c, inv_t)


def _fused_kernel(x_ref, ids_ref, mask_ref, *refs, n: int, v: int, c: int, inv_t: float, row_fn: RowFn, n_inputs: int):
    in_refs, (loss_ref, logp_ref, ent_ref, o_ref) = refs[:n_inputs], refs[n_inputs:]
    live = _live(mask_ref, n)
    ids = ids_ref[...]
    mu, log_s, logp, ent = _stats(x_ref, ids, v, c, inv_t)
    inputs = [r[...] for r in in_refs]
    loss, vjp = jax.vjp(lambda lp, h: jnp.broadcast_to(row_fn(lp, h, *inputs), lp.shape).astype(jnp.float32), logp, ent)
    g_logp, g_ent = vjp(jnp.ones_like(loss))
    g_logp = jnp.where(live, g_logp, 0.0)
    g_ent = jnp.where(live, g_ent, 0.0)
    loss_ref[...] = jnp.where(live, loss, 0.0)
    logp_ref[...] = jnp.where(live, logp, 0.0)
    ent_ref[...] = jnp.where(live, ent, 0.0)
    _write_grad(x_ref, o_ref, ids, mu + log_s, ent, g_logp, g_ent, live, v, c, inv_t)


def _check(logits2d: jax.Array, ids: jax.Array, rows: Sequence[tuple[str, Optional[jax.Array]]]) -> tuple[int, int]:
    if logits2d.ndim != 2 or logits2d.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(
            f"argument `logits2d`: expected float32 or bfloat16 [N, V], got {logits2d.dtype}{list(logits2d.shape)}"
        )
    n, v = logits2d.shape
    for name, x in (("ids", ids), *rows):
        if x is not None and tuple(x.shape) != (n,):
            raise ValueError(f"argument `{name}`: expected shape [{n}], got {list(x.shape)}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"argument `ids`: expected an integer dtype, got {ids.dtype}")
    return n, v


def _col(x: jax.Array, dtype: Any) -> jax.Array:
    return jnp.asarray(x).astype(dtype).reshape(-1, 1)


def _setup(logits2d, ids, mask, rows, bn, limit: Optional[int], grad: bool, n_inputs: int):
    """Shapes, block size, specs and compiler params shared by the three kernels (``limit``:
    the VMEM request, None for the chip's, :func:`._chips.chip`)."""
    n, v = _check(logits2d, jnp.asarray(ids), rows + [("mask", None if mask is None else jnp.asarray(mask))])
    target = _chips.chip()
    limit = target.vmem_limit_bytes if limit is None else int(limit)
    if bn is None:
        bn = block_rows(n, v, logits2d.dtype, limit * 4 // 5, grad=grad, row_inputs=n_inputs)
    elif bn != n and bn % 8:
        raise ValueError(f"argument `bn`: expected a multiple of 8 (or N={n}), got {bn}")
    bn = min(bn, n)
    ids_c = _col(ids, jnp.int32)
    mask_c = jnp.ones((n, 1), jnp.int32) if mask is None else _col(jnp.asarray(mask) != 0, jnp.int32)
    tile = pl.BlockSpec((bn, v), lambda i: (i, 0))
    row = pl.BlockSpec((bn, 1), lambda i: (i, 0))
    params = pltpu.CompilerParams(dimension_semantics=("parallel",), vmem_limit_bytes=limit)
    meta = dict(n=n, v=v, c=min(chunk_lanes(bn), v))
    return n, v, bn, ids_c, mask_c, tile, row, params, meta


def _cost(n: int, v: int, bn: int, in_specs: list, ins: tuple, out_specs: tuple, outs: tuple) -> pl.CostEstimate:
    """What XLA is told a kernel costs: ~8 VPU operations and an ``exp`` per logit, the
    bytes its blocks move (:func:`.cost.estimate`: the logits read once, ``dlogits``
    written once, the per-row columns)."""
    return cost.estimate(8 * n * v, n * v, (pl.cdiv(n, bn),), in_specs, ins, out_specs, outs)


def logits_stats(
    logits2d: jax.Array,
    ids: jax.Array,
    *,
    mask: Optional[jax.Array] = None,
    temperature: float = 1.0,
    interpret: Interpret = False,
    bn: Optional[int] = None,
    vmem_limit_bytes: Optional[int] = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(lse, logp, entropy)`` float32 ``[N]`` of ``logits2d / temperature`` at ``ids``
    ``[N]``, in one read of the logits; rows where ``mask`` is false are 0. ``bn`` (rows
    per block) defaults to the largest that fits the chip's VMEM (``vmem_limit_bytes``: the
    request, the chip's by default)."""
    n, v, bn, ids_c, mask_c, tile, row, params, meta = _setup(logits2d, ids, mask, [], bn, vmem_limit_bytes, False, 0)
    f32 = out_struct((n, 1), jnp.float32, logits2d, ids_c, mask_c)
    ins, in_specs, out_specs = (logits2d, ids_c, mask_c), [tile, row, row], (row, row, row)
    out = pl.pallas_call(
        functools.partial(_stats_kernel, inv_t=1.0 / float(temperature), **meta),
        out_shape=(f32, f32, f32),
        grid=(pl.cdiv(n, bn),),
        in_specs=in_specs,
        out_specs=out_specs,
        compiler_params=params,
        cost_estimate=_cost(n, v, bn, in_specs, ins, out_specs, (f32,) * 3),
        interpret=interpret,
        name="flashloss_logits_stats",
    )(*ins)
    lse, logp, ent = (x[:, 0] for x in out)
    return lse, logp, ent


def logits_grad(
    logits2d: jax.Array,
    ids: jax.Array,
    lse: jax.Array,
    entropy: jax.Array,
    g_logp: jax.Array,
    g_ent: jax.Array,
    *,
    mask: Optional[jax.Array] = None,
    temperature: float = 1.0,
    interpret: Interpret = False,
    bn: Optional[int] = None,
    vmem_limit_bytes: Optional[int] = None,
) -> jax.Array:
    """``dlogits`` ``[N, V]`` in the logits' dtype from the per-row cotangents ``g_logp`` and
    ``g_ent`` ``[N]`` of ``logp`` and ``entropy`` (``lse``, ``entropy`` from
    :func:`logits_stats`): ``(g_logp·(1[j=y] - p) - g_ent·p·(log p + H)) / T``, one read and
    one write of the logits, float32 math; masked rows get zeros."""
    rows = [("lse", lse), ("entropy", entropy), ("g_logp", g_logp), ("g_ent", g_ent)]
    n, v, bn, ids_c, mask_c, tile, row, params, meta = _setup(logits2d, ids, mask, rows, bn, vmem_limit_bytes, True, 4)
    row_args = [_col(x, jnp.float32) for _, x in rows]
    ins, in_specs = (logits2d, ids_c, mask_c, *row_args), [tile] + [row] * 6
    dz = out_struct((n, v), logits2d.dtype, *ins)
    return pl.pallas_call(
        functools.partial(_grad_kernel, inv_t=1.0 / float(temperature), **meta),
        out_shape=dz,
        grid=(pl.cdiv(n, bn),),
        in_specs=in_specs,
        out_specs=tile,
        compiler_params=params,
        cost_estimate=_cost(n, v, bn, in_specs, ins, (tile,), (dz,)),
        interpret=interpret,
        name="flashloss_logits_grad",
    )(*ins)


def logits_fused(
    logits2d: jax.Array,
    ids: jax.Array,
    row_inputs: Sequence[jax.Array],
    row_fn: RowFn,
    *,
    mask: Optional[jax.Array] = None,
    temperature: float = 1.0,
    interpret: Interpret = False,
    bn: Optional[int] = None,
    vmem_limit_bytes: Optional[int] = None,
    dz_dtype: Any = None,
    in_place: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """``(row_loss, logp, entropy, dlogits)`` in ONE kernel (one read and one write of the
    logits): per row block the statistics, then ``row_loss = row_fn(logp, entropy,
    *row_inputs)`` and its cotangents by ``jax.vjp`` inside the kernel, then ``dlogits``
    (the gradient of ``Σ row_loss``, in ``dz_dtype``, by default the logits' dtype;
    ``in_place``: written over the logits' buffer, when of their dtype).

    ``row_fn`` must be elementwise over rows (it sees ``(bn, 1)`` float32 vectors; any
    primitive Mosaic lowers: exp, log, min/max, where, ...); ``row_inputs`` are ``[N]``
    arrays (cast to float32), e.g. old and reference log-probs, the advantage and the
    reduction weight. Rows where ``mask`` is false (or beyond ``N``) give 0 loss, logp,
    entropy and dlogits, whatever ``row_fn`` returns there."""
    row_inputs = tuple(row_inputs)
    rows = [(f"row_inputs[{k}]", x) for k, x in enumerate(row_inputs)]
    k = len(rows)
    n, v, bn, ids_c, mask_c, tile, row, params, meta = _setup(logits2d, ids, mask, rows, bn, vmem_limit_bytes, True, k)
    row_args = [_col(x, jnp.float32) for x in row_inputs]
    ins = (logits2d, ids_c, mask_c, *row_args)
    f32 = out_struct((n, 1), jnp.float32, *ins)
    outs = (f32, f32, f32, out_struct((n, v), dz_dtype or logits2d.dtype, *ins))
    in_specs, out_specs = [tile, row, row] + [row] * k, (row, row, row, tile)
    loss, logp, ent, dz = pl.pallas_call(
        functools.partial(_fused_kernel, inv_t=1.0 / float(temperature), row_fn=row_fn, n_inputs=k, **meta),
        out_shape=outs,
        grid=(pl.cdiv(n, bn),),
        in_specs=in_specs,
        out_specs=out_specs,
        compiler_params=params,
        cost_estimate=_cost(n, v, bn, in_specs, ins, out_specs, outs),
        input_output_aliases={0: 3} if in_place and outs[3].dtype == logits2d.dtype else {},
        interpret=interpret,
        name="flashloss_logits_fused",
    )(*ins)
    return loss[:, 0], logp[:, 0], ent[:, 0], dz


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _logprobs(logits2d, ids, mask, temperature, interpret):
    _, logp, ent = logits_stats(logits2d, ids, mask=mask, temperature=temperature, interpret=interpret)
    return logp, ent


def _logprobs_fwd(logits2d, ids, mask, temperature, interpret):
    lse, logp, ent = logits_stats(logits2d, ids, mask=mask, temperature=temperature, interpret=interpret)
    return (logp, ent), (logits2d, ids, mask, lse, ent)


def _logprobs_bwd(temperature, interpret, res, cts):
    logits2d, ids, mask, lse, ent = res
    dz = logits_grad(logits2d, ids, lse, ent, cts[0], cts[1], mask=mask, temperature=temperature, interpret=interpret)
    return dz, None, None


_logprobs.defvjp(_logprobs_fwd, _logprobs_bwd)


def logits_logprobs(
    logits2d: jax.Array,
    ids: jax.Array,
    *,
    mask: Optional[jax.Array] = None,
    temperature: float = 1.0,
    interpret: Interpret = False,
) -> tuple[jax.Array, jax.Array]:
    """``(logp, entropy)`` ``[N]`` differentiable in ``logits2d`` (a ``jax.custom_vjp``:
    :func:`logits_stats` forward, :func:`logits_grad` backward, two reads and one write of
    the logits in all)."""
    ids = jnp.asarray(ids).astype(jnp.int32)
    mask = jnp.ones(ids.shape, jnp.int32) if mask is None else (jnp.asarray(mask) != 0).astype(jnp.int32)
    return _logprobs(logits2d, ids, mask, float(temperature), interpret)
