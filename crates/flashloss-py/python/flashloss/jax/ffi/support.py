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
  :mod:`.support_vocab`).
- Pallas path (:mod:`..pallas.support`, the head's statistics with ``HeadSpec.support``):
  streamed over the vocabulary (a running top-``C`` of the keys ``(s_j, j)`` per row,
  tallies at a per-row cut, the head's backward kernels with ``p^K`` in the same pass as
  the other statistics' gradients), also over ``vocab_axis``; no ``[N, V]`` array. Top-p's
  sums are f32 (the FFI kernel's f64), so a support may differ where an ascending
  cumulative mass is within f32 rounding of ``(1 - top_p)·M``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from .._head import Filters, Transform
from .fused import _values, head_grad_wanted, wants
from .ops import _call, _like, _or_empty, head_grad_results, vocab_size

#: Elements of one block's ``[rows, V]`` logits of the FFI path's vocab-parallel support
#: in plain JAX (:mod:`.support_vocab`; 16 MiB in f32).
BLOCK_ELEMENTS = 1 << 22


def _row_logits(h, weight, bias, layout: str, transform: Transform) -> jax.Array:
    """``s`` ``[V]`` f32 of one row ``h`` ``[H]``, as the head's kernels form it."""
    precision = jax.lax.Precision.HIGHEST if h.dtype == jnp.float32 else None
    contract = 1 if layout == "vh" else 0
    z = jax.lax.dot_general(weight, h, (((contract,), (0,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32)  # fmt: skip
    return transform.apply(z if bias is None else z + bias.astype(jnp.float32))


def _blocks(n: int, v: int) -> int:
    return max(1, min(n, BLOCK_ELEMENTS // max(1, v)))


def _zeros(shape, like) -> jax.Array:
    """f32 zeros varying over every mesh axis any of ``like`` varies over (inside
    ``shard_map``: the scan's carry has the type of what it accumulates)."""
    axes = set().union(*(getattr(jax.typeof(a).mat, "varying", ()) for a in like if a is not None))
    z = jnp.zeros(shape, jnp.float32)
    return jax.lax.pcast(z, tuple(sorted(axes)), to="varying") if axes else z


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
