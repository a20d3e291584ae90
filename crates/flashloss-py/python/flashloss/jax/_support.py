"""``linear_logprobs`` under vLLM V1's truncated support (``top_k``, ``top_p``, ``min_p``;
``docs/spec/losses.md``, "Per-token statistics beyond logp and entropy", and flashloss
addition 12 on ties), on either path.

Row i's support ``K_i`` is what survives vLLM's filters in its order on the f32 scaled
logits ``s_i``: min-p (``p_j ≥ min_p · max p``), top-k on what is left (``s_j ≥`` the k-th
largest left, ties kept), top-p on what is left renormalized (sorted ascending by
``(s_j, j)``, drop every entry whose ascending cumulative mass is ``≤ 1 - top_p``, always
keep the largest). ``logp^K_i = s_{i,y_i} - logsumexp_{j∈K_i} s_ij``, ``-inf`` where
``y_i ∉ K_i`` (flagged in ``outside``); its gradient holds ``K_i`` fixed:
``∂logp^K_i/∂s_ij = 1[j = y_i] - p^K_ij`` on ``K_i``, 0 elsewhere (none for an outside row).

- FFI path (:func:`ffi_logprobs`): the handlers ``flashloss_logp_support`` (every row's
  statistics with ``logp^K``) and ``flashloss_logp_support_grads`` (one more pass with the
  rows' cotangents), a whole head (a head split over ``vocab_axis``:
  :mod:`._support_vocab`).
- Pallas path (:func:`truncated_logp`): plain JAX over blocks of rows, NOT streamed over
  the vocabulary: each block's logits ``[rows, V]`` in f32 (``hidden·Wᵀ + bias``, the
  head's transform), the filters, ``logp^K``; the backward recomputes each block's logits
  and support (nothing ``[N, V]`` is kept) and takes the block's VJP of its logits. Memory
  ``O(rows_per_block · V)``; min-p's ratios and top-p's sums are f32 (the kernel's f64), so
  a support may differ where ``p_j / max p`` is within f32 rounding of ``min_p`` or an
  ascending cumulative mass within f32 rounding of ``1 - top_p``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from ._ffi import _values, head_grad_wanted, wants
from ._ops import _call, _like, _or_empty, head_grad_results, vocab_size
from .pallas.head import Transform

#: Elements of one block's ``[rows, V]`` logits on the Pallas path (16 MiB in f32).
BLOCK_ELEMENTS = 1 << 22


class Filters(NamedTuple):
    """The support's filters, each None where it keeps everything."""

    top_k: Optional[int]
    top_p: Optional[float]
    min_p: Optional[float]


def filters(top_k, top_p, min_p, vocab: int) -> Optional[Filters]:
    """The filters checked (a ``ValueError`` naming the argument), unset ones (``top_k``
    None or ``≥ V``, ``top_p`` None or 1, ``min_p`` None or 0) as None; None when none
    was given at all."""
    if top_k is None and top_p is None and min_p is None:
        return None
    if top_k is not None and (isinstance(top_k, bool) or int(top_k) != top_k or top_k < 1):
        raise ValueError(f"argument `top_k`: must be an integer >= 1 (None: no top-k), got {top_k!r}")
    if top_p is not None and not 0.0 < float(top_p) <= 1.0:
        raise ValueError(f"argument `top_p`: must be in (0, 1], got {top_p!r}")
    if min_p is not None and not 0.0 <= float(min_p) <= 1.0:
        raise ValueError(f"argument `min_p`: must be in [0, 1], got {min_p!r}")
    return Filters(
        top_k=None if top_k is None or int(top_k) >= vocab else int(top_k),
        top_p=None if top_p is None or float(top_p) == 1.0 else float(top_p),
        min_p=None if min_p is None or float(min_p) == 0.0 else float(min_p),
    )


def active(f: Optional[Filters]) -> Optional[str]:
    """The name of the first filter of ``f`` that drops anything, or None."""
    if f is None:
        return None
    return next((name for name, value in zip(Filters._fields, f) if value is not None), None)


