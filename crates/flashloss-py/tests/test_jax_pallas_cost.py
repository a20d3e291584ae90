"""Every Pallas kernel's declared ``pl.CostEstimate`` bytes against its own block specs
(``pallas/cost.py``): the ``pallas_call``s of traced steps (interpret mode, CPU), their
block mappings read from the jaxpr (each index map evaluated over the grid) and the bytes
counted from them, so that the bytes XLA's cost analysis (and the roofline estimates of
``flashloss.jax.tpu_compile``) takes from the kernels are counted, not guessed."""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashloss.jax as fj


def _pallas_calls(jaxpr) -> list:
    """Every ``pallas_call`` equation in ``jaxpr`` and the jaxprs nested in it."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            found.append(eqn)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else (value,):
                inner = getattr(sub, "jaxpr", None)
                if inner is not None and hasattr(inner, "eqns"):
                    found += _pallas_calls(inner)
                elif hasattr(sub, "eqns"):
                    found += _pallas_calls(sub)
    return found


def _spec_bytes(eqn) -> int:
    """The bytes the kernel's pipeline moves, from the block mappings in its jaxpr: a block
    at the first step and wherever its index changes, clipped to the array."""
    gm = eqn.params["grid_mapping"]
    total = 0
    for bm in gm.block_mappings:
        shape = [getattr(b, "block_size", b) or 1 for b in bm.block_shape]
        array, itemsize = bm.array_aval.shape, bm.array_aval.dtype.itemsize
        closed, last = bm.index_map_jaxpr, None
        for step in itertools.product(*(range(g) for g in gm.grid)):
            index = tuple(int(i) for i in jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *step))
            if index != last:
                total += itemsize * math.prod(min(b, a - i * b) for b, a, i in zip(shape, array, index))
                last = index
    return total


def _inputs(n=96, h=48, v=700, dtype=jnp.float32, seed=0):
    key = jax.random.split(jax.random.PRNGKey(seed), 4)
    hidden = (jax.random.normal(key[0], (1, n, h)) * 0.5).astype(dtype)
    weight = (jax.random.normal(key[1], (v, h)) * 0.2).astype(dtype)
    ids = jax.random.randint(key[2], (1, n), 0, v)
    mask = jnp.arange(n)[None] < n - 5
    adv = jnp.array([0.7])
    return hidden, weight, ids, mask, adv


def _check(eqns, names):
    assert {e.params["name"] for e in eqns} >= set(names), [e.params["name"] for e in eqns]
    for eqn in eqns:
        declared = eqn.params["cost_estimate"]
        assert declared is not None, eqn.params["name"]
        assert declared.bytes_accessed == _spec_bytes(eqn), eqn.params["name"]


@pytest.mark.parametrize("layout", ["vh", "hv"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_head_kernels_declare_their_blocks_bytes(layout, dtype):
    """The two kernels' plan: forward, dH and dW (a ragged N and V, with a bias)."""
    hidden, weight, ids, mask, adv = _inputs(dtype=dtype)
    weight = weight if layout == "vh" else weight.T
    bias = jnp.linspace(-0.1, 0.1, 700).astype(dtype)

    def f(x, w, c):
        return fj.linear_grpo_loss(x, w, ids, mask, adv, bias=c, impl="pallas", interpret=True, mode="two_pass",
                                   weight_layout=layout)[0]  # fmt: skip

    eqns = _pallas_calls(jax.make_jaxpr(jax.grad(f, (0, 1, 2)))(hidden, weight, bias).jaxpr)
    _check(eqns, ["flashloss_head_forward", "flashloss_head_dhidden", "flashloss_head_dweight"])


def test_logits_kernels_declare_their_blocks_bytes():
    """The logits level's statistics and gradient kernels, and the single pass's fused one."""
    hidden, weight, ids, mask, adv = _inputs()
    z = jnp.einsum("bth,vh->btv", hidden, weight)

    def g(z):
        return fj.grpo_loss(z, ids, mask, adv, loss_type="grpo", importance_sampling_level="sequence",
                            impl="pallas", interpret=True)[0]  # fmt: skip

    _check(_pallas_calls(jax.make_jaxpr(jax.grad(g))(z).jaxpr), ["flashloss_logits_stats", "flashloss_logits_grad"])

    def f(x, w):
        return fj.linear_grpo_loss(x, w, ids, mask, adv, impl="pallas", interpret=True, mode="single_pass",
                                   budget_mib=1.0)[0]  # fmt: skip

    _check(_pallas_calls(jax.make_jaxpr(jax.grad(f, (0, 1)))(hidden, weight).jaxpr), ["flashloss_logits_fused"])


def test_counted_bytes_are_the_blocks():
    """The count itself on a grid where a block is revisited: the head tile re-read per row
    block, the row block read once per row (``pallas/cost.py``)."""
    from flashloss.jax.pallas import cost

    blocks = [((8, 16), lambda i, j: (i, 0), (20, 16), 4), ((32, 16), lambda i, j: (j, 0), (70, 16), 2)]
    rows = 4 * (8 * 16 + 8 * 16 + 4 * 16)  # 3 row blocks, the last ragged (4 rows)
    tiles = 3 * 2 * (32 * 16 + 32 * 16 + 6 * 16)  # 3 tiles (the last 6 rows), re-read for each row block
    assert cost.moved_bytes((3, 3), blocks) == rows + tiles
    assert np.isclose(cost.moved_bytes((1, 1), blocks[:1]), 4 * 8 * 16)


def test_support_kernels_declare_their_blocks_bytes():
    """The sampler's truncated support: the narrowing, tallying and collecting kernels."""
    hidden, weight, ids, mask, adv = _inputs()
    eqns = []
    for opt in ({"top_k": 5}, {"top_p": 0.9}, {"min_p": 0.05}, {"top_k": 5, "top_p": 0.9}):

        def f(x, opt=opt):
            out = fj.linear_logprobs(
                x, weight, ids, temperature=1.0, return_entropy=True, mask=mask, impl="pallas", interpret=True, **opt
            )
            return jnp.where(out.outside_support, 0.0, out.logp).sum()

        eqns += _pallas_calls(jax.make_jaxpr(jax.grad(f))(hidden).jaxpr)
    _check(eqns, ["flashloss_support_narrow", "flashloss_support_tally", "flashloss_support_collect"])


def test_loop_trips_read_from_the_compiled_hlo():
    """``tpu_compile.loop_trips``: a ``lax.scan``'s length from the compiled module's text
    (XLA's cost analysis counts a loop's body once; the roofline multiplies by this)."""
    from flashloss.jax import tpu_compile

    def f(x):
        return jax.lax.scan(lambda c, r: (c + jnp.sum(jnp.sin(r)), None), 0.0, x)[0]

    hlo = jax.jit(f).lower(jnp.zeros((7, 33))).compile().as_text()
    assert tpu_compile.loop_trips(hlo) == [7]
    assert tpu_compile.loop_trips(jax.jit(jnp.sin).lower(jnp.zeros(3)).compile().as_text()) == []
