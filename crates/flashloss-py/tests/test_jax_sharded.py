"""flashloss.jax inside `jax.shard_map` on 8 simulated CPU devices (with JAX's
varying-axis checks on): `token_axis` (the sequences split over the axis) and
`vocab_axis` (the head's rows split over it), both on a 2 x 4 mesh, and the
differentiable `linear_logprobs` over `vocab_axis` give the one-device loss, metrics and
gradients. Runs in a subprocess, since the device count must be set before JAX starts."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("jax")
pytest.importorskip("flashloss.jax")


def test_token_axis_equals_one_device():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    out = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    done = [line for line in out.stdout.splitlines() if line.startswith("ok ")]
    assert len(done) == 10 + 2 + 4 + 6 + 1 + 4, out.stdout


def _main():
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import flashloss.jax as fj

    assert len(jax.devices()) == 8
    rng = np.random.default_rng(0)
    b, t, h, v = 16, 5, 8, 301
    hidden = jnp.asarray(rng.standard_normal((b, t, h)), jnp.float32)
    weight = jnp.asarray(rng.standard_normal((v, h)) * 0.3, jnp.float32)
    bias = jnp.asarray(rng.standard_normal(v) * 0.1, jnp.float32)
    ids = jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32)
    mask = jnp.asarray(np.arange(t)[None, :] < rng.integers(1, t + 1, b)[:, None])
    adv = jnp.asarray(rng.standard_normal(b), jnp.float32)
    old = jnp.asarray(-np.log(v) + 0.3 * rng.standard_normal((b, t)), jnp.float32)
    ref = jnp.asarray(-np.log(v) + 0.3 * rng.standard_normal((b, t)), jnp.float32)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    data, rep = P("data"), P()
    # grpo at sequence level: its clip metrics are means over sequences (TRL's [B, 1] flags).
    levels = [("dapo", "token"), ("grpo", "token"), ("bnpo", "token"), ("dr_grpo", "token"), ("grpo", "sequence")]
    # Under a truncated support the tokens outside it are masked before the normalizers.
    supports = [("dapo", "token", dict(top_k=20, top_p=0.9)), ("bnpo", "token", dict(top_p=0.5))]
    cases = [(lt, level, beta, {}) for lt, level in levels for beta in [0.0, 0.04]]
    for loss_type, level, beta, support in cases + [(lt, level, 0.04, sup) for lt, level, sup in supports]:
        kw = dict(loss_type=loss_type, beta=beta, max_completion_length=t, temperature=0.9,
                  importance_sampling_level=level, **support)  # fmt: skip

        def loss(x, w, bb, i, m, a, o, r, axis=None):
            out = fj.linear_grpo_loss(
                x, w, i, m, a, bias=bb, old_per_token_logps=o, ref_per_token_logps=r, token_axis=axis, **kw
            )
            return out[0], out[1].metrics

        args = (hidden, weight, bias, ids, mask, adv, old, ref)
        (want, wm), wg = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(*args)

        def local(x, w, bb, i, m, a, o, r):
            return jax.value_and_grad(lambda x, w, bb: loss(x, w, bb, i, m, a, o, r, "data"), (0, 1, 2), has_aux=True)(
                x, w, bb
            )

        specs = (data, rep, rep, data, data, data, data, data)
        f = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=((rep, rep), (data, rep, rep)))
        placed = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(args, specs)]
        (got, gm), gg = jax.jit(f)(*placed)
        assert abs(float(got) - float(want)) <= 1e-5 * max(abs(float(want)), 1.0), (loss_type, beta, got, want)
        for k in wm:
            assert abs(float(gm[k]) - float(wm[k])) <= 1e-5 * max(abs(float(wm[k])), 1.0), (loss_type, k)
        for name, a_, b_ in zip(("dhidden", "dweight", "dbias"), gg, wg):
            err = float(jnp.abs(a_ - b_).max()) / max(float(jnp.abs(b_).max()), 1e-6)
            assert err <= 1e-4, (loss_type, beta, name, err)
        if level == "sequence":
            assert float(wm["clip_ratio/region_mean"]) > 0, "some sequences clip"
        print("ok", loss_type, beta, support)
    _vocab_axis(jax, jnp, np, fj, mesh)
    _grid_2d(jax, jnp, np, fj)
    _logprobs_vocab_axis(jax, jnp, np, fj)
    _ce_vocab_axis(jax, jnp, np, fj)


def _ce_vocab_axis(jax, jnp, np, fj):
    """linear_cross_entropy with the head split over 8 devices: every reduction and option."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    rng = np.random.default_rng(4)
    n, h, v = 14, 8, 8 * 23
    hidden = jnp.asarray(rng.standard_normal((n, h)), jnp.float32)
    weight = jnp.asarray(rng.standard_normal((v, h)) * 0.5, jnp.float32)
    bias = jnp.asarray(rng.standard_normal(v) * 0.1, jnp.float32)
    targets = jnp.asarray(np.where(rng.random(n) > 0.2, rng.integers(0, v, n), -100), jnp.int32)
    upstream = jnp.asarray(rng.standard_normal(n), jnp.float32)
    mesh = jax.make_mesh((8,), ("v",), axis_types=(AxisType.Explicit,))
    cases = [
        ("mean", {}),
        ("sum", dict(label_smoothing=0.1, z_loss=1e-3)),
        ("none", dict(softcap=4.0, temperature=0.8)),
        ("mean", dict(softcap=3.0, label_smoothing=0.05, z_loss=1e-4)),
    ]
    for reduction, options in cases:

        def obj(x, w, bb, axis=None):
            out = fj.linear_cross_entropy(x, w, targets, bias=bb, reduction=reduction, vocab_axis=axis, **options)
            return (out * upstream).sum() if reduction == "none" else out

        want, wg = jax.value_and_grad(obj, (0, 1, 2))(hidden, weight, bias)
        local = lambda x, w, bb: jax.value_and_grad(lambda *a: obj(*a, "v"), (0, 1, 2))(x, w, bb)  # noqa: E731
        specs = (P(), P("v"), P("v"))
        f = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=(P(), (P(), P("v"), P("v"))))
        placed = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip((hidden, weight, bias), specs)]
        got, gg = jax.jit(f)(*placed)
        assert abs(float(got) - float(want)) <= 1e-5 * max(abs(float(want)), 1.0), (reduction, options, got, want)
        for name, a_, b_ in zip(("dhidden", "dweight", "dbias"), gg, wg):
            _close(jnp, a_, b_, ("ce", reduction, options, name))
        print("ok ce vocab", reduction, options)


