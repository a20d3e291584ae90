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

from . import _ops


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


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10, 11))
def grpo(hidden, weight, bias, ids, mask, adv, old, ref, config, mode, budget, layout):
    """``(loss, (logp, entropy, kl, metrics))`` of one ``flashloss_grpo_linear`` call."""
    loss, *_, logp, entropy, kl, metrics = _ops.grpo_linear(
        hidden, weight, bias, ids, mask, adv, old, ref, config=config, mode=mode, budget_mib=budget,
        weight_layout=layout, head_grad="frozen",
    )  # fmt: skip
    return loss, (logp, entropy, kl, metrics)


def _grpo_fwd(hidden, weight, bias, ids, mask, adv, old, ref, config, mode, budget, layout):
    primals = (hidden, weight, bias)
    head_grad = head_grad_of(weight, bias)
    hidden, weight, bias, ids, mask, adv, old, ref = _values(hidden, weight, bias, ids, mask, adv, old, ref)
    loss, dh, dw, db, logp, entropy, kl, metrics = _ops.grpo_linear(
        hidden, weight, bias, ids, mask, adv, old, ref, config=config, mode=mode, budget_mib=budget,
        weight_layout=layout, head_grad=head_grad,
    )  # fmt: skip
    grads = _wanted((dh, dw, db), primals)
    return (loss, (logp, entropy, kl, metrics)), (grads, _protos(hidden, weight, bias))


def _grpo_bwd(config, mode, budget, layout, res, cts):
    return (*_grads_bwd(res, cts[0]), None, None, None, None, None)


grpo.defvjp(_grpo_fwd, _grpo_bwd, symbolic_zeros=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def cross_entropy(hidden, weight, bias, targets, config, mode, budget, layout):
    """The reduced (mean, sum) cross-entropy of one ``flashloss_ce_linear`` call."""
    return _ops.ce_linear(
        hidden, weight, bias, targets, None, config=config, mode=mode, budget_mib=budget, weight_layout=layout,
        head_grad="frozen",
    )[0]  # fmt: skip


def _ce_fwd(hidden, weight, bias, targets, config, mode, budget, layout):
    primals = (hidden, weight, bias)
    head_grad = head_grad_of(weight, bias)
    hidden, weight, bias, targets = _values(hidden, weight, bias, targets)
    loss, dh, dw, db, _, _ = _ops.ce_linear(
        hidden, weight, bias, targets, None, config=config, mode=mode, budget_mib=budget, weight_layout=layout,
        head_grad=head_grad,
    )  # fmt: skip
    return loss, (_wanted((dh, dw, db), primals), _protos(hidden, weight, bias))


def _ce_bwd(config, mode, budget, layout, res, g):
    return (*_grads_bwd(res, g), None)


cross_entropy.defvjp(_ce_fwd, _ce_bwd, symbolic_zeros=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def cross_entropy_rows(hidden, weight, bias, targets, config, mode, budget, layout):
    """The per-row cross-entropy (reduction none): one statistics pass; the backward
    reruns the kernel with each row's cotangent."""
    return _ops.ce_rows(hidden, weight, bias, targets, config=config, budget_mib=budget, weight_layout=layout)


def _ce_rows_fwd(hidden, weight, bias, targets, config, mode, budget, layout):
    wanted = wants(hidden, weight, bias)
    hidden, weight, bias, targets = _values(hidden, weight, bias, targets)
    rows = cross_entropy_rows(hidden, weight, bias, targets, config, mode, budget, layout)
    return rows, (hidden, weight, bias, targets, wanted)


def _ce_rows_bwd(config, mode, budget, layout, res, g):
    hidden, weight, bias, targets, wanted = res
    if isinstance(g, SymbolicZero):
        return None, None, None, None
    _, dh, dw, db, _, _ = _ops.ce_linear(
        hidden, weight, bias, targets, g.astype(jnp.float32), config=config, mode=mode, budget_mib=budget,
        weight_layout=layout, head_grad=head_grad_wanted(wanted),
    )  # fmt: skip
    grads = tuple(None if w is None else d.astype(w.dtype) for d, w in zip((dh, dw, db), wanted))
    return (*grads, None)


cross_entropy_rows.defvjp(_ce_rows_fwd, _ce_rows_bwd, symbolic_zeros=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def grpo_logits(logits, ids, mask, adv, old, ref, config):
    """``(loss, (logp, entropy, kl, metrics))`` of one ``flashloss_grpo_logits`` call."""
    loss, _, logp, entropy, kl, metrics = _ops.grpo_logits(logits, ids, mask, adv, old, ref, config=config)
    return loss, (logp, entropy, kl, metrics)


def _logits_fwd(logits, ids, mask, adv, old, ref, config):
    loss, dz, logp, entropy, kl, metrics = _ops.grpo_logits(logits, ids, mask, adv, old, ref, config=config)
    return (loss, (logp, entropy, kl, metrics)), dz


def _logits_bwd(config, dz, cts):
    return ((cts[0] * dz).astype(dz.dtype), None, None, None, None, None)


grpo_logits.defvjp(_logits_fwd, _logits_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def grpo_logits_rows(logits, ids, mask, adv, old, ref, config):
    """``(token_loss, (kl, clipped))`` ``[B, T]``: the per-token losses ``ℓ_tot`` (Liger's
    ``reduce=False``); the backward runs the logits again with the cotangent."""
    ones = jnp.ones(ids.shape, jnp.float32)
    rows, kl, clipped, _ = _ops.grpo_logits_rows(logits, ids, mask, adv, old, ref, ones, config=config, with_grad=False)
    return rows, (kl, clipped)


def _rows_fwd(logits, ids, mask, adv, old, ref, config):
    return grpo_logits_rows(logits, ids, mask, adv, old, ref, config), (logits, ids, mask, adv, old, ref)


def _rows_bwd(config, res, cts):
    logits, ids, mask, adv, old, ref = res
    g = cts[0].astype(jnp.float32)
    dz = _ops.grpo_logits_rows(logits, ids, mask, adv, old, ref, g, config=config, with_grad=True)[3]
    return (dz, None, None, None, None, None)


grpo_logits_rows.defvjp(_rows_fwd, _rows_bwd)
