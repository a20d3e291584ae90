"""The JAX FFI calls with an ``[H, V]`` head (``weight_layout="hv"``, a Flax kernel):
``ffi.ops.grpo_linear``, ``ce_linear``, ``ce_rows``, ``logp_linear`` and the vocab-split
steps of ``ffi.vocab`` (``logprobs``, ``grpo``, ``cross_entropy``, on one device and inside
``jax.shard_map`` over 2 simulated devices) on ``weight.T`` equal the ``"vh"`` calls on
``weight`` (``dweight`` transposed); a weight of the wrong shape is an error naming
``weight``."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("flashloss.jax")

import jax.numpy as jnp  # noqa: E402

from flashloss.jax.ffi import ops as _ops  # noqa: E402
from flashloss.jax.ffi import vocab as _vocab  # noqa: E402

B, T, H, V = 3, 4, 16, 301
BUDGET = 64.0
GRPO = json.dumps({"loss_type": "dapo", "beta": 0.04, "entropy_coef": 0.01, "temperature": 0.9})
CE = json.dumps({"label_smoothing": 0.1, "z_loss": 1e-3, "softcap": 3.0, "reduction": "sum", "temperature": 0.8})


def _inputs(dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    hidden = jnp.asarray(rng.standard_normal((B * T, H)), dtype)
    weight = jnp.asarray(rng.standard_normal((V, H)) * 0.3, dtype)
    bias = jnp.asarray(rng.standard_normal(V) * 0.1, dtype)
    ids = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
    mask = jnp.asarray(np.arange(T)[None, :] < rng.integers(1, T + 1, B)[:, None])
    adv = jnp.asarray(rng.standard_normal(B), jnp.float32)
    old = jnp.asarray(-np.log(V) + 0.3 * rng.standard_normal((B, T)), jnp.float32)
    return hidden, weight, bias, ids, mask, adv, old


def _close(a, b, tol, name):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert a.shape == b.shape, (name, a.shape, b.shape)
    scale = max(float(np.abs(b).max()), 1e-6)
    err = float(np.abs(a - b).max())
    assert err <= tol * scale, (name, err, scale)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("mode", ["auto", "two_pass", "single_pass", "compact"])
def test_grpo_linear_hv_equals_vh(dtype, mode):
    hidden, weight, bias, ids, mask, adv, old = _inputs(dtype)
    kw = dict(config=GRPO, mode=mode, budget_mib=BUDGET)
    vh = _ops.grpo_linear(hidden, weight, bias, ids, mask, adv, old, old - 0.05, **kw)
    hv = _ops.grpo_linear(hidden, weight.T, bias, ids, mask, adv, old, old - 0.05, weight_layout="hv", **kw)
    assert hv[2].shape == (H, V)
    names = ("loss", "dhidden", "dweight", "dbias", "logp", "entropy", "kl", "metrics")
    for name, a, b in zip(names, hv, vh):
        _close(a, b.T if name == "dweight" else b, 1e-5, name)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_ce_linear_rows_and_logp_hv_equal_vh(dtype):
    hidden, weight, bias, ids, mask, *_ = _inputs(dtype, seed=1)
    targets = ids.reshape(-1).at[2].set(-100)
    kw = dict(config=CE, mode="auto", budget_mib=BUDGET)
    vh = _ops.ce_linear(hidden, weight, bias, targets, None, **kw)
    hv = _ops.ce_linear(hidden, weight.T, bias, targets, None, weight_layout="hv", **kw)
    assert hv[2].shape == (H, V)
    for name, a, b in zip(("loss", "dhidden", "dweight", "dbias", "row_loss", "count", "lse"), hv, vh):
        _close(a, b.T if name == "dweight" else b, 1e-5, name)
    rows = _ops.ce_rows(hidden, weight, bias, targets, config=CE, budget_mib=BUDGET)
    rows_hv = _ops.ce_rows(hidden, weight.T, bias, targets, config=CE, budget_mib=BUDGET, weight_layout="hv")
    for name, a, b in zip(("ce_rows", "ce_rows lse"), rows_hv, rows):
        _close(a, b, 1e-5, name)
    flat_ids, flat_mask = ids.reshape(-1), mask.reshape(-1)
    lp = _ops.logp_linear(hidden, weight, bias, flat_ids, flat_mask, temperature=0.8, budget_mib=BUDGET)
    lp_hv = _ops.logp_linear(
        hidden, weight.T, bias, flat_ids, flat_mask, temperature=0.8, budget_mib=BUDGET, weight_layout="hv"
    )
    for name, a, b in zip(("logp", "entropy"), lp_hv, lp):
        _close(a, b, 1e-5, name)


def test_vocab_steps_on_one_device_hv_equal_vh():
    hidden, weight, bias, ids, mask, adv, old = _inputs(seed=2)
    flat_ids, flat_mask = ids.reshape(-1), mask.reshape(-1)

    def logprobs(x, w, b, layout):
        lp, ent, lse, *_ = _vocab.logprobs(x, w, b, flat_ids, flat_mask, None, 0.8, BUDGET, "auto", layout)
        return (lp * 0.7).sum() + (ent * 0.3).sum() + (lse * 0.2).sum()

    def grpo(x, w, b, layout):
        loss, _ = _vocab.grpo(x, w, b, ids, mask, adv, old, old - 0.05, GRPO, None, 0.9, V, "auto", BUDGET, layout)
        return loss

    def ce(x, w, b, layout):
        t = flat_ids.at[1].set(-100)
        return _vocab.cross_entropy(x, w, b, t, None, CE, 0.8, -100, V, "sum", BUDGET, "auto", weight_layout=layout)[0]

    for name, f in (("logprobs", logprobs), ("grpo", grpo), ("cross_entropy", ce)):
        want, (dh, dw, db) = jax.value_and_grad(f, (0, 1, 2))(hidden, weight, bias, "vh")
        got, (gh, gw, gb) = jax.jit(jax.value_and_grad(f, (0, 1, 2)), static_argnums=3)(hidden, weight.T, bias, "hv")
        assert gw.shape == (H, V)
        _close(got, want, 1e-5, f"{name} value")
        _close(gh, dh, 1e-5, f"{name} dhidden")
        _close(gw, dw.T, 1e-5, f"{name} dweight")
        _close(gb, db, 1e-5, f"{name} dbias")


def test_wrong_weight_shape_names_weight():
    hidden, weight, bias, ids, mask, adv, old = _inputs(seed=3)
    kw = dict(config=CE, mode="auto", budget_mib=BUDGET)
    targets = ids.reshape(-1)
    # A [V, H] weight passed as [H, V]: its H dimension (V) is not hidden's.
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"argument `weight`: expected shape \[H=16, V\]"):
        jax.block_until_ready(_ops.ce_linear(hidden, weight, bias, targets, None, weight_layout="hv", **kw))
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"argument `weight`: expected shape \[V, H=16\]"):
        jax.block_until_ready(_ops.grpo_linear(hidden, weight.T, bias, ids, mask, adv, old, old - 0.05, config=GRPO,
                                               mode="auto", budget_mib=BUDGET))  # fmt: skip
    with pytest.raises(ValueError, match="argument `weight`: expected shape"):
        _ops.ce_linear(hidden, weight[None], bias, targets, None, weight_layout="hv", **kw)
    with pytest.raises(ValueError, match="argument `weight_layout`"):
        _ops.ce_linear(hidden, weight, bias, targets, None, weight_layout="kernel", **kw)


def test_vocab_axis_hv_equals_vh():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    out = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.split() == ["ok", "logprobs", "ok", "grpo", "ok", "cross_entropy"], out.stdout


def _main():
    """Inside ``jax.shard_map`` over 2 devices: each holds a block of the vocabulary,
    ``[V/2, H]`` rows of ``weight`` (``"vh"``) or ``[H, V/2]`` columns of ``weight.T``
    (``"hv"``); the two give the same values and gradients."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    assert len(jax.devices()) == 2
    hidden, weight, bias, ids, mask, adv, old = _inputs(seed=4)
    weight, bias = weight[:300], bias[:300]  # V divisible by 2
    v = 300
    ids = ids % v
    flat_ids, flat_mask = ids.reshape(-1), mask.reshape(-1)
    mesh = jax.make_mesh((2,), ("vocab",), axis_types=(AxisType.Explicit,))

    def step(kind, layout):
        def f(x, w, b):
            x = jax.lax.pcast(x, "vocab", to="varying")
            if kind == "logprobs":
                lp, ent, lse, *_ = _vocab.logprobs(x, w, b, flat_ids, flat_mask, "vocab", 0.8, BUDGET, "auto", layout)
                return (lp * 0.7).sum() + (ent * 0.3).sum() + (lse * 0.2).sum()
            if kind == "grpo":
                args = (GRPO, "vocab", 0.9, v, "auto", BUDGET, layout)
                return _vocab.grpo(x, w, b, ids, mask, adv, old, old - 0.05, *args)[0]
            t = flat_ids.at[1].set(-100)
            return _vocab.cross_entropy(x, w, b, t, "vocab", CE, 0.8, -100, v, "sum", BUDGET, "auto", layout)[0]

        specs = (P(), P("vocab", None) if layout == "vh" else P(None, "vocab"), P("vocab"))
        grad = jax.value_and_grad(f, (0, 1, 2))
        run = jax.jit(jax.shard_map(grad, mesh=mesh, in_specs=specs, out_specs=(P(), specs)))
        w = weight if layout == "vh" else weight.T
        return run(*(jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip((hidden, w, bias), specs)))

    for kind in ("logprobs", "grpo", "cross_entropy"):
        want, (dh, dw, db) = step(kind, "vh")
        got, (gh, gw, gb) = step(kind, "hv")
        assert gw.shape == (H, v)
        _close(got, want, 1e-5, f"{kind} value")
        _close(gh, dh, 1e-5, f"{kind} dhidden")
        _close(gw, dw.T, 1e-5, f"{kind} dweight")
        _close(gb, db, 1e-5, f"{kind} dbias")
        print("ok", kind)


if __name__ == "__main__":
    _main()
