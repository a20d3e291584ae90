"""flashloss.jax's Pallas path (the TPU kernels) on the CPU, in interpret mode: the head
kernels in TPU interpret mode (``pltpu.InterpretParams``: TPU semantics, blocks read past
an array's end are NaN, races detected) against an f64 numpy reference, ragged in rows
and vocabulary, both head layouts, f32 and bf16, temperature, soft-cap, bias, banned
tokens and extreme logits; a frozen head runs no dW kernel; the losses (every GRPO loss
type, token and sequence level, the cross-entropy, log-probs, the logits level) against
the f64 reference and the FFI path; errors name the argument, as on the FFI path."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
fj = pytest.importorskip("flashloss.jax")
pltpu = pytest.importorskip("jax.experimental.pallas.tpu")

from flashloss.jax import gradcheck  # noqa: E402
from flashloss.jax.pallas import head, stats  # noqa: E402

TPU = pltpu.InterpretParams()
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")


def _rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-6))


def _stats_f64(x, w, b, ids, live, temperature, softcap, layout):
    """lse, logp, entropy, mean of ``s = cap(x·Wᵀ + b) / T`` in f64, and ``∂(Σ c·stat)/∂s``."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    z = x @ (w if layout == "vh" else w.T).T + (0.0 if b is None else np.asarray(b, np.float64))
    s = (softcap * np.tanh(z / softcap) if softcap else z) / temperature
    top = s.max(1, keepdims=True)
    lse = (top + np.log(np.exp(s - top).sum(1, keepdims=True)))[:, 0]
    p = np.exp(s - lse[:, None])
    ent = lse - np.where(p > 0, p * np.where(np.isfinite(s), s, 0.0), 0.0).sum(1)
    logp = s[np.arange(len(ids)), ids] - lse
    out = [np.where(live, a, 0.0) for a in (lse, logp, ent, s.mean(1))]
    return out, s, p, z


def _head_inputs(rng, n, h, v, layout, dtype, bias=True, scale=0.5):
    x = jnp.asarray(rng.standard_normal((n, h)), dtype)
    w = jnp.asarray(rng.standard_normal((v, h) if layout == "vh" else (h, v)) * scale, dtype)
    b = jnp.asarray(rng.standard_normal(v) * 0.1, dtype) if bias else None
    ids = jnp.asarray(rng.integers(0, v, n), jnp.int32)
    live = jnp.asarray(rng.random(n) > 0.25)
    return x, w, b, ids, live


@pytest.mark.parametrize(
    "n,h,v,layout,temperature,softcap,dtype",
    [
        (300, 16, 1003, "vh", 0.7, None, "float32"),  # 3 row blocks (ragged), 4 vocab tiles (ragged)
        (300, 24, 1003, "hv", 1.0, 5.0, "float32"),
        (131, 24, 515, "vh", 1.3, 30.0, "bfloat16"),
        (7, 8, 257, "hv", 1.0, None, "bfloat16"),  # fewer rows than a block
    ],
)
def test_head_kernels_match_f64_in_tpu_interpret_mode(n, h, v, layout, temperature, softcap, dtype):
    rng = np.random.default_rng(n + v)
    x, w, b, ids, live = _head_inputs(rng, n, h, v, layout, jnp.dtype(dtype))
    spec = stats.HeadSpec(layout=layout, transform=head.Transform(temperature, softcap), vocab=v, interpret=TPU,
                          max_rows=128, max_vocab=256)  # fmt: skip
    got = stats.row_stats(x, w, b, ids, live, spec)
    want, s, p, z = _stats_f64(x, w, b, ids, live, temperature, softcap, layout)
    for g, r in zip(got, want):
        assert np.all(np.isfinite(np.asarray(g)))
        assert _rel(g, r) <= 1e-5
    cts = [rng.standard_normal(n) for _ in range(4)]

    def weighted(x, w, b):
        outs = stats.row_stats(x, w, b, ids, live, spec)
        return sum((jnp.asarray(c, jnp.float32) * t).sum() for c, t in zip(cts, outs))

    grads = jax.grad(weighted, argnums=(0, 1, 2))(x, w, b)
    # ∂/∂s of Σ c·(lse, logp, entropy, mean), then through the cap and the temperature.
    c_lse, c_logp, c_ent, c_mean = (np.where(live, c, 0.0)[:, None] for c in cts)
    onehot = np.zeros_like(s)
    onehot[np.arange(n), np.asarray(ids)] = 1.0
    ent = want[2][:, None]
    ds = c_lse * p + c_logp * (onehot - p) - c_ent * p * (np.log(np.maximum(p, 1e-300)) + ent) + c_mean / v
    dz = ds / temperature * ((1 - np.tanh(z / softcap) ** 2) if softcap else 1.0)
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    wv = w64 if layout == "vh" else w64.T
    dw = dz.T @ x64
    for g, r in zip(grads, (dz @ wv, dw if layout == "vh" else dw.T, dz.sum(0))):
        limit = 1e-4 if dtype == "float32" else 1e-2
        assert _rel(g, r) <= limit


