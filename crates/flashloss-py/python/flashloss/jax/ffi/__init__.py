"""The FFI path of :mod:`flashloss.jax` (CPU, and CUDA where built): flashloss's XLA FFI
handlers (``crates/flashloss-py/src/jax``) under ``jax.custom_vjp``.

- :mod:`.entry`: the path's implementation of each loss, ``impl(call, *operands)``, as
  :data:`flashloss.jax._paths.PATHS` names them;
- :mod:`.ops`: the ``jax.ffi.ffi_call`` of each handler (result types, attributes) and
  their registration;
- :mod:`.fused`: the one-device losses, each one fused kernel call giving the loss and
  the gradients together;
- :mod:`.vocab`: GRPO, log-probs and CE over a head split over ``vocab_axis``, cut at
  the collectives;
- :mod:`.support`: the sampler's truncated support (``top_k``/``top_p``/``min_p``) on one
  device, and the filters' rule (:class:`.._head.Filters`); :mod:`.support_vocab`: the
  support over ``vocab_axis`` in plain JAX.
"""
