"""PyTorch's entry to flashloss's fused kernels.

Each loss is a ``torch.library`` custom op (:mod:`flashloss._torch_ops`): it runs its
forward and backward in one fused call (the gradients are formed while each block of
logits is on hand) and autograd scales them by the upstream gradient, so nothing
``[N, V]``-sized is ever allocated, and ``torch.compile(fullgraph=True)`` and
``torch.export`` trace through the ops. Tensors are borrowed, not copied: ``hidden``
and ``weight`` must share a dtype (float32, bfloat16 or float16; a half dtype mixed
with float32 is cast to the half one, as autocast would), and non-contiguous inputs are made contiguous. Every
error is a ``ValueError`` naming the argument.

``vocab_parallel_group`` (a ``torch.distributed`` ``ProcessGroup``) splits the LM head
over ranks by rows (tensor parallel): each rank passes every row of ``hidden`` and its
own contiguous block of ``weight``/``bias``, in rank order (blocks may differ in size);
the row statistics merge over the group, every rank gets the whole loss and ``hidden``
gradient and its own block's gradients. A bad input on any rank is the same
``ValueError`` on every rank. A head given as ``DTensor``s says this itself: ``Shard(0)``
runs vocab-parallel over its 1-D mesh, ``Replicate()`` locally, other layouts are refused
(:mod:`flashloss._dtensor`).

Names and defaults are those of TRL's ``GRPOConfig`` and ``GRPOTrainer._compute_loss``
(see ``docs/torch.md`` for where each argument comes from and where flashloss differs).
"""

from __future__ import annotations

from typing import Optional

import torch

from . import _dist, _dtensor
from . import _torch_ops as ops
from . import _torch_packed as _packed
from ._config import DEFAULT_BUDGET_MIB
from ._spec import METRICS, CeArgs, GRPOOutputs, GrpoArgs, SamplerFilters, with_params
from ._torch_args import _FLOATS, _bool, _grpo_batch, _head, _head_grad, _items, _same_device
from ._torch_logprobs import LogprobOutputs, linear_logprobs
from ._torch_op_utils import _f32

__all__ = [
    "GRPOOutputs",
    "LogprobOutputs",
    "grpo_loss",
    "linear_cross_entropy",
    "linear_grpo_loss",
    "linear_logprobs",
]

#: TRL's defaults, the signatures' (``flashloss._spec.GrpoArgs``).
_TRL = GrpoArgs()


# The configs are JSON built from Python numbers: constants to torch.compile, which calls
# them while tracing instead of tracing into the checks and the JSON encoder.
@torch.compiler.assume_constant_result
def _grpo_json(**fields) -> str:
    return GrpoArgs(**fields).validate().config_json()


@torch.compiler.assume_constant_result
def _truncates(top_k, top_p, min_p) -> bool:
    return SamplerFilters.of(top_k, top_p, min_p).truncates


@torch.compiler.assume_constant_result
def _ce_json(**fields) -> str:
    return CeArgs(**fields).config_json()


