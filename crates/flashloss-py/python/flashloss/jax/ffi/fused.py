"""The losses on the FFI path (CPU, and CUDA where built): each a ``jax.custom_vjp``
whose forward runs one fused kernel call that yields the loss and the gradients of
``hidden``, ``weight`` and ``bias`` together (the fastest path on the CPU); its backward
scales them by the cotangent. ``layout`` names the head's layout (``"vh"`` ``[V, H]``,
``"hv"`` ``[H, V]``); the handlers read either without a transposed copy.

The custom_vjps take symbolic zeros (``defvjp(..., symbolic_zeros=True)``): where neither
``weight`` nor ``bias`` is perturbed (a frozen head, e.g. ``jax.grad`` over ``hidden``
alone, or a ``stop_gradient`` head) the call's ``head_grad`` attribute is ``"frozen"``:
no ``[V, H]`` result and no dW/dbias product. A call that is not differentiated forms
no head gradient either."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from . import ops


def _values(*primals):
    """The values of primals under symbolic zeros (``None`` stays ``None``)."""
    return tuple(None if a is None else a.value for a in primals)


def head_grad_of(weight, bias) -> str:
    """``"full"`` where the gradient of ``weight`` or ``bias`` (primals under symbolic
    zeros) is wanted, ``"frozen"`` where neither is perturbed."""
    wanted = weight.perturbed or (bias is not None and bias.perturbed)
    return "full" if wanted else "frozen"


def _wanted(grads, primals):
    """``grads`` with ``None`` for each primal that is not perturbed (or absent)."""
    return tuple(None if p is None or not p.perturbed else d for d, p in zip(grads, primals))


def wants(hidden, weight, bias):
    """A residual saying which gradients are wanted: a ``[0]`` array of each perturbed
    primal's dtype, ``None`` for the others (residuals hold arrays, not strings)."""
    return tuple(
        None if p is None or not p.perturbed else jnp.zeros((0,), p.value.dtype) for p in (hidden, weight, bias)
    )


def head_grad_wanted(wanted) -> str:
    """:func:`head_grad_of` from a :func:`wants` residual."""
    return "frozen" if wanted[1] is None and wanted[2] is None else "full"


def _protos(*xs):
    return tuple(None if x is None else jnp.zeros((0,), x.dtype) for x in xs)


def _grads_bwd(res, g):
    """``g · grad`` in each input's dtype; ``None`` where no gradient is wanted or the
    cotangent is a symbolic zero."""
    grads, protos = res
    if isinstance(g, SymbolicZero):
        return tuple(None for _ in grads)
    return tuple(None if d is None else (g * d).astype(p.dtype) for d, p in zip(grads, protos))


@functools.partial(jax.custom_vjp, nondiff_argnums=(9, 10, 11, 12))
def grpo(hidden, weight, bias, ids, mask, adv, old, ref, ratio, config, mode, budget, layout):
    """``(loss, (logp, entropy, kl, metrics))`` of one ``flashloss_grpo_linear`` call
    (``ratio``: the sampler's importance ratio ``[B]``, ``[B, T]`` or None)."""
    loss, *_, logp, entropy, kl, metrics = ops.grpo_linear(
        hidden, weight, bias, ids, mask, adv, old, ref, ratio, config=config, mode=mode, budget_mib=budget,
        weight_layout=layout, head_grad="frozen",
    )  # fmt: skip
    return loss, (logp, entropy, kl, metrics)


def _grpo_fwd(hidden, weight, bias, ids, mask, adv, old, ref, ratio, config, mode, budget, layout):
    primals = (hidden, weight, bias)
    head_grad = head_grad_of(weight, bias)
    hidden, weight, bias, ids, mask, adv, old, ref, ratio = _values(
        hidden, weight, bias, ids, mask, adv, old, ref, ratio
    )
    loss, dh, dw, db, logp, entropy, kl, metrics = ops.grpo_linear(
        hidden, weight, bias, ids, mask, adv, old, ref, ratio, config=config, mode=mode, budget_mib=budget,
        weight_layout=layout, head_grad=head_grad,
    )  # fmt: skip
    grads = _wanted((dh, dw, db), primals)
    return (loss, (logp, entropy, kl, metrics)), (grads, _protos(hidden, weight, bias))


def _grpo_bwd(config, mode, budget, layout, res, cts):
    return (*_grads_bwd(res, cts[0]), None, None, None, None, None, None)


grpo.defvjp(_grpo_fwd, _grpo_bwd, symbolic_zeros=True)


def _lse_grads(grads, wanted, g_lse, ce_call):
    """``grads`` (each ``None`` or an f32 gradient) plus those of ``Σ_i g_lse_i·lse_i``
    from one more kernel call ``ce_call(grad_lse=..., head_grad=...)`` (none where
    ``g_lse`` is a symbolic zero)."""
    if isinstance(g_lse, SymbolicZero):
        return grads
    extra = ce_call(grad_lse=g_lse.astype(jnp.float32), head_grad=head_grad_wanted(wanted))
    return tuple(None if w is None else (e if d is None else d + e) for d, e, w in zip(grads, extra, wanted))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def cross_entropy(hidden, weight, bias, targets, config, mode, budget, layout):
    """``(loss, lse)``: the reduced (mean, sum) cross-entropy of one ``flashloss_ce_linear``
    call and each row's log-sum-exp ``[N]`` (0 where ignored), differentiable in both (a
    cotangent on ``lse`` runs the kernel once more)."""
    out = ops.ce_linear(
        hidden, weight, bias, targets, None, config=config, mode=mode, budget_mib=budget, weight_layout=layout,
        head_grad="frozen",
    )  # fmt: skip
    return out[0], out[6]


