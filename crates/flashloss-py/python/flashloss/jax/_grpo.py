"""``flashloss.jax``'s GRPO losses: :func:`linear_grpo_loss` from the hidden states and the
LM head, and :func:`grpo_loss` on materialized logits."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from .._config import budget_or_unset as _budget
from .._spec import METRICS, NORMALIZERS, GRPOOutputs, GrpoArgs, SamplerFilters, with_params
from . import _args as A
from . import _head as H
from . import _packed, _policy
from ._calls import LinearGrpoCall, LogitsGrpoCall
from ._collectives import over_tokens
from ._losses import linear_logprobs
from ._paths import dispatch
from . import _checks

_TRL = GrpoArgs()


def _outputs(loss, aux, outside=None):
    logp, entropy, kl, metrics = jax.lax.stop_gradient(aux)
    return loss, GRPOOutputs(logp, entropy, kl, dict(zip(METRICS, metrics)), outside)


@with_params
def linear_grpo_loss(
    hidden: ArrayLike,
    weight: ArrayLike,
    completion_ids: ArrayLike,
    completion_mask: Optional[ArrayLike],
    advantages: ArrayLike,
    *,
    bias: Optional[ArrayLike] = None,
    old_per_token_logps: Optional[ArrayLike] = None,
    ref_per_token_logps: Optional[ArrayLike] = None,
    importance_sampling_ratio: Optional[ArrayLike] = None,
    policy_mask: Optional[ArrayLike] = None,
    entropy_mask: Optional[ArrayLike] = None,
    cu_seqlens: Optional[ArrayLike] = None,
    position_ids: Optional[ArrayLike] = None,
    loss_type: str = _TRL.loss_type,
    beta: float = _TRL.beta,
    epsilon_low: float = _TRL.epsilon_low,
    epsilon_high: Optional[float] = _TRL.epsilon_high,
    delta: Optional[float] = _TRL.delta,
    importance_sampling_level: str = _TRL.importance_sampling_level,
    temperature: float = _TRL.temperature,
    use_bias_correction_kl: bool = _TRL.use_bias_correction_kl,
    entropy_coef: float = _TRL.entropy_coef,
    num_items_in_batch: Union[float, ArrayLike, None] = _TRL.num_items_in_batch,
    max_completion_length: Optional[int] = _TRL.max_completion_length,
    sapo_temperature_pos: float = _TRL.sapo_temperature_pos,
    sapo_temperature_neg: float = _TRL.sapo_temperature_neg,
    vespo_k_pos: float = _TRL.vespo_k_pos,
    vespo_lambda_pos: float = _TRL.vespo_lambda_pos,
    vespo_k_neg: float = _TRL.vespo_k_neg,
    vespo_lambda_neg: float = _TRL.vespo_lambda_neg,
    top_k: Optional[int] = _TRL.top_k,
    top_p: Optional[float] = _TRL.top_p,
    min_p: Optional[float] = _TRL.min_p,
    mode: str = "auto",
    budget_mib: Optional[float] = None,
    token_axis: Optional[str] = None,
    vocab_axis: Optional[str] = None,
    impl: str = "auto",
    interpret: Any = False,
    weight_layout: str = "vh",
) -> tuple[jax.Array, GRPOOutputs]:
    """TRL's GRPO loss from ``hidden`` ``[B, T, H]`` (or ``[B·T, H]``) and the LM head
    ``weight`` (``[V, H]``, or ``[H, V]`` with ``weight_layout="hv"``; + ``bias`` ``[V]``)
    at ``completion_ids`` ``[B, T]``.

    Returns ``(loss, GRPOOutputs)``, differentiable in ``hidden``, ``weight`` and
    ``bias``. ``num_items_in_batch`` is part of the compiled call (a Python number, or a
    concrete 0-d array).

    {grpo_args}

    {grpo_masks}
    With either mask the loss is formed in JAX above the log-prob kernel
    (:func:`linear_logprobs`, differentiable in both outputs) on either path.

    {packed}
    Traced sequences (under ``jax.jit``) are placed in ``[B, total_tokens]`` and checked
    by a host callback; concrete ones (NumPy) in ``[B, T_max]``, checked at trace time.

    {filters}
    Under them every term of the loss uses that log-prob, and a token whose target is
    outside the support is masked (loss, normalizers and metrics) and flagged in
    ``GRPOOutputs.outside_support`` (``None`` when no filter is set). On the Pallas path,
    and with ``vocab_axis`` on both, the support is plain JAX over blocks of rows, not
    streamed.

    {plan} (the FFI path's)

    ``token_axis``: inside ``jax.shard_map``, the mesh axis over which the sequences are
    split (each device passes its own sequences and the whole head): the loss's
    normalizers and the metrics are summed over it (``_collectives.over_tokens``), so every device
    gets the one-device loss, its ``hidden`` gradient, and the head's gradient summed over
    the axis. A ``num_items_in_batch`` given is taken as already global, as TRL passes it.
    ``vocab_axis``: the mesh axis over which the head's vocabulary is split in equal
    contiguous blocks, in axis order (a tensor-parallel LM head); every device passes all
    the rows, the partial row statistics merge over the axis, and every device gets the
    loss, ``hidden``'s whole gradient and its own block's gradients. Both: a 2-D mesh.
    ``impl``, ``interpret``, ``weight_layout``: see :mod:`flashloss.jax`."""
    given = GrpoArgs.fields_of(locals())  # first: the call's GRPO arguments, by name
    hidden, weight, bias = A.head(hidden, weight, bias, weight_layout)
    packed = cu_seqlens is not None or position_ids is not None
    if packed:
        batch = _packed.Packed(cu_seqlens, position_ids, completion_ids, completion_mask, advantages)
        masks = (policy_mask, entropy_mask)
    else:
        ids, mask, adv, old, ref = A.grpo_batch(
            completion_ids, completion_mask, advantages, old_per_token_logps, ref_per_token_logps
        )
        b, t = ids.shape
        if hidden.size // hidden.shape[-1] != b * t:
            raise ValueError(
                f"argument `hidden`: has {hidden.size // hidden.shape[-1]} rows but completion_ids has B·T = {b * t}"
            )
        rho = _policy.sampler_ratio(importance_sampling_ratio, b, t)
        masks = (A.token_mask("policy_mask", policy_mask, (b, t)), A.token_mask("entropy_mask", entropy_mask, (b, t)))
    args = GrpoArgs(**given).validate()
    vocab = A.vocab_size(weight, weight_layout, vocab_axis)
    truncated = args.filters.truncates
    support = H.filters(args.filters, vocab) if truncated else None
    if H.active(support) is None:
        support = None
    else:
        args = args.with_filters(SamplerFilters(*support))
    budget = _budget(budget_mib)
    if token_axis is not None:
        A.axis_size("token_axis", token_axis)
        if args.entropy_coef and (NORMALIZERS[args.loss_type] == "sequences" or masks[1] is not None):
            raise ValueError(
                f"argument `token_axis`: an entropy bonus with loss_type {args.loss_type!r} or an entropy_mask has a "
                "normalizer of its own; not supported across devices yet"
            )
        weight = jax.lax.pcast(weight, token_axis, to="varying")
        bias = None if bias is None else jax.lax.pcast(bias, token_axis, to="varying")
    # linear_logprobs' plan and path, for the losses formed above it (packed, or with a mask)
    head = dict(
        mode=mode, budget_mib=budget, vocab_axis=vocab_axis, impl=impl, interpret=interpret, weight_layout=weight_layout
    )
    if packed:
        per_token = dict(
            old_per_token_logps=old_per_token_logps, ref_per_token_logps=ref_per_token_logps,
            importance_sampling_ratio=importance_sampling_ratio, policy_mask=policy_mask, entropy_mask=entropy_mask,
        )  # fmt: skip
        loss, aux, outside = _packed.linear_grpo(batch, hidden, weight, bias, per_token, args, head, token_axis)
        return _outputs(loss, aux, outside)
    by_stats = any(m is not None for m in masks)
    if vocab_axis is not None and not by_stats:  # (linear_logprobs casts its own)
        hidden = jax.lax.pcast(hidden, vocab_axis, to="varying")
    operands = (hidden, weight, bias, ids, mask, adv, old, ref, rho)
    if by_stats:
        loss, aux = _from_stats(*operands, args, masks, head)
    else:
        call = LinearGrpoCall(
            args=args, support=support, token_axis=token_axis, weight_layout=weight_layout, vocab_axis=vocab_axis,
            vocab=int(vocab), mode=mode, budget=budget, interpret=interpret, budget_given=budget_mib is not None,
        )  # fmt: skip
        loss, aux = dispatch("linear_grpo", impl, call, *operands)
    outside = mask & jnp.isneginf(aux[0]) if truncated else None
    if token_axis is not None:
        kept = mask if outside is None else mask & ~outside
        loss, metrics = over_tokens(loss, aux[3], kept, token_axis, args, _policy.clips_per_sequence(args, adv))
        aux = (*aux[:3], metrics)
    return _outputs(loss, aux, outside)


def _from_stats(hidden, weight, bias, ids, mask, adv, old, ref, rho, args: GrpoArgs, masks, head: dict):
    """``(loss, (logp, entropy, kl, metrics))`` with the loss in JAX (``_policy``) above
    :func:`linear_logprobs`' ``logp`` (under the support when one is set) and entropy, on
    either path: what TRL's ``policy_mask`` and ``entropy_mask`` take. The batch's values
    are checked by host callbacks."""
    b, t = ids.shape
    for name, values in (("advantages", adv), ("old_per_token_logps", old), ("ref_per_token_logps", ref)):
        _checks.finite(name, values, None if name == "advantages" else mask, True)
    _checks.sampler_ratio(rho, mask, True)
    f = args.filters
    out = linear_logprobs(
        hidden.reshape(b, t, hidden.shape[-1]),
        weight,
        ids,
        temperature=args.temperature,
        return_entropy=True,
        bias=bias,
        mask=mask,
        **asdict(f),
        **head,
    )
    kept = mask if out.outside_support is None else mask & ~out.outside_support
    loss, kl, metrics = _policy.grpo_policy_loss(
        jnp.where(kept, out.logp, 0.0), out.entropy, kept, adv, old, ref, args, rho, policy_mask=masks[0],
        entropy_mask=masks[1],
    )  # fmt: skip
    return loss, (out.logp, out.entropy, kl, metrics)


@with_params
def grpo_loss(
    logits: ArrayLike,
    completion_ids: ArrayLike,
    completion_mask: Optional[ArrayLike],
    advantages: ArrayLike,
    *,
    old_per_token_logps: Optional[ArrayLike] = None,
    ref_per_token_logps: Optional[ArrayLike] = None,
    importance_sampling_ratio: Optional[ArrayLike] = None,
    cu_seqlens: Optional[ArrayLike] = None,
    position_ids: Optional[ArrayLike] = None,
    loss_type: str = _TRL.loss_type,
    beta: float = _TRL.beta,
    epsilon_low: float = _TRL.epsilon_low,
    epsilon_high: Optional[float] = _TRL.epsilon_high,
    delta: Optional[float] = _TRL.delta,
    importance_sampling_level: str = _TRL.importance_sampling_level,
    temperature: float = _TRL.temperature,
    use_bias_correction_kl: bool = _TRL.use_bias_correction_kl,
    num_items_in_batch: Union[float, ArrayLike, None] = _TRL.num_items_in_batch,
    max_completion_length: Optional[int] = _TRL.max_completion_length,
    sapo_temperature_pos: float = _TRL.sapo_temperature_pos,
    sapo_temperature_neg: float = _TRL.sapo_temperature_neg,
    vespo_k_pos: float = _TRL.vespo_k_pos,
    vespo_lambda_pos: float = _TRL.vespo_lambda_pos,
    vespo_k_neg: float = _TRL.vespo_k_neg,
    vespo_lambda_neg: float = _TRL.vespo_lambda_neg,
    reduce: bool = True,
    impl: str = "auto",
    interpret: Any = False,
) -> tuple:
    """TRL's GRPO loss on materialized ``logits`` ``[B, T, V]`` (or Liger's ``[B, T+1, V]``,
    whose last position is not read; float32, bfloat16 or float16):
    the loss and ``dlogits`` in one pass (the place of the original Pallas kernel), the
    gradient in the logits' dtype with no float32 copy of bfloat16 logits. Returns
    ``(loss, GRPOOutputs)``, differentiable in ``logits``. ``impl``, ``interpret``: see
    :mod:`flashloss.jax`.

    {grpo_args}

    ``reduce=False`` returns Liger's ``(per_token_loss, per_token_kl, is_clipped)``
    ``[B, T]`` float32, 0 where masked (``per_token_kl`` None when ``beta == 0``):
    ``per_token_loss = ℓ·ρ + β·kl`` before the loss type's reduction, differentiable in
    ``logits`` (at sequence level through ``R_b``); its backward reads the logits again.

    {packed}
    Packed logits are ``[total_tokens, V]`` (or ``[1, total_tokens, V]``); each row's
    log-softmax is then formed in JAX (float32), and ``reduce=False`` is not taken."""
    args = GrpoArgs.of_bound(locals()).validate()  # first: the call's GRPO arguments, by name
    if cu_seqlens is not None or position_ids is not None:
        if not reduce:
            raise ValueError("argument `reduce`: False is not supported with a packed batch (cu_seqlens/position_ids)")
        batch = _packed.Packed(cu_seqlens, position_ids, completion_ids, completion_mask, advantages)
        per_token = dict(
            old_per_token_logps=old_per_token_logps, ref_per_token_logps=ref_per_token_logps,
            importance_sampling_ratio=importance_sampling_ratio, policy_mask=None, entropy_mask=None,
        )  # fmt: skip
        return _outputs(*_packed.logits_grpo(batch, logits, per_token, args))
    logits = A.floats("logits", logits)
    ids, mask, adv, old, ref = A.grpo_batch(
        completion_ids, completion_mask, advantages, old_per_token_logps, ref_per_token_logps
    )
    b, t = ids.shape
    if logits.ndim != 3 or logits.shape[0] != b or logits.shape[1] not in (t, t + 1):
        raise ValueError(
            f"argument `logits`: expected shape [B, T, V] (or Liger's [B, T+1, V]) with [B, T] = {[b, t]}, "
            f"got {list(logits.shape)}"
        )
    logits = logits[:, :t]  # Liger's [B, T+1, V]: the last position is not read
    rho = _policy.sampler_ratio(importance_sampling_ratio, *ids.shape)
    operands = (logits, ids, mask, adv, old, ref, rho)
    call = LogitsGrpoCall(args=args, interpret=interpret)
    if not reduce:
        rows, (kl, clipped) = dispatch("grpo_logits_rows", impl, call, *operands)
        return rows, (jax.lax.stop_gradient(kl) if args.beta != 0.0 else None), jax.lax.stop_gradient(clipped)
    return _outputs(*dispatch("grpo_logits", impl, call, *operands))
