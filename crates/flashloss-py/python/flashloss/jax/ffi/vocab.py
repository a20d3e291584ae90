"""GRPO over a head whose rows are split over a mesh axis (``vocab_axis`` inside
``jax.shard_map``; a tensor-parallel LM head). The step is cut at the collectives, which
JAX runs: pass A on each device's block gives per-row partial softmax states (max,
``Σexp``, ``Σexp·s``, the target's raw logit); they merge with ``lax.pmax`` / ``psum``
(:func:`.._collectives.merge_partial`, as flashloss's ``sharding::merge_partial``
does); the O(N) policy stage runs on the merged statistics (the same on every device);
pass B adds each block's ``dW`` and its part of ``dH``, which JAX sums over the axis
(``hidden`` is cast to varying first, so the transpose of that cast is the sum).

Each function takes ``weight_layout``: ``"vh"`` (the block ``[V_r, H]``) or ``"hv"``
(``[H, V_r]``, a Flax kernel split along its columns); the block's ``dweight`` has its
shape. The custom_vjps take symbolic zeros: a block whose ``weight`` and ``bias`` are not
perturbed (a frozen head) runs pass B with ``head_grad="frozen"`` (dH alone)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax.custom_derivatives import SymbolicZero

from .fused import _values, head_grad_wanted, wants
from .._collectives import merge_partial, psum, sum_p2, vocab_offset
from .ops import _call, _like, _or_empty, head_grad_results, vocab_size


def _partial(x, w, bias, ids, mask, offset, temperature, budget, mode, layout):
    """Pass A: ``(max, Σexp, Σexp·s, target logit, S₂)`` ``[N]`` of this block."""
    n = ids.shape[0]
    results = tuple(_like(x, (n,)) for _ in range(5))
    return _call(
        "flashloss_vocab_partial", results, x, w, _or_empty(bias, x.dtype), ids, mask, offset,
        budget_mib=budget, mode=mode, temperature=temperature, weight_layout=layout,
    )  # fmt: skip


def _policy(logp, entropy, ids, mask, adv, old, ref, config, vocab, ratio=None):
    b, t = ids.shape
    results = (_like(logp, ()), _like(logp, (b, t)), _like(logp, (b, t)), _like(logp, (b, t)), _like(logp, (5,)))
    return _call(
        "flashloss_grpo_policy", results,
        logp, entropy, ids, mask, adv, _or_empty(old, jnp.float32), _or_empty(ref, jnp.float32),
        _or_empty(ratio, jnp.float32), config=config, vocab=int(vocab),
    )  # fmt: skip


def _grads(x, w, bias, ids, mask, offset, stats, temperature, budget, mode, layout, head_grad, dlse=None):
    """Pass B: ``(dhidden, dweight, dbias)`` from the merged ``stats`` (max, log_sum,
    entropy) and the rows' cotangents (dlogp, dentropy; ``dlse`` of the log-sum-exp or
    None)."""
    v = vocab_size(w, layout)
    results = (_like(x, x.shape), *head_grad_results(x, w, bias, v, head_grad))
    return _call(
        "flashloss_vocab_grads", results, x, w, _or_empty(bias, x.dtype), ids, mask, offset, *stats,
        _or_empty(dlse, jnp.float32), budget_mib=budget, mode=mode, temperature=temperature, weight_layout=layout,
        head_grad=head_grad,
    )  # fmt: skip


def _cast_wanted(grads, wanted):
    """Each gradient in its input's dtype, ``None`` where it is not wanted."""
    return tuple(None if w is None else d.astype(w.dtype) for d, w in zip(grads, wanted))


