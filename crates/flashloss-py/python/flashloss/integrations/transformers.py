"""A transformers causal LM whose ``forward(..., labels=...)`` computes its loss with
:func:`flashloss.torch.linear_cross_entropy` from the last hidden states and the LM head,
so the ``[B, T, V]`` logits (and their gradient) are never formed::

    import flashloss.transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(...)
    flashloss.transformers.patch(model)           # this instance only; returns the model
    out = model(input_ids, labels=input_ids)      # out.loss as before, out.logits is None
    out.loss.backward()

    flashloss.transformers.patch("qwen2")          # or the class: every Qwen2ForCausalLM

The loss is transformers' ``ForCausalLMLoss``: labels shifted one to the left and padded
with ``-100`` (or ``shift_labels`` when given), ``ignore_index`` (default ``-100``), the
mean over the counted tokens, or their sum divided by ``num_items_in_batch`` when the
caller passes it (``Trainer`` does, for gradient accumulation). Gemma2's
``final_logit_softcapping`` is the kernel's ``softcap``. ``logits_to_keep`` selects the
hidden states as it selects the logits; the labels must then match the kept positions, as
they must without the patch. Without ``labels`` the model's own forward runs, logits and
all (generation, evaluation on logits, ``Trainer``'s label smoothing).

Supported: ``Qwen2ForCausalLM``, ``LlamaForCausalLM``, ``MistralForCausalLM``,
``Gemma2ForCausalLM`` (transformers 5), with transformers' default loss function.
Anything else is refused with a ``ValueError`` naming it.
"""

from __future__ import annotations

import functools
import types
from typing import Any, Callable, Optional, Union

import torch
import torch.nn.functional as F

from ..torch import linear_cross_entropy

__all__ = ["causal_lm_loss", "is_patched", "patch", "unpatch"]

#: ``model_type`` -> (module under ``transformers.models``, class, config attribute of the soft-cap).
_SUPPORTED = {
    "qwen2": ("qwen2", "Qwen2ForCausalLM", None),
    "llama": ("llama", "LlamaForCausalLM", None),
    "mistral": ("mistral", "MistralForCausalLM", None),
    "gemma2": ("gemma2", "Gemma2ForCausalLM", "final_logit_softcapping"),
}

_ORIGINAL_FORWARD: dict[type, Callable] = {}  # each patched class's own forward, kept before patching
_MARK = "__flashloss_patched__"


def _classes() -> dict[type, tuple[str, Optional[str]]]:
    import importlib

    out = {}
    for model_type, (module, name, softcap) in _SUPPORTED.items():
        cls = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name)
        out[cls] = (model_type, softcap)
    return out


def _supported_names() -> str:
    return ", ".join(name for _, name, _ in _SUPPORTED.values())


def _class_of(model_or_type: Any) -> type:
    """The supported causal-LM class that ``model_or_type`` names (a model, a config or a
    ``model_type`` string), or a ``ValueError``."""
    import transformers

    classes = _classes()
    if isinstance(model_or_type, torch.nn.Module):
        for cls in classes:
            if type(model_or_type) is cls or _fsdp_class_of(type(model_or_type)) is cls:
                return cls
        raise ValueError(
            f"flashloss.transformers.patch: unsupported model class {type(model_or_type).__name__} "
            f"(supported: {_supported_names()})"
        )
    if isinstance(model_or_type, transformers.PretrainedConfig):
        model_type = model_or_type.model_type
    elif isinstance(model_or_type, str):
        model_type = model_or_type
    else:
        raise ValueError(
            "flashloss.transformers.patch: expected a model, a config or a model_type string, "
            f"got {type(model_or_type).__name__}"
        )
    for cls, (name, _) in classes.items():
        if name == model_type:
            return cls
    raise ValueError(
        f"flashloss.transformers.patch: unsupported model_type {model_type!r} (supported: {', '.join(_SUPPORTED)})"
    )


