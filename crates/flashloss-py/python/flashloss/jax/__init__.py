"""JAX operations over flashloss's fused kernels (XLA FFI handlers, CPU).

``linear_grpo_loss`` and ``linear_cross_entropy`` compute TRL's GRPO loss and the
cross-entropy straight from the hidden states and the LM head, never holding the
``[tokens x vocab]`` logits; ``grpo_loss`` is the logits-level GRPO loss. Each is a
``jax.custom_vjp`` whose forward runs one fused kernel call that yields the loss and
the gradients of ``hidden``, ``weight`` and ``bias`` together (the fastest path on the
CPU); its backward scales them by the cotangent. They work under ``jax.jit``,
``jax.grad`` / ``value_and_grad`` and ``jax.vmap`` (the handler runs once per batch
element), in float32 and bfloat16. Argument names and defaults are TRL's, as in
:mod:`flashloss.torch`. The per-token outputs (``logp``, ``entropy``, ``kl``) and the
metrics carry no gradient.

Errors of the kernels (shapes, ids out of range, values beyond f32) are raised by JAX
as ``JaxRuntimeError`` with flashloss's message, which names the argument.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp

from .._config import DEFAULT_BUDGET_MIB, ce_config, grpo_config
from . import _ops, _vocab

__all__ = ["GRPOOutputs", "grpo_loss", "linear_cross_entropy", "linear_grpo_loss", "linear_logprobs"]

_ops.register()

_METRICS = ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


@jax.tree_util.register_dataclass
@dataclass
class GRPOOutputs:
    """What a GRPO call returns besides the loss (no gradient flows through it)."""

    #: Per-token log-probabilities of ``completion_ids`` ``[B, T]`` (float32).
    logp: jax.Array
    #: Per-token entropy ``[B, T]`` (float32).
    entropy: jax.Array
    #: Per-token KL as it enters the loss ``[B, T]`` (zero without a reference or at beta=0).
    kl: jax.Array
    #: TRL's logged metrics (scalars): kl, entropy, clip_ratio/{low,high,region}_mean.
    metrics: dict


def _floats(arg: str, x) -> jax.Array:
    x = jnp.asarray(x)
    if x.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"argument `{arg}`: expected dtype float32 or bfloat16, got {x.dtype}")
    return x


def _head(hidden, weight, bias):
    """One float dtype for the head (mixed dtypes become bfloat16, as autocast would)."""
    hidden, weight = _floats("hidden", hidden), _floats("weight", weight)
    bias = None if bias is None else _floats("bias", bias)
    if weight.ndim != 2:
        raise ValueError(f"argument `weight`: expected shape [V, H], got {list(weight.shape)}")
    if hidden.shape[-1:] != weight.shape[1:]:
        raise ValueError(f"argument `hidden`: expected shape [..., H={weight.shape[1]}], got {list(hidden.shape)}")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"argument `bias`: expected shape [V={weight.shape[0]}], got {list(bias.shape)}")
    dtypes = {x.dtype for x in (hidden, weight, bias) if x is not None}
    dtype = jnp.float32 if dtypes == {jnp.dtype(jnp.float32)} else jnp.bfloat16
    cast = [None if x is None else x.astype(dtype) for x in (hidden, weight, bias)]
    return cast


def _axis_size(arg: str, name: str) -> int:
    """The size of mesh axis ``name``; an error naming ``arg`` outside a ``shard_map``
    over it."""
    try:
        return jax.lax.axis_size(name)
    except NameError as e:
        raise ValueError(f"argument `{arg}`: no mesh axis {name!r} here (call inside jax.shard_map over it)") from e


def _ids(arg: str, x) -> jax.Array:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"argument `{arg}`: expected an integer dtype, got {x.dtype}")
    return x.astype(jnp.int64 if x.dtype == jnp.int64 else jnp.int32)


def _scaled(g, grads, like):
    """``g · grad`` in each input's dtype (``None`` where the input is ``None``)."""
    return tuple(None if d is None else (g * d).astype(x.dtype) for d, x in zip(grads, like))


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10))
def _grpo(hidden, weight, bias, ids, mask, adv, old, ref, config, mode, budget):
    loss, *_, logp, entropy, kl, metrics = _ops.grpo_linear(
        hidden, weight, bias, ids, mask, adv, old, ref, config=config, mode=mode, budget_mib=budget
    )
    return loss, (logp, entropy, kl, metrics)