def _step(
    hidden, weight, bias, ids, mask, adv, old, ref, ratio, config, axis, temperature, vocab, mode, budget, layout,
    head_grad,
):  # fmt: skip
    b, t = ids.shape
    x = hidden.reshape(b * t, hidden.shape[-1])
    flat_ids, flat_mask = ids.reshape(-1), mask.reshape(-1)
    offset = vocab_offset(weight, axis, layout)
    part = _partial(x, weight, bias, flat_ids, flat_mask, offset, temperature, budget, mode, layout)
    top, log_sum, entropy, logp = merge_partial(part, flat_mask, axis, temperature)
    loss, dlogp, dentropy, kl, metrics = _policy(
        logp.reshape(b, t), entropy.reshape(b, t), ids, mask, adv, old, ref, config, vocab, ratio
    )
    stats = (top, log_sum, entropy, dlogp.reshape(-1), dentropy.reshape(-1))
    if head_grad is None:  # not differentiated: no pass B
        return loss, (logp.reshape(b, t), entropy.reshape(b, t), kl, metrics), None
    dh, dw, db = _grads(
        x, weight, bias, flat_ids, flat_mask, offset, stats, temperature, budget, mode, layout, head_grad
    )
    aux = (logp.reshape(b, t), entropy.reshape(b, t), kl, metrics)
    return loss, aux, (dh.reshape(hidden.shape), dw, db)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10, 11, 12, 13, 14))
def grpo(
    hidden, weight, bias, ids, mask, adv, old, ref, config, axis, temperature, vocab, mode, budget, weight_layout="vh",
    ratio=None,
):  # fmt: skip
    """``(loss, (logp, entropy, kl, metrics))`` of this device's block of the head
    (``ratio``: the sampler's importance ratio ``[B]``, ``[B, T]`` or None)."""
    args = (config, axis, temperature, vocab, mode, budget, weight_layout, None)
    loss, aux, _ = _step(hidden, weight, bias, ids, mask, adv, old, ref, ratio, *args)
    return loss, aux


def _fwd(
    hidden, weight, bias, ids, mask, adv, old, ref, config, axis, temperature, vocab, mode, budget, weight_layout="vh",
    ratio=None,
):  # fmt: skip
    wanted = wants(hidden, weight, bias)
    args = (config, axis, temperature, vocab, mode, budget, weight_layout, head_grad_wanted(wanted))
    primals = _values(hidden, weight, bias, ids, mask, adv, old, ref, ratio)
    loss, aux, grads = _step(*primals, *args)
    return (loss, aux), (grads, wanted)


def _bwd(config, axis, temperature, vocab, mode, budget, weight_layout, res, cts):
    grads, wanted = res
    g = cts[0]
    if isinstance(g, SymbolicZero):
        return (None,) * 9
    out = _cast_wanted(tuple(g * d for d in grads), wanted)
    return (*out, None, None, None, None, None, None)


grpo.defvjp(_fwd, _bwd, symbolic_zeros=True)


def _logprobs_stats(x, w, bias, ids, mask, axis, temperature, budget, mode, weight_layout):
    offset = vocab_offset(w, axis, weight_layout)
    part = _partial(x, w, bias, ids, mask, offset, temperature, budget, mode, weight_layout)
    top, log_sum, entropy, logp = merge_partial(part, mask, axis, temperature)
    top_s = jnp.where(mask, top * jnp.float32(1.0 / temperature), 0.0)
    out = (logp, entropy, top_s + log_sum, top_s, sum_p2(part, mask, top, axis, temperature))
    return out, (x, w, bias, ids, mask, top, log_sum, entropy)


def _logprobs_fwd(x, w, bias, ids, mask, axis, temperature, budget, mode, weight_layout="vh"):
    wanted = wants(x, w, bias)
    x, w, bias, ids, mask = _values(x, w, bias, ids, mask)
    out, res = _logprobs_stats(x, w, bias, ids, mask, axis, temperature, budget, mode, weight_layout)
    return out, (res, wanted)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9))
