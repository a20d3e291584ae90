"""``flashloss.torch``'s GRPO losses: :func:`linear_grpo_loss` from the hidden states and
the LM head, and :func:`grpo_loss` on materialized logits (as ``flashloss.jax._grpo``)."""

from __future__ import annotations

from typing import Any, Optional, Union

import torch

from .._config import budget_or_unset as _budget
from .._spec import METRICS, GRPOOutputs, GrpoArgs, SamplerFilters, with_params
from . import _dist, _dtensor
from . import _ops as ops
from . import _packed
from . import _args as A
from ._op_utils import _f32

#: TRL's defaults, the signatures' (``flashloss._spec.GrpoArgs``).
_TRL = GrpoArgs()


# The configs are JSON built from Python numbers: constants to torch.compile, which calls
# them while tracing instead of tracing into the checks and the JSON encoder.
@torch.compiler.assume_constant_result
def _grpo_json(**fields) -> str:
    return GrpoArgs(**fields).validate().config_json()


@torch.compiler.assume_constant_result
def _truncates(**filters) -> bool:
    return SamplerFilters.of(**filters).truncates


def _outputs(loss, logp, entropy, kl, metrics, outside=None):
    named = {k: metrics[i] for i, k in enumerate(METRICS)}
    return loss, GRPOOutputs(logp=logp, entropy=entropy, kl=kl, metrics=named, outside_support=outside)


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
    num_items_in_batch: Union[float, torch.Tensor, None] = _TRL.num_items_in_batch,
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
    vocab_parallel_group: Optional[Any] = None,
) -> tuple[torch.Tensor, GRPOOutputs]:
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
    fields = GrpoArgs.fields_of(locals())  # first: the call's GRPO arguments, by name
    hidden, weight, bias, vocab_parallel_group = _dtensor.local_head(hidden, weight, bias, vocab_parallel_group)
    group = _dist.register(vocab_parallel_group)
    count, count_tensor = A.items(fields["num_items_in_batch"])  # a tensor is read inside the op
    fields["num_items_in_batch"] = count
    if cu_seqlens is not None or position_ids is not None:
        per_token = dict(
            old=old_per_token_logps, ref=ref_per_token_logps, ratio=importance_sampling_ratio,
            policy_mask=policy_mask, entropy_mask=entropy_mask,
        )  # fmt: skip

        def checked(per_token=per_token, fields=fields):  # on every rank before any collective: all fail together
            packed = _packed.Packed(cu_seqlens, position_ids, completion_ids, completion_mask, advantages)
            return packed.check(dict(per_token, hidden=hidden)), GrpoArgs(**fields).validate()

        packed, args = _dist.agreed(group, checked)
        plan = dict(mode=mode, budget_mib=budget_mib, vocab_parallel_group=vocab_parallel_group)
        head_ = dict(hidden=hidden, weight=weight, bias=bias)
        return _packed.linear_grpo(packed, head_, args, per_token, count_tensor, _grpo_json(**fields), plan)

    def prepare(fields=fields):
        device = A.same_device(
            dict(
                hidden=hidden, weight=weight, bias=bias, completion_ids=completion_ids,
                completion_mask=completion_mask, advantages=advantages, old_per_token_logps=old_per_token_logps,
                ref_per_token_logps=ref_per_token_logps, importance_sampling_ratio=importance_sampling_ratio,
                policy_mask=policy_mask, entropy_mask=entropy_mask,
            )
        )  # fmt: skip
        h, w, b = A.head(hidden, weight, bias)
        if b is not None and device.type == "cuda":
            b = b.float()  # the GPU kernels read the bias in f32
        return h, w, b, A.grpo_batch(completion_ids, completion_mask, advantages), _grpo_json(**fields)

    h, w, b, (ids, mask, adv), config = _dist.agreed(group, prepare)
    loss, _, _, _, logp, entropy, kl, metrics = ops.grpo_linear(
        h, w, b, ids, mask, adv, _f32(old_per_token_logps), _f32(ref_per_token_logps),
        _f32(importance_sampling_ratio), A.mask_bool(policy_mask), A.mask_bool(entropy_mask), count_tensor, config,
        mode, _budget(budget_mib), group, A.head_grad(weight, bias),
    )  # fmt: skip
    outside = mask.to(logp.device) & torch.isneginf(logp) if _truncates(**SamplerFilters.fields_of(fields)) else None
    return _outputs(loss, logp, entropy, kl, metrics, outside)


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
    num_items_in_batch: Union[float, torch.Tensor, None] = _TRL.num_items_in_batch,
    max_completion_length: Optional[int] = _TRL.max_completion_length,
    sapo_temperature_pos: float = _TRL.sapo_temperature_pos,
    sapo_temperature_neg: float = _TRL.sapo_temperature_neg,
    vespo_k_pos: float = _TRL.vespo_k_pos,
    vespo_lambda_pos: float = _TRL.vespo_lambda_pos,
    vespo_k_neg: float = _TRL.vespo_k_neg,
    vespo_lambda_neg: float = _TRL.vespo_lambda_neg,
    reduce: bool = True,
) -> tuple:
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
    fields = GrpoArgs.fields_of(locals())  # first: the call's GRPO arguments, by name
    count, count_tensor = A.items(fields["num_items_in_batch"])
    fields["num_items_in_batch"] = count
    if cu_seqlens is not None or position_ids is not None:
        if not reduce:
            raise ValueError("argument `reduce`: False is not supported with a packed batch (cu_seqlens/position_ids)")
        packed = _packed.Packed(cu_seqlens, position_ids, completion_ids, completion_mask, advantages)
        config = _grpo_json(**fields)
        logits = _floats("logits", logits)
        per_token = dict(
            old=old_per_token_logps, ref=ref_per_token_logps, ratio=importance_sampling_ratio, policy_mask=None,
            entropy_mask=None,
        )  # fmt: skip
        return _packed.logits_grpo(packed, logits, GrpoArgs(**fields), per_token, count_tensor, config)
    logits, batch = logits_inputs(
        logits, completion_ids, completion_mask, advantages, old_per_token_logps, ref_per_token_logps,
        importance_sampling_ratio,
    )  # fmt: skip
    config = _grpo_json(**fields)
    if not reduce:
        token_loss, kl, clipped = ops.grpo_logits_rows(logits, *batch, config)
        return token_loss, (kl if fields["beta"] != 0.0 else None), clipped
    loss, _, logp, entropy, kl, metrics = ops.grpo_logits(logits, *batch, count_tensor, config)
    return _outputs(loss, logp, entropy, kl, metrics)


def _floats(arg: str, x: torch.Tensor) -> torch.Tensor:
    if x.dtype not in A.FLOATS:
        raise ValueError(f"argument `{arg}`: expected dtype float32, bfloat16 or float16, got {x.dtype}")
    return x


def logits_inputs(logits, completion_ids, completion_mask, advantages, old, ref, ratio):
    """The logits-level call's checked inputs: ``(logits, (ids, mask, advantages, old, ref,
    ratio))``, Liger's ``[B, T+1, V]`` logits kept as they are (the kernels read ``[:, :T]``)."""
    A.same_device(
        dict(
            logits=logits, old_per_token_logps=old, ref_per_token_logps=ref, completion_ids=completion_ids,
            advantages=advantages, completion_mask=completion_mask, importance_sampling_ratio=ratio,
        ),
        cuda=False,
    )  # fmt: skip
    logits = _floats("logits", logits)
    ids, mask, adv = A.grpo_batch(completion_ids, completion_mask, advantages)
    return logits, (ids, mask, adv, _f32(old), _f32(ref), _f32(ratio))
