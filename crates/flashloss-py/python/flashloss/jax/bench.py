"""The original system's A/B in JAX: one GRPO training step's loss and gradients w.r.t.
the hidden states and the LM head, ``jit(value_and_grad)``, by one of three paths:

- ``baseline``: pure JAX as the original system wrote it (f32 ``h @ W.T``, ``log_softmax``,
  ``take_along_axis``, clipped ratio, k3 KL, masked mean);
- ``tiled``: what a JAX user can write today after MaxText's vocabulary tiling: a
  ``lax.scan`` over vocabulary tiles with an online logsumexp under ``custom_vjp`` (the
  backward recomputes each tile), then the same policy stage;
- ``fused``: :func:`flashloss.jax.linear_grpo_loss`.

One path per process (its peak RSS is its own), JSON out: the step time (median after
compile), XLA's compiled ``memory_analysis`` (temp, argument, output bytes; a fused
call's own workspace is outside XLA and shows only in the RSS) and the process's peak
RSS above the inputs. Progress goes to stderr.

    python -m flashloss.jax.bench --config configs/jax/fused.yaml [--set tokens=512 ...] [--json OUT]
"""

from __future__ import annotations

import argparse
import functools
import json
import resource
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import flashloss.jax as fj
from flashloss._config import load_yaml

DEFAULTS = dict(impl="fused", tokens=2048, hidden=1024, vocab=151936, batch=4, dtype="float32",
                beta=0.04, epsilon=0.2, temperature=1.0, warmup=1, repeat=3, vocab_tile=8192,
                budget_mib=160.0, seed=0, min_length=0.5)  # fmt: skip


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _policy(logp, old, ref, adv, mask, beta, eps):
    """dapo with k3 KL (bias-corrected), the masked token mean."""
    r = jnp.exp(logp - old)
    a = adv[:, None]
    loss = -jnp.minimum(r * a, jnp.clip(r, 1 - eps, 1 + eps) * a)
    d = ref - logp
    loss = loss + beta * (jnp.exp(d) - d - 1) * r
    m = mask.astype(jnp.float32)
    return (loss * m).sum() / jnp.maximum(m.sum(), 1.0)


def baseline_loss(h, w, ids, old, ref, adv, mask, cfg):
    b, t = ids.shape
    z = h.reshape(b * t, -1).astype(jnp.float32) @ w.astype(jnp.float32).T / cfg["temperature"]
    lp = jax.nn.log_softmax(z, axis=-1)
    logp = jnp.take_along_axis(lp, ids.reshape(-1, 1), 1).reshape(b, t)
    return _policy(logp, old, ref, adv, mask, cfg["beta"], cfg["epsilon"])


def _tiles(w, tile):
    v, h = w.shape
    pad = (-v) % tile
    wp = jnp.concatenate([w, jnp.zeros((pad, h), w.dtype)]) if pad else w
    return wp.reshape(-1, tile, h), v


def _tile_logits(x, wt, k, tile, v, inv_t):
    z = (x @ wt.T).astype(jnp.float32) * inv_t
    cols = k * tile + jnp.arange(tile)
    return jnp.where(cols[None, :] < v, z, -jnp.inf), cols


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def tiled_logp(x, w, ids, tile, inv_t):
    return _tiled_fwd(x, w, ids, tile, inv_t)[0]


def _tiled_fwd(x, w, ids, tile, inv_t):
    wt, v = _tiles(w, tile)
    n = x.shape[0]

    def step(carry, kw):
        m, s, tgt = carry
        k, wk = kw
        z, cols = _tile_logits(x, wk, k, tile, v, inv_t)
        m2 = jnp.maximum(m, z.max(1))
        s = s * jnp.exp(m - m2) + jnp.exp(z - m2[:, None]).sum(1)
        hit = cols[None, :] == ids[:, None]
        return (m2, s, tgt + jnp.where(hit, z, 0.0).sum(1)), None

    init = (jnp.full((n,), -jnp.inf), jnp.zeros((n,)), jnp.zeros((n,)))
    (m, s, tgt), _ = jax.lax.scan(step, init, (jnp.arange(wt.shape[0]), wt))
    lse = m + jnp.log(s)
    return tgt - lse, (x, w, ids, lse)


def _tiled_bwd(tile, inv_t, res, g):
    x, w, ids, lse = res
    wt, v = _tiles(w, tile)

    def step(dx, kw):
        k, wk = kw
        z, cols = _tile_logits(x, wk, k, tile, v, inv_t)
        p = jnp.exp(z - lse[:, None])
        dz = (g[:, None] * ((cols[None, :] == ids[:, None]) - p) * inv_t).astype(x.dtype)
        return dx + dz @ wk, dz.T @ x

    dx, dw = jax.lax.scan(step, jnp.zeros_like(x), (jnp.arange(wt.shape[0]), wt))
    return dx, dw.reshape(-1, w.shape[1])[: w.shape[0]], None