def logprobs(x, w, bias, ids, mask, axis, temperature, budget, mode, weight_layout="vh"):
    """``(logp, entropy, lse, max, sum_p2)`` ``[N]`` of rows ``x`` ``[N, H]`` at ``ids`` under
    this device's block of the head (``axis``: the mesh axis the head is split over, or
    None; ``lse``, ``max`` and ``Σp²`` of the scaled logits ``s = z / T``, 0 where not
    ``mask``), differentiable in ``logp``, ``entropy`` and ``lse`` (``max`` and ``sum_p2``
    take none): the
    backward is pass B with each row's cotangents as the coefficients of ``∂logp/∂z``,
    ``∂entropy/∂z`` and ``∂lse/∂z``."""
    return _logprobs_stats(x, w, bias, ids, mask, axis, temperature, budget, mode, weight_layout)[0]


def _logprobs_bwd(axis, temperature, budget, mode, weight_layout, res, cts):
    (x, w, bias, ids, mask, top, log_sum, entropy), wanted = res
    cts = cts[:3]  # `max` and `sum_p2` take no gradient
    if all(isinstance(c, SymbolicZero) for c in cts):
        return None, None, None, None, None
    g_logp, g_entropy, g_lse = (
        jnp.zeros_like(top) if isinstance(c, SymbolicZero) else jnp.where(mask, c, 0.0).astype(jnp.float32) for c in cts
    )
    dlse = None if isinstance(cts[2], SymbolicZero) else g_lse
    stats = (top, log_sum, entropy, g_logp, g_entropy)
    offset = vocab_offset(w, axis, weight_layout)
    head_grad = head_grad_wanted(wanted)
    grads = _grads(x, w, bias, ids, mask, offset, stats, temperature, budget, mode, weight_layout, head_grad, dlse)
    return (*_cast_wanted(grads, wanted), None, None)


logprobs.defvjp(_logprobs_fwd, _logprobs_bwd, symbolic_zeros=True)


def _ce_partial(x, w, bias, targets, offset, config, vocab, budget, mode, layout):
    n = targets.shape[0]
    results = tuple(_like(x, (n,)) for _ in range(5))
    return _call(
        "flashloss_ce_vocab_partial", results, x, w, _or_empty(bias, x.dtype), targets, offset,
        budget_mib=budget, mode=mode, config=config, vocab=int(vocab), weight_layout=layout,
    )  # fmt: skip


def _ce_grads(
    x, w, bias, targets, offset, stats, grad_rows, config, vocab, budget, mode, layout, head_grad, grad_lse=None,
    grad_output=1.0,
):  # fmt: skip
    """The row stage and pass B: ``(loss, row_loss, dhidden, dweight, dbias)``, the
    gradients of ``grad_output·L + Σ grad_lse·lse`` (``grad_rows`` weighting reduction
    none's rows; ``grad_lse`` None: no lse term)."""
    n, v = targets.shape[0], vocab_size(w, layout)
    results = (_like(x, ()), _like(x, (n,)), _like(x, x.shape), *head_grad_results(x, w, bias, v, head_grad))
    return _call(
        "flashloss_ce_vocab_grads", results, x, w, _or_empty(bias, x.dtype), targets, offset, *stats,
        _or_empty(grad_rows, jnp.float32), _or_empty(grad_lse, jnp.float32), budget_mib=budget, mode=mode,
        config=config, vocab=int(vocab), weight_layout=layout, head_grad=head_grad, grad_output=float(grad_output),
    )  # fmt: skip


def _ce_stats(x, w, bias, targets, axis, config, temperature, ignore_index, vocab, budget, mode, layout):
    """Every row's statistics over the whole vocabulary: max, log Σexp, entropy, logp,
    mean logit (as the loss transforms the logits: soft-cap, temperature)."""
    offset = vocab_offset(w, axis, layout)
    part = _ce_partial(x, w, bias, targets, offset, config, vocab, budget, mode, layout)
    live = targets != ignore_index
    top, log_sum, entropy, logp = merge_partial(part[:4], live, axis, temperature)
    mean = jnp.where(live, psum(part[4], axis) / jnp.float32(vocab) / jnp.float32(temperature), 0.0)
    return offset, (top, log_sum, entropy, logp, mean)


