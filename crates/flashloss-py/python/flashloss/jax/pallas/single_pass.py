"""The single-pass plan of a token-local GRPO step on the head: 6NHV FLOPs, as the
materialized-logits step, holding one block of rows' logits at a time.

Token-local (:func:`flashloss.jax._policy.is_token_local`: token-level ratios, not vespo,
and here no sampler support, no mesh axis, no soft-cap): the loss is
``L = Σ_i w_i·ℓ_tot,i + Σ_i e_i·H_i`` with weights ``w`` and ``e`` known from the mask
alone (:func:`~flashloss.jax._policy.reduction_weights`, ``entropy_weights``), so each
row's gradient is known as soon as its statistics are. For each block of ``R`` rows
(a ``lax.scan``):

    Z_b  = X_b·Wᵀ (+ c)                        XLA's dot, in f32 (as the two kernels' tiles) 2·R·H·V
    (ℓ_b, logp_b, H_b, dZ_b) = logits_fused(Z_b)  one Pallas kernel: one read of Z_b, one write of dZ_b
    dX_b = dZ_b·W                              XLA's dot, dZ in the head's dtype           2·R·H·V
    dW  += dZ_bᵀ·X_b,  dc += Σ_rows dZ_b       XLA's dot into an f32 carry                 2·R·H·V

so ``6·N·H·V`` FLOPs in all (XLA's cost analysis counts the loop's body once: times the
blocks; unrolled, the step compiled for v6e counts 6NHV, but XLA then holds every block's
logits at once) against the two-pass kernels' ``10·N·H·V`` (forward, then dH
and dW each recomputing the logits). Bytes held: the block's f32 ``Z_b`` and ``dZ_b``
(``2·R·V·4``) and the f32 ``dW`` carry (``V·H·4``): :func:`footprint_bytes`, chosen
within ``budget_mib`` (:func:`block_rows`). The gradients are formed in the forward and
scaled by the loss's cotangent in the backward (a ``jax.custom_vjp``), as the logits
level's fused kernel does; only the gradients asked for are formed (a frozen head runs no
dW product), and without a gradient the pass runs no product but the logits'.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp

from .. import _policy
from .._head import vocab_size
from . import logits

#: Rows per block tried, largest first (multiples of 128 rows: the MXU's tile).
BLOCK_ROWS = (4096, 2048, 1024, 512, 256, 128)


def footprint_bytes(rows: int, v: int, hidden: int, head_copy_bytes: int = 0) -> int:
    """Bytes the plan holds beyond its inputs and outputs: a block's f32 logits and ``dZ``
    (``2·rows·V·4``), the f32 ``dW`` and ``dc`` carries (``V·H·4 + V·4``) and the copy of
    the head the chip's compiler makes for its dots (``_chips.RELAYOUTS_BF16_HEAD``)."""
    return 2 * rows * v * 4 + v * hidden * 4 + v * 4 + head_copy_bytes


def block_rows(n: int, v: int, hidden: int, budget_bytes: float, head_copy_bytes: int = 0) -> Optional[int]:
    """The most rows per block (of :data:`BLOCK_ROWS`, or ``n`` when smaller) whose
    :func:`footprint_bytes` fits ``budget_bytes``; None when none does (then two-pass)."""
    for rows in (n,) if n < BLOCK_ROWS[-1] else BLOCK_ROWS:
        rows = min(rows, n)
        if footprint_bytes(rows, v, hidden, head_copy_bytes) <= budget_bytes:
            return rows
    return None


def _dot(a, b, contract: tuple[int, int], dtype) -> jax.Array:
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(
        a, b, ((contract[:1], contract[1:]), ((), ())), precision=precision, preferred_element_type=jnp.float32
    ).astype(dtype)


def _row_inputs(mask, adv, old, ref, ratio, args: _policy.GrpoArgs) -> tuple[list, callable]:
    """The per-row ``[N]`` f32 inputs of the fused kernel and its row function
    ``w·ℓ_tot + e·H`` (``logits.logits_fused``'s ``row_fn``)."""
    b, t = mask.shape
    has_old, has_kl, has_rho = old is not None, ref is not None and args.beta != 0.0, ratio is not None
    columns = [jnp.broadcast_to(adv[:, None], (b, t)), _policy.reduction_weights(mask, args)]
    columns.append(_policy.entropy_weights(mask, args))
    columns += ([old] if has_old else []) + ([ref] if has_kl else [])
    columns += [jnp.broadcast_to(jnp.where(mask, ratio, 1.0), (b, t))] if has_rho else []

    def row_fn(logp, entropy, adv, w, e, *rest):
        rest = list(rest)
        rho_row = rest.pop() if has_rho else None
        old_row = rest[0] if has_old else None
        ref_row = rest[-1] if has_kl else None
        return w * _policy.token_loss(logp, entropy, old_row, ref_row, adv, args, ratio=rho_row) + e * entropy

    return [c.reshape(-1).astype(jnp.float32) for c in columns], row_fn


