"""The XLA FFI calls of flashloss's handlers (``crates/flashloss-py/src/jax``),
registered once when :mod:`flashloss.jax` is imported: every handler for the CPU, and
in a build with the ``cuda`` feature the fused losses (``flashloss_grpo_linear``,
``flashloss_ce_linear``) for CUDA too, under the same names (not yet run on a GPU). Each fused call returns the loss
and the gradients of ``hidden``, ``weight``, ``bias`` together; ``vmap`` runs the
handler once per batch element (``vmap_method="sequential"``), since a GRPO batch's
normalizers span its sequences.

Every call that takes the LM head's ``weight`` takes ``weight_layout``: ``"vh"`` for
``[V, H]`` (PyTorch's layout, a tied embedding) or ``"hv"`` for ``[H, V]`` (a Flax
kernel, ``'BTD,DV->BTV'``), read as it lies (no transposed copy); ``dweight`` has the
weight's shape. Every call that forms gradients takes ``head_grad``: ``"full"``, or
``"frozen"`` (a frozen head: ``dweight`` and ``dbias`` come back ``[0]``, no dW/dbias
product, no ``[V, H]`` buffer)."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from ... import _native
from ..._spec.names import CORE_NAMES
from ..._spec.native import call_spec
from .._head import LAYOUTS
from .._head import vocab_size as block_size


def register() -> None:
    """Registers every handler with XLA (platforms ``cpu`` and, where built, ``CUDA``)."""
    for platform in ("cpu", "CUDA"):
        for name, capsule in _native.jax_targets(platform).items():
            jax.ffi.register_ffi_target(name, capsule, platform=platform)


def _like(x, shape, dtype=jnp.float32):
    """A result type of ``shape`` and ``dtype`` that carries ``x``'s varying mesh axes
    (inside ``shard_map``: custom_vjp checks them in the backward)."""
    return jax.typeof(x).update(shape=tuple(shape), dtype=dtype)


#: The public function each handler serves, whose argument names its errors use
#: (``flashloss._spec.names.CORE_NAMES``; the vocabulary passes serve the log-probs and,
#: through them, GRPO's statistics).
_API = {
    **dict.fromkeys(("grpo_linear", "grpo_logits", "grpo_logits_rows", "grpo_policy"), "grpo"),
    **dict.fromkeys(("ce_linear", "ce_rows", "ce_vocab_partial", "ce_vocab_grads"), "ce"),
    **dict.fromkeys(("logp_linear", "logp_support", "logp_support_grads", "vocab_partial", "vocab_grads"), "logprobs"),
}


def _call(name: str, results, *args, config: Optional[str] = None, **fields):
    """Handler ``name`` on ``args``, its one attribute ``spec`` the JSON of ``config`` and
    ``fields`` (:func:`flashloss._spec.native.call_spec`, parsed once in Rust), with the
    ``names`` its errors give the core's arguments."""
    spec = call_spec(config, names=CORE_NAMES[_API[name.removeprefix("flashloss_")]], **fields)
    return jax.ffi.ffi_call(name, results, vmap_method="sequential")(*args, spec=spec)


def _mib(budget_mib: Optional[float]) -> Optional[float]:
    """A budget for the spec: None (left out: unset, the backend's default) or a float."""
    return None if budget_mib is None else float(budget_mib)


def _or_empty(x: Optional[jax.Array], dtype) -> jax.Array:
    return jnp.zeros((0,), dtype) if x is None else x


def head_grad_results(x, weight, bias, v: int, head_grad: str):
    """The result types of ``dweight`` and ``dbias``: the weight's shape and ``[V]`` (or
    ``[0]`` without a bias), both ``[0]`` for a frozen head."""
    if head_grad not in ("full", "frozen"):
        raise ValueError(f'argument `head_grad`: expected "full" or "frozen", got {head_grad!r}')
    if head_grad == "frozen":
        return _like(x, (0,)), _like(x, (0,))
    return _like(x, weight.shape), _like(x, (0,) if bias is None else (v,))


def vocab_size(weight, weight_layout: str) -> int:
    """``V`` of ``weight`` (``[V, H]`` for ``weight_layout="vh"``, ``[H, V]`` for ``"hv"``)."""
    if weight_layout not in LAYOUTS:
        raise ValueError(f'argument `weight_layout`: expected "vh" ([V, H]) or "hv" ([H, V]), got {weight_layout!r}')
    if len(weight.shape) != 2:
        want = "[V, H]" if weight_layout == "vh" else "[H, V]"
        got = list(weight.shape)
        raise ValueError(f"argument `weight`: expected shape {want} (weight_layout {weight_layout!r}), got {got}")
    return block_size(weight, weight_layout)