def test_head_kernels_find_no_race():
    rng = np.random.default_rng(3)
    x, w, b, ids, live = _head_inputs(rng, 200, 16, 300, "vh", jnp.float32)
    params = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2)
    spec = stats.HeadSpec(transform=head.Transform(), vocab=300, interpret=params, max_rows=128, max_vocab=128)
    grads = jax.grad(lambda x, w: stats.row_stats(x, w, b, ids, live, spec).logp.sum(), (0, 1))(x, w)
    assert all(np.all(np.isfinite(np.asarray(g))) for g in grads)
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc

    assert not ipc.races.races_found


def test_banned_tokens_and_extreme_logits_stay_finite():
    rng = np.random.default_rng(4)
    n, h, v = 40, 8, 300
    x, w, _, ids, live = _head_inputs(rng, n, h, v, "vh", jnp.float32, bias=False, scale=400.0)  # logits ~ ±1e4
    bias = jnp.where(jnp.arange(v) % 7 == 0, -jnp.inf, 0.0).astype(jnp.float32)  # banned tokens
    ids = jnp.where(ids % 7 == 0, ids + 1, ids)
    spec = stats.HeadSpec(transform=head.Transform(0.7), vocab=v, interpret=True, max_vocab=128)
    out, grads = jax.value_and_grad(
        lambda x, w: (lambda s: s.logp.sum() + s.entropy.sum())(stats.row_stats(x, w, bias, ids, live, spec)), (0, 1)
    )(x, w)
    assert np.isfinite(float(out)) and all(np.all(np.isfinite(np.asarray(g))) for g in grads)
    want, *_ = _stats_f64(x, w, bias, ids, live, 0.7, None, "vh")
    got = stats.row_stats(x, w, bias, ids, live, spec)
    assert _rel(got.logp, want[1]) <= 1e-5  # rows near one-hot: entropy ~ 0, compared absolutely
    assert float(np.abs(np.asarray(got.entropy) - want[2]).max()) <= 1e-4


def _kernel_names(fn, *args):
    return {str(e.params.get("name")) for e in jax.make_jaxpr(fn)(*args).eqns}, str(jax.make_jaxpr(fn)(*args))


def test_frozen_head_runs_no_dw_kernel():
    rng = np.random.default_rng(5)
    x, w, b, ids, live = _head_inputs(rng, 64, 16, 300, "vh", jnp.float32)
    mask = live.reshape(8, 8)

    def loss(x, w):
        return fj.linear_grpo_loss(x.reshape(8, 8, 16), w, ids.reshape(8, 8), mask, jnp.ones(8), impl="pallas",
                                   interpret=True, mode="two_pass")[0]  # the two kernels' plan  # fmt: skip

    frozen = str(jax.make_jaxpr(jax.grad(loss))(x, w))
    both = str(jax.make_jaxpr(jax.grad(loss, (0, 1)))(x, w))
    assert "flashloss_head_dhidden" in frozen and "flashloss_head_dweight" not in frozen
    assert "flashloss_head_dweight" in both
    stopped = jax.grad(lambda x: loss(x, jax.lax.stop_gradient(w)))(x)
    assert _rel(stopped, jax.grad(loss, (0, 1))(x, w)[0]) <= 1e-7


