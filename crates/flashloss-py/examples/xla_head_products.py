"""The three products of a GRPO step on an LM head, alone, in XLA on the CPU: how much of
the pure-JAX baseline's step (``python -m flashloss.jax.bench --config
configs/jax/baseline.yaml``) is GEMM at XLA's own rate. ``jit`` of ``h @ W.T``
(logits), ``dZ @ W`` (dH) and ``dZ.T @ h`` (dW) in f32 at N tokens, H, V; the best of
``--repeat`` calls after one warm-up, as JSON with GFLOP/s (2NHV each).

    python crates/flashloss-py/examples/xla_head_products.py [--tokens 2048] [--hidden 1024] [--vocab 151936]
"""

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args()
    n, h, v = a.tokens, a.hidden, a.vocab
    rng = np.random.default_rng(0)
    hid = jnp.asarray(rng.standard_normal((n, h), np.float32))
    w = jnp.asarray(rng.standard_normal((v, h), np.float32))
    dz = jnp.asarray(rng.standard_normal((n, v), np.float32))
    products = {
        "logits": (jax.jit(lambda x, w: x @ w.T), (hid, w)),
        "dhidden": (jax.jit(lambda dz, w: dz @ w), (dz, w)),
        "dweight": (jax.jit(lambda dz, x: dz.T @ x), (dz, hid)),
    }
    out = {"tokens": n, "hidden": h, "vocab": v, "devices": str(jax.devices())}
    for name, (f, args) in products.items():
        jax.block_until_ready(f(*args))
        times = []
        for _ in range(a.repeat):
            start = time.perf_counter()
            jax.block_until_ready(f(*args))
            times.append(time.perf_counter() - start)
        out[name] = {"best_s": min(times), "gflops_per_s": 2 * n * h * v / min(times) / 1e9}
    out["sum_best_s"] = sum(out[k]["best_s"] for k in products)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
