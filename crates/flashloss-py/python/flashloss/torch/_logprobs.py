"""What :func:`flashloss.torch.linear_logprobs` checks beyond the head (as
``flashloss.jax._logprobs``): the candidates' ids."""

from __future__ import annotations

import torch


def check_gather_ids(ids: torch.Tensor, gather_ids) -> None:
    if gather_ids.dtype.is_floating_point or gather_ids.dtype.is_complex or gather_ids.dtype == torch.bool:
        raise ValueError(f"argument `gather_ids`: expected an integer dtype, got {gather_ids.dtype}")
    if gather_ids.dim() != ids.dim() + 1 or gather_ids.shape[:-1] != ids.shape or gather_ids.shape[-1] < 1:
        raise ValueError(
            f"argument `gather_ids`: expected shape {list(ids.shape)} + [K] with K >= 1 (ids' shape and K "
            f"candidates per token), got {list(gather_ids.shape)}"
        )
