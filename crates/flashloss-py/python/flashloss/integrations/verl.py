"""verl's fused per-token log-probs and entropy (``actor_rollout_ref.model.use_fused_kernels=True``)
computed by :func:`flashloss.torch.linear_logprobs` from the hidden states and the LM head,
so the ``[tokens, V]`` logits are never formed, not even one chunk of them::

    import flashloss.verl
    flashloss.verl.patch()       # in every process that builds the model, before training
    ...                          # verl as usual, with use_fused_kernels=True
    flashloss.verl.unpatch()     # verl exactly as it was

In verl's worker processes: ``actor_rollout_ref.model.external_lib=flashloss.verl_autopatch``
or ``VERL_USE_EXTERNAL_MODULES=flashloss.verl_autopatch`` (importing it patches).

What is replaced (and restored by :func:`unpatch`, by identity), in verl >= 0.8:

- ``verl.utils.experimental.torch_functional.FusedLinearForPPO.forward``: the torch backend
  (``fused_kernel_options.impl_backend: torch``, and its ``liger`` variant), which every
  HF forward patch of verl (``verl.models.transformers.dense_common``, ``qwen2_vl``,
  ``qwen3_vl``, ``qwen3_5``, ``glm4v``) instantiates and calls;
- ``FusedLinearForPPOTopK.forward`` in the same module, where a verl has it (0.9.1 does
  not; its contract: ``forward(hidden_states, vocab_weights, input_ids, gather_ids,
  temperature)`` gives the token log-probs, the entropy and the log-probs at ``gather_ids``
  ``[..., K]``, the teacher's top-k ids of on-policy distillation, all in the hidden
  states' dtype). Its ``extract_topk`` (the teacher's top-k selection, no gradient) stays
  verl's: flashloss has no top-k selection. Another class with this ``forward`` contract
  can take :func:`fused_linear_for_ppo_topk_forward` as its ``forward``;
- ``verl.utils.kernel.linear_cross_entropy.linear_cross_entropy``: the Triton backend, which
  the HF forward patches import when called, and which Megatron's fused forward
  (``verl.models.mcore.model_forward_fused``, ``model_forward_1f1b_overlap``) imports when
  loaded: already loaded modules get the replacement too, later ones import it.

Both keep verl's arguments and results: ``FusedLinearForPPO`` returns ``(log_probs,
entropy)`` of ``input_ids``' shape, ``log_probs`` float32 and ``entropy`` in the hidden
states' dtype (verl <= 0.7: both in that dtype); ``linear_cross_entropy`` returns float32
``[N]`` per token (``reduction`` ``"sum"``/``"mean"``: ``log_probs`` the 0-d sum/mean). The
Triton backend's ``dist_process_group`` (Megatron's tensor-parallel group: each rank holds
a contiguous block of the vocabulary, rows in rank order) becomes flashloss's
``vocab_parallel_group``; verl's contract there is that the caller sums the hidden gradient
over the group, so each rank's hidden gradient is the whole one divided by the group size.

flashloss computes the logits in f32 (bf16 operands, f32 accumulation), where verl's torch
backend rounds ``hidden @ W.T`` to bf16 first: on a bf16 model the two differ by that
rounding, and flashloss's values are the closer to the exact ones. Log-probs are never
positive and a vocabulary of any size works (verl#2656, verl#2899 were the Triton kernel's).

CUDA tensors run on flashloss's CUDA backend (a build with the ``cuda`` feature; the
token ids are copied to the host, the outputs come back on the GPU): compiled, not yet
run on a GPU.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import torch

from ..torch import linear_logprobs
from .._spec.names import in_caller_names

__all__ = ["is_patched", "linear_cross_entropy", "patch", "unpatch"]

_TORCH_BACKEND = "verl.utils.experimental.torch_functional"
_TRITON_BACKEND = "verl.utils.kernel.linear_cross_entropy"
#: Modules that bind ``linear_cross_entropy`` when they are loaded (Megatron's fused forward).
_TRITON_IMPORTERS = ("verl.models.mcore.model_forward_fused", "verl.models.mcore.model_forward_1f1b_overlap")
_REDUCTIONS = ("none", "sum", "mean")
#: flashloss's argument names -> those of verl's fused forwards and of its linear_cross_entropy, in errors.
_PPO_NAMES = {"hidden": "hidden_states", "weight": "vocab_weights", "ids": "input_ids"}
_CE_NAMES = {"ids": "labels"}

_state: dict[str, Any] = {}  # what patch() replaced: name -> original
_options: dict[str, Any] = {"budget_mib": None}


def _temperature(temperature: Any) -> float:
    """verl's scalar temperature (a float, or a one-element tensor) as a float."""
    if isinstance(temperature, torch.Tensor):
        if temperature.numel() != 1:
            raise ValueError(
                f"argument `temperature`: expected a scalar, got a tensor of shape {list(temperature.shape)} "
                "(verl's fused kernels take one temperature per call)"
            )
        return float(temperature.item())
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"argument `temperature`: expected a float, got {type(temperature).__name__}")
    return float(temperature)


