"""The Pallas path's streamed truncated support (``flashloss.jax.pallas.support``) in
interpret mode, against the float64 numpy reference of test_jax_logprobs_support.py, at
small tiles (128 columns, so a ragged last tile and many tiles per row) and shapes that
exercise every branch: odd sizes, masked rows, ties (repeated weight rows, a row of one
value), flat and peaked rows, ``top_k`` above the list's 512 keys (further collecting
passes) and a top-p nucleus longer than the list (the narrowing search past it); the
gradients of every statistic together (one backward pass), and min-p's threshold against
f64. Then the search's pass counts (``support.search_passes``' diagnostic, from
``support._forward``) on flat rows, ties and top-k past the list, at V = 1024-2048."""

import math

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
pytest.importorskip("flashloss.jax")
from flashloss.jax._head import Filters  # noqa: E402
from flashloss.jax.pallas import support  # noqa: E402
from flashloss.jax._head import Transform  # noqa: E402
from flashloss.jax.pallas.stats import HeadSpec  # noqa: E402
from test_jax_logprobs_support import exact_head, reference, support_keep  # noqa: E402

N, H, V, TEMPERATURE = 13, 12, 700, 0.5
CASES = [  # (filters, bias): without a bias row 1's logits are all 0, one tie
    ((5, None, None), True),  # peaked rows: a cut inside the list
    ((600, None, None), True),  # top_k > 512: a second collecting pass
    ((None, 0.97, None), True),  # a flat row's nucleus passes 128 keys: the walk goes on
    ((None, None, 0.3), False),
    ((40, 0.8, 0.01), True),
    ((None, 0.5, 0.2), False),
    ((3, 0.9, None), False),
    ((V - 1, 0.9, None), True),
]


def _head(seed: int):
    x, w, b = exact_head(N, H, V, seed)
    x[0] *= 8  # a peaked row
    x[1] = 0  # the bias alone (runs of equal values), or 0 everywhere
    x[2] = x[2] / 4  # a flat row
    return x, w, b


@pytest.mark.parametrize("filters,has_bias", CASES)
def test_streamed_support_matches_the_f64_reference(filters, has_bias):
    x, w, b = _head(4)
    b = b if has_bias else np.zeros_like(b)
    z = x.astype(np.float64) @ w.T.astype(np.float64) + b
    ranks = [0, 1, 3, 2, 6, 30, 4, 0, 200, 5, 1, 2, 12]
    ids = np.array([np.argsort(-z[i], kind="stable")[r] for i, r in enumerate(ranks)])
    live = np.ones(N, bool)
    live[3] = False
    g = np.linspace(0.5, -0.75, N)
    want, want_out, _ = reference(x, w, b, ids, live, g, TEMPERATURE, filters)
    spec = HeadSpec(layout="vh", transform=Transform(TEMPERATURE), vocab=V, interpret=True, max_rows=128,
                    max_vocab=128, support=Filters(*filters))  # fmt: skip

    def f(x, w, bias):
        st = support.row_stats(x, w, bias, jnp.asarray(ids, jnp.int32), jnp.asarray(live), spec)
        lp = jnp.where(st.outside, 0.0, st.logp_k)
        return (lp * jnp.asarray(g, jnp.float32)).sum() + 0.1 * st.entropy.sum(), st

    args = (jnp.asarray(x), jnp.asarray(w), jnp.asarray(b) if has_bias else None)
    (_, st), grads = jax.jit(jax.value_and_grad(f, (0, 1, 2), has_aux=True))(*args)
    np.testing.assert_array_equal(np.asarray(st.outside), want_out)
    got = np.asarray(st.logp_k, np.float64)
    finite = live & ~want_out
    assert np.array_equal(np.isneginf(got), want_out) and (got[~live] == 0).all() and finite.any()
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-5, atol=1e-6)

    # Gradients: logp^K's (support fixed) plus the full softmax entropy's, float64.
    _, _, (dx, dw, db) = reference(x, w, b, ids, live, g, TEMPERATURE, filters)
    s = z / TEMPERATURE
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    logp = np.log(p)
    ent = -(p * logp).sum(-1)
    ds_ent = np.where(live[:, None], -p * (logp + ent[:, None]), 0.0) * 0.1 / TEMPERATURE
    refs = (dx + ds_ent @ w, dw + ds_ent.T @ x, db + ds_ent.sum(0))
    for name, a, ref in zip(("dhidden", "dweight", "dbias"), grads, refs):
        if a is None:
            continue
        err = np.abs(np.asarray(a, np.float64) - ref).max()
        assert err <= 1e-4 * max(np.abs(ref).max(), 1e-6) + 1e-7, (name, err)