def _grpo_fwd(hidden, weight, bias, ids, mask, adv, old, ref, config, mode, budget):
    loss, dh, dw, db, logp, entropy, kl, metrics = _ops.grpo_linear(
        hidden, weight, bias, ids, mask, adv, old, ref, config=config, mode=mode, budget_mib=budget
    )
    like = (hidden, weight, bias)
    protos = tuple(None if x is None else jnp.zeros((0,), x.dtype) for x in like)
    return (loss, (logp, entropy, kl, metrics)), ((dh, dw, None if bias is None else db), protos)


def _grads_bwd(res, g):
    grads, protos = res
    return _scaled(g, grads, protos)


def _grpo_bwd(config, mode, budget, res, cts):
    return (*_grads_bwd(res, cts[0]), None, None, None, None, None)


_grpo.defvjp(_grpo_fwd, _grpo_bwd)


def linear_grpo_loss(
    hidden,
    weight,
    completion_ids,
    completion_mask,
    advantages,
    *,
    bias=None,
    old_per_token_logps=None,
    ref_per_token_logps=None,
    loss_type: str = "dapo",
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: Optional[float] = None,
    delta: Optional[float] = None,
    importance_sampling_level: str = "token",
    temperature: float = 1.0,
    use_bias_correction_kl: bool = True,
    entropy_coef: float = 0.0,
    num_items_in_batch: Optional[float] = None,
    max_completion_length: Optional[int] = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
    mode: str = "auto",
    budget_mib: Optional[float] = None,
    token_axis: Optional[str] = None,
    vocab_axis: Optional[str] = None,
):
    """TRL's GRPO loss from ``hidden`` ``[B, T, H]`` (or ``[B·T, H]``) and the LM head
    ``weight`` ``[V, H]`` (+ ``bias`` ``[V]``) at ``completion_ids`` ``[B, T]``.

    Returns ``(loss, GRPOOutputs)``, differentiable in ``hidden``, ``weight`` and
    ``bias``. ``epsilon_high=None`` means ``epsilon_low``; ``old_per_token_logps=None``
    means on-policy (ratio 1); ``num_items_in_batch`` must be a Python number (it is part
    of the compiled call).

    ``token_axis``: inside ``jax.shard_map``, the mesh axis over which the sequences are
    split (each device passes its own sequences and the whole head): the loss's
    normalizers (the token count of dapo/bnpo, the sequence count of grpo/dr_grpo/luspo)
    and the metrics are summed over it, so every device gets the one-device loss, its
    ``hidden`` gradient, and the head's gradient summed over the axis. A
    ``num_items_in_batch`` given is taken as already global, as TRL passes it.

    ``vocab_axis``: inside ``jax.shard_map``, the mesh axis over which ``weight`` (and
    ``bias``) is split by rows in equal contiguous blocks, in axis order (a
    tensor-parallel LM head); every device passes all the rows. The partial row
    statistics merge over the axis, every device gets the loss and ``hidden``'s whole
    gradient, and its own block's ``weight`` / ``bias`` gradients.

    Both (a 2-D mesh): each device holds its sequences and its block of the head; the
    statistics merge over ``vocab_axis``, the normalizers and ``weight``'s gradient sum
    over ``token_axis``."""
    hidden, weight, bias = _head(hidden, weight, bias)
    ids = _ids("completion_ids", completion_ids)
    if ids.ndim != 2:
        raise ValueError(f"argument `completion_ids`: expected shape [B, T], got {list(ids.shape)}")
    b, t = ids.shape
    if hidden.size // hidden.shape[-1] != b * t:
        raise ValueError(
            f"argument `hidden`: has {hidden.size // hidden.shape[-1]} rows but completion_ids has B·T = {b * t}"
        )
    mask = jnp.ones((b, t), bool) if completion_mask is None else jnp.asarray(completion_mask) != 0
    adv = jnp.asarray(advantages, jnp.float32)
    if adv.ndim == 2 and adv.shape[1] == 1:
        adv = adv[:, 0]  # TRL's unsqueezed [B, 1]
    old = None if old_per_token_logps is None else jnp.asarray(old_per_token_logps, jnp.float32)
    ref = None if ref_per_token_logps is None else jnp.asarray(ref_per_token_logps, jnp.float32)
    config = grpo_config(
        loss_type, beta, epsilon_low, epsilon_high, delta, importance_sampling_level, temperature,
        use_bias_correction_kl, entropy_coef, num_items_in_batch, max_completion_length,
        sapo_temperature_pos, sapo_temperature_neg, vespo_k_pos, vespo_lambda_pos, vespo_k_neg,
        vespo_lambda_neg,
    )  # fmt: skip
    budget = DEFAULT_BUDGET_MIB if budget_mib is None else float(budget_mib)
    if token_axis is not None:
        _axis_size("token_axis", token_axis)
        if entropy_coef and loss_type not in ("dapo", "bnpo", "cispo", "vespo"):
            raise ValueError(
                f"argument `token_axis`: an entropy bonus with loss_type {loss_type!r} has a normalizer of its own; "
                "not supported across devices yet"
            )
        weight = jax.lax.pcast(weight, token_axis, to="varying")
        bias = None if bias is None else jax.lax.pcast(bias, token_axis, to="varying")
    if vocab_axis is not None:
        vocab = weight.shape[0] * _axis_size("vocab_axis", vocab_axis)
        hidden = jax.lax.pcast(hidden, vocab_axis, to="varying")
        args = (hidden, weight, bias, ids, mask, adv, old, ref)
        loss, (logp, entropy, kl, metrics) = _vocab.grpo(
            *args, config, vocab_axis, float(temperature), int(vocab), mode, budget
        )
    else:
        loss, (logp, entropy, kl, metrics) = _grpo(hidden, weight, bias, ids, mask, adv, old, ref, config, mode, budget)
    if token_axis is not None:
        loss, metrics = _over_tokens(loss, metrics, mask, token_axis, loss_type, num_items_in_batch)
    aux = jax.lax.stop_gradient((logp, entropy, kl, metrics))
    return loss, GRPOOutputs(aux[0], aux[1], aux[2], dict(zip(_METRICS, aux[3])))


