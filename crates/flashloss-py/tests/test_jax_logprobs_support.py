"""``flashloss.jax.linear_logprobs`` under vLLM V1's truncated support (``top_k``,
``top_p``, ``min_p``) on the FFI path and the Pallas path (plain JAX over row blocks):
``logp`` is ``logp^K`` (``-inf`` where the target is outside the support, flagged in
``outside_support``), against a float64 numpy reference that materializes vLLM's filters
in vLLM's order on the f32 scaled logits (min-p, top-k with ties kept, top-p by a stable
ascending sort of ``(s_j, j)``), values and ``jax.grad`` with the support held fixed. Exact
inputs (small integers scaled by powers of two, repeated weight rows, a flat row) make
every logit exact, so ties reproduce and both sides decide on the same values."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
fj = pytest.importorskip("flashloss.jax")

IMPLS = ("ffi", "pallas")
FILTERS = [(5, None, None), (None, 0.6, None), (None, None, 0.2), (40, 0.8, 0.01), (None, 0.9, None), (7, 1.0, 0.0)]


def exact_head(n: int, h: int, v: int, seed: int):
    """A head whose logits are exact in f32, with ties: vocabulary rows from 64 on repeat
    three patterns, and the last row's logits are the bias alone."""
    rng = np.random.default_rng(seed)
    hidden = rng.integers(-4, 5, (n, h)) / 4
    weight = rng.integers(-4, 5, (v, h)) / 8
    bias = rng.integers(-8, 9, v) / 16
    weight[64:] = weight[np.arange(64, v) % 3]
    hidden[-1] = 0
    return hidden.astype(np.float32), weight.astype(np.float32), bias.astype(np.float32)


def support_keep(s32: np.ndarray, top_k, top_p, min_p) -> np.ndarray:
    """vLLM's filters on the f32 scaled logits ``s32`` ``[N, V]`` (decisions in f64)."""
    v = s32.shape[1]
    s = s32.astype(np.float64)
    top = s.max(-1, keepdims=True)
    keep = np.ones(s.shape, bool)
    if min_p:
        keep &= np.exp(s - top) >= min_p
    if top_k is not None and top_k < v:
        left = np.where(keep, s, -np.inf)
        kth = -np.sort(-left, -1)[:, top_k - 1 : top_k]
        keep &= s >= kth
    if top_p is not None and top_p < 1:
        left = np.where(keep, s, -np.inf)
        order = np.argsort(left, -1, kind="stable")
        mass = np.where(keep, np.exp(s - top), 0.0)
        q = np.take_along_axis(mass, order, -1) / mass.sum(-1, keepdims=True)
        drop = np.cumsum(q, -1) <= 1 - top_p
        drop[:, -1] = False
        dropped = np.zeros_like(drop)
        np.put_along_axis(dropped, order, drop, -1)
        keep &= ~dropped
    return keep


def reference(x, w, b, ids, live, g, temperature, filters):
    """``(logp^K, outside)`` and the gradients ``(dx, dw, db)`` of ``Σ g·logp^K`` (finite
    live rows), float64, the support fixed."""
    z = x.astype(np.float64) @ w.astype(np.float64).T + b
    s32 = (z.astype(np.float32) * np.float32(1.0 / temperature)).astype(np.float32)
    keep = support_keep(s32, *filters)
    s = z / temperature
    lse = np.log(np.where(keep, np.exp(s - s.max(-1, keepdims=True)), 0.0).sum(-1)) + s.max(-1)
    rows = np.arange(len(ids))
    inside = keep[rows, ids]
    logp = np.where(inside, s[rows, ids] - lse, -np.inf)
    p_k = np.where(keep, np.exp(s - lse[:, None]), 0.0)
    coef = np.where(live & inside, g, 0.0)
    onehot = np.zeros_like(s)
    onehot[rows, ids] = 1.0
    dz = coef[:, None] * (onehot - p_k) / temperature
    logp = np.where(live, logp, 0.0)
    return logp, live & ~inside, (dz @ w, dz.T @ x, dz.sum(0))


