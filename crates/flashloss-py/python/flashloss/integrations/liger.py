"""Liger-Kernel's GRPO conventions, for code written against Liger: the module
:class:`LigerFusedLinearGRPOLoss` and the logits-level :func:`triton_grpo_loss`, with
Liger's names, positional orders, defaults (``beta=0.04``, ``temperature=0.9`` for the
logits-level call, ``use_bias_correction_kl=False``) and returns (``(loss, metrics)`` with
``metrics`` a list ``[kl_mean, clip_ratio]``). They run :mod:`flashloss.torch`'s kernels;
:mod:`flashloss.torch` and :mod:`flashloss.jax` are TRL-shaped (``GRPOOutputs``)."""

from __future__ import annotations

from typing import Optional

import torch

from .. import _native
from .._spec.native import call_spec
from .._spec import GrpoArgs, LogprobRequest
from ..torch import _args as A
from ..torch import _ops as ops
from ..torch import linear_grpo_loss, linear_logprobs
from ..torch._grpo import _grpo_json, logits_inputs
from .._spec.names import in_caller_names, native

__all__ = ["LigerFusedLinearGRPOLoss", "triton_grpo_loss"]

#: TRL's defaults where Liger keeps them.
_TRL = GrpoArgs()
#: flashloss's argument names -> Liger's, in errors.
_MODULE_NAMES = {
    "hidden": "_input",
    "weight": "lin_weight",
    "completion_ids": "selected_token_ids",
    "completion_mask": "attention_mask",
    "importance_sampling_ratio": "vllm_is_ratio",
}
_LOGITS_NAMES = {
    "old_per_token_logps": "old_logp",
    "ref_per_token_logps": "ref_logp",
    "importance_sampling_ratio": "vllm_is_ratio",
    "epsilon_low": "eps_low",
    "epsilon_high": "eps_high",
}
#: Liger's own defaults.
LIGER_BETA = 0.04
LIGER_TEMPERATURE = 0.9
LIGER_EPS_HIGH = 0.4
LIGER_BIAS_CORRECTION_KL = False


class LigerFusedLinearGRPOLoss(torch.nn.Module):
    """Liger-Kernel's ``LigerFusedLinearGRPOLoss`` as a drop-in: the same name,
    constructor and ``forward`` arguments (and Liger's defaults), returning ``(loss, metrics)`` with ``metrics`` a
    list of scalar tensors ``[kl_mean (when beta != 0), clip_ratio]`` as Liger does.

    Liger-only knobs that do not change the result (``compiled``, ``chunk_size``) are
    accepted and ignored. As in Liger, the reference is ``ref_per_token_logps``, else the
    reference head ``ref_input @ ref_weight.T + ref_bias`` (log-probs without gradient),
    used only with ``use_ref_model``; ``ref_weight``/``ref_bias`` without ``ref_input``
    are ignored. With no reference the KL term is zero, and ``beta != 0`` still reports
    it (``kl_mean`` 0), as Liger does.
    """

    def __init__(
        self,
        beta: float = LIGER_BETA,
        compiled: bool = True,
        use_ref_model: bool = True,
        chunk_size: int = 1,
        epsilon_low: float = _TRL.epsilon_low,
        epsilon_high: float = _TRL.epsilon_low,
        loss_type: str = _TRL.loss_type,
        max_completion_length: Optional[int] = _TRL.max_completion_length,
        importance_sampling_level: str = _TRL.importance_sampling_level,
        sapo_temperature_pos: float = _TRL.sapo_temperature_pos,
        sapo_temperature_neg: float = _TRL.sapo_temperature_neg,
        temperature: float = _TRL.temperature,
        delta: Optional[float] = _TRL.delta,
        use_bias_correction_kl: bool = LIGER_BIAS_CORRECTION_KL,
        vespo_k_pos: float = _TRL.vespo_k_pos,
        vespo_lambda_pos: float = _TRL.vespo_lambda_pos,
        vespo_k_neg: float = _TRL.vespo_k_neg,
        vespo_lambda_neg: float = _TRL.vespo_lambda_neg,
        budget_mib: Optional[float] = None,
    ):
        fields = GrpoArgs.fields_of(locals())  # first: the loss's arguments, by name (beta: at each call)
        super().__init__()
        self.beta = fields.pop("beta")
        self.use_ref_model = use_ref_model
        self.fields = fields
        self.budget_mib = budget_mib

    def forward(
        self,
        _input,
        lin_weight,
        selected_token_ids,
        attention_mask,
        advantages,
        bias=None,
        ref_per_token_logps=None,
        old_per_token_logps=None,
        ref_input=None,
        ref_weight=None,
        ref_bias=None,
        vllm_is_ratio=None,
        num_items_in_batch=None,
    ):
        try:
            b, t = selected_token_ids.shape
            hidden = _input.reshape(b, t, -1) if _input.dim() == 2 else _input
            ref = ref_per_token_logps if self.use_ref_model else None
            if ref is None and self.use_ref_model and ref_input is not None:
                ref = self._reference(ref_input.reshape(b, t, -1), ref_weight, ref_bias, selected_token_ids)
            # No reference model: Liger's KL is that of the policy with itself, zero.
            beta = self.beta if self.use_ref_model else 0.0
            loss, out = linear_grpo_loss(
                hidden,
                lin_weight,
                selected_token_ids,
                attention_mask,
                advantages,
                bias=bias,
                old_per_token_logps=old_per_token_logps,
                ref_per_token_logps=ref,
                importance_sampling_ratio=vllm_is_ratio,
                num_items_in_batch=num_items_in_batch,
                budget_mib=self.budget_mib,
                **self.fields,
                beta=beta,
            )
        except (ValueError, TypeError) as e:
            in_caller_names(e, _MODULE_NAMES)
            raise
        clip = out.metrics["clip_ratio/region_mean"]
        metrics = [out.metrics["kl"], clip] if self.beta != 0.0 else [clip]
        return loss, metrics

    def _reference(self, ref_input, ref_weight, ref_bias, ids):
        """Liger's reference log-probs from a reference head (no gradient)."""
        if ref_weight is None:
            raise ValueError("argument `ref_weight`: required with ref_input (the reference model's LM head)")
        with torch.no_grad():
            request = LogprobRequest.of_bound(self.fields)
            return linear_logprobs(ref_input, ref_weight, ids, temperature=request.temperature, bias=ref_bias).logp