def _fsdp_class_of(t: type) -> Optional[type]:
    """The model class that FSDP2's ``fully_shard`` subclassed into ``t``
    (``FSDPQwen2ForCausalLM(FSDPModule, Qwen2ForCausalLM)``), else None."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return None
    bases = [b for b in t.__bases__ if b is not FSDPModule]
    if FSDPModule in t.__bases__ and len(bases) == 1 and t.__name__ == f"FSDP{bases[0].__name__}":
        return bases[0]
    return None


def _keep(hidden: torch.Tensor, logits_to_keep: Union[int, torch.Tensor]) -> torch.Tensor:
    """The hidden states whose logits the model would compute (transformers' ``slice_logits_to_keep``)."""
    if isinstance(logits_to_keep, torch.Tensor) and logits_to_keep.ndim == 2:
        if logits_to_keep.dtype == torch.bool:
            return hidden[logits_to_keep]
        return torch.take_along_dim(hidden, logits_to_keep[..., None], dim=1)
    if isinstance(logits_to_keep, int):
        logits_to_keep = slice(-logits_to_keep, None)
    return hidden[:, logits_to_keep, :]


def causal_lm_loss(
    hidden: torch.Tensor,
    head: torch.nn.Linear,
    labels: Optional[torch.Tensor],
    *,
    shift_labels: Optional[torch.Tensor] = None,
    num_items_in_batch: Optional[Union[torch.Tensor, int]] = None,
    ignore_index: int = -100,
    softcap: Optional[float] = None,
    mode: str = "auto",
    budget_mib: Optional[float] = None,
) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` of ``head(hidden)`` (soft-capped when ``softcap``)
    at ``labels``, computed by :func:`flashloss.torch.linear_cross_entropy`."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    rows = hidden.shape[:-1]
    if shift_labels.numel() != rows.numel():
        raise ValueError(
            f"argument `labels`: {list(shift_labels.shape)} labels for {list(rows)} hidden states "
            "(with `logits_to_keep`, the labels must match the kept positions)"
        )
    targets = shift_labels.reshape(rows).to(hidden.device)
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = linear_cross_entropy(
        hidden, head.weight, targets, bias=head.bias, ignore_index=ignore_index, softcap=softcap,
        reduction=reduction, mode=mode, budget_mib=budget_mib,
    )  # fmt: skip
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


def _make_forward(original: Callable, softcap_attr: Optional[str], mode: str, budget_mib: Optional[float]):
    from transformers.modeling_outputs import CausalLMOutputWithPast

    @functools.wraps(original)  # keeps the signature: Trainer reads it (**kwargs -> num_items_in_batch)
    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        past_key_values: Any = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        labels: Optional[torch.LongTensor] = None,
        use_cache: Optional[bool] = None,
        logits_to_keep: Union[int, torch.Tensor] = 0,
        **kwargs: Any,
    ):
        if labels is None:  # no loss asked: the model's own forward, logits and all
            return original(
                self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                past_key_values=past_key_values, inputs_embeds=inputs_embeds, labels=labels,
                use_cache=use_cache, logits_to_keep=logits_to_keep, **kwargs,
            )  # fmt: skip
        loss_name = getattr(self.loss_function, "__name__", repr(self.loss_function))
        if loss_name != "ForCausalLMLoss":
            raise ValueError(
                f"flashloss.transformers: {type(self).__name__} has the loss function "
                f"{loss_name}, not transformers' ForCausalLMLoss that flashloss computes"
            )
        return_dict = kwargs.pop("return_dict", None)
        if return_dict is None:
            return_dict = getattr(self.config, "return_dict", True)
        outputs = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs,
        )  # fmt: skip
        hidden = _keep(outputs.last_hidden_state, logits_to_keep)
        softcap = None if softcap_attr is None else getattr(self.config, softcap_attr, None)
        loss = causal_lm_loss(
            hidden, self.lm_head, labels,
            shift_labels=kwargs.get("shift_labels"),
            num_items_in_batch=kwargs.get("num_items_in_batch"),
            ignore_index=kwargs.get("ignore_index", -100),
            softcap=softcap, mode=mode, budget_mib=budget_mib,
        )  # fmt: skip
        out = CausalLMOutputWithPast(
            loss=loss,
            logits=None,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )
        return out if return_dict else out.to_tuple()

    setattr(forward, _MARK, True)
    return forward


def patch(model_or_type: Any, *, mode: str = "auto", budget_mib: Optional[float] = None) -> Any:
    """Make ``forward(..., labels=...)`` compute the loss with flashloss (see the module).

    ``model_or_type`` is either a model instance (``Qwen2ForCausalLM``, ...): a new forward
    is bound to that instance only, and the instance is returned; or a ``model_type``
    string (``"qwen2"``, ``"llama"``, ``"mistral"``, ``"gemma2"``) or a config: the class's
    ``forward`` is replaced, for every instance, existing and future (as Liger's
    ``apply_liger_kernel_to_*`` and Cut Cross-Entropy's ``cce_patch`` do), and ``None`` is
    returned. ``mode`` and ``budget_mib`` go to :func:`flashloss.torch.linear_cross_entropy`.
    Patching twice replaces the first patch; :func:`unpatch` undoes it. Anything
    unsupported raises a ``ValueError`` naming it.
    """
    cls = _class_of(model_or_type)
    softcap_attr = _classes()[cls][1]
    original = _ORIGINAL_FORWARD.setdefault(cls, cls.__dict__["forward"])
    forward = _make_forward(original, softcap_attr, mode, budget_mib)
    if isinstance(model_or_type, torch.nn.Module):
        model_or_type.forward = types.MethodType(forward, model_or_type)
        return model_or_type
    cls.forward = forward
    return None


def unpatch(model_or_type: Any) -> Any:
    """Undo :func:`patch` on an instance (returned) or on a class (``None``)."""
    cls = _class_of(model_or_type)
    if isinstance(model_or_type, torch.nn.Module):
        model_or_type.__dict__.pop("forward", None)
        return model_or_type
    if cls in _ORIGINAL_FORWARD:
        cls.forward = _ORIGINAL_FORWARD[cls]
    return None


def is_patched(model: torch.nn.Module) -> bool:
    """Whether ``model.forward`` is flashloss's (patched on the instance or on its class)."""
    return getattr(model.forward, _MARK, False)
