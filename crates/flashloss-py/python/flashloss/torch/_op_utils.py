"""Helpers shared by flashloss's ``torch.library`` ops (:mod:`flashloss.torch._ops` and
:mod:`flashloss.torch._logits_ops`): a head's gradient buffers and their fake shapes, the
dtypes gradients go back in, TRL's metrics tensor, and saved gradients scaled by the
upstream gradient."""

from __future__ import annotations

import json
from typing import Optional

import torch
from torch import Tensor

from .._spec import METRICS


def _stream(device: torch.device) -> int:
    """PyTorch's current stream on ``device`` (0 on the CPU): the kernels run on it."""
    return 0 if device.type == "cpu" else torch.cuda.current_stream(device).cuda_stream


def _f32(t: Optional[Tensor]) -> Optional[Tensor]:
    """``t`` as the native calls read an f32 input: detached, on the CPU, contiguous."""
    return None if t is None else t.detach().to(device="cpu", dtype=torch.float32).contiguous()


def _zeros_f32(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else torch.zeros(t.shape, dtype=torch.float32, device=t.device)


def _grad_buffers(
    hidden: Tensor, weight: Tensor, bias: Optional[Tensor], head_grad: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """The head's zeroed f32 gradient buffers; ``dweight`` and ``dbias`` are empty (an op
    returns tensors) for a frozen head (``head_grad`` False), ``dbias`` without a bias."""

    def empty():  # one tensor per output: an op's outputs may not alias each other
        return hidden.new_empty((0,), dtype=torch.float32)

    dw = _zeros_f32(weight) if head_grad else empty()
    db = _zeros_f32(bias) if head_grad and bias is not None else empty()
    return _zeros_f32(hidden), dw, db


def _native_grads(dw: Tensor, db: Tensor, bias: Optional[Tensor], head_grad: bool) -> tuple:
    """``(grad_weight, grad_bias)`` as the native calls take them: None for a frozen head
    (no dW, no dbias formed) and for an absent bias."""
    if not head_grad:
        return None, None
    return dw, None if bias is None else db


def to_device(t: Tensor, device) -> Tensor:
    """A host tensor of a native call's results on ``device``, copied up without a wait:
    from pageable memory CUDA stages the copy before returning (the host tensor may go),
    and a non-blocking copy spares the stream synchronization PyTorch follows a blocking
    one with (docs/design.md, "Host waits of one call")."""
    return t.to(device, non_blocking=True)


def scalar_on(x: float, device, dtype=torch.float32) -> Tensor:
    """The scalar ``x`` on ``device`` (:func:`to_device`)."""
    return to_device(torch.tensor(x, dtype=dtype), device)


#: The metrics' dtype, JAX's too (``GRPOOutputs.metrics``).
METRICS_DTYPE = torch.float32


def metrics_tensor(out: dict, device=None) -> Tensor:
    """TRL's metrics of a native GRPO call's result, in :data:`METRICS` order."""
    host = torch.tensor([out[k] for k in METRICS], dtype=METRICS_DTYPE)
    return host if device is None else to_device(host, device)


def _with_items(config: str, num_items: Optional[Tensor]) -> str:
    """``config`` with ``num_items_in_batch`` read from a tensor (TRL passes one)."""
    if num_items is None:
        return config
    c = json.loads(config)
    c["num_items_in_batch"] = float(num_items)
    return json.dumps(c)


def _scale(grad: Tensor, grads: tuple, dtypes: tuple) -> list:
    """``grad · g`` in each input's dtype (None where the input is absent). Eager on the
    CPU with ``grad == 1`` (``loss.backward()``) the saved gradients are returned as they
    are (cast where the input's dtype differs): autograd then takes them as ``.grad``
    without a copy, where ``grad * g`` would write a fresh ``[V, H]`` tensor (0.27 s at
    V=151936, H=1024 on 2 cores, docs/results/cpu_bench.md)."""
    unit = grad.device.type == "cpu" and not torch.compiler.is_compiling() and grad.item() == 1.0
    return [None if dt is None else (g if unit else grad * g).to(dt) for g, dt in zip(grads, dtypes)]


def _only_the_loss_differentiable(ctx, output) -> None:
    """Marks every output but the loss (output 0) non-differentiable, and has autograd
    pass ``None`` for their gradients instead of zero tensors of their shapes (the
    gradient outputs' zeros took 0.13 s a backward at V=151936, H=1024)."""
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)


def _fake_grads(
    hidden: Tensor, weight: Tensor, bias: Optional[Tensor], head_grad: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """The fake (meta) gradient buffers of a head (as :func:`_grad_buffers` shapes them)."""
    f32 = dict(dtype=torch.float32)
    dw = hidden.new_empty(weight.shape if head_grad else (0,), **f32)
    db = hidden.new_empty(bias.shape if head_grad and bias is not None else (0,), **f32)
    return hidden.new_empty(hidden.shape, **f32), dw, db


def _head_dtypes(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], head_grad: bool) -> tuple:
    """The dtypes the gradients go back in; None where no gradient is returned."""
    return (
        hidden.dtype,
        weight.dtype if head_grad else None,
        bias.dtype if head_grad and bias is not None else None,
    )


def _head_wanted(ctx) -> bool:
    """Whether autograd wants the gradient of ``weight`` or ``bias`` (inputs 1, 2)."""
    return bool(ctx.needs_input_grad[1] or ctx.needs_input_grad[2])