class _GrpoLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, dlogits, loss):
        ctx.dlogits = dlogits
        ctx.dtype = logits.dtype
        return loss.clone()

    @staticmethod
    def backward(ctx, grad_output):
        d = ctx.dlogits if float(grad_output) == 1.0 else ctx.dlogits * grad_output.to(ctx.dtype)
        ctx.dlogits = None
        return d, None, None


def triton_grpo_loss(
    logits: torch.Tensor,
    old_logp: Optional[torch.Tensor],
    ref_logp: Optional[torch.Tensor],
    completion_ids: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: Optional[torch.Tensor] = None,
    temperature: float = LIGER_TEMPERATURE,
    beta: float = LIGER_BETA,
    eps_low: float = _TRL.epsilon_low,
    eps_high: float = LIGER_EPS_HIGH,
    inplace: bool = True,
    loss_type: str = _TRL.loss_type,
    max_completion_length: Optional[int] = None,
    importance_sampling_level: str = _TRL.importance_sampling_level,
    reduce: bool = True,
    sapo_temperature_pos: float = _TRL.sapo_temperature_pos,
    sapo_temperature_neg: float = _TRL.sapo_temperature_neg,
    vllm_is_ratio: Optional[torch.Tensor] = None,
    delta: Optional[float] = None,
    use_bias_correction_kl: bool = LIGER_BIAS_CORRECTION_KL,
    num_items_in_batch=None,
    vespo_k_pos: float = _TRL.vespo_k_pos,
    vespo_lambda_pos: float = _TRL.vespo_lambda_pos,
    vespo_k_neg: float = _TRL.vespo_k_neg,
    vespo_lambda_neg: float = _TRL.vespo_lambda_neg,
):
    """Liger's ``triton_grpo_loss``: the logits-level GRPO loss in its call shape and defaults:
    ``logits`` ``[B, T+1, V]`` (the last position is not read) or ``[B, T, V]``. Returns
    ``(loss, metrics)`` with ``metrics = [kl_mean, clip_ratio]`` (``[clip_ratio]`` when
    ``beta == 0``). The gradient is formed in the forward; with ``inplace`` it overwrites
    ``logits`` (which must then not be used again), else a ``[B, T, V]`` buffer is
    allocated. Under ``torch.compile`` the call is never in place.

    ``reduce=False`` returns Liger's ``(per_token_loss, per_token_kl, is_clipped)``
    ``[B, T]`` float32, each 0 where masked (``per_token_kl`` None when ``beta == 0``):
    ``per_token_loss = ℓ·ρ + β·kl`` before the loss type's reduction, differentiable in
    ``logits`` (at sequence level through the shared ratio ``R_b``); its backward runs the
    logits again with the upstream gradient (never in place)."""
    try:
        fields = GrpoArgs.fields_of(locals(), epsilon_low=eps_low, epsilon_high=eps_high)  # first, by name
        count, count_tensor = A.items(fields["num_items_in_batch"])
        fields["num_items_in_batch"] = count
        logits, (ids, mask, adv, old, ref, ratio) = logits_inputs(
            logits, completion_ids, completion_mask, advantages, old_logp, ref_logp, vllm_is_ratio
        )
        config = _grpo_json(**fields)
        if not reduce:
            token_loss, kl, clipped = ops.grpo_logits_rows(logits, ids, mask, adv, old, ref, ratio, config)
            return token_loss, (kl if beta != 0.0 else None), clipped
        if inplace and logits.is_contiguous() and not torch.compiler.is_compiling():
            loss, metrics = _grpo_logits_in_place(logits, ids, mask, adv, old, ref, ratio, count_tensor, config)
        else:
            loss, _, _, _, _, metrics = ops.grpo_logits(logits, ids, mask, adv, old, ref, ratio, count_tensor, config)
    except (ValueError, TypeError) as e:
        in_caller_names(e, _LOGITS_NAMES)
        raise
    clip = metrics[4]
    return loss, ([metrics[0], clip] if beta != 0.0 else [clip])


def _grpo_logits_in_place(logits, ids, mask, adv, old, ref, ratio, items, config):
    """The logits-level call that writes ``∂L/∂logits`` over ``logits`` (eager only)."""
    t = ids.shape[1]
    z = logits.detach()
    logp, entropy, kl = (torch.empty(ids.shape, dtype=torch.float32) for _ in range(3))
    batch = (ids, mask, adv, old, ref, ratio, None, None)
    out = native(
        "grpo", _native.grpo_logits, z, batch, None, (logp, entropy, kl), call_spec(ops._with_items(config, items))
    )
    z[:, t:].zero_()
    loss = _GrpoLogits.apply(logits, z, torch.tensor(out["loss"], dtype=torch.float32))
    return loss, ops.metrics_tensor(out)
