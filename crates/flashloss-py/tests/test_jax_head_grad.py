"""The frozen head on flashloss.jax's FFI path: the custom_vjps take symbolic zeros, so
a gradient over ``hidden`` alone (or a ``stop_gradient`` head) calls the handlers with
``head_grad="frozen"`` (no ``[V, H]`` result) and gives the trainable head's hidden
gradient; the GRPO and CE losses, per-row CE and the differentiable log-probs, the
one-device calls and the vocabulary-split ones (``ffi.vocab``, on one block)."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("flashloss.jax")
import jax.numpy as jnp  # noqa: E402

import flashloss.jax as fj  # noqa: E402
from flashloss.jax.ffi import ops as _ops  # noqa: E402
from flashloss.jax.ffi import vocab as _vocab  # noqa: E402

B, T, H, V = 3, 5, 16, 301


def _data(dtype=jnp.float32):
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.standard_normal((B, T, H)), dtype)
    weight = jnp.asarray(rng.standard_normal((V, H)) * 0.3, dtype)
    bias = jnp.asarray(rng.standard_normal(V) * 0.1, dtype)
    ids = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
    mask = jnp.asarray(rng.random((B, T)) > 0.2)
    adv = jnp.asarray(rng.standard_normal(B), jnp.float32)
    old = jnp.asarray(-np.log(V) + 0.3 * rng.standard_normal((B, T)), jnp.float32)
    up = jnp.asarray(rng.standard_normal((2, B, T)), jnp.float32)
    return hidden, weight, bias, ids, mask, adv, old, up


@pytest.fixture
def head_grads(monkeypatch):
    """The ``head_grad`` attribute of every FFI call traced (``None``: a call without
    one, statistics only)."""
    seen = []
    real = _ops._call

    def spy(name, results, *args, **attrs):
        seen.append(attrs.get("head_grad"))
        return real(name, results, *args, **attrs)

    monkeypatch.setattr(_ops, "_call", spy)
    monkeypatch.setattr(_vocab, "_call", spy)
    return seen


def _losses():
    hidden, weight, bias, ids, mask, adv, old, up = _data()

    def grpo(x, w, b):
        return fj.linear_grpo_loss(
            x, w, ids, mask, adv, bias=b, old_per_token_logps=old, ref_per_token_logps=old - 0.1, beta=0.04,
            temperature=0.9, impl="ffi",
        )[0]  # fmt: skip

    def ce(x, w, b):
        return fj.linear_cross_entropy(x, w, jnp.where(mask, ids, -100), bias=b, label_smoothing=0.1, impl="ffi")

    def ce_rows(x, w, b):
        return (fj.linear_cross_entropy(x, w, ids, bias=b, reduction="none", impl="ffi") * up[0]).sum()

    def logprobs(x, w, b):
        logp, entropy = fj.linear_logprobs(
            x, w, ids, temperature=0.8, return_entropy=True, bias=b, mask=mask, impl="ffi"
        )[:2]
        return (logp * up[0]).sum() + (entropy * up[1]).sum()

    def split(x, w, b):
        """The vocabulary-split GRPO step on one block (``axis`` None)."""
        from flashloss._spec import GrpoArgs

        config = GrpoArgs(loss_type="dapo", beta=0.04, epsilon_low=0.2, epsilon_high=0.2, temperature=0.9).config_json()
        args = (config, None, 0.9, V, "two_pass", 64.0)
        return _vocab.grpo(x, w, b, ids, mask, adv, old, old - 0.1, *args)[0]

    def split_ce(x, w, b):
        args = (None, _ce_config(), 1.0, -100, V, "mean", 64.0, "two_pass")
        return _vocab.cross_entropy(x.reshape(-1, H), w, b, jnp.where(mask, ids, -100).reshape(-1), *args)[0]

    fns = dict(grpo=grpo, ce=ce, ce_rows=ce_rows, logprobs=logprobs, split_grpo=split, split_ce=split_ce)
    return fns, (hidden, weight, bias)


def _ce_config():
    from flashloss._spec import CeArgs

    return CeArgs().config_json()


FNS = ["grpo", "ce", "ce_rows", "logprobs", "split_grpo", "split_ce"]


@pytest.mark.parametrize("name", FNS)
def test_frozen_head_gives_the_trainable_dhidden_without_dweight(name, head_grads):
    fns, (hidden, weight, bias) = _losses()
    fn = fns[name]
    full = jax.grad(fn, (0, 1, 2))(hidden, weight, bias)
    assert "full" in head_grads and "frozen" not in head_grads, head_grads
    head_grads.clear()
    dh = jax.grad(fn)(hidden, weight, bias)
    assert "frozen" in head_grads and "full" not in head_grads, head_grads
    np.testing.assert_allclose(dh, full[0], rtol=1e-6, atol=1e-7)
    head_grads.clear()
    # A stop_gradient head is not perturbed either.
    stopped = jax.grad(lambda x, w, b: fn(x, jax.lax.stop_gradient(w), jax.lax.stop_gradient(b)), (0, 1, 2))
    dh2, dw2, db2 = stopped(hidden, weight, bias)
    assert "frozen" in head_grads and "full" not in head_grads, head_grads
    np.testing.assert_allclose(dh2, full[0], rtol=1e-6, atol=1e-7)
    assert not np.any(dw2) and not np.any(db2)


@pytest.mark.parametrize("name", FNS)
def test_bias_alone_and_jit(name, head_grads):
    fns, (hidden, weight, bias) = _losses()
    fn = fns[name]
    full = jax.grad(fn, (0, 1, 2))(hidden, weight, bias)
    db = jax.jit(jax.grad(fn, 2))(hidden, weight, bias)
    np.testing.assert_allclose(db, full[2], rtol=1e-6, atol=1e-7)
    head_grads.clear()
    dh = jax.jit(jax.grad(fn))(hidden, weight, bias)
    assert "frozen" in head_grads and "full" not in head_grads, head_grads
    np.testing.assert_allclose(dh, full[0], rtol=1e-6, atol=1e-7)


def test_undifferentiated_calls_form_no_head_gradient(head_grads):
    fns, (hidden, weight, bias) = _losses()
    for name in FNS:
        fns[name](hidden, weight, bias)
    assert "full" not in head_grads, head_grads


def test_ops_frozen_results_are_empty():
    hidden, weight, bias, ids, mask, adv, old, _ = _data(jnp.bfloat16)
    from flashloss._spec import CeArgs

    config = CeArgs().config_json()
    out = _ops.ce_linear(hidden.reshape(-1, H), weight, bias, ids.reshape(-1), None, config=config, mode="auto",
                         budget_mib=64.0, head_grad="frozen")  # fmt: skip
    assert out[2].shape == (0,) and out[3].shape == (0,) and out[1].shape == (B * T, H)
    with pytest.raises(ValueError, match="head_grad"):
        _ops.ce_linear(hidden.reshape(-1, H), weight, bias, ids.reshape(-1), None, config=config, mode="auto",
                       budget_mib=64.0, head_grad="none")  # fmt: skip