def _close(jnp, got, want, what, rel=1e-4):
    err = float(jnp.abs(got - want).max()) / max(float(jnp.abs(want).max()), 1e-6)
    assert err <= rel, (what, err)


def _grid_2d(jax, jnp, np, fj):
    """token_axis and vocab_axis together: sequences over "t" (2), head rows over "v" (4)."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    rng = np.random.default_rng(2)
    b, t, h, v = 6, 5, 8, 4 * 43
    hidden = jnp.asarray(rng.standard_normal((b, t, h)), jnp.float32)
    weight = jnp.asarray(rng.standard_normal((v, h)) * 0.3, jnp.float32)
    bias = jnp.asarray(rng.standard_normal(v) * 0.1, jnp.float32)
    ids = jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32)
    mask = jnp.asarray(np.arange(t)[None, :] < rng.integers(1, t + 1, b)[:, None])
    adv = jnp.asarray(rng.standard_normal(b), jnp.float32)
    old = jnp.asarray(-np.log(v) + 0.3 * rng.standard_normal((b, t)), jnp.float32)
    ref = jnp.asarray(-np.log(v) + 0.3 * rng.standard_normal((b, t)), jnp.float32)
    mesh = jax.make_mesh((2, 4), ("t", "v"), axis_types=(AxisType.Explicit, AxisType.Explicit))
    # The last two under the sampler's truncated support (its tokens outside masked over both axes).
    cases = [("dapo", 0.04, "token", {}), ("grpo", 0.0, "token", {}), ("bnpo", 0.04, "token", {}),
             ("dr_grpo", 0.04, "sequence", {}), ("dapo", 0.04, "token", dict(top_k=20)),
             ("grpo", 0.04, "sequence", dict(min_p=0.05))]  # fmt: skip
    for loss_type, beta, level, support in cases:
        kw = dict(loss_type=loss_type, beta=beta, importance_sampling_level=level, temperature=0.9, **support)

        def loss(x, w, bb, i, m, a, o, r, axes=(None, None)):
            kw2 = dict(token_axis=axes[0], vocab_axis=axes[1], max_completion_length=t, **kw)
            out = fj.linear_grpo_loss(x, w, i, m, a, bias=bb, old_per_token_logps=o, ref_per_token_logps=r, **kw2)
            return out[0], out[1].metrics

        args = (hidden, weight, bias, ids, mask, adv, old, ref)
        (want, wm), wg = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(*args)

        def local(x, w, bb, i, m, a, o, r):
            f = lambda x, w, bb: loss(x, w, bb, i, m, a, o, r, ("t", "v"))  # noqa: E731
            return jax.value_and_grad(f, (0, 1, 2), has_aux=True)(x, w, bb)

        rows, block = P("t"), P("v")
        specs = (rows, block, block, rows, rows, rows, rows, rows)
        f = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=((P(), P()), (rows, block, block)))
        placed = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(args, specs)]
        (got, gm), gg = jax.jit(f)(*placed)
        assert abs(float(got) - float(want)) <= 1e-5 * max(abs(float(want)), 1.0), (loss_type, got, want)
        for k in wm:
            assert abs(float(gm[k]) - float(wm[k])) <= 1e-5 * max(abs(float(wm[k])), 1.0), (loss_type, k)
        for name, a_, b_ in zip(("dhidden", "dweight", "dbias"), gg, wg):
            _close(jnp, a_, b_, (loss_type, level, name))
        print("ok 2d", loss_type, beta, level, support)


def _logprobs_vocab_axis(jax, jnp, np, fj):
    """linear_logprobs' gradient (both outputs weighted) with the head split over 8 devices."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    rng = np.random.default_rng(3)
    n, h, v = 12, 8, 8 * 29
    hidden = jnp.asarray(rng.standard_normal((n, h)), jnp.float32)
    weight = jnp.asarray(rng.standard_normal((v, h)) * 0.3, jnp.float32)
    bias = jnp.asarray(rng.standard_normal(v) * 0.1, jnp.float32)
    ids = jnp.asarray(rng.integers(0, v, n), jnp.int32)
    mask = jnp.asarray(rng.random(n) > 0.2)
    cl, ce = jnp.asarray(rng.standard_normal(n), jnp.float32), jnp.asarray(rng.standard_normal(n), jnp.float32)

    def obj(x, w, bb, axis=None):
        lp, ent = fj.linear_logprobs(
            x, w, ids, temperature=0.8, return_entropy=True, bias=bb, mask=mask, vocab_axis=axis
        )[:2]
        return (lp * cl).sum() + (ent * ce).sum()

    want, wg = jax.value_and_grad(obj, (0, 1, 2))(hidden, weight, bias)
    mesh = jax.make_mesh((8,), ("v",), axis_types=(AxisType.Explicit,))
    local = lambda x, w, bb: jax.value_and_grad(lambda *a: obj(*a, "v"), (0, 1, 2))(x, w, bb)  # noqa: E731
    specs = (P(), P("v"), P("v"))
    f = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=(P(), (P(), P("v"), P("v"))))
    placed = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip((hidden, weight, bias), specs)]
    got, gg = jax.jit(f)(*placed)
    assert abs(float(got) - float(want)) <= 1e-5 * max(abs(float(want)), 1.0), (got, want)
    for name, a_, b_ in zip(("dhidden", "dweight", "dbias"), gg, wg):
        _close(jnp, a_, b_, ("logprobs", name))
    print("ok logprobs vocab")