def _ce_forward(x, w, bias, targets, args, reduction, head_grad):
    """``(loss or per-row losses, lse)`` and, for mean and sum, the loss's gradients of
    ``head_grad`` (``args``: axis, config, temperature, ignore_index, vocab, budget, mode,
    layout)."""
    axis, config, temperature, ignore_index, vocab, budget, mode, layout = args
    offset, stats = _ce_stats(x, w, bias, targets, *args)
    zero = jnp.zeros(targets.shape, jnp.float32) if reduction == "none" else None
    head_grad = "frozen" if reduction == "none" else head_grad  # none: pass B in the backward
    loss, rows, dh, dw, db = _ce_grads(x, w, bias, targets, offset, stats, zero, config, vocab, budget, mode, layout,
                                       head_grad)  # fmt: skip
    out = rows if reduction == "none" else loss
    top, log_sum = stats[:2]
    lse = jnp.where(targets != ignore_index, top * jnp.float32(1.0 / temperature) + log_sum, 0.0)
    if axis is not None:  # the same on every device (from the merged statistics): say so
        out, lse = jax.lax.pmax(out, axis), jax.lax.pmax(lse, axis)
    return (out, lse), (offset, stats, (dh, dw, db))


def _ce_fwd(
    x, w, bias, targets, axis, config, temperature, ignore_index, vocab, reduction, budget, mode, weight_layout="vh"
):  # fmt: skip
    wanted = wants(x, w, bias)
    x, w, bias, targets = _values(x, w, bias, targets)
    args = (axis, config, temperature, ignore_index, vocab, budget, mode, weight_layout)
    out, (offset, stats, grads) = _ce_forward(x, w, bias, targets, args, reduction, head_grad_wanted(wanted))
    return out, (x, w, bias, targets, offset, stats, grads, wanted)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8, 9, 10, 11, 12))
def cross_entropy(
    x, w, bias, targets, axis, config, temperature, ignore_index, vocab, reduction, budget, mode, weight_layout="vh"
):  # fmt: skip
    """Cross-entropy of rows ``x`` ``[N, H]`` at ``targets`` ``[N]`` (ids of the whole
    vocabulary) under this device's block of the head, its rows merged over ``axis``:
    ``(out, lse)``, the loss (reduction mean, sum) or the per-row losses (none) and each
    row's log-sum-exp of the scaled logits (0 where ignored), the same on every device.
    Mean and sum form the loss's gradients in the forward; none runs pass B in its
    backward with each row's cotangent; a cotangent on ``lse`` joins pass B's
    coefficients (``∂lse/∂s_j = p_j``; for mean and sum one more pass B)."""
    args = (axis, config, temperature, ignore_index, vocab, budget, mode, weight_layout)
    return _ce_forward(x, w, bias, targets, args, reduction, "frozen")[0]


def _ce_bwd(axis, config, temperature, ignore_index, vocab, reduction, budget, mode, weight_layout, res, cts):
    x, w, bias, targets, offset, stats, grads, wanted = res
    g, g_lse = cts
    no_g, no_lse = isinstance(g, SymbolicZero), isinstance(g_lse, SymbolicZero)
    if no_g and no_lse:
        return None, None, None, None
    tail = (config, vocab, budget, mode, weight_layout, head_grad_wanted(wanted))
    dlse = None if no_lse else g_lse.astype(jnp.float32)
    if reduction == "none":  # one pass B with both cotangents
        rows = jnp.zeros(targets.shape, jnp.float32) if no_g else g.astype(jnp.float32)
        _, _, *grads = _ce_grads(x, w, bias, targets, offset, stats, rows, *tail, grad_lse=dlse)
    elif no_lse:
        grads = [g * d for d in grads]
    else:  # the lse's pass B (grad_output 0), plus the forward's gradients scaled by g
        _, _, *extra = _ce_grads(x, w, bias, targets, offset, stats, None, *tail, grad_lse=dlse, grad_output=0.0)
        grads = extra if no_g else [g * d + e for d, e in zip(grads, extra)]
    return (*_cast_wanted(grads, wanted), None)


cross_entropy.defvjp(_ce_fwd, _ce_bwd, symbolic_zeros=True)