@with_params
def linear_grpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: Optional[torch.Tensor],
    advantages: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    old_per_token_logps: Optional[torch.Tensor] = None,
    ref_per_token_logps: Optional[torch.Tensor] = None,
    importance_sampling_ratio: Optional[torch.Tensor] = None,
    policy_mask: Optional[torch.Tensor] = None,
    entropy_mask: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    position_ids: Optional[torch.Tensor] = None,
    loss_type: str = _TRL.loss_type,
    beta: float = _TRL.beta,
    epsilon_low: float = _TRL.epsilon_low,
    epsilon_high: Optional[float] = _TRL.epsilon_high,
    delta: Optional[float] = _TRL.delta,
    importance_sampling_level: str = _TRL.importance_sampling_level,
    temperature: float = _TRL.temperature,
    use_bias_correction_kl: bool = _TRL.use_bias_correction_kl,
    entropy_coef: float = _TRL.entropy_coef,
    num_items_in_batch=_TRL.num_items_in_batch,
    max_completion_length: Optional[int] = _TRL.max_completion_length,
    sapo_temperature_pos: float = _TRL.sapo_temperature_pos,
    sapo_temperature_neg: float = _TRL.sapo_temperature_neg,
    vespo_k_pos: float = _TRL.vespo_k_pos,
    vespo_lambda_pos: float = _TRL.vespo_lambda_pos,
    vespo_k_neg: float = _TRL.vespo_k_neg,
    vespo_lambda_neg: float = _TRL.vespo_lambda_neg,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    min_p: Optional[float] = None,
    mode: str = "auto",
    budget_mib: Optional[float] = None,
    vocab_parallel_group=None,
):
    """TRL's GRPO loss from ``hidden`` ``[B, T, H]`` (or ``[B·T, H]``) and the LM head
    ``weight`` ``[V, H]`` (+ ``bias`` ``[V]``) at ``completion_ids`` ``[B, T]``.

    Returns ``(loss, GRPOOutputs)``; ``loss.backward()`` gives the gradients of
    ``hidden``, ``weight`` and ``bias``. ``num_items_in_batch`` may be a 0-d tensor (TRL
    passes one; it is read inside the op).

    {grpo_args}

    {grpo_masks}

    {packed}

    {filters}
    Under them every term of the loss uses that log-prob, and a token whose target is
    outside the support is masked (loss, normalizers and metrics) and flagged in
    ``GRPOOutputs.outside_support`` (``None`` when no filter is set).

    {plan}
    """
    hidden, weight, bias, vocab_parallel_group = _dtensor.local_head(hidden, weight, bias, vocab_parallel_group)
    group = _dist.register(vocab_parallel_group)
    fields = dict(  # the loss's configuration but num_items_in_batch (read by _items under agreement)
        loss_type=loss_type, beta=beta, epsilon_low=epsilon_low, epsilon_high=epsilon_high, delta=delta,
        importance_sampling_level=importance_sampling_level, temperature=temperature,
        use_bias_correction_kl=use_bias_correction_kl, entropy_coef=entropy_coef,
        max_completion_length=max_completion_length, sapo_temperature_pos=sapo_temperature_pos,
        sapo_temperature_neg=sapo_temperature_neg, vespo_k_pos=vespo_k_pos, vespo_lambda_pos=vespo_lambda_pos,
        vespo_k_neg=vespo_k_neg, vespo_lambda_neg=vespo_lambda_neg, top_k=top_k, top_p=top_p, min_p=min_p,
    )  # fmt: skip
    if cu_seqlens is not None or position_ids is not None:
        items, items_tensor = _items(num_items_in_batch)
        fields["num_items_in_batch"] = items
        per_token = dict(
            old=old_per_token_logps, ref=ref_per_token_logps, ratio=importance_sampling_ratio,
            policy_mask=policy_mask, entropy_mask=entropy_mask,
        )  # fmt: skip

        def checked():  # on every rank of a group before any collective: all fail together
            packed = _packed.Packed(cu_seqlens, position_ids, completion_ids, completion_mask, advantages)
            return packed.check(dict(per_token, hidden=hidden)), GrpoArgs(**fields).validate()

        packed, args = _dist.agreed(group, checked)
        plan = dict(mode=mode, budget_mib=budget_mib, vocab_parallel_group=vocab_parallel_group)
        head = dict(hidden=hidden, weight=weight, bias=bias)
        return _packed.linear_grpo(packed, head, args, per_token, items_tensor, _grpo_json(**fields), plan)

    def prepare():
        device = _same_device(
            dict(
                hidden=hidden,
                weight=weight,
                bias=bias,
                completion_ids=completion_ids,
                completion_mask=completion_mask,
                advantages=advantages,
                old_per_token_logps=old_per_token_logps,
                ref_per_token_logps=ref_per_token_logps,
                importance_sampling_ratio=importance_sampling_ratio,
                policy_mask=policy_mask,
                entropy_mask=entropy_mask,
            )
        )
        h, w, b = _head(hidden, weight, bias)
        if b is not None and device.type == "cuda":
            b = b.float()  # the GPU kernels read the bias in f32
        items, items_tensor = _items(num_items_in_batch)
        config = _grpo_json(**fields, num_items_in_batch=items)
        return h, w, b, _grpo_batch(completion_ids, completion_mask, advantages), items_tensor, config

    h, w, b, (ids, mask, adv), items, config = _dist.agreed(group, prepare)
    budget = DEFAULT_BUDGET_MIB if budget_mib is None else float(budget_mib)
    loss, _, _, _, logp, entropy, kl, metrics = ops.grpo_linear(
        h, w, b, ids, mask, adv, _f32(old_per_token_logps), _f32(ref_per_token_logps),
        _f32(importance_sampling_ratio), _bool(policy_mask), _bool(entropy_mask), items, config, mode,
        budget, group, _head_grad(weight, bias),
    )  # fmt: skip
    named = {k: metrics[i] for i, k in enumerate(METRICS)}
    outside = torch.isneginf(logp) if _truncates(top_k, top_p, min_p) else None
    return loss, GRPOOutputs(logp=logp, entropy=entropy, kl=kl, metrics=named, outside_support=outside)


