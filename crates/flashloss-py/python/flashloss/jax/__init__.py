"""JAX operations over flashloss's fused kernels, on two paths chosen by platform.

``linear_grpo_loss``, ``linear_cross_entropy`` and ``linear_logprobs`` compute TRL's GRPO
loss, the cross-entropy and per-token log-probs/entropy straight from the hidden states
and the LM head, never holding the ``[tokens x vocab]`` logits; ``grpo_loss`` is the
logits-level GRPO loss. The API is :mod:`flashloss.torch`'s, argument for argument
(names, defaults, keyword-only rules, return types: ``tests/test_api_parity.py``), with
TRL's names and defaults (:mod:`flashloss._spec`); where torch takes a
``vocab_parallel_group``, JAX takes ``vocab_axis`` (and ``token_axis``), and every
function also takes:

- ``impl``: ``"ffi"`` runs flashloss's XLA FFI handlers (CPU; CUDA where built, not yet
  run on a GPU): one fused kernel call gives the loss and the gradients together.
  ``"pallas"`` runs Pallas TPU (Mosaic) kernels (:mod:`flashloss.jax.pallas`) for the
  head's per-row statistics and their backward, with the loss above them in plain JAX
  that JAX differentiates. ``"auto"`` (default) picks per lowering platform with
  ``jax.lax.platform_dependent``: Pallas on TPU, the FFI handlers elsewhere, so a step
  exported for TPU from a CPU host takes the Pallas path. The Pallas path has never run on
  a TPU: it is checked in TPU interpret mode, and compiled for v5e, v6e, v5p and v7x by the
  real XLA TPU compiler (libtpu, no TPU: :mod:`flashloss.jax.tpu_compile`; ``docs/jax.md``).
- ``interpret``: run the Pallas kernels in interpret mode (``True``, or
  ``pltpu.InterpretParams()`` for TPU semantics) on any backend; with ``impl="auto"`` it
  selects the Pallas path.
- ``weight_layout``: ``"vh"`` for a head ``[V, H]`` (PyTorch, tied embeddings), ``"hv"``
  for a Flax kernel ``[H, V]`` (``'BTD,DV->BTV'``); no path makes a transposed copy.

They work under ``jax.jit``, ``jax.grad`` / ``value_and_grad``, ``jax.vmap`` and
``jax.shard_map`` (``token_axis``, ``vocab_axis``), in float32, bfloat16 and float16
(float16 widened to float32 on the Pallas path). The
per-token outputs (``logp``, ``entropy``, ``kl``) and the metrics carry no gradient.

Errors known at trace time (shapes, dtypes, the loss config) are ``ValueError`` naming
the argument, on both paths; those only the data tell (ids out of range, values beyond
f32) are raised by JAX as ``JaxRuntimeError`` with flashloss's message.
"""

from __future__ import annotations

import jax

from .._spec import GRPOOutputs, LogprobOutputs
from .ffi import ops as _ffi_ops
from ._grpo import grpo_loss, linear_grpo_loss
from ._losses import linear_cross_entropy, linear_logprobs

__all__ = ["GRPOOutputs", "LogprobOutputs", "grpo_loss", "linear_cross_entropy", "linear_grpo_loss", "linear_logprobs"]

_ffi_ops.register()
jax.tree_util.register_dataclass(GRPOOutputs)
