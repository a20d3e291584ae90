"""Pallas (Mosaic TPU) kernels of :mod:`flashloss.jax` (``impl="pallas"``, and
``impl="auto"`` when lowered for TPU). Never run on a TPU: checked in TPU interpret mode
on the CPU, and compiled for v5e, v6e, v5p and v7x by the real XLA TPU compiler (libtpu,
no TPU needed: :mod:`flashloss.jax.tpu_compile`; ``docs/jax.md``).

- :mod:`.head`: the LM head's forward, a running softmax state per row over vocabulary
  tiles; :mod:`.head_grads`: its dH and dW kernels from per-row coefficients;
  :mod:`.stats`: the ``custom_vjp`` over them (per-row lse, logp, entropy, mean logit);
- :mod:`.logits`: the logits-level kernels (statistics, gradient, and a fused
  statistics-loss-gradient kernel for token-local losses);
- :mod:`.losses`: GRPO, CE and log-probs on them, the loss in plain JAX
  (:mod:`flashloss.jax._policy`); :mod:`.._checks`: run-time input checks;
- :mod:`.entry`: the path's implementation of each loss, ``impl(call, *operands)``, as
  :data:`flashloss.jax._paths.PATHS` names them;
- :mod:`._chips`: the chips, their VMEM and the blocks (:func:`target_chip`).
"""

from ._chips import target_chip

__all__ = ["target_chip"]
