"""flashloss.jax's Pallas path inside ``jax.shard_map`` on 8 simulated CPU devices (JAX's
varying-axis checks on; the kernels in interpret mode): ``token_axis``, ``vocab_axis``
and both on a 2 x 4 mesh give the one-device loss and gradients of GRPO (token and
sequence level), the cross-entropy and the log-probs, in both head layouts. Runs in a
subprocess, since the device count must be set before JAX starts."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("jax")
pytest.importorskip("flashloss.jax")

CASES = 7


def test_sharded_pallas_equals_one_device():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    out = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    done = [line for line in out.stdout.splitlines() if line.startswith("ok ")]
    assert len(done) == CASES, out.stdout


def _main():
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import flashloss.jax as fj

    assert len(jax.devices()) == 8
    rng = np.random.default_rng(0)
    b, t, h, v = 8, 5, 8, 304
    hidden = jnp.asarray(rng.standard_normal((b, t, h)), jnp.float32)
    weight = jnp.asarray(rng.standard_normal((v, h)) * 0.3, jnp.float32)
    ids = jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32)
    mask = jnp.asarray(np.arange(t)[None] < rng.integers(1, t + 1, b)[:, None])
    adv = jnp.asarray(rng.standard_normal(b), jnp.float32)
    old = jnp.asarray(-np.log(v) + 0.3 * rng.standard_normal((b, t)), jnp.float32)
    ref = jnp.asarray(-np.log(v) + 0.3 * rng.standard_normal((b, t)), jnp.float32)
    targets = jnp.where(mask, ids, -100)

    def grpo(level, layout):
        def loss(x, w, i, m, a, o, r, token_axis=None, vocab_axis=None):
            return fj.linear_grpo_loss(
                x, w, i, m, a, old_per_token_logps=o, ref_per_token_logps=r, beta=0.04, loss_type="grpo",
                importance_sampling_level=level, impl="pallas", interpret=True, weight_layout=layout,
                token_axis=token_axis, vocab_axis=vocab_axis,
            )[0]  # fmt: skip

        return loss

    def ce(x, w, i, m, a, o, r, token_axis=None, vocab_axis=None):
        return fj.linear_cross_entropy(x, w, jnp.where(m, i, -100), label_smoothing=0.1, impl="pallas",
                                       interpret=True, vocab_axis=vocab_axis)  # fmt: skip

    def logprobs(x, w, i, m, a, o, r, token_axis=None, vocab_axis=None):
        logp, ent = fj.linear_logprobs(
            x, w, i, temperature=0.9, return_entropy=True, mask=m, impl="pallas", interpret=True, vocab_axis=vocab_axis
        )[:2]
        return (logp * a[:, None]).sum() + 0.1 * ent.sum()

    cases = [
        ("token", "grpo token", grpo("token", "vh")),
        ("vocab", "grpo token", grpo("token", "vh")),
        ("2d", "grpo sequence hv", grpo("sequence", "hv")),
        ("vocab", "grpo sequence hv", grpo("sequence", "hv")),
        ("vocab", "ce", ce),
        ("vocab", "logprobs", logprobs),
        ("2d", "grpo token", grpo("token", "vh")),
    ]
    assert len(cases) == CASES
    tokens = (ids, mask, adv, old, ref)
    del targets
    for parallel, name, fn in cases:
        layout = "hv" if name.endswith("hv") else "vh"
        w_in = weight if layout == "vh" else weight.T
        want, (dh_want, dw_want) = jax.value_and_grad(fn, (0, 1))(hidden, w_in, *tokens)
        shape = {"token": (8, 1), "vocab": (1, 8), "2d": (2, 4)}[parallel]
        names = tuple(a for a, k in zip(("t", "v"), shape) if k > 1)
        mesh = jax.make_mesh(tuple(k for k in shape if k > 1), names, axis_types=(AxisType.Explicit,) * len(names))
        axes = dict(token_axis="t" if "t" in names else None, vocab_axis="v" if "v" in names else None)
        if name in ("ce", "logprobs"):
            axes.pop("token_axis")
            rows = P()
        else:
            rows = P(axes["token_axis"])
        block = P(axes["vocab_axis"]) if layout == "vh" else P(None, axes["vocab_axis"])
        specs = (rows, block) + (rows,) * len(tokens)

        def local(x, w, *tok, fn=fn, axes=axes):
            return jax.value_and_grad(lambda x, w: fn(x, w, *tok, **axes), (0, 1))(x, w)

        step = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=(P(), (rows, block)))
        placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((hidden, w_in) + tokens, specs)]
        got, (dh, dw) = jax.jit(step)(*placed)
        scale = max(1.0, abs(float(want)))
        assert abs(float(got) - float(want)) <= 1e-5 * scale, (parallel, name, float(got), float(want))
        for g, w_ in ((dh, dh_want), (dw, dw_want)):
            err = float(jnp.abs(g - w_).max() / jnp.maximum(jnp.abs(w_).max(), 1e-6))
            assert err <= 1e-5, (parallel, name, err)
        print("ok", parallel, name)


if __name__ == "__main__":
    _main()