def _vocab_axis(jax, jnp, np, fj, mesh):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    rng = np.random.default_rng(1)
    b, t, h, v = 3, 5, 8, 8 * 41
    hidden = jnp.asarray(rng.standard_normal((b, t, h)), jnp.float32)
    weight = jnp.asarray(rng.standard_normal((v, h)) * 0.3, jnp.float32)
    bias = jnp.asarray(rng.standard_normal(v) * 0.1, jnp.float32)
    ids = jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32)
    mask = jnp.asarray(np.arange(t)[None, :] < rng.integers(1, t + 1, b)[:, None])
    adv = jnp.asarray(rng.standard_normal(b), jnp.float32)
    old = jnp.asarray(-np.log(v) + 0.3 * rng.standard_normal((b, t)), jnp.float32)
    ref = jnp.asarray(-np.log(v) + 0.3 * rng.standard_normal((b, t)), jnp.float32)
    cases = [("dapo", 0.04, "token"), ("grpo", 0.0, "token"), ("bnpo", 0.04, "token"), ("grpo", 0.04, "sequence")]
    for loss_type, beta, level in cases:
        kw = dict(loss_type=loss_type, beta=beta, importance_sampling_level=level, temperature=0.9, entropy_coef=0.01)

        def loss(x, w, bb, axis=None):
            out = fj.linear_grpo_loss(
                x, w, ids, mask, adv, bias=bb, old_per_token_logps=old, ref_per_token_logps=ref, vocab_axis=axis, **kw
            )
            return out[0], out[1].metrics

        (want, wm), wg = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(hidden, weight, bias)
        local = lambda x, w, bb: jax.value_and_grad(lambda *a: loss(*a, "v"), (0, 1, 2), has_aux=True)(x, w, bb)  # noqa: E731
        specs = (P(), P("v"), P("v"))
        vmesh = jax.make_mesh((8,), ("v",), axis_types=mesh.axis_types)
        f = jax.shard_map(local, mesh=vmesh, in_specs=specs, out_specs=((P(), P()), (P(), P("v"), P("v"))))
        placed = [jax.device_put(x, NamedSharding(vmesh, s)) for x, s in zip((hidden, weight, bias), specs)]
        (got, gm), gg = jax.jit(f)(*placed)
        assert abs(float(got) - float(want)) <= 1e-5 * max(abs(float(want)), 1.0), (loss_type, got, want)
        for k in wm:
            assert abs(float(gm[k]) - float(wm[k])) <= 1e-5 * max(abs(float(wm[k])), 1.0), (loss_type, k)
        for name, a_, b_ in zip(("dhidden", "dweight", "dbias"), gg, wg):
            err = float(jnp.abs(a_ - b_).max()) / max(float(jnp.abs(b_).max()), 1e-6)
            assert err <= 1e-4, (loss_type, level, name, err)
        print("ok vocab", loss_type, beta, level)


