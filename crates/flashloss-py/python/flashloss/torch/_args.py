"""The torch binding's argument checks, shared by its losses (as ``flashloss.jax._args``):
tensors on one device, the head in one float dtype and contiguous, whether autograd
will want the head's own gradients, and a GRPO batch's per-sequence inputs."""

from __future__ import annotations

import torch

from .. import _native
from ._op_utils import _f32

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
HALVES = (torch.bfloat16, torch.float16)


def check_tensor(arg: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"argument `{arg}`: expected a torch.Tensor, got {type(t).__name__}")


def same_device(tensors: dict, cuda: bool = True) -> torch.device:
    device = None
    for arg, t in tensors.items():
        if t is None:
            continue
        check_tensor(arg, t)
        if device is None:
            device = t.device
        elif t.device != device:
            first = next(a for a, x in tensors.items() if x is not None)
            raise ValueError(f"argument `{arg}` is on {t.device} but `{first}` is on {device}")
    if device is not None and device.type != "cpu":
        if device.type != "cuda" or not _native.cuda_build:
            raise ValueError(
                f"tensors on {device}: this build of flashloss runs CPU tensors "
                "(CUDA tensors need the CUDA backend, in the default build; this one was built without it)"
            )
        if not cuda:
            raise ValueError(f"tensors on {device}: this function runs CPU tensors only (so far)")
    return device


def head(hidden, weight, bias):
    """``hidden``, ``weight``, ``bias`` as the kernels read them: one float dtype, contiguous."""
    for arg, t in (("hidden", hidden), ("weight", weight), ("bias", bias)):
        if t is not None and t.dtype not in FLOATS:
            raise ValueError(f"argument `{arg}`: expected dtype float32, bfloat16 or float16, got {t.dtype}")
    dtypes = {t.dtype for t in (hidden, weight, bias) if t is not None}
    # One dtype as it is; float32 with one half dtype: that one (as autocast); both halves: float32.
    halves = [d for d in HALVES if d in dtypes]
    dtype = halves[0] if len(halves) == 1 else torch.float32
    if dtype == torch.float16 and hidden.device.type == "cuda":
        # The CUDA backend reads f32 or bf16: a float16 head is widened (exactly), so its
        # products run on the widened operands, as the CPU's do (an f32 copy of the head).
        dtype = torch.float32
    cast = [None if t is None else t.to(dtype).contiguous() for t in (hidden, weight, bias)]
    return cast


def head_grad(weight, bias) -> bool:
    """Whether autograd will want the head's own gradients: False for a frozen head
    (``weight`` and ``bias`` without ``requires_grad``, or grad mode off), which then gets
    no ``[V, H]`` gradient buffer and no dW/dbias product."""
    wants = weight.requires_grad or (bias is not None and bias.requires_grad)
    return bool(torch.is_grad_enabled() and wants)


def mask_bool(t):
    return None if t is None else (t != 0).cpu().contiguous()


def items(num_items_in_batch):
    """``num_items_in_batch`` as (config value, tensor input): a tensor (TRL passes one)
    is read inside the op, so that compiled code never reads it on the host."""
    if isinstance(num_items_in_batch, torch.Tensor):
        return None, num_items_in_batch.detach().reshape(())
    return num_items_in_batch, None


def grpo_batch(completion_ids, completion_mask, advantages):
    """``(ids int64, mask bool, advantages f32)`` on the CPU, checked (TRL's ``[B, 1]``
    advantages as ``[B]``)."""
    check_tensor("completion_ids", completion_ids)
    if completion_ids.dim() != 2:
        raise ValueError(f"argument `completion_ids`: expected shape [B, T], got {list(completion_ids.shape)}")
    if completion_ids.dtype.is_floating_point or completion_ids.dtype == torch.bool:
        raise ValueError(f"argument `completion_ids`: expected an integer dtype, got {completion_ids.dtype}")
    ids = completion_ids.to(device="cpu", dtype=torch.int64).contiguous()
    if completion_mask is None:
        mask = torch.ones_like(ids, dtype=torch.bool)
    else:
        check_tensor("completion_mask", completion_mask)
        mask = (completion_mask != 0).cpu().contiguous()
    check_tensor("advantages", advantages)
    if advantages.dim() == 2 and advantages.shape[1] == 1:
        advantages = advantages[:, 0]  # TRL's unsqueezed [B, 1]
    return ids, mask, _f32(advantages)
