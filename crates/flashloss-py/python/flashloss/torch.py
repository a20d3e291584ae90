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
``ValueError`` on every rank.

Names and defaults are those of TRL's ``GRPOConfig`` and ``GRPOTrainer._compute_loss``
(see ``docs/python.md`` for where each argument comes from and where flashloss differs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from . import _dist, _native
from . import _torch_ops as ops
from ._config import DEFAULT_BUDGET_MIB
from ._config import ce_config as _ce_config
from ._config import grpo_config as _grpo_config
from ._config import sampler_filters as _sampler_filters
from ._torch_args import _FLOATS, _bool, _check_tensor, _head, _head_grad, _same_device
from ._torch_logprobs import LogprobOutputs, linear_logprobs
from ._torch_op_utils import _f32

# The configs are JSON built from Python numbers: constants to torch.compile, which
# calls them while tracing instead of tracing into the JSON encoder.
grpo_config = torch.compiler.assume_constant_result(_grpo_config)
ce_config = torch.compiler.assume_constant_result(_ce_config)

__all__ = [
    "GRPOOutputs",
    "LinearGRPOLoss",
    "LogprobOutputs",
    "grpo_loss",
    "linear_cross_entropy",
    "linear_grpo_loss",
    "linear_logprobs",
]


@dataclass
class GRPOOutputs:
    """What a GRPO call returns besides the loss (all detached)."""

    #: Per-token log-probabilities of ``completion_ids`` ``[B, T]`` (float32).
    logp: torch.Tensor
    #: Per-token entropy ``[B, T]`` (float32).
    entropy: torch.Tensor
    #: Per-token KL as it enters the loss ``[B, T]`` (float32; zero without a reference
    #: or at ``beta=0``).
    kl: torch.Tensor
    #: TRL's logged metrics: ``kl``, ``entropy``, ``clip_ratio/low_mean``,
    #: ``clip_ratio/high_mean``, ``clip_ratio/region_mean`` (masked means, 0-d float64
    #: tensors: ``float()`` or ``.item()`` them to log).
    metrics: dict
    #: Under ``top_k``/``top_p``/``min_p``: whether each token's target is outside the
    #: sampler's truncated support ``[B, T]`` (bool; such tokens were masked); else ``None``.
    outside_support: Optional[torch.Tensor] = None


def _items(num_items_in_batch):
    """``num_items_in_batch`` as (config value, tensor input): a tensor (TRL passes one)
    is read inside the op, so that compiled code never reads it on the host."""
    if isinstance(num_items_in_batch, torch.Tensor):
        return None, num_items_in_batch.detach().reshape(())
    return num_items_in_batch, None


def _grpo_batch(completion_ids, completion_mask, advantages):
    _check_tensor("completion_ids", completion_ids)
    if completion_ids.dim() != 2:
        raise ValueError(f"argument `completion_ids`: expected shape [B, T], got {list(completion_ids.shape)}")
    if completion_ids.dtype.is_floating_point or completion_ids.dtype == torch.bool:
        raise ValueError(f"argument `completion_ids`: expected an integer dtype, got {completion_ids.dtype}")
    ids = completion_ids.to(device="cpu", dtype=torch.int64).contiguous()
    if completion_mask is None:
        mask = torch.ones_like(ids, dtype=torch.bool)
    else:
        _check_tensor("completion_mask", completion_mask)
        mask = (completion_mask != 0).cpu().contiguous()
    _check_tensor("advantages", advantages)
    if advantages.dim() == 2 and advantages.shape[1] == 1:
        advantages = advantages[:, 0]  # TRL's unsqueezed [B, 1]
    return ids, mask, _f32(advantages)


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
    loss_type: str = "dapo",
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: Optional[float] = None,
    delta: Optional[float] = None,
    importance_sampling_level: str = "token",
    temperature: float = 1.0,
    use_bias_correction_kl: bool = True,
    entropy_coef: float = 0.0,
    num_items_in_batch=None,
    max_completion_length: Optional[int] = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
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
    ``hidden``, ``weight`` and ``bias``. ``epsilon_high=None`` means ``epsilon_low`` (TRL's
    ``epsilon``); ``old_per_token_logps=None`` means on-policy (ratio 1).
    ``policy_mask`` (TRL's off-policy mask) and ``entropy_mask`` (its top-entropy mask)
    ``[B, T]`` multiply each token's policy loss (not the KL); the entropy bonus is the
    mean over ``completion_mask * entropy_mask``.

    ``top_k``, ``top_p``, ``min_p`` (the sampler's, vLLM V1's order; ``None``, ``top_k=0``,
    ``top_p=1``, ``min_p=0`` unset): every term uses the log-prob under the sampler's
    truncated support, and a token whose target is outside it is masked (loss, normalizers
    and metrics) and flagged in ``GRPOOutputs.outside_support`` (its ``logp`` is ``-inf``).
    The entropy stays the full softmax's.
    """
    group = _dist.register(vocab_parallel_group)

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
        config = grpo_config(
            loss_type, beta, epsilon_low, epsilon_high, delta, importance_sampling_level, temperature,
            use_bias_correction_kl, entropy_coef, items, max_completion_length,
            sapo_temperature_pos, sapo_temperature_neg, vespo_k_pos, vespo_lambda_pos, vespo_k_neg,
            vespo_lambda_neg, top_k=top_k, top_p=top_p, min_p=min_p,
        )  # fmt: skip
        return h, w, b, _grpo_batch(completion_ids, completion_mask, advantages), items_tensor, config

    h, w, b, (ids, mask, adv), items, config = _dist.agreed(group, prepare)
    budget = DEFAULT_BUDGET_MIB if budget_mib is None else float(budget_mib)
    loss, _, _, _, logp, entropy, kl, metrics = ops.grpo_linear(
        h, w, b, ids, mask, adv, _f32(old_per_token_logps), _f32(ref_per_token_logps),
        _f32(importance_sampling_ratio), _bool(policy_mask), _bool(entropy_mask), items, config, mode,
        budget, group, _head_grad(weight, bias),
    )  # fmt: skip
    named = {k: metrics[i] for i, k in enumerate(ops.METRICS)}
    truncated = any(x is not None for x in _sampler_filters(top_k, top_p, min_p))
    outside = torch.isneginf(logp) if truncated else None
    return loss, GRPOOutputs(logp=logp, entropy=entropy, kl=kl, metrics=named, outside_support=outside)


class LinearGRPOLoss(torch.nn.Module):
    """A drop-in for Liger-Kernel's ``LigerFusedLinearGRPOLoss``: the same constructor
    and ``forward`` arguments, returning ``(loss, metrics)`` with ``metrics`` a list of
    scalar tensors ``[kl_mean (when beta != 0), clip_ratio]`` as Liger does.

    Liger-only knobs that do not change the result (``compiled``, ``chunk_size``) are
    accepted and ignored. As in Liger, the reference is ``ref_per_token_logps``, else the
    reference head ``ref_input @ ref_weight.T + ref_bias`` (log-probs without gradient),
    used only with ``use_ref_model``; ``ref_weight``/``ref_bias`` without ``ref_input``
    are ignored. With no reference the KL term is zero, and ``beta != 0`` still reports
    it (``kl_mean`` 0), as Liger does.
    """

    def __init__(
        self,
        beta: float = 0.04,
        compiled: bool = True,
        use_ref_model: bool = True,
        chunk_size: int = 1,
        epsilon_low: float = 0.2,
        epsilon_high: float = 0.2,
        loss_type: str = "dapo",
        max_completion_length: Optional[int] = None,
        importance_sampling_level: str = "token",
        sapo_temperature_pos: float = 1.0,
        sapo_temperature_neg: float = 1.05,
        temperature: float = 1.0,
        delta: Optional[float] = None,
        use_bias_correction_kl: bool = False,
        vespo_k_pos: float = 2.0,
        vespo_lambda_pos: float = 3.0,
        vespo_k_neg: float = 3.0,
        vespo_lambda_neg: float = 2.0,
        budget_mib: Optional[float] = None,
    ):
        super().__init__()
        self.beta = beta
        self.use_ref_model = use_ref_model
        self.kwargs = dict(
            epsilon_low=epsilon_low,
            epsilon_high=epsilon_high,
            loss_type=loss_type,
            max_completion_length=max_completion_length,
            importance_sampling_level=importance_sampling_level,
            sapo_temperature_pos=sapo_temperature_pos,
            sapo_temperature_neg=sapo_temperature_neg,
            temperature=temperature,
            delta=delta,
            use_bias_correction_kl=use_bias_correction_kl,
            vespo_k_pos=vespo_k_pos,
            vespo_lambda_pos=vespo_lambda_pos,
            vespo_k_neg=vespo_k_neg,
            vespo_lambda_neg=vespo_lambda_neg,
            budget_mib=budget_mib,
        )

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
            beta=beta,
            num_items_in_batch=num_items_in_batch,
            **self.kwargs,
        )
        clip = out.metrics["clip_ratio/region_mean"]
        metrics = [out.metrics["kl"], clip] if self.beta != 0.0 else [clip]
        return loss, metrics

    def _reference(self, ref_input, ref_weight, ref_bias, ids):
        """Liger's reference log-probs from a reference head (no gradient)."""
        if ref_weight is None:
            raise ValueError("argument `ref_weight`: required with ref_input (the reference model's LM head)")
        with torch.no_grad():
            temperature = self.kwargs["temperature"]
            return linear_logprobs(ref_input, ref_weight, ids, temperature, bias=ref_bias)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: Optional[float] = None,
    reduction: str = "mean",
    temperature: float = 1.0,
    *,
    return_lse: bool = False,
    mode: str = "auto",
    budget_mib: Optional[float] = None,
    vocab_parallel_group=None,
):
    """Cross-entropy of ``hidden @ weight.T + bias`` at ``targets``, as Cut Cross-Entropy's
    ``linear_cross_entropy(e, c, targets, ...)`` and PyTorch's
    ``F.linear_cross_entropy(input, linear_weight, target, ...)`` compute it (with the
    options of ``docs/spec/losses.md``: label smoothing, z-loss, soft-cap, temperature).
    ``hidden`` ``[..., H]`` and ``targets`` ``[...]``; reduction ``none`` returns ``[...]``.
    ``return_lse`` returns ``(loss, lse)`` as Cut Cross-Entropy does: ``lse`` ``[...]``
    float32, each row's log-sum-exp of the logits as the loss sees them (soft-capped,
    divided by the temperature), 0 where ``targets`` is ``ignore_index``, differentiable
    (e.g. for a z-loss of the caller's own)."""
    group = _dist.register(vocab_parallel_group)

    def prepare():
        device = _same_device(dict(hidden=hidden, weight=weight, targets=targets, bias=bias))
        config = ce_config(ignore_index, label_smoothing, z_loss, softcap, reduction, temperature)
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


def grpo_loss(
    logits: torch.Tensor,
    old_logp: Optional[torch.Tensor],
    ref_logp: Optional[torch.Tensor],
    completion_ids: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: Optional[torch.Tensor] = None,
    temperature: float = 0.9,
    beta: float = 0.04,
    eps_low: float = 0.2,
    eps_high: float = 0.4,
    inplace: bool = True,
    loss_type: str = "dapo",
    max_completion_length: Optional[int] = None,
    importance_sampling_level: str = "token",
    reduce: bool = True,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    vllm_is_ratio: Optional[torch.Tensor] = None,
    delta: Optional[float] = None,
    use_bias_correction_kl: bool = False,
    num_items_in_batch=None,
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
):
    """The logits-level GRPO loss in the call shape of Liger's ``triton_grpo_loss``:
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
    _same_device(
        dict(
            logits=logits,
            old_logp=old_logp,
            ref_logp=ref_logp,
            completion_ids=completion_ids,
            advantages=advantages,
            completion_mask=completion_mask,
            vllm_is_ratio=vllm_is_ratio,
        ),
        cuda=False,
    )
    if logits.dtype not in _FLOATS:
        raise ValueError(f"argument `logits`: expected dtype float32, bfloat16 or float16, got {logits.dtype}")
    ids, mask, adv = _grpo_batch(completion_ids, completion_mask, advantages)
    items, items_tensor = _items(num_items_in_batch)
    config = grpo_config(
        loss_type, beta, eps_low, eps_high, delta, importance_sampling_level, temperature,
        use_bias_correction_kl, 0.0, items, max_completion_length,
        sapo_temperature_pos, sapo_temperature_neg, vespo_k_pos, vespo_lambda_pos, vespo_k_neg,
        vespo_lambda_neg,
    )  # fmt: skip
    old, ref, ratio = _f32(old_logp), _f32(ref_logp), _f32(vllm_is_ratio)
    if not reduce:
        token_loss, kl, clipped = ops.grpo_logits_rows(logits, ids, mask, adv, old, ref, ratio, config)
        return token_loss, (kl if beta != 0.0 else None), clipped
    if inplace and logits.is_contiguous() and not torch.compiler.is_compiling():
        loss, metrics = _grpo_logits_in_place(logits, ids, mask, adv, old, ref, ratio, items_tensor, config)
    else:
        loss, _, _, _, _, metrics = ops.grpo_logits(logits, ids, mask, adv, old, ref, ratio, items_tensor, config)
    clip = metrics[4]
    return loss, ([metrics[0], clip] if beta != 0.0 else [clip])


def _grpo_logits_in_place(logits, ids, mask, adv, old, ref, ratio, items, config):
    """The logits-level call that writes ``∂L/∂logits`` over ``logits`` (eager only)."""
    t = ids.shape[1]
    z = logits.detach()
    logp, entropy, kl = (torch.empty(ids.shape, dtype=torch.float32) for _ in range(3))
    out = _native.grpo_logits(
        z, ids, mask, adv, old, ref, ratio, ops._with_items(config, items), None, logp, entropy, kl
    )
    z[:, t:].zero_()
    loss = _GrpoLogits.apply(logits, z, torch.tensor(out["loss"], dtype=torch.float32))
    return loss, ops.metrics_tensor(out)