def _logp_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The dtype of verl's ``FusedLinearForPPO`` log-probs: float32 from verl 0.8 on."""
    return hidden.dtype if _state.get("legacy_logp_dtype") else torch.float32


def _check_hidden_states(hidden_states: Any) -> None:
    """verl's fused forwards take ``[T, H]`` or ``[B, T, H]``."""
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() not in (2, 3):
        shape = list(hidden_states.shape) if isinstance(hidden_states, torch.Tensor) else type(hidden_states).__name__
        raise ValueError(f"argument `hidden_states`: expected shape [T, H] or [B, T, H], got {shape}")


def fused_linear_for_ppo_forward(
    self: Any,
    hidden_states: torch.Tensor,
    vocab_weights: torch.Tensor,
    input_ids: torch.Tensor,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The replacement of ``FusedLinearForPPO.forward``: ``(log_probs, entropy)`` of
    ``input_ids``' shape (``hidden_states`` ``[T, H]`` or ``[B, T, H]``, ``vocab_weights``
    ``[V, H]``), differentiable in ``hidden_states`` and ``vocab_weights`` through both."""
    _check_hidden_states(hidden_states)
    try:
        logp, entropy = linear_logprobs(
            hidden_states, vocab_weights, input_ids, temperature=_temperature(temperature), return_entropy=True,
            budget_mib=_options["budget_mib"],
        )[:2]  # fmt: skip
    except (ValueError, TypeError) as e:
        in_caller_names(e, _PPO_NAMES)
        raise
    return logp.to(_logp_dtype(hidden_states)), entropy.to(hidden_states.dtype)


def fused_linear_for_ppo_topk_forward(
    self: Any,
    hidden_states: torch.Tensor,
    vocab_weights: torch.Tensor,
    input_ids: torch.Tensor,
    gather_ids: torch.Tensor,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The replacement of ``FusedLinearForPPOTopK.forward`` (on-policy distillation, the
    student's pass): ``(token_log_probs, entropy, gathered_log_probs)``, the first two of
    ``input_ids``' shape and the last of ``gather_ids``' (``[T, K]`` or ``[B, T, K]``: the
    log-probs ``s_k - lse`` at the teacher's top-k ids), all in the hidden states' dtype,
    differentiable in ``hidden_states`` and ``vocab_weights`` through the three."""
    _check_hidden_states(hidden_states)
    if not isinstance(gather_ids, torch.Tensor):
        raise TypeError(f"argument `gather_ids`: expected a tensor [..., K], got {type(gather_ids).__name__}")
    try:
        out = linear_logprobs(
            hidden_states, vocab_weights, input_ids, temperature=_temperature(temperature), return_entropy=True,
            budget_mib=_options["budget_mib"], gather_ids=gather_ids,
        )  # fmt: skip
    except (ValueError, TypeError) as e:
        in_caller_names(e, _PPO_NAMES)
        raise
    dtype = hidden_states.dtype
    return out.logp.to(dtype), out.entropy.to(dtype), out.gathered_logp.to(dtype)


