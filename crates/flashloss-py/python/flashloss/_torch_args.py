"""Argument checks shared by flashloss's PyTorch entry points (:mod:`flashloss.torch`):
tensors on one device, the head in one float dtype and contiguous, and whether autograd
will want the head's own gradients."""

from __future__ import annotations

import torch

from . import _native

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_HALVES = (torch.bfloat16, torch.float16)


def _check_tensor(arg: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"argument `{arg}`: expected a torch.Tensor, got {type(t).__name__}")


def _same_device(tensors: dict, cuda: bool = True) -> torch.device:
    device = None
    for arg, t in tensors.items():
        if t is None:
            continue
        _check_tensor(arg, t)
        if device is None:
            device = t.device
        elif t.device != device:
            first = next(a for a, x in tensors.items() if x is not None)
            raise ValueError(f"argument `{arg}` is on {t.device} but `{first}` is on {device}")
    if device is not None and device.type != "cpu":
        if device.type != "cuda" or not _native.cuda_build:
            raise ValueError(
                f"tensors on {device}: this build of flashloss runs CPU tensors "
                "(CUDA tensors need the build with the `cuda` feature)"
            )
        if not cuda:
            raise ValueError(f"tensors on {device}: this function runs CPU tensors only (so far)")
    return device


def _head(hidden, weight, bias):
    """``hidden``, ``weight``, ``bias`` as the kernels read them: one float dtype, contiguous."""
    for arg, t in (("hidden", hidden), ("weight", weight), ("bias", bias)):
        if t is not None and t.dtype not in _FLOATS:
            raise ValueError(f"argument `{arg}`: expected dtype float32, bfloat16 or float16, got {t.dtype}")
    dtypes = {t.dtype for t in (hidden, weight, bias) if t is not None}
    # One dtype as it is; float32 with one half dtype: that one (as autocast); both halves: float32.
    halves = [d for d in _HALVES if d in dtypes]
    dtype = halves[0] if len(halves) == 1 else torch.float32
    cast = [None if t is None else t.to(dtype).contiguous() for t in (hidden, weight, bias)]
    return cast


def _head_grad(weight, bias) -> bool:
    """Whether autograd will want the head's own gradients: False for a frozen head
    (``weight`` and ``bias`` without ``requires_grad``, or grad mode off), which then gets
    no ``[V, H]`` gradient buffer and no dW/dbias product."""
    wants = weight.requires_grad or (bias is not None and bias.requires_grad)
    return bool(torch.is_grad_enabled() and wants)


def _bool(t):
    return None if t is None else (t != 0).cpu().contiguous()
