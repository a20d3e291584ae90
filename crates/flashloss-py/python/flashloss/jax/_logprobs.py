"""What :func:`flashloss.jax.linear_logprobs` returns beyond ``logp`` and the entropy
(``docs/spec/losses.md``, "Per-token statistics beyond logp and entropy"), on either path.

- ``lse``: each row's log-sum-exp of the scaled logits ``s = (h·Wᵀ + c) / T``, from the
  head's statistics kernel, differentiable (``∂lse/∂s_j = p_j``);
- ``max_logit``: ``max_j s_j`` and ``sum_p2``: ``Σ_j p_j²``, statistics without gradient;
- ``gathered_logp`` ``[N, K]``: ``s_{ik} - lse_i`` at candidate ids ``k_i1 … k_iK``. The
  candidates' logits are formed here in plain JAX, ``h_i · W[k_ik] + c[k_ik]`` over blocks
  of rows (``lax.map`` with a batch size, so no ``[N, K, H]`` array exists beyond one
  block), minus the differentiable ``lse``: JAX's gradient of the gather gives
  ``Σ_k c_ik·1[j = k_ik]``, the ``lse``'s VJP gives ``-Σ_k c_ik·p_ij``.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp

from ._head import Transform, vocab_size

#: Elements of ``[rows, K, H]`` gathered weight rows held at once (16 MiB in f32).
GATHER_BLOCK_ELEMENTS = 1 << 22


def gather_ids(ids, rows_shape: tuple) -> jax.Array:
    """``gather_ids`` ``[..., K]`` (``...`` the rows' shape) as ``[N, K]`` int32."""
    ids = jnp.asarray(ids)
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"argument `gather_ids`: expected an integer dtype, got {ids.dtype}")
    if ids.ndim != len(rows_shape) + 1 or ids.shape[:-1] != tuple(rows_shape) or ids.shape[-1] < 1:
        raise ValueError(
            f"argument `gather_ids`: expected shape {[*rows_shape, 'K']} with K >= 1, got {list(ids.shape)}"
        )
    return ids.reshape(-1, ids.shape[-1]).astype(jnp.int32)


def check_gather_ids(ids: jax.Array, live: jax.Array, vocab: int) -> None:
    """Every live row's candidate ids in ``[0, vocab)``; a ``ValueError`` (surfaced as
    ``JaxRuntimeError``) naming the first bad one, by a host callback."""
    bad = live[:, None] & ((ids < 0) | (ids >= vocab))
    flat = bad.reshape(-1)
    index = jnp.argmax(flat)
    k = ids.shape[1]

    def report(any_bad, index, id_):
        if any_bad:
            i = int(index)
            raise ValueError(
                f"argument `gather_ids`: id {int(id_)} at index {i} (row {i // k}, candidate {i % k}) "
                f"is outside [0, {vocab})"
            )

    jax.debug.callback(report, jnp.any(flat), index, ids.reshape(-1)[index])


def _block_rows(n: int, k: int, hidden: int) -> int:
    return max(1, min(n, GATHER_BLOCK_ELEMENTS // max(1, k * hidden)))


def gathered_logits(
    x, weight, bias, ids, live, *, layout: str, transform: Transform, vocab_axis: Optional[str]
) -> jax.Array:
    """``s_ik`` ``[N, K]`` f32: the scaled logits of rows ``x`` ``[N, H]`` at ``ids``
    ``[N, K]`` (ids of the whole vocabulary; inside a ``shard_map`` over ``vocab_axis``
    each device forms those in its block and the sum over the axis gives all), 0 where
    not ``live``. Products in the inputs' dtype with f32 accumulation, as the kernels."""
    n, k = ids.shape
    block = vocab_size(weight, layout)
    offset = 0 if vocab_axis is None else jax.lax.axis_index(vocab_axis) * block
    local = jnp.where(live[:, None], ids, 0) - offset
    own = live[:, None] & (local >= 0) & (local < block)
    local = jnp.clip(local, 0, block - 1)
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None

    def row(args):
        h, cols = args  # [H], [K]
        w = weight[cols] if layout == "vh" else weight[:, cols].T  # [K, H]
        z = jnp.dot(w, h, precision=precision, preferred_element_type=jnp.float32)
        return z if bias is None else z + bias[cols].astype(jnp.float32)

    if n == 0:
        return jnp.zeros((0, k), jnp.float32)
    # rematerialized: under a gradient, a block's gathered rows are formed again in the
    # backward instead of kept for every block (an [N, K, H] residual: 4.3 GB at N = 8192,
    # K = 64, H = 4096 in bf16)
    z = jax.lax.map(jax.checkpoint(row), (x, local), batch_size=_block_rows(n, k, x.shape[1]))
    s = jnp.where(own, transform.apply(z), 0.0)
    return s if vocab_axis is None else jax.lax.psum(s, vocab_axis)


def gathered_logp(x, weight, bias, ids, live, lse, **kw: Any) -> jax.Array:
    """``log p_ik = s_ik - lse_i`` ``[N, K]`` (0 where not ``live``), differentiable in the
    head's inputs through both terms (``lse`` from the statistics' ``custom_vjp``)."""
    s = gathered_logits(x, weight, bias, ids, live, **kw)
    return jnp.where(live[:, None], s - lse[:, None], 0.0)


def gathered(call, x, weight, bias, live, lse, cand, check: bool) -> Optional[jax.Array]:
    """``gathered_logp`` of a ``linear_logprobs`` call (a :class:`._calls.LogprobCall`) at
    the candidates ``cand`` ``[N, K]`` (None where none were asked); ``check``: their ids
    checked against ``V`` by a host callback first."""
    if cand is None:
        return None
    if check:
        check_gather_ids(cand, live, call.vocab)
    kw = dict(layout=call.weight_layout, transform=call.transform, vocab_axis=call.vocab_axis)
    return gathered_logp(x, weight, bias, cand, live, lse, **kw)


def all_inside(call, live) -> Optional[jax.Array]:
    """``outside_support`` where a filter is named but keeps everything (all False), None
    where none is named."""
    return None if call.support is None else jnp.zeros(live.shape, bool)