def _step(x, weight, bias, ids, mask, adv, old, ref, ratio, args, layout, rows, interpret, wants=(False,) * 3):
    """``(loss, (logp, entropy), (dX, dW, dc))`` of the single pass (see the module): of the
    gradients only those ``wants`` asks for (of ``x``, ``weight``, ``bias``; None for the
    others); none: no product but the logits'."""
    n, hidden = x.shape
    v = vocab_size(weight, layout)
    want_dx, want_dw, want_dc = wants[0], wants[1], wants[2] and bias is not None
    columns, row_fn = _row_inputs(mask, adv, old, ref, ratio, args)
    live = mask.reshape(-1)
    pad = -n % rows

    def blocks(a):
        return jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)).reshape(-1, rows, *a.shape[1:])

    w_contract = 1 if layout == "vh" else 0  # Z = X·Wᵀ over H

    def block(carry, xs):
        dw, dc = carry
        xb, yb, lb, *cb = xs
        z = _dot(xb, weight, (1, w_contract), jnp.float32)
        if bias is not None:
            z = z + bias.astype(jnp.float32)
        row_loss, logp, entropy, dz = logits.logits_fused(
            z, yb, cb, row_fn, mask=lb, temperature=args.temperature, interpret=interpret
        )
        dz = dz.astype(weight.dtype)  # the products on the head's dtype, as the two kernels' are
        dx = _dot(dz, weight, (1, 1 - w_contract), x.dtype) if want_dx else None
        if want_dw:
            dw = dw + (_dot(dz, xb, (0, 0), jnp.float32) if layout == "vh" else _dot(xb, dz, (0, 0), jnp.float32))
        if want_dc:
            dc = dc + jnp.sum(dz.astype(jnp.float32), axis=0)
        return (dw, dc), (row_loss, logp, entropy, dx)

    zero = (
        jnp.zeros(weight.shape, jnp.float32) if want_dw else None,
        jnp.zeros((v,), jnp.float32) if want_dc else None,
    )
    xs = (blocks(x), blocks(ids.reshape(-1).astype(jnp.int32)), blocks(live), *(blocks(c) for c in columns))
    (dw, dc), (row_loss, logp, entropy, dx) = jax.lax.scan(block, zero, xs)
    logp, entropy = (y.reshape(-1)[:n].reshape(mask.shape) for y in (logp, entropy))
    dx = None if dx is None else dx.reshape(-1, hidden)[:n]
    return jnp.sum(row_loss), (logp, entropy), (dx, dw, dc)


@functools.partial(jax.custom_vjp, nondiff_argnums=(9, 10, 11, 12))
def _grpo(x, weight, bias, ids, mask, adv, old, ref, ratio, args, layout, rows, interpret):
    loss, stats, _ = _step(x, weight, bias, ids, mask, adv, old, ref, ratio, args, layout, rows, interpret)
    return loss, stats


def _value(a):
    """``(value, perturbed)`` of a primal under symbolic zeros (``None`` stays ``None``)."""
    return (None, False) if a is None else (a.value, a.perturbed)


def _fwd(x, weight, bias, ids, mask, adv, old, ref, ratio, args, layout, rows, interpret):
    (x, want_dx), (weight, want_dw), (bias, want_db) = _value(x), _value(weight), _value(bias)
    ids, mask, adv, old, ref, ratio = (_value(a)[0] for a in (ids, mask, adv, old, ref, ratio))
    wants = (want_dx, want_dw, want_db)
    loss, stats, grads = _step(x, weight, bias, ids, mask, adv, old, ref, ratio, args, layout, rows, interpret, wants)
    dtypes = tuple(None if a is None else jnp.zeros((), a.dtype) for a in (weight, bias))  # scalars of each dtype
    return (loss, stats), (grads, dtypes)


def _bwd(args, layout, rows, interpret, res, cts):
    (dx, dw, dc), (w_dtype, b_dtype) = res
    g = cts[0]  # the statistics carry no gradient (the caller stops it)
    dx = None if dx is None else (g * dx).astype(dx.dtype)
    dw = None if dw is None else (g * dw).astype(w_dtype.dtype)
    dc = None if dc is None else (g * dc).astype(b_dtype.dtype)
    return (dx, dw, dc, None, None, None, None, None, None)


_grpo.defvjp(_fwd, _bwd, symbolic_zeros=True)


def grpo(
    x, weight, bias, ids, mask, adv, old, ref, ratio, args: _policy.GrpoArgs, layout: str, rows: int, interpret: Any
):
    """``(loss, (logp, entropy))`` of a token-local GRPO step on rows ``x`` ``[N, H]``
    (``ids``, ``mask``, ``old``, ``ref`` ``[B, T]`` with ``B·T = N``; ``adv`` ``[B]``;
    ``ratio`` ``[B, 1]``, ``[B, T]`` or None) in one pass over blocks of ``rows`` rows;
    differentiable in ``x``, ``weight`` and ``bias``."""
    return _grpo(x, weight, bias, ids, mask, adv, old, ref, ratio, args, layout, rows, interpret)