def keep_row(s: jax.Array, f: Filters) -> jax.Array:
    """``K`` of one row's f32 scaled logits ``s`` ``[V]`` as a bool mask, in vLLM's order."""
    s = s + 0.0  # -0 is +0: equal values tie
    keep = jnp.ones(s.shape, bool)
    top = s.max()
    if f.min_p is not None:
        keep = jnp.exp(s - top) >= jnp.float32(f.min_p)
    if f.top_k is not None:
        left = jnp.where(keep, s, -jnp.inf)
        keep = keep & (s >= jax.lax.top_k(left, f.top_k)[0][f.top_k - 1])
    if f.top_p is not None:
        order = jnp.argsort(jnp.where(keep, s, -jnp.inf), stable=True)  # ascending by (s_j, j)
        mass = jnp.where(keep, jnp.exp(s - top), 0.0)
        cum = jnp.cumsum(mass[order]) / mass.sum()
        drop = (cum <= jnp.float32(1.0 - f.top_p)).at[-1].set(False)
        keep = keep & ~jnp.zeros(s.shape, bool).at[order].set(drop)
    return keep


def _row_logits(h, weight, bias, layout: str, transform: Transform) -> jax.Array:
    """``s`` ``[V]`` f32 of one row ``h`` ``[H]``, as the head's kernels form it."""
    precision = jax.lax.Precision.HIGHEST if h.dtype == jnp.float32 else None
    contract = 1 if layout == "vh" else 0
    z = jax.lax.dot_general(weight, h, (((contract,), (0,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32)  # fmt: skip
    return transform.apply(z if bias is None else z + bias.astype(jnp.float32))


def _blocks(n: int, v: int) -> int:
    return max(1, min(n, BLOCK_ELEMENTS // max(1, v)))


def _row_forward(args, weight, bias, spec):
    """``(logp^K, outside)`` of one row (``args``: h, y, live)."""
    h, y, live = args
    f, layout, transform = spec
    s = _row_logits(h, weight, bias, layout, transform)
    keep = keep_row(s, f)
    lse_k = jax.nn.logsumexp(jnp.where(keep, s, -jnp.inf))
    inside = keep[y]
    logp = jnp.where(inside, s[y] - lse_k, -jnp.inf)
    return jnp.where(live, logp, 0.0), live & ~inside


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def truncated_logp(x, weight, bias, ids, live, spec):
    """``(logp^K, outside)`` ``[N]`` of rows ``x`` ``[N, H]`` (0 and False where not
    ``live``); ``spec``: (Filters, layout, Transform). Differentiable in ``logp^K`` with
    the support held fixed."""
    if x.shape[0] == 0:
        return jnp.zeros((0,), jnp.float32), jnp.zeros((0,), bool)
    row = functools.partial(_row_forward, weight=weight, bias=bias, spec=spec)
    return jax.lax.map(row, (x, ids, live), batch_size=_blocks(x.shape[0], vocab_size(weight, spec[1])))


def _zeros(shape, like) -> jax.Array:
    """f32 zeros varying over every mesh axis any of ``like`` varies over (inside
    ``shard_map``: the scan's carry has the type of what it accumulates)."""
    axes = set().union(*(getattr(jax.typeof(a).mat, "varying", ()) for a in like if a is not None))
    z = jnp.zeros(shape, jnp.float32)
    return jax.lax.pcast(z, tuple(sorted(axes)), to="varying") if axes else z


def _fwd(x, weight, bias, ids, live, spec):
    x, weight, bias, ids, live = _values(x, weight, bias, ids, live)
    out = truncated_logp(x, weight, bias, ids, live, spec)
    return out, (x, weight, bias, ids, live, out[1])


def _bwd(spec, res, cts):
    x, weight, bias, ids, live, outside = res
    f, layout, transform = spec
    g = cts[0]
    if isinstance(g, SymbolicZero) or x.shape[0] == 0:
        return None, None, None, None, None
    g = jnp.where(live & ~outside, g, 0.0).astype(jnp.float32)
    n, v = x.shape[0], vocab_size(weight, layout)
    rows = _blocks(n, v)
    pad = -n % rows
    blocks = [jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)).reshape(-1, rows, *a.shape[1:]) for a in (x, ids, g)]

    def block(carry, args):
        xb, yb, gb = args
        logits = jax.vmap(lambda h, w, b: _row_logits(h, w, b, layout, transform), (0, None, None))
        s, pull = jax.vjp(logits, xb, weight, bias)
        keep = jax.vmap(lambda r: keep_row(r, f))(s)
        p_k = jnp.where(keep, jax.nn.softmax(jnp.where(keep, s, -jnp.inf), axis=-1), 0.0)
        ds = gb[:, None] * (jax.nn.one_hot(yb, v, dtype=jnp.float32) - p_k)
        dx, dw, db = pull(ds)
        dw_sum, db_sum = carry
        return (dw_sum + dw.astype(jnp.float32), None if bias is None else db_sum + db.astype(jnp.float32)), dx

    varying = (x, weight, bias, ids, g)
    zero = (_zeros(weight.shape, varying), None if bias is None else _zeros(bias.shape, varying))
    (dw, db), dx = jax.lax.scan(block, zero, tuple(blocks))
    db = None if bias is None else db.astype(bias.dtype)
    return dx.reshape(-1, x.shape[1])[:n], dw.astype(weight.dtype), db, None, None


truncated_logp.defvjp(_fwd, _bwd, symbolic_zeros=True)


def _attrs(f: Filters, temperature: float, budget: float, mode: str, layout: str) -> dict:
    return dict(budget_mib=budget, mode=mode, temperature=temperature, weight_layout=layout,
                top_k=0 if f.top_k is None else int(f.top_k), top_p=1.0 if f.top_p is None else float(f.top_p),
                min_p=0.0 if f.min_p is None else float(f.min_p))  # fmt: skip


def _ffi_forward(x, w, bias, ids, mask, attrs):
    n = ids.shape[0]
    results = tuple(_like(x, (n,)) for _ in range(6))
    out = _call("flashloss_logp_support", results, x, w, _or_empty(bias, x.dtype), ids, mask, **attrs)
    return (*out[:5], out[5] != 0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9))
def ffi_logprobs(x, w, bias, ids, mask, f, temperature, budget, mode, layout="vh"):
    """``(logp^K, entropy, lse, max, sum_p2, outside)`` ``[N]`` of one
    ``flashloss_logp_support`` call (0 where not ``mask``; ``entropy``, ``lse``, ``max``,
    ``sum_p2`` of the full softmax), differentiable in ``logp^K`` (support fixed),
    ``entropy`` and ``lse``: the backward is one ``flashloss_logp_support_grads`` call."""
    return _ffi_forward(x, w, bias, ids, mask, _attrs(f, temperature, budget, mode, layout))


def _ffi_fwd(x, w, bias, ids, mask, f, temperature, budget, mode, layout="vh"):
    wanted = wants(x, w, bias)
    x, w, bias, ids, mask = _values(x, w, bias, ids, mask)
    out = _ffi_forward(x, w, bias, ids, mask, _attrs(f, temperature, budget, mode, layout))
    return out, (x, w, bias, ids, mask, wanted)


def _ffi_bwd(f, temperature, budget, mode, layout, res, cts):
    x, w, bias, ids, mask, wanted = res
    cts = cts[:3]  # max, sum_p2 and outside take no gradient
    if all(isinstance(c, SymbolicZero) for c in cts):
        return None, None, None, None, None
    g_logp, g_ent, g_lse = (None if isinstance(c, SymbolicZero) else c.astype(jnp.float32) for c in cts)
    g_logp = jnp.zeros(ids.shape, jnp.float32) if g_logp is None else g_logp
    head_grad = head_grad_wanted(wanted)
    results = (_like(x, x.shape), *head_grad_results(x, w, bias, vocab_size(w, layout), head_grad))
    grads = _call(
        "flashloss_logp_support_grads", results, x, w, _or_empty(bias, x.dtype), ids, mask, g_logp,
        _or_empty(g_ent, jnp.float32), _or_empty(g_lse, jnp.float32), head_grad=head_grad,
        **_attrs(f, temperature, budget, mode, layout),
    )  # fmt: skip
    out = tuple(None if p is None else d.astype(p.dtype) for d, p in zip(grads, wanted))
    return (*out, None, None)


ffi_logprobs.defvjp(_ffi_fwd, _ffi_bwd, symbolic_zeros=True)
