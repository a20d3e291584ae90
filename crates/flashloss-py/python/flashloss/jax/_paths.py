"""The dispatch table of :mod:`flashloss.jax`: :data:`PATHS` maps ``(loss, path)`` to the
path's implementation, every one ``impl(call, *operands)`` (the call's statics:
:mod:`._calls`; the FFI path's: :mod:`.ffi.entry`, the Pallas path's:
:mod:`.pallas.entry`), and :func:`dispatch` picks the path from ``impl``."""

from __future__ import annotations

import functools
from typing import Callable

import jax

from .ffi import entry as ffi
from .pallas import entry as pallas

IMPLS = ("auto", "ffi", "pallas")
LOSSES = ("linear_grpo", "grpo_logits", "grpo_logits_rows", "linear_cross_entropy", "linear_logprobs")

#: ``(loss, path) -> impl(call, *operands)``.
PATHS: dict[tuple[str, str], Callable] = {
    (loss, name): getattr(module, loss) for loss in LOSSES for name, module in (("ffi", ffi), ("pallas", pallas))
}


def dispatch(loss: str, impl: str, call, *operands):
    """``PATHS[loss, path](call, *operands)`` on the path ``impl`` names: ``"ffi"``,
    ``"pallas"``, or ``"auto"``: Pallas when ``call.interpret`` is set, else by the
    lowering platform (``jax.lax.platform_dependent``: Pallas on TPU, the FFI handlers
    elsewhere; both are traced)."""
    if impl not in IMPLS:
        raise ValueError(f"argument `impl`: expected one of {', '.join(IMPLS)}, got {impl!r}")
    on = {name: functools.partial(PATHS[loss, name], call) for name in ("ffi", "pallas")}
    if impl == "pallas" or (impl == "auto" and call.interpret):
        return on["pallas"](*operands)
    if impl == "ffi":
        return on["ffi"](*operands)
    return jax.lax.platform_dependent(*operands, tpu=on["pallas"], default=on["ffi"])
