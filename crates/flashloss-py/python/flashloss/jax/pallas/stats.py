"""Per-row statistics of the LM head on the Pallas kernels, differentiable: a
``jax.custom_vjp`` whose forward is :func:`.head.forward_state` (and, inside a
``shard_map`` whose vocabulary axis splits the head, the merge of every device's state
with ``pmax``/``psum``) and whose backward is :mod:`.head_grads` with each row's
cotangents as coefficients. The loss above it (GRPO, CE) is plain JAX on ``[N]``
vectors, differentiated by JAX.

For the merged state ``(m, σ, u, t, ζ)`` of a row (:mod:`.head`): ``lse = m + log σ``,
``logp = t - lse``, entropy ``= log σ - u/σ``, mean logit ``= ζ / V``, the max logit ``m``
and (``HeadSpec.sum_p2``) ``Σ_j p_j² = σ₂/σ²``; the last two take no gradient. Rows where
``live`` is false give zeros and no gradient. Symbolic zeros tell which inputs need a gradient:
a head that needs none (frozen, LoRA) runs no dW kernel; ``hidden`` without one runs no
dH kernel.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from .._collectives import merge_partial, psum, sum_p2
from . import head, head_grads


class RowStats(NamedTuple):
    """Per-row statistics ``[N]`` f32 of ``s = cap(h·Wᵀ + c) / T`` at the row's id."""

    lse: jax.Array
    logp: jax.Array
    entropy: jax.Array
    #: ``Σ_j s_j / V``: label smoothing's uniform term.
    mean: jax.Array
    #: ``max_j s_j`` (no gradient).
    max: jax.Array
    #: ``Σ_j p_j²`` (no gradient; zeros unless ``HeadSpec.sum_p2``).
    sum_p2: jax.Array
    #: ``logp^K`` and whether ``y ∉ K`` under ``HeadSpec.support`` (:mod:`.support`), else None.
    logp_k: Optional[jax.Array] = None
    outside: Optional[jax.Array] = None


@dataclass(frozen=True)
class HeadSpec:
    """What the kernels need besides the arrays (static under ``jit``)."""

    layout: str = "vh"
    transform: head.Transform = head.Transform()
    #: Mesh axis over which the head's vocabulary is split (inside ``shard_map``), or None.
    vocab_axis: Optional[str] = None
    #: The whole vocabulary (over every device of ``vocab_axis``).
    vocab: int = 0
    chip: Optional[str] = None
    interpret: Any = False
    #: Caps on the blocks' rows and vocabulary entries (multiples of 128), or None.
    max_rows: Optional[int] = None
    max_vocab: Optional[int] = None
    #: Whether the forward kernel also sums ``e^{2(s - m)}`` (for ``RowStats.sum_p2``).
    sum_p2: bool = False
    #: The sampler's truncated support (``flashloss.jax._head.Filters``), or None.
    support: Any = None

    def kernel_args(self) -> dict:
        return dict(
            layout=self.layout,
            transform=self.transform,
            chip=self.chip,
            interpret=self.interpret,
            max_rows=self.max_rows,
            max_vocab=self.max_vocab,
        )


def _local_ids(ids, weight, spec: HeadSpec):
    """The ids as columns of this device's block (other devices' ids match no column)."""
    if spec.vocab_axis is None:
        return ids
    block = head.vocab_size(weight, spec.layout)
    return ids - (jax.lax.axis_index(spec.vocab_axis) * block).astype(ids.dtype)


def _merge(state, live, spec: HeadSpec) -> RowStats:
    """The row statistics from every device's state: the kernel's ``m`` and ``t`` are in
    scaled units already, so this is the binding's one merge at temperature 1."""
    m, sigma, u, t, zeta, *sigma2 = state
    axis = spec.vocab_axis
    top, log_total, entropy, logp = merge_partial((m, sigma, u, t), live, axis, 1.0)
    zero = jnp.zeros_like(top)
    p2 = sum_p2((m, sigma, u, t, sigma2[0]), live, top, axis, 1.0) if sigma2 else zero
    return RowStats(
        lse=jnp.where(live, top + log_total, zero),
        logp=logp,
        entropy=entropy,
        mean=jnp.where(live, psum(zeta, axis) / spec.vocab, zero),
        max=top,
        sum_p2=p2,
    )


def _forward(x, weight, bias, ids, live, spec: HeadSpec) -> RowStats:
    ids = _local_ids(ids, weight, spec)
    state = head.forward_state(x, weight, bias, ids, sum_p2=spec.sum_p2, **spec.kernel_args())
    return _merge(state, live, spec)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _row_stats(x, weight, bias, ids, live, spec):
    return _forward(x, weight, bias, ids, live, spec)


def _primal(a):
    """``(value, perturbed)`` of a primal under symbolic zeros (``None`` stays ``None``)."""
    return (None, False) if a is None else (a.value, a.perturbed)


def _fwd(x, weight, bias, ids, live, spec):
    (x, want_dh), (weight, want_dw), (bias, want_db) = _primal(x), _primal(weight), _primal(bias)
    (ids, _), (live, _) = _primal(ids), _primal(live)
    stats = _forward(x, weight, bias, ids, live, spec)
    wants = tuple(() if w else None for w in (want_dh, want_dw, want_db and bias is not None))
    return stats, (x, weight, bias, ids, live, stats.lse, stats.entropy, wants)


def _dense(ct, like):
    return jnp.zeros_like(like) if isinstance(ct, SymbolicZero) else ct.astype(jnp.float32)


def coefficients(cts, lse, entropy, live, spec: HeadSpec) -> tuple:
    """:data:`.head_grads.COEFFICIENTS` of the rows from the cotangents of ``(lse, logp,
    entropy, mean)``."""
    g_lse, g_logp, g_ent, g_mean = (_dense(c, lse) for c in cts)
    zero = jnp.zeros_like(lse)
    coef = [jnp.where(live, c, zero) for c in (g_logp, g_lse - g_logp, g_ent, g_mean / spec.vocab)]
    return (jnp.where(live, lse, jnp.inf), entropy, *coef)


def grads(x, weight, bias, local, rows, wants, spec: HeadSpec) -> tuple:
    """``(dh, dw, db)`` of the backward kernels (None where ``wants`` says no)."""
    kw = spec.kernel_args()
    dh = head_grads.dhidden(x, weight, bias, local, rows, **kw) if wants[0] is not None else None
    dw = db = None
    if wants[1] is not None or wants[2] is not None:
        dw, db = head_grads.dweight(x, weight, bias, local, rows, **kw)
        dw = dw if wants[1] is not None else None
        db = db.astype(bias.dtype) if wants[2] is not None else None
    return dh, dw, db


def _bwd(spec, res, cts):
    x, weight, bias, ids, live, lse, entropy, wants = res
    rows = coefficients(cts[:4], lse, entropy, live, spec)  # max and sum_p2 take none
    return (*grads(x, weight, bias, _local_ids(ids, weight, spec), rows, wants, spec), None, None)


_row_stats.defvjp(_fwd, _bwd, symbolic_zeros=True)


def row_stats(x, weight, bias, ids, live, spec: HeadSpec) -> RowStats:
    """:class:`RowStats` of rows ``x`` ``[N, H]`` at ``ids`` ``[N]`` (int32) where
    ``live`` ``[N]`` (bool), differentiable in ``x``, ``weight`` and ``bias``."""
    return _row_stats(x, weight, bias, ids, live, spec)