def _grpo_inputs(seed, b=3, t=7, h=16, v=1001, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    hidden = jnp.asarray(rng.standard_normal((b, t, h)), dtype)
    weight = jnp.asarray(rng.standard_normal((v, h)) * (2.0 / np.sqrt(h)), dtype)
    ids = jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32)
    mask = jnp.asarray(np.arange(t)[None, :] < np.r_[t, rng.integers(1, t + 1, b - 1)][:, None])
    adv = jnp.asarray(rng.standard_normal(b), jnp.float32)
    old = jnp.asarray(-np.log(v) + 0.3 * rng.standard_normal((b, t)), jnp.float32)
    ref = jnp.asarray(-np.log(v) + 0.3 * rng.standard_normal((b, t)), jnp.float32)
    return hidden, weight, ids, mask, adv, old, ref


def _f64_grpo(hidden, weight, ids, mask, adv, old, ref, cfg):
    with jax.enable_x64(True):
        h64, w64 = jnp.asarray(np.asarray(hidden, np.float64)), jnp.asarray(np.asarray(weight, np.float64))
        f64 = [jnp.asarray(np.asarray(a, np.float64)) for a in (adv, old, ref)]

        def ref_fn(x, wt):
            z = (x.reshape(-1, x.shape[-1]) @ wt.T).reshape(*ids.shape, -1)
            return gradcheck.reference_loss(jnp, jax, z, jnp.asarray(ids), jnp.asarray(mask), *f64, cfg)

        loss, (dh, dw) = jax.value_and_grad(ref_fn, (0, 1))(h64, w64)
        return float(loss), np.asarray(dh), np.asarray(dw)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_grpo_on_pallas_matches_f64_reference_and_ffi(loss_type, level):
    if level == "sequence" and loss_type in ("cispo", "vespo", "luspo"):
        pytest.skip("TRL has no sequence level for this loss type")
    hidden, weight, ids, mask, adv, old, ref = _grpo_inputs(11)
    cfg = dict(loss_type=loss_type, importance_sampling_level=level, beta=0.04, temperature=0.9,
               use_bias_correction_kl=True)  # fmt: skip
    kw = dict(cfg, epsilon_high=1.2 if loss_type == "cispo" else 0.2, max_completion_length=7,
              old_per_token_logps=old, ref_per_token_logps=ref)  # fmt: skip

    def run(impl):
        f = lambda x, w: fj.linear_grpo_loss(x, w, ids, mask, adv, impl=impl, interpret=True, **kw)  # noqa: E731
        return jax.value_and_grad(f, (0, 1), has_aux=True)(hidden, weight)

    (loss, aux), (dh, dw) = run("pallas")
    want, dh64, dw64 = _f64_grpo(hidden, weight, ids, mask, adv, old, ref, cfg)
    assert abs(float(loss) - want) <= 1e-5 * max(1.0, abs(want))
    assert _rel(dh, dh64) <= 1e-4 and _rel(dw, dw64) <= 1e-4
    (loss_ffi, aux_ffi), (dh_ffi, dw_ffi) = run("ffi")
    assert abs(float(loss) - float(loss_ffi)) <= 1e-5 * max(1.0, abs(want))
    assert _rel(dh, dh_ffi) <= 1e-4 and _rel(dw, dw_ffi) <= 1e-4
    for a, b in ((aux.logp, aux_ffi.logp), (aux.entropy, aux_ffi.entropy), (aux.kl, aux_ffi.kl)):
        assert _rel(a, b) <= 1e-5
    for k in aux.metrics:
        assert abs(float(aux.metrics[k]) - float(aux_ffi.metrics[k])) <= 1e-5, k