def test_min_p_cut_is_the_f64_threshold():
    """``min_p_cut(m, min_p)`` is the least f32 ``s`` with ``f64(s) - f64(m) ≥ log(min_p)``."""
    rng = np.random.default_rng(0)
    m = np.concatenate([rng.normal(0, 30, 2000), rng.normal(0, 1e-3, 500), [0.0, 1.0, -1.0, 1e4]]).astype(np.float32)
    for min_p in (1e-4, 0.05, 0.1, 0.3, 1 / 3, 0.9, 1.0):
        cut = np.asarray(support.min_p_cut(jnp.asarray(m), min_p))
        log = math.log(min_p)
        ok = cut.astype(np.float64) - m.astype(np.float64) >= log
        below = np.nextafter(cut, np.float32(-np.inf)).astype(np.float64) - m.astype(np.float64) >= log
        assert ok.all() and not below.any(), min_p


def _one_hot_head(rows):
    """Rows ``x_i = e_i`` over a head whose column ``i`` is row ``i``'s logits: every logit
    exact (T = 1), and a last, dead row of zeros (one tie of ``V`` entries)."""
    v, n = len(rows[0]), len(rows) + 1
    w = np.zeros((v, n), np.float32)
    for i, r in enumerate(rows):
        w[:, i] = r
    x = np.eye(n, dtype=np.float32)
    x[-1] = 0
    return x, w


def _check_forward(x, w, filters, offsets, max_vocab=1024):
    """``support._forward`` against the f64 reference, each row's target ``offsets[i]``
    entries past its last kept one (0: the first dropped); returns its passes past pass A."""
    n, v = x.shape[0], w.shape[0]
    z = x.astype(np.float64) @ w.T.astype(np.float64)
    kept = support_keep(z.astype(np.float32), *filters).sum(1)
    keys = [np.lexsort((-np.arange(v), -z[i])) for i in range(n)]  # descending (s, j): the support's order
    ids = np.array([keys[i][min(kept[i] + d, v - 1)] for i, d in enumerate(offsets)])
    live = np.ones(n, bool)
    live[-1] = False
    spec = HeadSpec(layout="vh", transform=Transform(1.0), vocab=v, interpret=True, max_rows=128,
                    max_vocab=max_vocab, support=Filters(*filters))  # fmt: skip
    args = (jnp.asarray(x), jnp.asarray(w), None, jnp.asarray(ids, jnp.int32), jnp.asarray(live))
    (logp, outside, *_), passes = jax.jit(lambda *a: support._forward(*a, spec))(*args)
    want, want_out, _ = reference(x, w, np.zeros(v, np.float32), ids, live, np.ones(n), 1.0, filters)
    np.testing.assert_array_equal(np.asarray(outside), want_out, err_msg=str(filters))
    got = np.asarray(logp, np.float64)
    finite = live & ~want_out
    assert np.array_equal(np.isneginf(got), want_out) and want_out.any() and finite.any()
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-5, atol=1e-6)
    return int(passes), z


def test_flat_rows_narrow_onto_the_top_p_cut_in_few_passes():
    """Flat rows whose nucleus holds most of V = 2048 keys (the list walk took 15 passes of
    C = 128 keys): uniform over [0, 3], 2 ± a few ulps, 0 ± 1e-30 steps (the f32 order's
    spacing), beside a peaked row and a dead row of one value. The narrowing takes
    ``⌈log_T(V/C)⌉ + 1`` passes and one collecting pass (support_search's header), exact."""
    from flashloss.jax.pallas import support_search

    rng = np.random.default_rng(7)
    v = 2048
    rows = [rng.uniform(0, 3, v), 2.0 + rng.integers(-8, 9, v) * 2.0**-22, rng.integers(-8, 9, v) * 1e-30,
            rng.normal(0, 4, v)]  # fmt: skip
    x, w = _one_hot_head(rows)
    passes, z = _check_forward(x, w, (None, 0.9, None), [0, -1, 0, -1, 0])
    walk = -(-support_keep(z[:3].astype(np.float32), None, 0.9, None).sum(1).max() // 128)  # one per 128 keys
    bound = math.ceil(math.log(v / 128, support_search.THRESHOLDS)) + 1 + 1
    assert passes <= bound < walk, (passes, bound, walk)


def test_ties_and_top_k_past_the_list_narrow_exactly(monkeypatch):
    """top_k = 600 > C = 512 by narrowing on counts (the walk turned off), then top-p: a
    flat row, a row whose 640 top entries tie (``v_k`` the tie's value, top-p's cut its
    576-th key: past the list, the walk by columns through the tie), a peaked row, a
    dead row."""
    from flashloss.jax.pallas import support_search

    monkeypatch.setattr(support_search, "WALK_PASSES", 0)
    rng = np.random.default_rng(8)
    v = 1024
    tie = rng.uniform(-12, -10, v)
    tie[rng.permutation(v)[:640]] = 0.0
    x, w = _one_hot_head([rng.uniform(0, 3, v), tie, rng.normal(0, 4, v)])
    passes, _ = _check_forward(x, w, (600, 0.9, None), [0, 0, -1, 0])
    # top-k: narrowing, one collecting pass; M's tally; top-p: narrowing and the tie's walk.
    bound = 2 * support_search.max_narrowing_passes() + 1 + 1 + 1
    assert 2 <= passes <= bound, (passes, bound)