def _over_tokens(loss, metrics, mask, axis, loss_type, num_items_in_batch):
    """The one-device loss and metrics from each device's: the loss is a sum of row terms
    over a normalizer, so `L = Σ_d L_d · n_d / Σ_d n_d` (`n_d` the device's normalizer);
    the metrics are token means, so they are weighted by the devices' token counts."""
    tokens = mask.sum().astype(jnp.float32)
    if loss_type in ("dapo", "cispo", "vespo") and num_items_in_batch is not None:
        norm = jnp.float32(1.0)  # already global: the device's losses add up
        share = norm
    else:
        norm = tokens if loss_type in ("dapo", "bnpo", "cispo", "vespo") else jnp.float32(mask.shape[0])
        share = norm / jax.lax.psum(norm, axis)
    loss = jax.lax.psum(jax.lax.stop_gradient(share) * loss, axis)
    metrics = jax.lax.psum(metrics * tokens, axis) / jnp.maximum(jax.lax.psum(tokens, axis), 1.0)
    return loss, metrics


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _ce(hidden, weight, bias, targets, config, mode, budget):
    return _ops.ce_linear(hidden, weight, bias, targets, None, config=config, mode=mode, budget_mib=budget)[0]


def _ce_fwd(hidden, weight, bias, targets, config, mode, budget):
    loss, dh, dw, db, _, _ = _ops.ce_linear(
        hidden, weight, bias, targets, None, config=config, mode=mode, budget_mib=budget
    )
    protos = tuple(None if x is None else jnp.zeros((0,), x.dtype) for x in (hidden, weight, bias))
    return loss, ((dh, dw, None if bias is None else db), protos)


