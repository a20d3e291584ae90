"""flashloss.jax's per-row outputs beyond logp and entropy (issue 33), on the FFI path and
the Pallas path (interpret mode, small shapes): ``linear_logprobs``' ``return_lse``,
``return_max``, ``return_sum_p2`` and ``gather_ids``, and ``linear_cross_entropy``'s
``return_lse``, against a materialized float64 numpy reference: values, and the
gradients of a random combination of the outputs (``∂lse/∂s_j = p_j``, the candidates'
``1[j = k] - p_j``), odd vocabularies, masked rows, K = 1, repeated candidates, both
layouts, bias, soft-cap; bad candidate ids name ``gather_ids``."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
fj = pytest.importorskip("flashloss.jax")

IMPLS = ("ffi", "pallas")


def _rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-6))


def _inputs(seed, n, h, v, k, layout, bias=True):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, h)).astype(np.float32)
    w = (rng.standard_normal((v, h)) * 0.6).astype(np.float32)
    b = (rng.standard_normal(v) * 0.2).astype(np.float32) if bias else None
    ids = rng.integers(0, v, n)
    live = rng.random(n) > 0.3
    cand = rng.integers(0, v, (n, k))
    if k > 1:
        cand[:, -1] = cand[:, 0]  # a repeated candidate
        cand[0, 1] = ids[0]  # the target among the candidates
    coef = [rng.standard_normal(n) for _ in range(3)] + [rng.standard_normal((n, k))]
    wt = w if layout == "vh" else w.T
    return x, w, wt, b, ids, live, cand, coef


def _reference(x, w, b, ids, live, cand, coef, temperature, softcap=None):
    """Values ``(logp, entropy, lse, max, Σp², gathered)`` and the gradients ``(dx, dw, db)``
    of ``Σ a·logp + Σ e·H + Σ c·lse + Σ d·gathered`` (live rows), in float64."""
    x, w = x.astype(np.float64), w.astype(np.float64)
    z = x @ w.T + (0.0 if b is None else b.astype(np.float64))
    tanh = np.tanh(z / softcap) if softcap else None
    s = (softcap * tanh if softcap else z) / temperature
    lse = np.log(np.exp(s - s.max(1, keepdims=True)).sum(1)) + s.max(1)
    p = np.exp(s - lse[:, None])
    logp_all = s - lse[:, None]
    ent = -(p * logp_all).sum(1)
    rows = np.arange(len(ids))
    logp = logp_all[rows, ids]
    gathered = logp_all[rows[:, None], cand]
    a, e, c, d = (np.where(live if g.ndim == 1 else live[:, None], g, 0.0) for g in coef)
    onehot = np.zeros_like(s)
    onehot[rows, ids] = 1.0
    ds = a[:, None] * (onehot - p) - e[:, None] * p * (logp_all + ent[:, None]) + c[:, None] * p
    for j in range(cand.shape[1]):
        hot = np.zeros_like(s)
        hot[rows, cand[:, j]] = 1.0
        ds += d[:, j : j + 1] * (hot - p)
    dz = ds / temperature * ((1.0 - tanh**2) if softcap else 1.0)
    m = live.astype(np.float64)
    values = [v * (m if v.ndim == 1 else m[:, None]) for v in (logp, ent, lse, s.max(1), (p * p).sum(1), gathered)]
    return values, (dz @ w, dz.T @ x, dz.sum(0))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "n,h,v,k,layout,bias", [(9, 8, 37, 3, "vh", True), (6, 12, 131, 1, "hv", False), (5, 4, 29, 4, "hv", True)]
)
def test_linear_logprobs_outputs_and_gradients_match_f64(impl, n, h, v, k, layout, bias):
    x, w, wt, b, ids, live, cand, coef = _inputs(n + v, n, h, v, k, layout, bias)
    temperature = 0.7
    kw = dict(bias=None if b is None else jnp.asarray(b), mask=jnp.asarray(live), return_lse=True, return_max=True,
              return_sum_p2=True, gather_ids=jnp.asarray(cand), impl=impl, interpret=impl == "pallas",
              weight_layout=layout)  # fmt: skip

    def f(x, w, bias):
        out = fj.linear_logprobs(
            x, w, jnp.asarray(ids), temperature=temperature, return_entropy=True, **dict(kw, bias=bias)
        )
        a, e, c, d = (jnp.asarray(g, jnp.float32) for g in coef)
        loss = (a * out.logp).sum() + (e * out.entropy).sum() + (c * out.lse).sum() + (d * out.gathered_logp).sum()
        return loss, out

    args = (jnp.asarray(x), jnp.asarray(wt), None if b is None else jnp.asarray(b))
    (_, out), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(*args)
    assert isinstance(out, fj.LogprobOutputs)
    want, want_grads = _reference(x, w, b, ids, live, cand, coef, temperature)
    names = ("logp", "entropy", "lse", "max_logit", "sum_p2", "gathered_logp")
    for name, got, ref in zip(names, out, want):
        assert got.shape == ref.shape, name
        assert _rel(got, ref) <= (1e-5 if name != "sum_p2" else 2e-5), name
    dx, dw, db = want_grads
    assert _rel(grads[0], dx) <= 1e-4
    assert _rel(grads[1], dw if layout == "vh" else dw.T) <= 1e-4
    if b is not None:
        assert _rel(grads[2], db) <= 1e-4


@pytest.mark.parametrize("layout", ["vh", "hv"])
def test_pallas_sum_p2_and_max_over_several_vocabulary_tiles(layout):
    """The forward kernel's S₂ is rescaled by e^{2(m_old - m_new)} when a later tile holds a
    larger logit: 3 tiles of 128 (the last ragged), rows whose max is in the last tile."""
    from flashloss.jax.pallas import head, stats

    n, h, v = 6, 8, 301
    x, w, wt, b, ids, live, _, _ = _inputs(21, n, h, v, 1, layout)
    w[290] *= 8.0  # a large logit in the last (ragged) tile for most rows
    wt = w if layout == "vh" else w.T
    spec = stats.HeadSpec(layout=layout, transform=head.Transform(0.8), vocab=v, interpret=True, max_vocab=128,
                          sum_p2=True)  # fmt: skip
    st = stats.row_stats(jnp.asarray(x), jnp.asarray(wt), jnp.asarray(b), jnp.asarray(ids, jnp.int32),
                         jnp.asarray(live), spec)  # fmt: skip
    want, _ = _reference(x, w, b, ids, live, ids[:, None], [np.zeros(n)] * 3 + [np.zeros((n, 1))], 0.8)
    assert _rel(st.lse, want[2]) <= 1e-5 and _rel(st.max, want[3]) <= 1e-6
    assert _rel(st.sum_p2, want[4]) <= 2e-5


@pytest.mark.parametrize("impl", IMPLS)
def test_logprob_outputs_unasked_are_none_and_default_return_is_unchanged(impl):
    x, w, _, _, ids, live, cand, _ = _inputs(3, 4, 8, 19, 2, "vh")
    common = dict(mask=jnp.asarray(live), impl=impl, interpret=impl == "pallas")
    plain = fj.linear_logprobs(jnp.asarray(x), jnp.asarray(w), jnp.asarray(ids), temperature=1.0, **common)
    # One return type (was a bare array): a LogprobOutputs with only logp.
    assert isinstance(plain, fj.LogprobOutputs) and plain.entropy is None and plain.outside_support is None
    plain = plain.logp
    out = fj.linear_logprobs(
        jnp.asarray(x), jnp.asarray(w), jnp.asarray(ids), temperature=1.0, gather_ids=jnp.asarray(cand[:, :1]), **common
    )
    assert out.entropy is None and out.lse is None and out.max_logit is None and out.sum_p2 is None
    assert out.gathered_logp.shape == (4, 1)
    np.testing.assert_allclose(np.asarray(out.logp), np.asarray(plain), rtol=0, atol=0)
    # [B, T] rows: gathered [B, T, K]
    x3 = jnp.asarray(np.random.default_rng(1).standard_normal((2, 3, 8)), jnp.float32)
    ids3, cand3 = jnp.zeros((2, 3), jnp.int32), jnp.ones((2, 3, 5), jnp.int32)
    got = fj.linear_logprobs(x3, jnp.asarray(w), ids3, gather_ids=cand3, return_lse=True, impl=impl,
                             interpret=impl == "pallas")  # fmt: skip
    assert got.gathered_logp.shape == (2, 3, 5) and got.lse.shape == (2, 3)


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_gather_ids_name_the_argument(impl):
    x, w, _, _, ids, live, cand, _ = _inputs(4, 4, 8, 19, 2, "vh")
    kw = dict(impl=impl, interpret=impl == "pallas")
    with pytest.raises(ValueError, match="argument `gather_ids`: expected shape"):
        fj.linear_logprobs(jnp.asarray(x), jnp.asarray(w), jnp.asarray(ids), gather_ids=jnp.asarray(cand[:3]), **kw)
    bad = jnp.asarray(cand).at[2, 1].set(19)
    live = jnp.ones(4, bool)
    with pytest.raises(Exception, match=r"argument `gather_ids`: id 19 at index 5 \(row 2, candidate 1\)"):
        jax.block_until_ready(
            fj.linear_logprobs(jnp.asarray(x), jnp.asarray(w), jnp.asarray(ids), mask=live, gather_ids=bad, **kw)
        )
    # a masked row's candidates are not read
    out = fj.linear_logprobs(jnp.asarray(x), jnp.asarray(w), jnp.asarray(ids), mask=live.at[2].set(False),
                             gather_ids=bad, **kw)  # fmt: skip
    assert float(out.gathered_logp[2, 1]) == 0.0


def _ce_reference(x, w, b, targets, ignore, coef_lse, temperature, softcap, reduction):
    """CE values, lse and the gradients of ``L + Σ c·lse`` (plain CE), float64."""
    live = targets != ignore
    safe = np.where(live, targets, 0)
    cand = safe[:, None]
    zero = np.zeros(len(targets))
    weight = 1.0 / max(live.sum(), 1) if reduction == "mean" else 1.0
    coef = [-weight * np.ones(len(targets)), zero, coef_lse, np.zeros((len(targets), 1))]
    values, grads = _reference(x, w, b, safe, live, cand, coef, temperature, softcap)
    rows = -values[0]
    loss = rows if reduction == "none" else rows.sum() * weight
    return loss, values[2], grads


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("reduction,softcap", [("mean", None), ("sum", 4.0), ("none", None)])
def test_cross_entropy_return_lse_matches_f64(impl, reduction, softcap):
    n, h, v = 7, 8, 41
    x, w, _, b, targets, _, _, _ = _inputs(11, n, h, v, 1, "vh")
    targets = np.where(np.arange(n) % 3 == 1, -100, targets)
    coef_lse = np.random.default_rng(5).standard_normal(n)
    g_rows = np.random.default_rng(6).standard_normal(n)

    def f(x, w, bias):
        loss, lse = fj.linear_cross_entropy(x, w, jnp.asarray(targets), bias=bias, softcap=softcap, reduction=reduction,
                                            temperature=0.9, return_lse=True, impl=impl,
                                            interpret=impl == "pallas")  # fmt: skip
        total = (loss * jnp.asarray(g_rows, jnp.float32)).sum() if reduction == "none" else loss
        return total + (lse * jnp.asarray(coef_lse, jnp.float32)).sum(), (loss, lse)

    (_, (loss, lse)), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(
        jnp.asarray(x), jnp.asarray(w), jnp.asarray(b)
    )
    if reduction == "none":  # the rows' cotangents g_rows: fold them into the reference
        want_rows, want_lse, _ = _ce_reference(x, w, b, targets, -100, coef_lse, 0.9, softcap, "none")
        live = targets != -100
        coef = [-np.where(live, g_rows, 0.0), np.zeros(n), coef_lse, np.zeros((n, 1))]
        safe = np.where(live, targets, 0)
        _, want_grads = _reference(x, w, b, safe, live, safe[:, None], coef, 0.9, softcap)
        assert _rel(loss, want_rows) <= 1e-5
    else:
        want_loss, want_lse, want_grads = _ce_reference(x, w, b, targets, -100, coef_lse, 0.9, softcap, reduction)
        assert abs(float(loss) - want_loss) <= 1e-5 * max(1.0, abs(want_loss))
    assert lse.shape == (n,) and float(jnp.abs(lse[1])) == 0.0
    assert _rel(lse, want_lse) <= 1e-5
    for got, want in zip(grads, want_grads):
        assert _rel(got, want) <= 1e-4


def test_cross_entropy_without_return_lse_is_unchanged():
    x, w, _, b, targets, _, _, _ = _inputs(12, 5, 8, 23, 1, "vh")
    args = (jnp.asarray(x), jnp.asarray(w), jnp.asarray(targets))
    loss = fj.linear_cross_entropy(*args, impl="ffi")
    loss2, lse = fj.linear_cross_entropy(*args, impl="ffi", return_lse=True)
    assert loss.shape == () and float(loss) == float(loss2) and lse.shape == (5,)