def _ce_fwd(hidden, weight, bias, targets, config, mode, budget, layout):
    wanted = wants(hidden, weight, bias)
    hidden, weight, bias, targets = _values(hidden, weight, bias, targets)
    loss, dh, dw, db, _, _, lse = ops.ce_linear(
        hidden, weight, bias, targets, None, config=config, mode=mode, budget_mib=budget, weight_layout=layout,
        head_grad=head_grad_wanted(wanted),
    )  # fmt: skip
    return (loss, lse), (hidden, weight, bias, targets, (dh, dw, db), wanted)


def _ce_bwd(config, mode, budget, layout, res, cts):
    hidden, weight, bias, targets, grads, wanted = res
    g, g_lse = cts
    scaled = tuple(None if w is None or isinstance(g, SymbolicZero) else g * d for d, w in zip(grads, wanted))

    def call(**kw):
        return ops.ce_linear(
            hidden, weight, bias, targets, None, config=config, mode=mode, budget_mib=budget, weight_layout=layout,
            grad_output=0.0, **kw,
        )[1:4]  # fmt: skip

    out = _lse_grads(scaled, wanted, g_lse, call)
    return (*_cast(out, wanted), None)


cross_entropy.defvjp(_ce_fwd, _ce_bwd, symbolic_zeros=True)


def _cast(grads, wanted):
    """Each gradient in its input's dtype, ``None`` where it is not wanted (or none)."""
    return tuple(None if w is None or d is None else d.astype(w.dtype) for d, w in zip(grads, wanted))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def cross_entropy_rows(hidden, weight, bias, targets, config, mode, budget, layout):
    """``(row_loss, lse)`` ``[N]``: the per-row cross-entropy (reduction none) and
    log-sum-exp, one statistics pass; the backward reruns the kernel with each row's
    cotangents."""
    return ops.ce_rows(hidden, weight, bias, targets, config=config, budget_mib=budget, weight_layout=layout)


def _ce_rows_fwd(hidden, weight, bias, targets, config, mode, budget, layout):
    wanted = wants(hidden, weight, bias)
    hidden, weight, bias, targets = _values(hidden, weight, bias, targets)
    out = cross_entropy_rows(hidden, weight, bias, targets, config, mode, budget, layout)
    return out, (hidden, weight, bias, targets, wanted)


def _ce_rows_bwd(config, mode, budget, layout, res, cts):
    hidden, weight, bias, targets, wanted = res
    g, g_lse = cts
    if isinstance(g, SymbolicZero) and isinstance(g_lse, SymbolicZero):
        return None, None, None, None
    rows = None if isinstance(g, SymbolicZero) else g.astype(jnp.float32)
    _, dh, dw, db, *_ = ops.ce_linear(
        hidden, weight, bias, targets, rows, config=config, mode=mode, budget_mib=budget, weight_layout=layout,
        head_grad=head_grad_wanted(wanted), grad_output=0.0 if rows is None else 1.0,
        grad_lse=None if isinstance(g_lse, SymbolicZero) else g_lse.astype(jnp.float32),
    )  # fmt: skip
    return (*_cast((dh, dw, db), wanted), None)


cross_entropy_rows.defvjp(_ce_rows_fwd, _ce_rows_bwd, symbolic_zeros=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def grpo_logits(logits, ids, mask, adv, old, ref, ratio, config):
    """``(loss, (logp, entropy, kl, metrics))`` of one ``flashloss_grpo_logits`` call."""
    loss, _, logp, entropy, kl, metrics = ops.grpo_logits(logits, ids, mask, adv, old, ref, ratio, config=config)
    return loss, (logp, entropy, kl, metrics)


def _logits_fwd(logits, ids, mask, adv, old, ref, ratio, config):
    loss, dz, logp, entropy, kl, metrics = ops.grpo_logits(logits, ids, mask, adv, old, ref, ratio, config=config)
    return (loss, (logp, entropy, kl, metrics)), dz


def _logits_bwd(config, dz, cts):
    return ((cts[0] * dz).astype(dz.dtype), None, None, None, None, None, None)


grpo_logits.defvjp(_logits_fwd, _logits_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def grpo_logits_rows(logits, ids, mask, adv, old, ref, ratio, config):
    """``(token_loss, (kl, clipped))`` ``[B, T]``: the per-token losses ``ℓ_tot`` (Liger's
    ``reduce=False``); the backward runs the logits again with the cotangent."""
    ones = jnp.ones(ids.shape, jnp.float32)
    rows, kl, clipped, _ = ops.grpo_logits_rows(
        logits, ids, mask, adv, old, ref, ones, config=config, with_grad=False, ratio=ratio
    )
    return rows, (kl, clipped)


def _rows_fwd(logits, ids, mask, adv, old, ref, ratio, config):
    out = grpo_logits_rows(logits, ids, mask, adv, old, ref, ratio, config)
    return out, (logits, ids, mask, adv, old, ref, ratio)


def _rows_bwd(config, res, cts):
    logits, ids, mask, adv, old, ref, ratio = res
    g = cts[0].astype(jnp.float32)
    dz = ops.grpo_logits_rows(logits, ids, mask, adv, old, ref, g, config=config, with_grad=True, ratio=ratio)[3]
    return (dz, None, None, None, None, None, None)


grpo_logits_rows.defvjp(_rows_fwd, _rows_bwd)
