"""``flashloss.jax.linear_grpo_loss`` under the sampler's truncated support (``top_k``,
``top_p``, ``min_p``; docs/spec/losses.md, flashloss addition 13) on the FFI path and the
Pallas path (interpret mode): against TRL's loss (``gradcheck.reference_loss``) on logits
materialized and truncated to vLLM's support (the logits outside it at ``-inf``, so
``log_softmax`` renormalizes over it), with the tokens whose target is outside masked;
loss, gradients, the outside flags and ``logp = -inf`` there. Exact inputs make both
sides decide the same support, ties included."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
fj = pytest.importorskip("flashloss.jax")
from flashloss.jax import gradcheck  # noqa: E402
from test_jax_logprobs_support import exact_head, support_keep  # noqa: E402

B, T, H, V, TEMPERATURE = 2, 3, 12, 301, 0.9


def batch(seed: int):
    x, w, bias = exact_head(B * T, H, V, seed)
    z = x.astype(np.float64) @ w.T.astype(np.float64) + bias
    rng = np.random.default_rng(seed)
    ranks = rng.integers(0, 12, B * T)
    ranks[::2] = 0  # every other target is its row's argmax: inside any support
    ids = np.array([np.argsort(-z[i], kind="stable")[r] for i, r in enumerate(ranks)]).reshape(B, T)
    mask = np.ones((B, T), bool)
    mask[1, -1] = False
    adv = rng.standard_normal(B).astype(np.float32)
    old = (rng.standard_normal((B, T)) * 0.1 - 2.0).astype(np.float32)
    ref = (old - 0.05).astype(np.float32)
    return x.reshape(B, T, H), w, bias, z, ids, mask, adv, old, ref


def reference(x, w, bias, keep, ids, mask, adv, old, ref, cfg):
    """TRL's loss on the logits outside the support at -inf, the outside tokens masked
    (their ids moved to a kept entry: masked rows are never read)."""
    inside = np.take_along_axis(keep, ids.reshape(-1, 1), 1).reshape(B, T)
    kept = mask & inside
    safe_ids = np.where(inside, ids, keep.reshape(B, T, V).argmax(-1))
    z = x.reshape(B * T, H) @ w.T + bias
    z = jnp.where(keep, z, -jnp.inf).reshape(B, T, V)
    loss = gradcheck.reference_loss(jnp, jax, z, jnp.asarray(safe_ids), jnp.asarray(kept), adv, old, ref, cfg)
    return loss, mask & ~inside


@pytest.mark.parametrize("impl", ("ffi", "pallas"))
@pytest.mark.parametrize("filters", [(5, None, None), (None, 0.8, None), (4, 0.9, 0.02)])
@pytest.mark.parametrize("loss_type,level", [("dapo", "token"), ("grpo", "sequence")])
def test_loss_and_gradients_match_trl_under_the_support(impl, filters, loss_type, level):
    x, w, bias, z, ids, mask, adv, old, ref = batch(4)
    s32 = (z.astype(np.float32) * np.float32(1.0 / TEMPERATURE)).astype(np.float32)
    keep = support_keep(s32, *filters)
    cfg = dict(loss_type=loss_type, importance_sampling_level=level, beta=0.04, temperature=TEMPERATURE,
               use_bias_correction_kl=True)  # fmt: skip
    top_k, top_p, min_p = filters

    def ours(x, w, b):
        return fj.linear_grpo_loss(
            x, w, jnp.asarray(ids), jnp.asarray(mask), adv, bias=b, old_per_token_logps=old, ref_per_token_logps=ref,
            top_k=top_k, top_p=top_p, min_p=min_p, impl=impl, interpret=impl == "pallas", **cfg,
        )  # fmt: skip

    def theirs(x, w, b):
        return reference(x, w, b, keep, ids, mask, adv, old, ref, cfg)

    args = tuple(jnp.asarray(a) for a in (x, w, bias))
    (got, out), g_got = jax.jit(jax.value_and_grad(ours, (0, 1, 2), has_aux=True))(*args)
    (want, outside), g_want = jax.value_and_grad(theirs, (0, 1, 2), has_aux=True)(*args)
    np.testing.assert_array_equal(np.asarray(out.outside_support), outside)
    assert outside.any() or filters == (None, 0.8, None)
    assert np.isneginf(np.asarray(out.logp)[outside]).all()
    assert abs(float(got) - float(want)) <= 1e-5 * max(1.0, abs(float(want)))
    for name, a, b in zip(("dhidden", "dweight", "dbias"), g_got, g_want):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.abs(a - b).max() <= 1e-4 * max(np.abs(b).max(), 1e-6), name


def test_unset_filters_are_the_plain_loss_and_vocab_axis_takes_a_support():
    x, w, bias, _, ids, mask, adv, old, _ = batch(2)
    kw = dict(bias=jnp.asarray(bias), old_per_token_logps=old, impl="ffi")
    plain, out = fj.linear_grpo_loss(jnp.asarray(x), jnp.asarray(w), ids, mask, adv, **kw)
    unset, out_unset = fj.linear_grpo_loss(jnp.asarray(x), jnp.asarray(w), ids, mask, adv, top_k=0, top_p=1.0, **kw)
    assert float(plain) == float(unset) and out.outside_support is None and out_unset.outside_support is None
    with pytest.raises(ValueError, match="top_k"):
        fj.linear_grpo_loss(jnp.asarray(x), jnp.asarray(w), ids, mask, adv, top_k=-2, **kw)
    P = jax.sharding.PartitionSpec
    mesh = jax.make_mesh((1,), ("v",), axis_types=(jax.sharding.AxisType.Explicit,))

    def loss(x, w, axis=None):  # vocab-parallel (8 devices in test_jax_support_vocab.py): one device's here
        out = fj.linear_grpo_loss(x, w, ids, mask, adv, top_k=4, top_p=0.5, vocab_axis=axis, impl="ffi")
        return out[0], out[1].outside_support

    placed = [jax.device_put(jnp.asarray(a), jax.NamedSharding(mesh, s)) for a, s in ((x, P()), (w, P("v")))]
    sharded = jax.shard_map(lambda x, w: loss(x, w, "v"), mesh=mesh, in_specs=(P(), P("v")), out_specs=P())
    got = jax.jit(sharded)(*placed)
    want = loss(jnp.asarray(x), jnp.asarray(w))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    assert np.asarray(want[1]).any()
    assert abs(float(got[0]) - float(want[0])) <= 1e-5 * max(1.0, abs(float(want[0])))