@pytest.mark.parametrize("impl", ["pallas", "ffi"])
@pytest.mark.parametrize("layout", ["vh", "hv"])
def test_bf16_grpo_both_layouts_on_both_paths(layout, impl):
    hidden, weight, ids, mask, adv, old, ref = _grpo_inputs(12, dtype=jnp.bfloat16)
    cfg = dict(loss_type="dapo", importance_sampling_level="token", beta=0.04, temperature=1.0,
               use_bias_correction_kl=True)  # fmt: skip
    w_in = weight if layout == "vh" else weight.T
    f = lambda x, w: fj.linear_grpo_loss(x, w, ids, mask, adv, old_per_token_logps=old, ref_per_token_logps=ref,  # noqa: E731
                                         beta=0.04, impl=impl, interpret=TPU, weight_layout=layout)[0]  # fmt: skip
    loss, (dh, dw) = jax.value_and_grad(f, (0, 1))(hidden, w_in)
    assert dh.dtype == jnp.bfloat16 and dw.dtype == jnp.bfloat16 and dw.shape == w_in.shape
    want, dh64, dw64 = _f64_grpo(hidden, weight, ids, mask, adv, old, ref, cfg)
    assert abs(float(loss) - want) <= 1e-3 * max(1.0, abs(want))
    assert _rel(dh, dh64) <= 1e-2 and _rel(dw if layout == "vh" else dw.T, dw64) <= 1e-2


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(label_smoothing=0.1, z_loss=1e-3),
        dict(softcap=20.0, temperature=0.8, reduction="sum"),
        dict(label_smoothing=0.05, reduction="none"),
    ],
)
def test_cross_entropy_on_pallas_matches_ffi(kw):
    rng = np.random.default_rng(21)
    n, h, v = 40, 16, 777
    x = jnp.asarray(rng.standard_normal((n, h)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((v, h)) * 0.4, jnp.float32)
    b = jnp.asarray(rng.standard_normal(v) * 0.1, jnp.float32)
    t = jnp.asarray(np.where(rng.random(n) < 0.2, -100, rng.integers(0, v, n)), jnp.int32)
    out = {}
    for impl in ("pallas", "ffi"):

        def f(x, w, b, impl=impl):
            r = fj.linear_cross_entropy(x, w, t, bias=b, impl=impl, interpret=TPU, **kw)
            return (r * jnp.linspace(0.5, 1.5, n)).sum() if kw.get("reduction") == "none" else r

        out[impl] = jax.value_and_grad(f, (0, 1, 2))(x, w, b)
    (lp, gp), (lf, gf) = out["pallas"], out["ffi"]
    assert abs(float(lp) - float(lf)) <= 1e-5 * max(1.0, abs(float(lf)))
    for a, c in zip(gp, gf):
        assert _rel(a, c) <= 1e-4


def test_linear_logprobs_on_pallas_differentiates_logp_and_entropy():
    rng = np.random.default_rng(31)
    x, w, b, ids, live = _head_inputs(rng, 24, 8, 500, "hv", jnp.float32)
    c1, c2 = (jnp.asarray(rng.standard_normal(24), jnp.float32) for _ in range(2))

    def f(x, w, impl):
        logp, ent = fj.linear_logprobs(
            x,
            w,
            ids,
            temperature=0.8,
            return_entropy=True,
            bias=b,
            mask=live,
            impl=impl,
            interpret=True,
            weight_layout="hv",
        )[:2]
        return (c1 * logp).sum() + (c2 * ent).sum()

    got = jax.value_and_grad(f, (0, 1))(x, w, "pallas")
    want, *_ = _stats_f64(x, w, b, ids, live, 0.8, None, "hv")
    assert abs(float(got[0]) - float((np.asarray(c1) * want[1] + np.asarray(c2) * want[2]).sum())) <= 1e-4
    ffi = jax.value_and_grad(f, (0, 1))(x, w, "ffi")
    assert _rel(got[1][0], ffi[1][0]) <= 1e-4 and _rel(got[1][1], ffi[1][1]) <= 1e-4


@pytest.mark.parametrize("loss_type,level", [("dapo", "token"), ("grpo", "sequence"), ("vespo", "token")])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logits_level_on_pallas_matches_f64_reference(loss_type, level, dtype):
    hidden, weight, ids, mask, adv, old, ref = _grpo_inputs(41)
    z = (hidden.reshape(-1, 16) @ weight.T).reshape(3, 7, -1).astype(dtype)
    cfg = dict(loss_type=loss_type, importance_sampling_level=level, beta=0.04, temperature=0.9,
               use_bias_correction_kl=True)  # fmt: skip
    kw = dict(cfg, old_per_token_logps=old, ref_per_token_logps=ref)
    loss, dz = jax.value_and_grad(lambda z: fj.grpo_loss(z, ids, mask, adv, impl="pallas", interpret=TPU, **kw)[0])(z)
    assert dz.dtype == z.dtype
    with jax.enable_x64(True):
        f64 = [jnp.asarray(np.asarray(a, np.float64)) for a in (adv, old, ref)]
        ref_fn = lambda z: gradcheck.reference_loss(jnp, jax, z, ids, mask, *f64, cfg)  # noqa: E731
        want, dz64 = jax.value_and_grad(ref_fn)(jnp.asarray(np.asarray(z, np.float64)))
        want, dz64 = float(want), np.asarray(dz64)
    tol = (1e-5, 1e-4) if dtype == "float32" else (1e-3, 1e-2)
    assert abs(float(loss) - want) <= tol[0] * max(1.0, abs(want))
    assert _rel(dz, dz64) <= tol[1]


def test_auto_takes_pallas_in_interpret_mode_and_ffi_on_the_cpu():
    hidden, weight, ids, mask, adv, *_ = _grpo_inputs(51)

    def f(interpret, **kw):
        return lambda x: fj.linear_grpo_loss(x, weight, ids, mask, adv, interpret=interpret, **kw)[0]

    assert "flashloss_head_forward" in str(jax.make_jaxpr(f(True, mode="two_pass"))(hidden))
    assert "flashloss_logits_fused" in str(jax.make_jaxpr(f(True, mode="single_pass"))(hidden))
    # the default plan: the lowest counted roofline within the chip's budget (pallas/single_pass.py);
    # at this shape the two kernels (the single pass writes and reads its block's logits, they never do)
    assert "flashloss_head_forward" in str(jax.make_jaxpr(f(True))(hidden))
    on_cpu = jax.jit(f(False)).lower(hidden).as_text()
    assert "flashloss_grpo_linear" in on_cpu and "tpu_custom_call" not in on_cpu


@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(impl="tpu"), "argument `impl`"),
        (dict(weight_layout="vhx"), "argument `weight_layout`"),
        (dict(loss_type="nope"), "loss_type"),
        (dict(epsilon_low=-1.0), "epsilon_low"),
        (dict(temperature=0.0), "temperature"),
    ],
)
@pytest.mark.parametrize("impl", ["pallas", "ffi"])
def test_bad_arguments_raise_value_errors_at_trace_time(kw, message, impl):
    hidden, weight, ids, mask, adv, *_ = _grpo_inputs(61)
    kw = dict(dict(impl=impl, interpret=True), **kw)
    with pytest.raises(ValueError, match=message):
        jax.make_jaxpr(lambda x: fj.linear_grpo_loss(x, weight, ids, mask, adv, **kw)[0])(hidden)


