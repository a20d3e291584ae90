"""The losses on the FFI path (CPU, and CUDA where built): each a ``jax.custom_vjp``
whose forward runs one fused kernel call that yields the loss and the gradients of
``hidden``, ``weight`` and ``bias`` together (the fastest path on the CPU); its backward
scales them by the cotangent. ``layout`` names the head's layout (``"vh"`` ``[V, H]``,
``"hv"`` ``[H, V]``); the handlers read either without a transposed copy."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import _ops


def _scaled(g, grads, like):
    """``g · grad`` in each input's dtype (``None`` where the input is ``None``)."""
    return tuple(None if d is None else (g * d).astype(x.dtype) for d, x in zip(grads, like))


def _protos(*xs):
    return tuple(None if x is None else jnp.zeros((0,), x.dtype) for x in xs)


def _grads_bwd(res, g):
    grads, protos = res
    return _scaled(g, grads, protos)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10, 11))
def grpo(hidden, weight, bias, ids, mask, adv, old, ref, config, mode, budget, layout):
    """``(loss, (logp, entropy, kl, metrics))`` of one ``flashloss_grpo_linear`` call."""
    loss, *_, logp, entropy, kl, metrics = _ops.grpo_linear(
        hidden, weight, bias, ids, mask, adv, old, ref, config=config, mode=mode, budget_mib=budget,
        weight_layout=layout,
    )  # fmt: skip
    return loss, (logp, entropy, kl, metrics)


def _grpo_fwd(hidden, weight, bias, ids, mask, adv, old, ref, config, mode, budget, layout):
    loss, dh, dw, db, logp, entropy, kl, metrics = _ops.grpo_linear(
        hidden, weight, bias, ids, mask, adv, old, ref, config=config, mode=mode, budget_mib=budget,
        weight_layout=layout,
    )  # fmt: skip
    grads = (dh, dw, None if bias is None else db)
    return (loss, (logp, entropy, kl, metrics)), (grads, _protos(hidden, weight, bias))


def _grpo_bwd(config, mode, budget, layout, res, cts):
    return (*_grads_bwd(res, cts[0]), None, None, None, None, None)


grpo.defvjp(_grpo_fwd, _grpo_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def cross_entropy(hidden, weight, bias, targets, config, mode, budget, layout):
    """The reduced (mean, sum) cross-entropy of one ``flashloss_ce_linear`` call."""
    return _ops.ce_linear(
        hidden, weight, bias, targets, None, config=config, mode=mode, budget_mib=budget, weight_layout=layout
    )[0]


def _ce_fwd(hidden, weight, bias, targets, config, mode, budget, layout):
    loss, dh, dw, db, _, _ = _ops.ce_linear(
        hidden, weight, bias, targets, None, config=config, mode=mode, budget_mib=budget, weight_layout=layout
    )
    return loss, ((dh, dw, None if bias is None else db), _protos(hidden, weight, bias))


def _ce_bwd(config, mode, budget, layout, res, g):
    return (*_grads_bwd(res, g), None)


cross_entropy.defvjp(_ce_fwd, _ce_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def cross_entropy_rows(hidden, weight, bias, targets, config, mode, budget, layout):
    """The per-row cross-entropy (reduction none): one statistics pass; the backward
    reruns the kernel with each row's cotangent."""
    return _ops.ce_rows(hidden, weight, bias, targets, config=config, budget_mib=budget, weight_layout=layout)


def _ce_rows_fwd(hidden, weight, bias, targets, config, mode, budget, layout):
    rows = cross_entropy_rows(hidden, weight, bias, targets, config, mode, budget, layout)
    return rows, (hidden, weight, bias, targets)


def _ce_rows_bwd(config, mode, budget, layout, res, g):
    hidden, weight, bias, targets = res
    _, dh, dw, db, _, _ = _ops.ce_linear(
        hidden, weight, bias, targets, g.astype(jnp.float32), config=config, mode=mode, budget_mib=budget,
        weight_layout=layout,
    )  # fmt: skip
    grads = (dh, dw, None if bias is None else db)
    return (*(None if d is None else d.astype(x.dtype) for d, x in zip(grads, (hidden, weight, bias))), None)


cross_entropy_rows.defvjp(_ce_rows_fwd, _ce_rows_bwd)


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
