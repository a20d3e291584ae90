"""The sampler's truncated support (``top_k``, ``top_p``, ``min_p``) with the head split
over ``vocab_axis`` (8 simulated CPU devices, JAX's varying-axis checks on), on both
paths: ``linear_logprobs`` (``logp^K``, ``outside_support``, the gradients of ``hidden``,
``weight``, ``bias``) and ``linear_grpo_loss`` (loss, ``outside_support``, gradients)
equal the one-device call. Exact inputs (``exact_head``: vocabulary rows from 64 on
repeat three patterns, so runs of equal logits span the devices' blocks) make every
logit exact, so both sides decide on the same values and ties are cut across blocks.
Runs in a subprocess, since the device count must be set before JAX starts."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("jax")
pytest.importorskip("flashloss.jax")

FILTERS = [(5, None, None), (None, 0.4, None), (None, None, 0.6), (8, 0.7, 0.05), (None, 0.93, None)]
IMPLS = ("ffi", "pallas")


def test_vocab_axis_support_equals_one_device():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(__file__), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    done = [line for line in out.stdout.splitlines() if line.startswith("ok ")]
    assert len(done) == 2 * len(IMPLS) * len(FILTERS) + 1, out.stdout


def _close(np, got, want, what, rel=1e-4):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-6)
    assert err <= rel, (what, err)


def _main():
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P
    from test_jax_logprobs_support import exact_head, support_keep

    import flashloss.jax as fj

    assert len(jax.devices()) == 8
    n, h, v, temperature = 14, 8, 8 * 23, 0.5
    x, w, b = exact_head(n, h, v, 3)
    z = x.astype(np.float64) @ w.T.astype(np.float64) + b
    ranks = [0, 1, 3, 2, 6, 30, 4, 0, 9, 5, 1, 2, 12, 0]  # targets near the top: some inside, some out
    ids = np.array([np.argsort(-z[i], kind="stable")[r] for i, r in enumerate(ranks)])
    live = np.ones(n, bool)
    live[1] = False
    g = np.linspace(0.5, -0.75, n).astype(np.float32)
    mesh = jax.make_mesh((8,), ("v",), axis_types=(AxisType.Explicit,))
    specs = (P(), P("v"), P("v"))
    head = (jnp.asarray(x), jnp.asarray(w), jnp.asarray(b))
    placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(head, specs)]
    s32 = (z.astype(np.float32) * np.float32(1.0 / temperature)).astype(np.float32)
    cut_across = False  # some support cuts a run of equal logits that spans two blocks
    for filters in FILTERS:
        keep = support_keep(s32, *filters)
        for i in range(n):
            for value in np.unique(s32[i][keep[i]]):
                run = np.flatnonzero(s32[i] == value)
                cut_across |= bool(~keep[i][run].all() and len(np.unique(run // (v // 8))) > 1)
    assert cut_across
    from flashloss.jax.ffi import support as _support
    from flashloss.jax.ffi import support_vocab as _support_vocab

    _support.BLOCK_ELEMENTS = 4 * v  # blocks of 4 rows: 14 rows end in a padded block
    split = jax.device_put(jnp.asarray(s32), NamedSharding(mesh, P(None, "v")))
    for filters in FILTERS:
        f = _support.Filters(*filters)
        masks = jax.shard_map(lambda s: _support_vocab.keep_block(s, f, "v")[0], mesh=mesh, in_specs=P(None, "v"),
                              out_specs=P(None, "v"))(split)  # fmt: skip
        np.testing.assert_array_equal(np.asarray(masks), support_keep(s32, *filters), err_msg=str(filters))
    print("ok the support's masks over 8 blocks are the reference's, ties cut across blocks")

    for impl in IMPLS:
        for top_k, top_p, min_p in FILTERS:
            kw = dict(top_k=top_k, top_p=top_p, min_p=min_p, impl=impl, interpret=impl == "pallas")

            def logprobs(x, w, bb, axis=None):
                out = fj.linear_logprobs(
                    x,
                    w,
                    jnp.asarray(ids),
                    temperature=temperature,
                    return_entropy=True,
                    bias=bb,
                    mask=jnp.asarray(live),
                    vocab_axis=axis,
                    **kw,
                )
                obj = (jnp.where(out.outside_support, 0.0, out.logp) * g).sum() + 0.1 * out.entropy.sum()
                return obj, (out.logp, out.outside_support)

            grad = jax.value_and_grad(logprobs, (0, 1, 2), has_aux=True)
            (want, (lp, out)), wg = jax.jit(grad)(*head)
            local = jax.shard_map(lambda *a: grad(*a, "v"), mesh=mesh, in_specs=specs,
                                  out_specs=((P(), (P(), P())), (P(), P("v"), P("v"))))  # fmt: skip
            (got, (lp_got, out_got)), gg = jax.jit(local)(*placed)
            np.testing.assert_array_equal(np.asarray(out_got), np.asarray(out))
            outside = int(np.asarray(out).sum())
            finite = live & ~np.asarray(out)
            assert np.isneginf(np.asarray(lp_got)[np.asarray(out)]).all()
            _close(np, np.asarray(lp_got)[finite], np.asarray(lp)[finite], ("logp", impl, top_k, top_p), 1e-5)
            assert abs(float(got) - float(want)) <= 1e-5 * max(abs(float(want)), 1.0), (impl, got, want)
            for name, a_, b_ in zip(("dhidden", "dweight", "dbias"), gg, wg):
                _close(np, a_, b_, ("logprobs", impl, top_k, top_p, min_p, name))
            print("ok logprobs", impl, top_k, top_p, min_p, outside, "outside")
            outside += _grpo(jax, jnp, np, fj, mesh, specs, head, placed, ids, impl, (top_k, top_p, min_p))
            assert outside > 0 or top_p == 0.93, ("no target outside", impl, top_k, top_p, min_p)


def _grpo(jax, jnp, np, fj, mesh, specs, head, placed, ids, impl, filters):
    from jax.sharding import PartitionSpec as P

    ids = ids.reshape(2, -1)
    rng = np.random.default_rng(1)
    mask = np.ones(ids.shape, bool)
    mask[1, -1] = False
    adv = rng.standard_normal(ids.shape[0]).astype(np.float32)
    old = (rng.standard_normal(ids.shape) * 0.1 - 2.0).astype(np.float32)
    ref = (old - 0.05).astype(np.float32)
    top_k, top_p, min_p = filters
    kw = dict(loss_type="dapo", beta=0.04, temperature=0.9, entropy_coef=0.01, top_k=top_k, top_p=top_p, min_p=min_p,
              impl=impl, interpret=impl == "pallas")  # fmt: skip

    def loss(x, w, bb, axis=None):
        out = fj.linear_grpo_loss(x.reshape(*ids.shape, -1), w, jnp.asarray(ids), jnp.asarray(mask), adv, bias=bb,
                                  old_per_token_logps=old, ref_per_token_logps=ref, vocab_axis=axis, **kw)  # fmt: skip
        return out[0], (out[1].outside_support, out[1].metrics["kl"])

    grad = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)
    (want, (out, kl)), wg = jax.jit(grad)(*head)
    local = jax.shard_map(lambda *a: grad(*a, "v"), mesh=mesh, in_specs=specs,
                          out_specs=((P(), (P(), P())), (P(), P("v"), P("v"))))  # fmt: skip
    (got, (out_got, kl_got)), gg = jax.jit(local)(*placed)
    np.testing.assert_array_equal(np.asarray(out_got), np.asarray(out))
    assert abs(float(got) - float(want)) <= 1e-5 * max(abs(float(want)), 1.0), (impl, filters, got, want)
    assert abs(float(kl_got) - float(kl)) <= 1e-5 * max(abs(float(kl)), 1.0), (impl, filters, kl_got, kl)
    for name, a_, b_ in zip(("dhidden", "dweight", "dbias"), gg, wg):
        _close(np, a_, b_, ("grpo", impl, filters, name))
    print("ok grpo", impl, filters, int(np.asarray(out).sum()), "outside")
    return int(np.asarray(out).sum())


if __name__ == "__main__":
    _main()