def _call(impl, x, w, b, ids, live, temperature, filters, **kw):
    top_k, top_p, min_p = filters
    return fj.linear_logprobs(
        x,
        w,
        jnp.asarray(ids),
        temperature=temperature,
        bias=b,
        mask=jnp.asarray(live),
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        impl=impl,
        interpret=impl == "pallas",
        **kw,
    )


@pytest.mark.parametrize("impl", (*IMPLS, "auto"))  # auto: both paths traced, the FFI one runs on the CPU
@pytest.mark.parametrize("filters", FILTERS)
def test_values_and_gradients_match_the_f64_reference(impl, filters):
    _check_against_reference(impl, filters, "vh", jnp.float32)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout,dtype", [("hv", jnp.float32), ("vh", jnp.bfloat16), ("hv", jnp.bfloat16)])
def test_layouts_and_bf16_match_the_f64_reference(impl, layout, dtype):
    """The exact inputs are exact in bf16 too: the same logits, the gradients in bf16."""
    _check_against_reference(impl, (40, 0.8, 0.01), layout, dtype)


def _check_against_reference(impl, filters, layout, dtype):
    n, h, v, temperature = 7, 12, 301, 0.5
    x, w, b = exact_head(n, h, v, 3)
    z = x.astype(np.float64) @ w.T.astype(np.float64) + b
    ranks = [0, 1, 3, 2, 6, 30, 4]  # targets near the top: some inside, some outside a support
    ids = np.array([np.argsort(-z[i], kind="stable")[r] for i, r in enumerate(ranks)])
    live = np.ones(n, bool)
    live[1] = False
    g = np.linspace(0.5, -0.75, n)
    want, want_out, (dx, dw, db) = reference(x, w, b, ids, live, g, temperature, filters)
    finite = live & ~want_out

    def f(x, w, bias):
        out = _call(impl, x, w, bias, ids, live, temperature, filters, weight_layout=layout)
        return (jnp.where(out.outside_support, 0.0, out.logp) * jnp.asarray(g, jnp.float32)).sum(), out

    wt = w if layout == "vh" else w.T
    args = (jnp.asarray(x, dtype), jnp.asarray(wt, dtype), jnp.asarray(b, dtype))
    (_, out), grads = jax.jit(jax.value_and_grad(f, (0, 1, 2), has_aux=True))(*args)
    assert isinstance(out, fj.LogprobOutputs) and out.outside_support.dtype == jnp.bool_
    np.testing.assert_array_equal(np.asarray(out.outside_support), want_out)
    got = np.asarray(out.logp, np.float64)
    assert np.array_equal(np.isneginf(got), want_out) and (got[~live] == 0).all()
    assert finite.any()
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-5, atol=1e-6)
    tol = 1e-4 if dtype == jnp.float32 else 1e-2
    for name, a, ref in zip(("dhidden", "dweight", "dbias"), grads, (dx, dw if layout == "vh" else dw.T, db)):
        err = np.abs(np.asarray(a.astype(jnp.float32), np.float64) - ref).max()
        assert err <= tol * max(np.abs(ref).max(), 1e-6) + 1e-7, (name, err)


def test_the_filters_cut_inside_ties_and_drop_targets():
    """The cases above are not vacuous: some target is outside, and some support is cut
    inside a run of equal logits (top-p drops the lower ids of a tie first)."""
    n, h, v = 7, 12, 301
    x, w, b = exact_head(n, h, v, 3)
    s32 = ((x.astype(np.float64) @ w.T.astype(np.float64) + b).astype(np.float32) * np.float32(2.0)).astype(np.float32)
    cut_in_tie = False
    for filters in FILTERS:
        keep = support_keep(s32, *filters)
        for i in range(n):
            kept = s32[i][keep[i]]
            cut_in_tie |= bool(np.isin(s32[i][~keep[i]], kept).any())
    assert cut_in_tie