class _ScaleGrad(torch.autograd.Function):
    """The identity, whose backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float | None = 1.0,
    reduction: str | None = "none",
    dist_process_group: torch.distributed.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The replacement of verl's Triton ``linear_cross_entropy`` (same arguments):
    ``(log_probs, entropy)`` float32 ``[N]`` over the ``N`` rows of ``hidden`` ``[..., H]``
    (``labels`` ``[...]``); ``reduction`` ``"sum"``/``"mean"`` reduces ``log_probs`` to 0-d.
    With ``dist_process_group`` each rank holds its block of ``weight``'s rows, and gets
    ``1/world_size`` of the hidden gradient (the caller sums it over the group)."""
    if not isinstance(reduction, str) or reduction.lower() not in _REDUCTIONS:
        raise ValueError(f"argument `reduction`: expected one of {', '.join(_REDUCTIONS)}, got {reduction!r}")
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 1:
        raise ValueError("argument `hidden`: expected a tensor [..., H]")
    h = hidden.reshape(-1, hidden.shape[-1])
    if not isinstance(labels, torch.Tensor) or labels.numel() != h.shape[0]:
        got = list(labels.shape) if isinstance(labels, torch.Tensor) else type(labels).__name__
        raise ValueError(f"argument `labels`: expected {h.shape[0]} labels (hidden's rows), got {got}")
    if dist_process_group is not None and torch.is_grad_enabled() and hidden.requires_grad:
        h = _ScaleGrad.apply(h, 1.0 / torch.distributed.get_world_size(dist_process_group))
    try:
        logp, entropy = linear_logprobs(
            h, weight, labels.reshape(-1), temperature=_temperature(temperature), return_entropy=True,
            budget_mib=_options["budget_mib"], vocab_parallel_group=dist_process_group,
        )[:2]  # fmt: skip
    except (ValueError, TypeError) as e:
        in_caller_names(e, _CE_NAMES)
        raise
    reduction = reduction.lower()
    if reduction == "sum":
        logp = logp.sum()
    elif reduction == "mean":
        logp = logp.mean()
    return logp, entropy


def _import(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise ImportError(f"flashloss.verl: cannot import {name} ({e}); is verl installed? (pip install verl)") from e


def _version() -> tuple[int, ...]:
    import verl

    parts = []
    for p in str(getattr(verl, "__version__", "0")).split(".")[:2]:
        digits = "".join(c for c in p if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def _expect(module: Any, name: str) -> Any:
    value = getattr(module, name, None)
    if value is None or not callable(value):
        import verl

        raise ImportError(
            f"flashloss.verl: {module.__name__}.{name} is not in verl {getattr(verl, '__version__', '?')} "
            "(flashloss.verl patches verl >= 0.8's fused kernels)"
        )
    return value


def patch(*, budget_mib: float | None = None) -> None:
    """Routes verl's fused log-probs and entropy through flashloss (see the module).
    ``budget_mib``: the kernels' workspace budget (flashloss's default when None).
    Patching twice only updates the options. Raises ``ImportError`` when verl is missing
    or lacks the functions it replaces."""
    if budget_mib is not None and not (isinstance(budget_mib, (int, float)) and budget_mib > 0):
        raise ValueError(f"argument `budget_mib`: expected a positive number or None, got {budget_mib!r}")
    _options["budget_mib"] = None if budget_mib is None else float(budget_mib)
    if _state:
        return
    torch_backend = _import(_TORCH_BACKEND)
    triton_backend = _import(_TRITON_BACKEND)
    fused = _expect(torch_backend, "FusedLinearForPPO")
    forward = _expect(fused, "forward")
    original_lce = _expect(triton_backend, "linear_cross_entropy")

    _state["legacy_logp_dtype"] = _version() < (0, 8)
    _state["FusedLinearForPPO.forward"] = forward
    fused.forward = fused_linear_for_ppo_forward
    topk = getattr(torch_backend, "FusedLinearForPPOTopK", None)  # not in verl 0.9.1
    if topk is not None:
        _state["FusedLinearForPPOTopK.forward"] = _expect(topk, "forward")
        topk.forward = fused_linear_for_ppo_topk_forward
    _state[_TRITON_BACKEND] = original_lce
    triton_backend.linear_cross_entropy = linear_cross_entropy
    for name in _TRITON_IMPORTERS:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "linear_cross_entropy", None) is original_lce:
            _state[name] = original_lce
            module.linear_cross_entropy = linear_cross_entropy


def unpatch() -> None:
    """Restores everything :func:`patch` replaced (a module whose replacement was itself
    replaced since is left as it is)."""
    if not _state:
        return
    torch_backend = _import(_TORCH_BACKEND)
    fused = torch_backend.FusedLinearForPPO
    if fused.forward is fused_linear_for_ppo_forward:
        fused.forward = _state["FusedLinearForPPO.forward"]
    topk = getattr(torch_backend, "FusedLinearForPPOTopK", None)
    if (
        "FusedLinearForPPOTopK.forward" in _state
        and topk is not None
        and topk.forward is fused_linear_for_ppo_topk_forward
    ):
        topk.forward = _state["FusedLinearForPPOTopK.forward"]
    for name in (_TRITON_BACKEND, *_TRITON_IMPORTERS):
        module = sys.modules.get(name)
        if name in _state and module is not None and module.linear_cross_entropy is linear_cross_entropy:
            module.linear_cross_entropy = _state[name]
    _state.clear()
    _options["budget_mib"] = None


def is_patched() -> bool:
    """Whether :func:`patch` is in effect."""
    return bool(_state)