def test_bad_shapes_name_the_argument_on_both_layouts():
    hidden, weight, ids, mask, adv, *_ = _grpo_inputs(62)
    with pytest.raises(ValueError, match="argument `hidden`"):
        fj.linear_grpo_loss(hidden, weight, ids, mask, adv, impl="pallas", interpret=True, weight_layout="hv")
    with pytest.raises(ValueError, match="argument `bias`"):
        fj.linear_cross_entropy(hidden.reshape(-1, 16), weight, ids.reshape(-1), bias=jnp.zeros(3), impl="pallas",
                                interpret=True)  # fmt: skip


def test_bad_values_raise_at_run_time_with_the_message():
    hidden, weight, ids, mask, adv, *_ = _grpo_inputs(63)
    bad_ids = ids.at[1, 0].set(5000)
    with pytest.raises(Exception, match=r"argument `completion_ids`: id 5000 at index 7 \(sequence 1, position 0\)"):
        jax.block_until_ready(fj.linear_grpo_loss(hidden, weight, bad_ids, mask, adv, impl="pallas", interpret=True))
    nan_hidden = hidden.at[0, 2, 3].set(jnp.nan)
    with pytest.raises(Exception, match="row 2 holds NaN"):
        jax.block_until_ready(fj.linear_grpo_loss(nan_hidden, weight, ids, mask, adv, impl="pallas", interpret=True))
    with pytest.raises(Exception, match="argument `advantages`: value nan at index 1"):
        jax.block_until_ready(
            fj.linear_grpo_loss(hidden, weight, ids, mask, adv.at[1].set(jnp.nan), impl="pallas", interpret=True)
        )
    # The process goes on.
    loss, _ = fj.linear_grpo_loss(hidden, weight, ids, mask, adv, impl="pallas", interpret=True)
    assert np.isfinite(float(loss))