@pytest.mark.parametrize("impl", IMPLS)
def test_unset_filters_are_the_plain_call(impl):
    x, w, b = exact_head(5, 8, 99, 5)
    ids, live = np.arange(5) * 17 % 99, np.ones(5, bool)
    args = (jnp.asarray(x), jnp.asarray(w), jnp.asarray(b))
    plain = _call(impl, *args, ids, live, 0.7, (None, None, None))
    out = _call(impl, *args, ids, live, 0.7, (99, 1.0, 0.0), return_lse=True)
    np.testing.assert_array_equal(np.asarray(out.logp), np.asarray(plain.logp))
    assert not np.asarray(out.outside_support).any() and out.lse is not None
    # One rule (vLLM's, TRL's): top_k 0 and -1 are "no top-k".
    for top_k in (0, -1):
        out = _call(impl, *args, ids, live, 0.7, (top_k, None, None))
        np.testing.assert_array_equal(np.asarray(out.logp), np.asarray(plain.logp))
        assert not np.asarray(out.outside_support).any()


@pytest.mark.parametrize("impl", IMPLS)
def test_other_outputs_stay_the_full_softmax(impl):
    """entropy, lse and the candidates' log-probs do not see the support; their gradients
    add to logp^K's."""
    n, h, v = 6, 8, 120
    x, w, b = exact_head(n, h, v, 9)
    ids, live = np.arange(n) * 13 % v, np.ones(n, bool)
    args = (jnp.asarray(x), jnp.asarray(w), jnp.asarray(b))
    kw = dict(return_entropy=True, return_lse=True, gather_ids=jnp.asarray(ids[:, None]))
    full = _call(impl, *args, ids, live, 0.5, (None, None, None), **kw)
    cut = _call(impl, *args, ids, live, 0.5, (10, None, None), **kw)
    for name in ("entropy", "lse", "gathered_logp"):
        np.testing.assert_allclose(np.asarray(getattr(cut, name)), np.asarray(getattr(full, name)), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(cut.gathered_logp[:, 0]), np.asarray(full.logp), rtol=1e-6)

    def f(x, filters):
        out = _call(impl, x, args[1], args[2], ids, live, 0.5, filters, **kw)
        return out.entropy.sum() + 0.5 * out.lse.sum()

    g_full = jax.grad(f)(args[0], (None, None, None))
    g_cut = jax.grad(f)(args[0], (10, None, None))
    np.testing.assert_allclose(np.asarray(g_cut), np.asarray(g_full), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs,arg",
    [(dict(top_k=-2), "top_k"), (dict(top_k=2.5), "top_k"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
     (dict(top_p=float("nan")), "top_p"), (dict(min_p=-0.1), "min_p"), (dict(min_p=1.1), "min_p")],
)  # fmt: skip
def test_bad_filters_name_the_argument(kwargs, arg):
    x, w, _ = exact_head(2, 4, 50, 1)
    with pytest.raises(ValueError, match=f"argument `{arg}`"):
        fj.linear_logprobs(jnp.asarray(x), jnp.asarray(w), jnp.asarray([1, 2]), **kwargs)


def test_vocab_axis_takes_a_support_on_one_device_mesh():
    """With ``vocab_axis`` the support is vocab-parallel (``_support_vocab``; 8 devices in
    test_jax_support_vocab.py): on a mesh of one it is the plain call's (``top_p`` clear of
    a cumulative mass on the boundary: the plain FFI call decides in f64, this one in f32)."""
    from jax.sharding import PartitionSpec as P

    x, w, _ = exact_head(3, 4, 80, 1)
    ids = jnp.asarray([1, 2, 70])
    mesh = jax.make_mesh((1,), ("v",), axis_types=(jax.sharding.AxisType.Explicit,))

    def f(x, w, axis=None):
        out = fj.linear_logprobs(x, w, ids, top_k=3, top_p=0.43, vocab_axis=axis, impl="ffi")
        return out.logp, out.outside_support

    placed = [jax.device_put(jnp.asarray(a), jax.NamedSharding(mesh, s)) for a, s in ((x, P()), (w, P("v")))]
    got = jax.jit(jax.shard_map(lambda x, w: f(x, w, "v"), mesh=mesh, in_specs=(P(), P("v")), out_specs=P()))(*placed)
    want = f(jnp.asarray(x), jnp.asarray(w))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-6)
