"""A JAX GRPO step, jit(value_and_grad) of flashloss.jax.linear_grpo_loss, checked against the
same DAPO loss computed the plain way on materialized logits. On a TPU the same step runs the
Pallas kernels; elsewhere the XLA FFI handlers.

Run: python examples/jax_grpo_step.py
"""

import jax
import jax.numpy as jnp
import numpy as np

import flashloss.jax as fj

B, T, H, V = 4, 32, 64, 5000
k = jax.random.split(jax.random.key(0), 5)
hidden = jax.random.normal(k[0], (B, T, H))
weight = jax.random.normal(k[1], (V, H)) / np.sqrt(H)  # the LM head [V, H]; weight_layout="hv" takes a Flax [H, V]
completion_ids = jax.random.randint(k[2], (B, T), 0, V)
completion_mask = jnp.ones((B, T), jnp.int32).at[:, -5:].set(0)
advantages = jax.random.normal(k[3], (B,))
old_logps = -jax.random.uniform(k[4], (B, T)) - 8.0


def fused(h: jax.Array, w: jax.Array) -> jax.Array:
    loss, _ = fj.linear_grpo_loss(h, w, completion_ids, completion_mask, advantages, old_per_token_logps=old_logps)
    return loss


step = jax.jit(jax.value_and_grad(fused, argnums=(0, 1)))
loss, (dhidden, dweight) = step(hidden, weight)
print(f"flashloss loss {float(loss):.6f}")


def plain(h: jax.Array, w: jax.Array) -> jax.Array:
    """Logits, log-softmax, TRL's clipped ratio, DAPO's token-normalized sum."""
    logp = jnp.take_along_axis(jax.nn.log_softmax(h @ w.T, -1), completion_ids[..., None], -1)[..., 0]
    ratio = jnp.exp(logp - old_logps)
    a = advantages[:, None]
    per_token = -jnp.minimum(ratio * a, jnp.clip(ratio, 0.8, 1.2) * a)
    return (per_token * completion_mask).sum() / completion_mask.sum()


want, (want_dh, want_dw) = jax.jit(jax.value_and_grad(plain, argnums=(0, 1)))(hidden, weight)
print(f"plain loss     {float(want):.6f}")
np.testing.assert_allclose(loss, want, rtol=1e-5, atol=1e-6)
for got, want in ((dhidden, want_dh), (dweight, want_dw)):
    # The default plan (mode="auto") may keep probabilities in f16 on the CPU: gradients within 1e-3 of the largest.
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-3 * float(jnp.abs(want).max()))
print("OK: loss and gradients agree with the plain path")