def grpo_linear(
    hidden, weight, bias, ids, mask, advantages, old, ref, ratio=None, *, config: str, mode: str,
    budget_mib: Optional[float], weight_layout: str = "vh", head_grad: str = "full",
):  # fmt: skip
    """``(loss, dhidden, dweight, dbias, logp, entropy, kl, metrics[5])``; ``ratio``: the
    sampler's importance ratio ``[B]``, ``[B, T]`` or None."""
    b, t = ids.shape
    v = vocab_size(weight, weight_layout)
    x = hidden
    results = (
        _like(x, ()),
        _like(x, hidden.shape),
        *head_grad_results(x, weight, bias, v, head_grad),
        _like(x, (b, t)),
        _like(x, (b, t)),
        _like(x, (b, t)),
        _like(x, (5,)),
    )
    return _call(
        "flashloss_grpo_linear", results,
        hidden, weight, _or_empty(bias, hidden.dtype), ids, mask, advantages,
        _or_empty(old, jnp.float32), _or_empty(ref, jnp.float32), _or_empty(ratio, jnp.float32),
        budget_mib=_mib(budget_mib), config=config, mode=mode, weight_layout=weight_layout,
        head_grad=head_grad,
    )  # fmt: skip


def ce_linear(
    hidden, weight, bias, targets, grad_rows, *, config: str, mode: str, budget_mib: Optional[float],
    weight_layout: str = "vh", head_grad: str = "full", grad_lse=None, grad_output: float = 1.0,
):  # fmt: skip
    """``(loss, dhidden, dweight, dbias, row_loss[N], count, lse[N])``: the gradients of
    ``grad_output·L + Σ_i grad_lse_i·lse_i`` (``grad_lse`` ``[N]`` or None), ``lse`` each
    row's log-sum-exp of the scaled logits (0 where ignored)."""
    v = vocab_size(weight, weight_layout)
    n = targets.shape[0]
    x = hidden
    results = (
        _like(x, ()),
        _like(x, hidden.shape),
        *head_grad_results(x, weight, bias, v, head_grad),
        _like(x, (n,)),
        _like(x, ()),
        _like(x, (n,)),
    )
    return _call(
        "flashloss_ce_linear", results,
        hidden, weight, _or_empty(bias, hidden.dtype), targets, _or_empty(grad_rows, jnp.float32),
        _or_empty(grad_lse, jnp.float32), budget_mib=_mib(budget_mib), config=config, mode=mode,
        weight_layout=weight_layout, head_grad=head_grad, grad_output=float(grad_output),
    )  # fmt: skip


def ce_rows(hidden, weight, bias, targets, *, config: str, budget_mib: Optional[float], weight_layout: str = "vh"):
    """``(row_loss[N], lse[N])``: the per-row CE losses and log-sum-exps (0 where
    ignored), one statistics pass (no gradient buffers)."""
    n = targets.shape[0]
    vocab_size(weight, weight_layout)
    return _call(
        "flashloss_ce_rows", (_like(hidden, (n,)), _like(hidden, (n,))),
        hidden, weight, _or_empty(bias, hidden.dtype), targets, budget_mib=_mib(budget_mib), config=config,
        weight_layout=weight_layout,
    )  # fmt: skip


def logp_linear(
    hidden, weight, bias, ids, mask, *, temperature: float, budget_mib: Optional[float], weight_layout: str = "vh"
):
    """``(logp[N], entropy[N])`` (no gradient)."""
    n = ids.shape[0]
    vocab_size(weight, weight_layout)
    return _call(
        "flashloss_logp_linear", (_like(hidden, (n,)), _like(hidden, (n,))),
        hidden, weight, _or_empty(bias, hidden.dtype), ids, mask,
        budget_mib=_mib(budget_mib), mode="two_pass", temperature=float(temperature), weight_layout=weight_layout,
    )  # fmt: skip


def grpo_logits(logits, ids, mask, advantages, old, ref, ratio=None, *, config: str):
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
        _or_empty(ratio, jnp.float32), config=config,
    )  # fmt: skip


def grpo_logits_rows(logits, ids, mask, advantages, old, ref, grad_rows, *, config: str, with_grad: bool, ratio=None):
    """``(token_loss, kl, clipped, dlogits)``, ``[B, T]`` f32 and (``with_grad``) the
    gradient of ``Σ grad_rows·ℓ_tot`` in the logits' shape and dtype (else ``[0]``)."""
    b, t = ids.shape
    z = logits
    dz = _like(z, logits.shape if with_grad else (0,), logits.dtype)
    results = (_like(z, (b, t)), _like(z, (b, t)), _like(z, (b, t)), dz)
    return _call(
        "flashloss_grpo_logits_rows", results,
        logits, ids, mask, advantages, _or_empty(old, jnp.float32), _or_empty(ref, jnp.float32),
        _or_empty(ratio, jnp.float32), grad_rows, config=config,
    )  # fmt: skip
