"""The JAX binding's argument checks, shared by its losses: the head in one float dtype
and layout, ids, a GRPO batch, mesh axes (the choice of path: :mod:`._paths`)."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from ._head import LAYOUTS
from ._head import vocab_size as block_size


def floats(arg: str, x) -> jax.Array:
    x = jnp.asarray(x)
    if x.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise ValueError(f"argument `{arg}`: expected dtype float32, bfloat16 or float16, got {x.dtype}")
    return x


def wide(*xs):
    """float16 widened to float32 (exact) for the Pallas kernels, which take float32 and
    bfloat16 (TPUs have no float16 arithmetic); JAX casts the gradients back."""
    return [x.astype(jnp.float32) if x is not None and x.dtype == jnp.float16 else x for x in xs]


def head(hidden, weight, bias, layout: str):
    """One float dtype for the head (mixed dtypes become bfloat16, as autocast would);
    ``weight`` ``[V, H]`` (layout ``vh``) or ``[H, V]`` (``hv``)."""
    if layout not in LAYOUTS:
        raise ValueError(f"argument `weight_layout`: expected 'vh' ([V, H]) or 'hv' ([H, V]), got {layout!r}")
    hidden, weight = floats("hidden", hidden), floats("weight", weight)
    bias = None if bias is None else floats("bias", bias)
    if weight.ndim != 2:
        expected = "[V, H]" if layout == "vh" else "[H, V]"
        raise ValueError(f"argument `weight`: expected shape {expected}, got {list(weight.shape)}")
    v, h = weight.shape if layout == "vh" else weight.shape[::-1]
    if hidden.shape[-1] != h:
        raise ValueError(f"argument `hidden`: expected shape [..., H={h}], got {list(hidden.shape)}")
    if bias is not None and bias.shape != (v,):
        raise ValueError(f"argument `bias`: expected shape [V={v}], got {list(bias.shape)}")
    dtypes = {x.dtype for x in (hidden, weight, bias) if x is not None}
    # One dtype as it is; float32 with one half dtype: that one (as autocast); both halves: float32.
    halves = [d for d in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) if d in dtypes]
    dtype = halves[0] if len(halves) == 1 else jnp.float32
    cast = [None if x is None else x.astype(dtype) for x in (hidden, weight, bias)]
    return cast


def axis_size(arg: str, name: str) -> int:
    """The size of mesh axis ``name``; an error naming ``arg`` outside a ``shard_map``
    over it."""
    try:
        return jax.lax.axis_size(name)
    except NameError as e:
        raise ValueError(f"argument `{arg}`: no mesh axis {name!r} here (call inside jax.shard_map over it)") from e


def int_ids(arg: str, x) -> jax.Array:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"argument `{arg}`: expected an integer dtype, got {x.dtype}")
    return x.astype(jnp.int64 if x.dtype == jnp.int64 else jnp.int32)


def grpo_batch(completion_ids, completion_mask, advantages, old_per_token_logps, ref_per_token_logps):
    ids = int_ids("completion_ids", completion_ids)
    if ids.ndim != 2:
        raise ValueError(f"argument `completion_ids`: expected shape [B, T], got {list(ids.shape)}")
    b, t = ids.shape
    mask = jnp.ones((b, t), bool) if completion_mask is None else jnp.asarray(completion_mask) != 0
    if mask.shape != (b, t):
        raise ValueError(f"argument `completion_mask`: expected shape [B, T] = {[b, t]}, got {list(mask.shape)}")
    adv = jnp.asarray(advantages, jnp.float32)
    if adv.ndim == 2 and adv.shape[1] == 1:
        adv = adv[:, 0]  # TRL's unsqueezed [B, 1]
    old = None if old_per_token_logps is None else jnp.asarray(old_per_token_logps, jnp.float32)
    ref = None if ref_per_token_logps is None else jnp.asarray(ref_per_token_logps, jnp.float32)
    return ids, mask, adv, old, ref


def token_mask(arg: str, x, shape: tuple) -> Optional[jax.Array]:
    """An optional per-token mask ``[B, T]`` as bool (nonzero: set)."""
    if x is None:
        return None
    m = jnp.asarray(x) != 0
    if m.shape != tuple(shape):
        raise ValueError(f"argument `{arg}`: expected shape [B, T] = {list(shape)}, got {list(m.shape)}")
    return m


def vocab_size(weight, layout: str, vocab_axis: Optional[str]) -> int:
    """The whole vocabulary: this device's block times the devices of ``vocab_axis``."""
    v = block_size(weight, layout)
    return v if vocab_axis is None else v * axis_size("vocab_axis", vocab_axis)