tiled_logp.defvjp(_tiled_fwd, _tiled_bwd)


def tiled_loss(h, w, ids, old, ref, adv, mask, cfg):
    b, t = ids.shape
    logp = tiled_logp(h.reshape(b * t, -1), w, ids.reshape(-1), cfg["vocab_tile"], 1.0 / cfg["temperature"])
    return _policy(logp.reshape(b, t), old, ref, adv, mask, cfg["beta"], cfg["epsilon"])


def fused_loss(h, w, ids, old, ref, adv, mask, cfg):
    return fj.linear_grpo_loss(
        h, w, ids, mask, adv, old_per_token_logps=old, ref_per_token_logps=ref, loss_type="dapo",
        beta=cfg["beta"], epsilon_low=cfg["epsilon"], temperature=cfg["temperature"], budget_mib=cfg["budget_mib"],
    )[0]  # fmt: skip


IMPLS = {"baseline": baseline_loss, "tiled": tiled_loss, "fused": fused_loss}


def inputs(cfg):
    rng = np.random.default_rng(cfg["seed"])
    b, n, h, v = cfg["batch"], cfg["tokens"], cfg["hidden"], cfg["vocab"]
    t = n // b
    dtype = jnp.dtype(cfg["dtype"])
    hid = jnp.asarray(rng.standard_normal((b, t, h), np.float32), dtype)
    w = jnp.asarray(rng.standard_normal((v, h), np.float32) * (1.0 / np.sqrt(h)), dtype)
    ids = jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32)
    base = -float(np.log(v))
    old = jnp.asarray(base + 0.1 * rng.standard_normal((b, t)), jnp.float32)
    ref = jnp.asarray(base + 0.1 * rng.standard_normal((b, t)), jnp.float32)
    adv = jnp.asarray(rng.standard_normal(b), jnp.float32)
    # Each sequence's completion: a length drawn from [min_length·T, T], padding after it.
    lengths = rng.integers(round(cfg["min_length"] * t), t + 1, b)
    mask = jnp.asarray(np.arange(t)[None, :] < lengths[:, None])
    return hid, w, ids, old, ref, adv, mask


def run(cfg) -> dict:
    loss_fn = IMPLS[cfg["impl"]]
    args = inputs(cfg)
    jax.block_until_ready(args)
    rss_inputs = _rss_bytes()
    step = jax.jit(jax.value_and_grad(lambda h, w, *rest: loss_fn(h, w, *rest, cfg), argnums=(0, 1)))
    compiled = step.lower(*args).compile()
    mem = compiled.memory_analysis()
    times = []
    for k in range(cfg["warmup"] + cfg["repeat"]):
        start = time.perf_counter()
        loss, grads = compiled(*args)
        jax.block_until_ready((loss, grads))
        if k >= cfg["warmup"]:
            times.append(time.perf_counter() - start)
        print(
            f"{cfg['impl']}: step {k + 1}/{cfg['warmup'] + cfg['repeat']} {times[-1] if times else 0:.3f} s",
            file=sys.stderr,
        )
    return {
        "impl": cfg["impl"],
        "config": cfg,
        "loss": float(loss),
        "step_seconds_median": statistics.median(times),
        "step_seconds": times,
        "temp_bytes": int(mem.temp_size_in_bytes),
        "argument_bytes": int(mem.argument_size_in_bytes),
        "output_bytes": int(mem.output_size_in_bytes),
        "peak_rss_above_inputs_bytes": _rss_bytes() - rss_inputs,
        "logits_bytes_f32": 4 * cfg["tokens"] * cfg["vocab"],
        "devices": str(jax.devices()),
    }


def load(path, overrides):
    cfg = load_yaml(path, overrides, DEFAULTS)
    if cfg["impl"] not in IMPLS:
        raise ValueError(f"impl: expected one of {sorted(IMPLS)}, got {cfg['impl']!r}")
    if not 0.0 <= cfg["min_length"] <= 1.0:
        raise ValueError(f"min_length: expected a fraction of T in [0, 1], got {cfg['min_length']!r}")
    if cfg["tokens"] % cfg["batch"]:
        raise ValueError(f"tokens: {cfg['tokens']} is not a multiple of batch {cfg['batch']}")
    return cfg


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--json", metavar="OUT")
    a = p.parse_args(argv)
    cfg = load(a.config, a.set)
    print(f"bench: {cfg['impl']} N={cfg['tokens']} H={cfg['hidden']} V={cfg['vocab']} {cfg['dtype']}", file=sys.stderr)
    result = run(cfg)
    text = json.dumps(result)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