if __name__ == "__main__":
    _main()


@pytest.mark.parametrize(
    "sets",
    [
        [],
        ["level=logits"],
        ["parallel=vocab"],
        ["loss_type=grpo", "parallel=vocab", "beta=0.0"],
        ["parallel=token", "batch=8", "loss_type=bnpo"],
        ["parallel=2d", "loss_type=dr_grpo"],
    ],
)
def test_gradcheck_cli_passes_and_fails_with_its_gates(sets):
    config = os.path.join(os.path.dirname(__file__), "..", "..", "..", "configs", "jax", "gradcheck.yaml")
    cmd = [sys.executable, "-m", "flashloss.jax.gradcheck", "--config", config, "--json"]
    cmd += [f"--set={s}" for s in sets]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert json.loads(out.stdout)["passed"]
    strict = subprocess.run(cmd + ["--set=grad_rel=1e-12"], capture_output=True, text=True, timeout=600)
    assert strict.returncode == 1 and not json.loads(strict.stdout)["passed"]


_EVERY_LOSS = """
import itertools, sys
from flashloss.jax import gradcheck
types = gradcheck.LOSS_TYPES
failed = []
for lt, lvl, level in itertools.product(types, ("token", "sequence"), ("linear", "logits")):
    if lt == "vespo" and lvl == "sequence":
        continue  # refused, as TRL 1.16 does
    cfg = gradcheck.load(sys.argv[1], [f"loss_type={lt}", f"importance_sampling_level={lvl}", f"level={level}"])
    r = gradcheck.run(cfg)
    print(lt, lvl, level, r["passed"], flush=True)
    if not r["passed"]:
        failed.append((lt, lvl, level, r["gates"]))
assert not failed, failed
"""


def test_gradcheck_every_loss_type_and_level():
    """The f64 reference of TRL's loss for every loss type, token and sequence level, on
    both levels (LM head and logits): one process (the gradcheck turns x64 on)."""
    config = os.path.join(os.path.dirname(__file__), "..", "..", "..", "configs", "jax", "gradcheck.yaml")
    out = subprocess.run([sys.executable, "-c", _EVERY_LOSS, config], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count(" True") == 30, out.stdout
