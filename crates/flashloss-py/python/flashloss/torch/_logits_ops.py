"""GRPO on materialized logits as ``torch.library`` custom ops (re-exported by
:mod:`flashloss.torch._ops`): ``grpo_logits`` returns ``∂loss/∂logits`` (zero at
positions it does not read) with the loss, and the per-token losses (``reduce=False``)
run the logits again in their backward with the upstream gradient."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import _native
from .._spec.names import native
from .._spec.native import call_spec
from ._op_utils import METRICS, METRICS_DTYPE, _f32, _only_the_loss_differentiable, _scale, _with_items, metrics_tensor

# --- GRPO on materialized logits -------------------------------------------------------


@torch.library.custom_op("flashloss::grpo_logits", mutates_args=())
def grpo_logits(
    logits: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    advantages: Tensor,
    old_per_token_logps: Optional[Tensor],
    ref_per_token_logps: Optional[Tensor],
    importance_sampling_ratio: Optional[Tensor],
    num_items: Optional[Tensor],
    config: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(loss, dlogits, logp, entropy, kl, metrics)``; ``dlogits`` has ``logits``' shape
    and dtype (zero at positions ``t ≥ T``)."""
    b, t = completion_ids.shape
    dlogits = torch.empty((b, t, logits.shape[-1]), dtype=logits.dtype)
    logp, entropy, kl = (torch.empty((b, t), dtype=torch.float32) for _ in range(3))
    batch = (
        completion_ids,
        completion_mask,
        advantages,
        old_per_token_logps,
        ref_per_token_logps,
        importance_sampling_ratio,
        None,
        None,
    )
    out = native("grpo", _native.grpo_logits, 
        logits.contiguous(), batch, dlogits, (logp, entropy, kl), call_spec(_with_items(config, num_items)),
    )  # fmt: skip
    if logits.shape[1] != t:
        dlogits = torch.nn.functional.pad(dlogits, (0, 0, 0, logits.shape[1] - t))
    loss = torch.tensor(out["loss"], dtype=torch.float32)
    metrics = metrics_tensor(out)
    return loss, dlogits, logp, entropy, kl, metrics


@grpo_logits.register_fake
def _(logits, completion_ids, *args):
    f32 = dict(dtype=torch.float32)
    per_token = tuple(logits.new_empty(completion_ids.shape, **f32) for _ in range(3))
    metrics = logits.new_empty((len(METRICS),), dtype=METRICS_DTYPE)
    return (logits.new_empty((), **f32), logits.new_empty(logits.shape), *per_token, metrics)


def _grpo_logits_setup(ctx, inputs, output):
    ctx.save_for_backward(output[1])
    _only_the_loss_differentiable(ctx, output)


def _grpo_logits_backward(ctx, grad, *_):
    (dlogits,) = ctx.saved_tensors
    return (*_scale(grad, (dlogits,), (dlogits.dtype,)), *([None] * 8))


grpo_logits.register_autograd(_grpo_logits_backward, setup_context=_grpo_logits_setup)


# --- Per-token GRPO losses on materialized logits (reduce=False) ------------------------


def _per_token_call(logits, ids, mask, adv, old, ref, ratio, config, grad_rows, dlogits):
    """The native per-token call: ``(token_loss, kl, clipped)`` ``[B, T]`` f32."""
    outs = [torch.empty(ids.shape, dtype=torch.float32) for _ in range(5)]
    batch = (ids, mask, adv, old, ref, ratio, None, None)
    native(
        "grpo",
        _native.grpo_logits_per_token,
        logits.contiguous(),
        batch,
        grad_rows,
        dlogits,
        tuple(outs),
        call_spec(config),
    )
    token_loss, _, _, kl, clipped = outs
    return token_loss, kl, clipped


@torch.library.custom_op("flashloss::grpo_logits_rows", mutates_args=())
def grpo_logits_rows(
    logits: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    advantages: Tensor,
    old_per_token_logps: Optional[Tensor],
    ref_per_token_logps: Optional[Tensor],
    importance_sampling_ratio: Optional[Tensor],
    config: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """Each token's loss ``ℓ_tot = ℓ·ρ + β·kl`` unreduced, its KL and its clip flag (0/1),
    ``[B, T]`` f32, 0 where masked (Liger's ``reduce=False``)."""
    return _per_token_call(
        logits, completion_ids, completion_mask, advantages, old_per_token_logps, ref_per_token_logps,
        importance_sampling_ratio, config, None, None,
    )  # fmt: skip


@grpo_logits_rows.register_fake
def _(logits, completion_ids, *args):
    return tuple(logits.new_empty(completion_ids.shape, dtype=torch.float32) for _ in range(3))


@torch.library.custom_op("flashloss::grpo_logits_rows_backward", mutates_args=())
def grpo_logits_rows_backward(
    logits: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    advantages: Tensor,
    old_per_token_logps: Optional[Tensor],
    ref_per_token_logps: Optional[Tensor],
    importance_sampling_ratio: Optional[Tensor],
    config: str,
    grad_rows: Tensor,
) -> Tensor:
    """``∂(Σ_i grad_rows_i·ℓ_tot,i)/∂logits`` in ``logits``' shape and dtype (zero at
    positions ``t ≥ T``)."""
    b, t = completion_ids.shape
    dlogits = torch.empty((b, t, logits.shape[-1]), dtype=logits.dtype)
    _per_token_call(
        logits, completion_ids, completion_mask, advantages, old_per_token_logps, ref_per_token_logps,
        importance_sampling_ratio, config, _f32(grad_rows), dlogits,
    )  # fmt: skip
    if logits.shape[1] != t:
        dlogits = torch.nn.functional.pad(dlogits, (0, 0, 0, logits.shape[1] - t))
    return dlogits


@grpo_logits_rows_backward.register_fake
def _(logits, *args):
    return logits.new_empty(logits.shape)


def _grpo_rows_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:7])
    ctx.config = inputs[7]
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)


def _grpo_rows_backward(ctx, grad_rows, *_):
    if grad_rows is None:
        return (None,) * 8
    dlogits = grpo_logits_rows_backward(*ctx.saved_tensors, ctx.config, grad_rows)
    return (dlogits, *([None] * 7))


grpo_logits_rows.register_autograd(_grpo_rows_backward, setup_context=_grpo_rows_setup)