@with_params
def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: Optional[float] = None,
    reduction: str = "mean",
    temperature: float = 1.0,
    return_lse: bool = False,
    mode: str = "auto",
    budget_mib: Optional[float] = None,
    vocab_parallel_group=None,
):
    """Cross-entropy of ``hidden @ weight.T + bias`` at ``targets``, as Cut Cross-Entropy's
    ``linear_cross_entropy(e, c, targets, ...)`` and PyTorch's
    ``F.linear_cross_entropy(input, linear_weight, target, ...)`` compute it: ``hidden``
    ``[..., H]`` and ``targets`` ``[...]``; every option is keyword-only.

    {ce_args}

    {plan}"""
    hidden, weight, bias, vocab_parallel_group = _dtensor.local_head(hidden, weight, bias, vocab_parallel_group)
    group = _dist.register(vocab_parallel_group)

    def prepare():
        device = _same_device(dict(hidden=hidden, weight=weight, targets=targets, bias=bias))
        config = _ce_json(
            ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
            reduction=reduction, temperature=temperature,
        )  # fmt: skip
        if targets.dtype.is_floating_point or targets.dtype == torch.bool:
            raise ValueError(f"argument `targets`: expected an integer dtype, got {targets.dtype}")
        if hidden.shape[:-1] != targets.shape:
            rows = list(hidden.shape[:-1])
            raise ValueError(f"argument `targets`: shape {list(targets.shape)} does not match hidden's rows {rows}")
        h, w, b = _head(hidden, weight, bias)
        if b is not None and device.type == "cuda":
            b = b.float()  # the GPU kernels read the bias in f32
        return h.reshape(-1, h.shape[-1]), w, b, config

    h2, w, b, config = _dist.agreed(group, prepare)
    tgt = targets.reshape(-1).to(device="cpu", dtype=torch.int64).contiguous()
    budget = DEFAULT_BUDGET_MIB if budget_mib is None else float(budget_mib)
    if return_lse:
        args = (h2, w, b, tgt, config, mode, budget, group)
        if reduction == "none":
            rows, lse = ops.ce_linear_rows_lse(*args)
            return rows.reshape(targets.shape), lse.reshape(targets.shape)
        loss, lse = ops.ce_linear_lse(*args)[:2]
        return loss, lse.reshape(targets.shape)
    if reduction == "none":
        return ops.ce_linear_rows(h2, w, b, tgt, config, mode, budget, group).reshape(targets.shape)
    return ops.ce_linear(h2, w, b, tgt, config, mode, budget, group, _head_grad(weight, bias))[0]


