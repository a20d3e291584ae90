"""The collectives of ``flashloss.jax``, written once: the merge of the vocabulary blocks'
partial softmax states over a ``vocab_axis`` (flashloss's ``sharding::merge_partial``),
a block's vocabulary offset, and :func:`over_tokens`, the reduction of a GRPO loss and its
metrics over a ``token_axis``, driven by ``flashloss._spec.NORMALIZERS``. The Pallas path's
``pallas.stats`` merges its kernel's state (in scaled units) with the same functions at
temperature 1."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .._spec import METRICS, GrpoArgs
from ._head import vocab_size


def psum(x, axis):
    """``x`` summed over ``axis`` (itself when the head is not split: ``axis`` None)."""
    return x if axis is None else jax.lax.psum(x, axis)


def merge_partial(part, mask, axis, temperature):
    """The row statistics over the whole vocabulary from every block's partial state
    (``axis`` None: one block, the whole head)."""
    mx, s, u, tgt = part[:4]
    live = mask
    top = jnp.where(live, mx, -jnp.inf)
    top = top if axis is None else jax.lax.pmax(top, axis)
    top = jnp.where(live, top, 0.0)
    inv_t = jnp.float32(1.0 / temperature)
    d = jnp.where(live & (s > 0), (mx - top) * inv_t, 0.0)
    f = jnp.where(live & (s > 0), jnp.exp(d), 0.0)
    total = psum(s * f, axis)
    weighted = psum(f * (u + s * d), axis)
    total = jnp.where(live, total, 1.0)
    log_sum = jnp.log(total)
    entropy = jnp.where(live, log_sum - weighted / total, 0.0)
    logp = jnp.where(live, (psum(tgt, axis) - top) * inv_t - log_sum, 0.0)
    return top, jnp.where(live, log_sum, 0.0), entropy, logp


def sum_p2(part, mask, top, axis, temperature):
    """``Σ_j p_j² = Σ S₂·f² / (Σ S·f)²`` over the blocks, ``f = exp((max - top)/T)`` each
    block's rescale to the merged ``top`` (0 where not ``mask``)."""
    mx, s, _, _, s2 = part
    f = jnp.where(mask & (s > 0), jnp.exp((mx - top) * jnp.float32(1.0 / temperature)), 0.0)
    total = jnp.where(mask, psum(s * f, axis), 1.0)
    return jnp.where(mask, psum(s2 * f * f, axis) / (total * total), 0.0)


def vocab_offset(weight, axis, layout):
    """The first vocabulary id of this device's block of the head."""
    if axis is None:
        return jnp.int32(0)
    return (jax.lax.axis_index(axis) * vocab_size(weight, layout)).astype(jnp.int32)


def over_tokens(loss, metrics, mask, axis: str, args: GrpoArgs, clips_per_sequence: bool):
    """The one-device loss and metrics from each device's over ``axis``: the loss is a sum
    of row terms over the normalizer ``args.normalizer`` names (``NORMALIZERS``), so
    ``L = Σ_d L_d · n_d / Σ_d n_d`` (``n_d`` the device's normalizer; a given
    ``num_items_in_batch`` is already global, so the devices' losses add up); the metrics
    are token means, so they are weighted by the devices' token counts (the clip metrics
    by their sequence counts where they are sequence means)."""
    tokens = mask.sum().astype(jnp.float32)
    sequences = jnp.float32(mask.shape[0])
    clips = sequences if clips_per_sequence else tokens
    weight = {"kl": tokens, "entropy": tokens}
    weights = jnp.stack([weight.get(name, clips) for name in METRICS])
    metrics = jax.lax.psum(metrics * weights, axis) / jnp.maximum(jax.lax.psum(weights, axis), 1.0)
    norm = {"given": jnp.float32(1.0), "tokens": tokens, "sequences": sequences}[args.normalizer]
    share = norm if args.normalizer == "given" else norm / jax.lax.psum(norm, axis)
    loss = jax.lax.psum(jax.lax.stop_gradient(share) * loss, axis)
    return loss, metrics
