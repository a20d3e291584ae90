"""What both of :mod:`flashloss.jax`'s paths (``ffi/``, ``pallas/``) know of an LM head,
written once and importing neither: its vocabulary size in either layout, the transform
of its logits, and the sampler's filters resolved against its vocabulary."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from .._spec import SamplerFilters

#: ``weight_layout``'s values: ``[V, H]`` (PyTorch's, tied embeddings) and ``[H, V]`` (Flax's).
LAYOUTS = ("vh", "hv")


def vocab_size(weight, layout: str) -> int:
    """``V`` of a ``weight`` of ``layout`` (this device's block inside a ``shard_map``)."""
    return weight.shape[0] if layout == "vh" else weight.shape[1]


@dataclass(frozen=True)
class Transform:
    """How raw logits become the softmax's ``s``: soft-cap (``cap·tanh(z/cap)``), then
    ``/ temperature``."""

    temperature: float = 1.0
    softcap: Optional[float] = None

    def apply(self, z: jax.Array) -> jax.Array:
        if self.softcap is not None:
            z = self.softcap * jnp.tanh(z / self.softcap)
        return z * (1.0 / self.temperature)

    def slope(self, s: jax.Array) -> jax.Array:
        """``∂s/∂z`` at the tile whose transformed logits are ``s``."""
        inv_t = 1.0 / self.temperature
        if self.softcap is None:
            return jnp.full_like(s, inv_t)
        tanh = s / (self.softcap * inv_t)
        return inv_t * (1.0 - tanh * tanh)


class Filters(NamedTuple):
    """The support's filters, each None where it keeps everything."""

    top_k: Optional[int]
    top_p: Optional[float]
    min_p: Optional[float]


def filters(f: SamplerFilters, vocab: int) -> Filters:
    """``f`` (checked by :class:`SamplerFilters`' rule) on a vocabulary of ``vocab``: a
    ``top_k`` at or above it keeps everything too."""
    top_k = None if f.top_k is None or f.top_k >= vocab else f.top_k
    return Filters(top_k, f.top_p, f.min_p)


def active(f: Optional[Filters]) -> Optional[str]:
    """The name of the first filter of ``f`` that drops anything, or None."""
    if f is None:
        return None
    return next((name for name, value in zip(Filters._fields, f) if value is not None), None)