def _ce_bwd(config, mode, budget, res, g):
    return (*_grads_bwd(res, g), None)


_ce.defvjp(_ce_fwd, _ce_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _ce_rows(hidden, weight, bias, targets, config, mode, budget):
    return _ops.ce_rows(hidden, weight, bias, targets, config=config, budget_mib=budget)


def _ce_rows_fwd(hidden, weight, bias, targets, config, mode, budget):
    return _ce_rows(hidden, weight, bias, targets, config, mode, budget), (hidden, weight, bias, targets)


def _ce_rows_bwd(config, mode, budget, res, g):
    hidden, weight, bias, targets = res
    _, dh, dw, db, _, _ = _ops.ce_linear(
        hidden, weight, bias, targets, g.astype(jnp.float32), config=config, mode=mode, budget_mib=budget
    )
    like = (hidden, weight, bias)
    grads = (dh, dw, None if bias is None else db)
    return (*(None if d is None else d.astype(x.dtype) for d, x in zip(grads, like)), None)


_ce_rows.defvjp(_ce_rows_fwd, _ce_rows_bwd)


def linear_cross_entropy(
    hidden,
    weight,
    targets,
    *,
    bias=None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: Optional[float] = None,
    reduction: str = "mean",
    temperature: float = 1.0,
    mode: str = "auto",
    budget_mib: Optional[float] = None,
    vocab_axis: Optional[str] = None,
):
    """Cross-entropy of ``hidden @ weight.T + bias`` at ``targets`` (Cut Cross-Entropy's
    call): ``hidden`` ``[..., H]``, ``targets`` ``[...]``; reduction ``mean``, ``sum`` or
    ``none`` (``[...]``, whose backward reruns the kernel with each row's cotangent).
    ``vocab_axis``: inside ``jax.shard_map``, the mesh axis over which ``weight`` (and
    ``bias``) is split by rows in equal contiguous blocks, as in
    :func:`linear_grpo_loss`; every device passes all the rows and gets the loss, the
    whole ``hidden`` gradient and its block's gradients."""
    config = ce_config(ignore_index, label_smoothing, z_loss, softcap, reduction, temperature)
    hidden, weight, bias = _head(hidden, weight, bias)
    targets = _ids("targets", targets)
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(
            f"argument `targets`: shape {list(targets.shape)} does not match hidden's rows {list(hidden.shape[:-1])}"
        )
    h2, t1 = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    budget = DEFAULT_BUDGET_MIB if budget_mib is None else float(budget_mib)
    if vocab_axis is not None:
        vocab = weight.shape[0] * _axis_size("vocab_axis", vocab_axis)
        h2 = jax.lax.pcast(h2, vocab_axis, to="varying")
        args = (vocab_axis, config, float(temperature), int(ignore_index), int(vocab), reduction, budget, mode)
        out = _vocab.cross_entropy(h2, weight, bias, t1, *args)
        return out.reshape(targets.shape) if reduction == "none" else out
    if reduction == "none":
        return _ce_rows(h2, weight, bias, t1, config, mode, budget).reshape(targets.shape)
    return _ce(h2, weight, bias, t1, config, mode, budget)


def linear_logprobs(
    hidden,
    weight,
    ids,
    temperature: float = 1.0,
    return_entropy: bool = False,
    *,
    bias=None,
    mask=None,
    budget_mib=None,
    mode: str = "auto",
    vocab_axis: Optional[str] = None,
):
    """Per-token log-probabilities of ``ids`` ``[...]`` under ``(hidden @ weight.T + bias) /
    temperature`` (``hidden`` ``[..., H]``); ``(logp, entropy)`` when ``return_entropy``.
    Rows where ``mask`` is false are zero. Differentiable in ``hidden``, ``weight`` and
    ``bias`` (the forward keeps each row's ``max``, ``log Σexp`` and entropy; the backward
    is one more pass over the head); ``vocab_axis`` as in :func:`linear_grpo_loss`."""
    hidden, weight, bias = _head(hidden, weight, bias)
    ids = _ids("ids", ids)
    if hidden.shape[:-1] != ids.shape:
        raise ValueError(
            f"argument `ids`: shape {list(ids.shape)} does not match hidden's rows {list(hidden.shape[:-1])}"
        )
    m = jnp.ones(ids.shape, bool) if mask is None else jnp.asarray(mask) != 0
    budget = DEFAULT_BUDGET_MIB if budget_mib is None else float(budget_mib)
    x = hidden.reshape(-1, hidden.shape[-1])
    if vocab_axis is not None:
        _axis_size("vocab_axis", vocab_axis)
        x = jax.lax.pcast(x, vocab_axis, to="varying")
    logp, entropy = _vocab.logprobs(
        x, weight, bias, ids.reshape(-1), m.reshape(-1), vocab_axis, float(temperature), budget, mode
    )
    logp, entropy = logp.reshape(ids.shape), entropy.reshape(ids.shape)
    return (logp, entropy) if return_entropy else logp


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _logits(logits, ids, mask, adv, old, ref, config):
    loss, _, logp, entropy, kl, metrics = _ops.grpo_logits(logits, ids, mask, adv, old, ref, config=config)
    return loss, (logp, entropy, kl, metrics)


def _logits_fwd(logits, ids, mask, adv, old, ref, config):
    loss, dz, logp, entropy, kl, metrics = _ops.grpo_logits(logits, ids, mask, adv, old, ref, config=config)
    return (loss, (logp, entropy, kl, metrics)), dz


def _logits_bwd(config, dz, cts):
    return ((cts[0] * dz).astype(dz.dtype), None, None, None, None, None)


_logits.defvjp(_logits_fwd, _logits_bwd)


def grpo_loss(
    logits,
    completion_ids,
    completion_mask,
    advantages,
    *,
    old_per_token_logps=None,
    ref_per_token_logps=None,
    loss_type: str = "dapo",
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: Optional[float] = None,
    delta: Optional[float] = None,
    importance_sampling_level: str = "token",
    temperature: float = 1.0,
    use_bias_correction_kl: bool = True,
    num_items_in_batch: Optional[float] = None,
    max_completion_length: Optional[int] = None,
):
    """TRL's GRPO loss on materialized ``logits`` ``[B, T, V]`` (float32 or bfloat16):
    the loss and ``dlogits`` in one pass (the place of the original Pallas kernel), the
    gradient in the logits' dtype with no float32 copy of bfloat16 logits. Returns
    ``(loss, GRPOOutputs)``, differentiable in ``logits``."""
    logits = _floats("logits", logits)
    ids = _ids("completion_ids", completion_ids)
    if logits.ndim != 3 or logits.shape[:2] != ids.shape:
        raise ValueError(
            f"argument `logits`: expected shape [B, T, V] with [B, T] = {list(ids.shape)}, got {list(logits.shape)}"
        )
    mask = jnp.ones(ids.shape, bool) if completion_mask is None else jnp.asarray(completion_mask) != 0
    adv = jnp.asarray(advantages, jnp.float32)
    if adv.ndim == 2 and adv.shape[1] == 1:
        adv = adv[:, 0]
    old = None if old_per_token_logps is None else jnp.asarray(old_per_token_logps, jnp.float32)
    ref = None if ref_per_token_logps is None else jnp.asarray(ref_per_token_logps, jnp.float32)
    config = grpo_config(
        loss_type, beta, epsilon_low, epsilon_high, delta, importance_sampling_level, temperature,
        use_bias_correction_kl, 0.0, num_items_in_batch, max_completion_length,
        1.0, 1.05, 2.0, 3.0, 3.0, 2.0,
    )  # fmt: skip
    loss, aux = _logits(logits, ids, mask, adv, old, ref, config)
    aux = jax.lax.stop_gradient(aux)
    return loss, GRPOOutputs(aux[0], aux[1], aux[2], dict(zip(_METRICS, aux[3])))