@with_params
def grpo_loss(
    logits: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: Optional[torch.Tensor],
    advantages: torch.Tensor,
    *,
    old_per_token_logps: Optional[torch.Tensor] = None,
    ref_per_token_logps: Optional[torch.Tensor] = None,
    importance_sampling_ratio: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    position_ids: Optional[torch.Tensor] = None,
    loss_type: str = _TRL.loss_type,
    beta: float = _TRL.beta,
    epsilon_low: float = _TRL.epsilon_low,
    epsilon_high: Optional[float] = _TRL.epsilon_high,
    delta: Optional[float] = _TRL.delta,
    importance_sampling_level: str = _TRL.importance_sampling_level,
    temperature: float = _TRL.temperature,
    use_bias_correction_kl: bool = _TRL.use_bias_correction_kl,
    num_items_in_batch=_TRL.num_items_in_batch,
    max_completion_length: Optional[int] = _TRL.max_completion_length,
    sapo_temperature_pos: float = _TRL.sapo_temperature_pos,
    sapo_temperature_neg: float = _TRL.sapo_temperature_neg,
    vespo_k_pos: float = _TRL.vespo_k_pos,
    vespo_lambda_pos: float = _TRL.vespo_lambda_pos,
    vespo_k_neg: float = _TRL.vespo_k_neg,
    vespo_lambda_neg: float = _TRL.vespo_lambda_neg,
    reduce: bool = True,
):
    """TRL's GRPO loss on materialized ``logits`` ``[B, T, V]`` (or Liger's ``[B, T+1, V]``,
    whose last position is not read; float32, bfloat16 or float16): the loss and
    ``dlogits`` in one pass, the gradient in the logits' dtype. Returns
    ``(loss, GRPOOutputs)``, differentiable in ``logits`` (Liger's call shape, in place:
    :func:`flashloss.liger.triton_grpo_loss`).

    {grpo_args}

    ``reduce=False`` returns Liger's ``(per_token_loss, per_token_kl, is_clipped)``
    ``[B, T]`` float32, each 0 where masked (``per_token_kl`` None when ``beta == 0``):
    ``per_token_loss = ℓ·ρ + β·kl`` before the loss type's reduction, differentiable in
    ``logits`` (at sequence level through the shared ratio ``R_b``); its backward runs the
    logits again with the upstream gradient.

    {packed}
    Packed logits are ``[total_tokens, V]`` (or ``[1, total_tokens, V]``); each live row's
    log-softmax is then formed in PyTorch (float32), and ``reduce=False`` is not taken."""
    if cu_seqlens is not None or position_ids is not None:
        return _logits_packed(
            logits, completion_ids, completion_mask, advantages, old_per_token_logps, ref_per_token_logps,
            importance_sampling_ratio, cu_seqlens, position_ids, num_items_in_batch, reduce,
            dict(
                loss_type=loss_type, beta=beta, epsilon_low=epsilon_low, epsilon_high=epsilon_high, delta=delta,
                importance_sampling_level=importance_sampling_level, temperature=temperature,
                use_bias_correction_kl=use_bias_correction_kl, max_completion_length=max_completion_length,
                sapo_temperature_pos=sapo_temperature_pos, sapo_temperature_neg=sapo_temperature_neg,
                vespo_k_pos=vespo_k_pos, vespo_lambda_pos=vespo_lambda_pos, vespo_k_neg=vespo_k_neg,
                vespo_lambda_neg=vespo_lambda_neg,
            ),
        )  # fmt: skip
    ids, mask, adv, (old, ref, ratio), items, config = _grpo_logits_inputs(
        logits, completion_ids, completion_mask, advantages, old_per_token_logps, ref_per_token_logps,
        importance_sampling_ratio, num_items_in_batch,
        dict(
            loss_type=loss_type, beta=beta, epsilon_low=epsilon_low, epsilon_high=epsilon_high, delta=delta,
            importance_sampling_level=importance_sampling_level, temperature=temperature,
            use_bias_correction_kl=use_bias_correction_kl, max_completion_length=max_completion_length,
            sapo_temperature_pos=sapo_temperature_pos, sapo_temperature_neg=sapo_temperature_neg,
            vespo_k_pos=vespo_k_pos, vespo_lambda_pos=vespo_lambda_pos, vespo_k_neg=vespo_k_neg,
            vespo_lambda_neg=vespo_lambda_neg,
        ),
    )  # fmt: skip
    if not reduce:
        token_loss, kl, clipped = ops.grpo_logits_rows(logits, ids, mask, adv, old, ref, ratio, config)
        return token_loss, (kl if beta != 0.0 else None), clipped
    loss, _, logp, entropy, kl, metrics = ops.grpo_logits(logits, ids, mask, adv, old, ref, ratio, items, config)
    named = {k: metrics[i] for i, k in enumerate(METRICS)}
    return loss, GRPOOutputs(logp=logp, entropy=entropy, kl=kl, metrics=named)


def _logits_packed(logits, ids, mask, adv, old, ref, ratio, cu_seqlens, position_ids, num_items, reduce, fields):
    """``grpo_loss`` on a packed batch (:mod:`flashloss._torch_packed`)."""
    if not reduce:
        raise ValueError("argument `reduce`: False is not supported with a packed batch (cu_seqlens/position_ids)")
    packed = _packed.Packed(cu_seqlens, position_ids, ids, mask, adv)
    items, items_tensor = _items(num_items)
    config = _grpo_json(num_items_in_batch=items, **fields)
    args = GrpoArgs(num_items_in_batch=items, **fields)
    if logits.dtype not in _FLOATS:
        raise ValueError(f"argument `logits`: expected dtype float32, bfloat16 or float16, got {logits.dtype}")
    per_token = dict(old=old, ref=ref, ratio=ratio, policy_mask=None, entropy_mask=None)
    return _packed.logits_grpo(packed, logits, args, per_token, items_tensor, config)


def _grpo_logits_inputs(logits, completion_ids, completion_mask, advantages, old, ref, ratio, num_items, fields):
    """The logits-level call's checked inputs: ``(ids, mask, advantages, (old, ref, ratio),
    num_items tensor or None, config JSON)``; ``fields``: :class:`GrpoArgs`' fields."""
    _same_device(
        dict(
            logits=logits,
            old_per_token_logps=old,
            ref_per_token_logps=ref,
            completion_ids=completion_ids,
            advantages=advantages,
            completion_mask=completion_mask,
            importance_sampling_ratio=ratio,
        ),
        cuda=False,
    )
    if logits.dtype not in _FLOATS:
        raise ValueError(f"argument `logits`: expected dtype float32, bfloat16 or float16, got {logits.dtype}")
    ids, mask, adv = _grpo_batch(completion_ids, completion_mask, advantages)
    items, items_tensor = _items(num_items)
    config = _grpo_json(num_items_in_batch=items, **fields)
    return ids, mask, adv, (_f32(old), _f32(ref), _f32(ratio)), items_tensor, config
