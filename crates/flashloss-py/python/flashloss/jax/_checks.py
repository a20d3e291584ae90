"""Run-time checks of the Pallas path's inputs, with the FFI path's messages.

What only the data can tell (an id outside the vocabulary, a value that is not
finite, a target whose logit is ``-inf``) is found on the device as the first bad
index of each kind, and reported by a host callback that raises ``ValueError``; JAX
surfaces it as a ``JaxRuntimeError`` carrying the message, as it does the FFI
handlers' errors. The callback is emitted only where the program runs on the host
that traces it (interpret mode, or a TPU host); a program lowered for TPU on a host
without one (``jax.export``) carries no Python callback and so no checks: a serialized
program cannot call back into Python.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np


def runs_here(interpret: Any) -> bool:
    """Whether the Pallas kernels run on this host's default backend."""
    return bool(interpret) or jax.default_backend() == "tpu"


def _first(bad: jax.Array) -> tuple[jax.Array, jax.Array]:
    flat = bad.reshape(-1)
    return jnp.any(flat), jnp.argmax(flat)


def ids_in_range(arg: str, ids: jax.Array, live: jax.Array, vocab: int, seq_len: int, interpret: Any) -> None:
    """Every live id in ``[0, vocab)``."""
    if not runs_here(interpret):
        return
    flat, live = ids.reshape(-1), live.reshape(-1)
    any_bad, index = _first(live & ((flat < 0) | (flat >= vocab)))

    def report(any_bad, index, id_):
        if any_bad:
            i = int(index)
            raise ValueError(
                f"argument `{arg}`: id {int(id_)} at index {i} (sequence {i // seq_len}, position {i % seq_len}) "
                f"is outside [0, {vocab})"
            )

    jax.debug.callback(report, any_bad, index, flat[index])


def finite(arg: str, values: Optional[jax.Array], live: Optional[jax.Array], interpret: Any) -> None:
    """Every value of ``values`` finite (where ``live``, when given)."""
    if values is None or not runs_here(interpret):
        return
    bad = ~jnp.isfinite(values)
    if live is not None:
        bad = bad & jnp.broadcast_to(live, values.shape)
    any_bad, index = _first(bad)

    def report(any_bad, index, value):
        if any_bad:
            raise ValueError(f"argument `{arg}`: value {float(value)} at index {int(index)} is not finite")

    jax.debug.callback(report, any_bad, index, values.reshape(-1)[index].astype(jnp.float32))


def sampler_ratio(ratio: Optional[jax.Array], mask: jax.Array, interpret: Any) -> None:
    """The sampler's importance ratio (``[B, 1]``: every value; ``[B, T]``: where ``mask``)
    finite and ``>= 0``, with the FFI handlers' message."""
    if ratio is None or not runs_here(interpret):
        return
    bad = ~(jnp.isfinite(ratio) & (ratio >= 0))
    if ratio.shape == mask.shape:
        bad = bad & mask
    any_bad, index = _first(bad)

    def report(any_bad, index, value):
        if any_bad:
            why = "is negative" if np.isfinite(value) else "is not finite"
            raise ValueError(f"argument `importance_sampling_ratio`: value {float(value)} at index {int(index)} {why}")

    jax.debug.callback(report, any_bad, index, ratio.reshape(-1)[index].astype(jnp.float32))


def row_stats_finite(lse: jax.Array, logp: jax.Array, live: jax.Array, seq_len: int, interpret: Any) -> None:
    """A live row's statistics finite: NaN or +inf in its logits names ``hidden``/
    ``weight``; a ``-inf`` target logit (probability zero) names the row."""
    if not runs_here(interpret):
        return
    lse, logp, live = lse.reshape(-1), logp.reshape(-1), live.reshape(-1)
    any_nan, nan_row = _first(live & ~jnp.isfinite(lse))
    any_zero, zero_row = _first(live & jnp.isfinite(lse) & (logp == -np.inf))

    def report(any_nan, nan_row, any_zero, zero_row):
        if any_nan:
            raise ValueError(
                f"argument `hidden` or `weight`: row {int(nan_row)} holds NaN or +inf logits (a value of hidden, "
                "weight or bias is not finite, or too large)"
            )
        if any_zero:
            i = int(zero_row)
            raise ValueError(
                f"row {i} (sequence {i // seq_len}, position {i % seq_len}): its target id has a -inf logit"
            )

    jax.debug.callback(report, any_nan, nan_row, any_zero, zero_row)
