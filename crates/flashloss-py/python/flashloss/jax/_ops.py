"""The XLA FFI calls of flashloss's handlers (``crates/flashloss-py/src/jax``),
registered once when :mod:`flashloss.jax` is imported: every handler for the CPU, and
in a build with the ``cuda`` feature the fused losses (``flashloss_grpo_linear``,
``flashloss_ce_linear``) for CUDA too, under the same names (not yet run on a GPU). Each fused call returns the loss
and the gradients of ``hidden``, ``weight``, ``bias`` together; ``vmap`` runs the
handler once per batch element (``vmap_method="sequential"``), since a GRPO batch's
normalizers span its sequences."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from .. import _native


def register() -> None:
    """Registers every handler with XLA (platforms ``cpu`` and, where built, ``CUDA``)."""
    for platform in ("cpu", "CUDA"):
        for name, capsule in _native.jax_targets(platform).items():
            jax.ffi.register_ffi_target(name, capsule, platform=platform)


def _like(x, shape, dtype=jnp.float32):
    """A result type of ``shape`` and ``dtype`` that carries ``x``'s varying mesh axes
    (inside ``shard_map``: custom_vjp checks them in the backward)."""
    return jax.typeof(x).update(shape=tuple(shape), dtype=dtype)


def _call(name: str, results, *args, **attrs):
    return jax.ffi.ffi_call(name, results, vmap_method="sequential")(*args, **attrs)


def _or_empty(x: Optional[jax.Array], dtype) -> jax.Array:
    return jnp.zeros((0,), dtype) if x is None else x


def grpo_linear(hidden, weight, bias, ids, mask, advantages, old, ref, *, config: str, mode: str, budget_mib: float):
    """``(loss, dhidden, dweight, dbias, logp, entropy, kl, metrics[5])``."""
    b, t = ids.shape
    v, h = weight.shape
    x = hidden
    results = (
        _like(x, ()),
        _like(x, hidden.shape),
        _like(x, weight.shape),
        _like(x, (0,) if bias is None else (v,)),
        _like(x, (b, t)),
        _like(x, (b, t)),
        _like(x, (b, t)),
        _like(x, (5,)),
    )
    return _call(
        "flashloss_grpo_linear", results,
        hidden, weight, _or_empty(bias, hidden.dtype), ids, mask, advantages,
        _or_empty(old, jnp.float32), _or_empty(ref, jnp.float32),
        budget_mib=float(budget_mib), config=config, mode=mode,
    )  # fmt: skip


def ce_linear(hidden, weight, bias, targets, grad_rows, *, config: str, mode: str, budget_mib: float):
    """``(loss, dhidden, dweight, dbias, row_loss[N], count)``."""
    v, h = weight.shape
    n = targets.shape[0]
    x = hidden
    results = (
        _like(x, ()),
        _like(x, hidden.shape),
        _like(x, weight.shape),
        _like(x, (0,) if bias is None else (v,)),
        _like(x, (n,)),
        _like(x, ()),
    )
    return _call(
        "flashloss_ce_linear", results,
        hidden, weight, _or_empty(bias, hidden.dtype), targets, _or_empty(grad_rows, jnp.float32),
        budget_mib=float(budget_mib), config=config, mode=mode,
    )  # fmt: skip


def ce_rows(hidden, weight, bias, targets, *, config: str, budget_mib: float):
    """``row_loss[N]``: the per-row CE losses, one statistics pass (no gradient buffers)."""
    n = targets.shape[0]
    return _call(
        "flashloss_ce_rows", (_like(hidden, (n,)),),
        hidden, weight, _or_empty(bias, hidden.dtype), targets, budget_mib=float(budget_mib), config=config,
    )[0]  # fmt: skip


def logp_linear(hidden, weight, bias, ids, mask, *, temperature: float, budget_mib: float):
    """``(logp[N], entropy[N])`` (no gradient)."""
    n = ids.shape[0]
    return _call(
        "flashloss_logp_linear", (_like(hidden, (n,)), _like(hidden, (n,))),
        hidden, weight, _or_empty(bias, hidden.dtype), ids, mask,
        budget_mib=float(budget_mib), mode="two_pass", temperature=float(temperature),
    )  # fmt: skip


def grpo_logits(logits, ids, mask, advantages, old, ref, *, config: str):
    """``(loss, dlogits (logits' dtype), logp, entropy, kl, metrics[5])``."""
    b, t = ids.shape
    z = logits
    results = (
        _like(z, ()),
        _like(z, logits.shape, logits.dtype),
        _like(z, (b, t)),
        _like(z, (b, t)),
        _like(z, (b, t)),
        _like(z, (5,)),
    )
    return _call(
        "flashloss_grpo_logits", results,
        logits, ids, mask, advantages, _or_empty(old, jnp.float32), _or_empty(ref, jnp.float32),
        config=config,
    )  # fmt: skip
