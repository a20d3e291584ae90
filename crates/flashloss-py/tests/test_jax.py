"""flashloss.jax against pure-JAX references of TRL's formulas (f32, autodiff), under
jit, grad and vmap, f32 and bf16; the FFI mirror's layout against jaxlib's header; bad
input raises an error naming the argument, and the process goes on."""

import os
import subprocess
import tempfile

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
fj = pytest.importorskip("flashloss.jax")
gradcheck = pytest.importorskip("flashloss.jax.gradcheck")

from flashloss import _native  # noqa: E402


def test_ffi_mirror_matches_the_installed_header():
    layout = _native.jax_abi_layout()
    lines = ["#include <stddef.h>", "#include <stdio.h>", '#include "xla/ffi/api/c_api.h"', "int main(void) {"]
    for name, (size, fields) in layout.items():
        if size:
            lines.append(f'printf("{name} size %zu\\n", sizeof({name}));')
        for field in fields:
            lines.append(f'printf("{name} {field} %zu\\n", offsetof({name}, {field}));')
    lines += ["return 0;", "}"]
    with tempfile.TemporaryDirectory() as d:
        src, exe = os.path.join(d, "abi.c"), os.path.join(d, "abi")
        with open(src, "w") as f:
            f.write("\n".join(lines))
        subprocess.run(["cc", "-I", jax.ffi.include_dir(), src, "-o", exe], check=True)
        out = subprocess.run([exe], check=True, capture_output=True, text=True).stdout
    header = {tuple(line.split()[:2]): int(line.split()[2]) for line in out.splitlines()}
    mirror = {}
    for name, (size, fields) in layout.items():
        if size:
            mirror[(name, "size")] = size
        mirror.update({(name, k): v for k, v in fields.items()})
    assert header == mirror


def _inputs(b, t, h, v, seed, dtype=jnp.float32, masked=True, bias=False):
    rng = np.random.default_rng(seed)
    hidden = jnp.asarray(rng.standard_normal((b, t, h)), dtype)
    weight = jnp.asarray(rng.standard_normal((v, h)) * 0.5, dtype)
    ids = jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32)
    lens = rng.integers(1, t + 1, b) if masked else np.full(b, t)
    mask = jnp.asarray(np.arange(t)[None, :] < lens[:, None])
    adv = jnp.asarray(rng.standard_normal(b), jnp.float32)
    old = jnp.asarray(-np.log(v) + 0.3 * rng.standard_normal((b, t)), jnp.float32)
    ref = jnp.asarray(-np.log(v) + 0.3 * rng.standard_normal((b, t)), jnp.float32)
    bias_v = jnp.asarray(rng.standard_normal(v) * 0.1, dtype) if bias else None
    return hidden, weight, bias_v, ids, mask, adv, old, ref


def _trl_loss(hidden, weight, bias, ids, mask, adv, old, ref, loss_type, beta, temperature, bias_kl):
    """TRL's GRPOTrainer._compute_loss (token level) on materialized logits, in f32."""
    b, t = ids.shape
    z = hidden.reshape(b * t, -1).astype(jnp.float32) @ weight.astype(jnp.float32).T
    if bias is not None:
        z = z + bias.astype(jnp.float32)
    cfg = dict(
        loss_type=loss_type,
        importance_sampling_level="token",
        beta=beta,
        temperature=temperature,
        use_bias_correction_kl=bias_kl,
    )
    return gradcheck.reference_loss(jnp, jax, z.reshape(b, t, -1), ids, mask, adv, old, ref, cfg)


def _close(got, want, rel, what):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = max(np.abs(want).max(), 1e-6)
    err = np.abs(got - want).max() / scale
    assert err <= rel, f"{what}: {err:.3e} > {rel}"


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "bnpo", "dr_grpo"])
@pytest.mark.parametrize("beta,bias_kl", [(0.0, True), (0.04, True), (0.04, False)])
def test_linear_grpo_matches_trl_under_jit_and_grad(loss_type, beta, bias_kl):
    hidden, weight, bias, ids, mask, adv, old, ref = _inputs(3, 7, 16, 1001, seed=1, bias=True)
    kw = dict(loss_type=loss_type, beta=beta, temperature=0.9, use_bias_correction_kl=bias_kl, max_completion_length=7)

    def ours(h, w, bb):
        loss, _ = fj.linear_grpo_loss(
            h, w, ids, mask, adv, bias=bb, old_per_token_logps=old, ref_per_token_logps=ref if beta else None, **kw
        )
        return loss

    def theirs(h, w, bb):
        return _trl_loss(h, w, bb, ids, mask, adv, old, ref, loss_type, beta, 0.9, bias_kl)

    got, g_got = jax.jit(jax.value_and_grad(ours, argnums=(0, 1, 2)))(hidden, weight, bias)
    want, g_want = jax.value_and_grad(theirs, argnums=(0, 1, 2))(hidden, weight, bias)
    _close(got, want, 1e-5, "loss")
    for name, a, b_ in zip(("dhidden", "dweight", "dbias"), g_got, g_want):
        _close(a, b_, 1e-4, name)


def test_outputs_metrics_and_bf16():
    hidden, weight, _, ids, mask, adv, old, ref = _inputs(2, 5, 8, 257, seed=2)
    loss, out = fj.linear_grpo_loss(hidden, weight, ids, mask, adv, old_per_token_logps=old, beta=0.0)
    lp = jax.nn.log_softmax(hidden.reshape(10, -1) @ weight.T, -1)
    want = jnp.take_along_axis(lp, ids.reshape(-1, 1), 1).reshape(2, 5)
    _close(jnp.where(mask, out.logp, 0), jnp.where(mask, want, 0), 1e-5, "logp")
    assert set(out.metrics) == {
        "kl",
        "entropy",
        "clip_ratio/low_mean",
        "clip_ratio/high_mean",
        "clip_ratio/region_mean",
    }
    hb, wb = hidden.astype(jnp.bfloat16), weight.astype(jnp.bfloat16)
    lb, grads = jax.value_and_grad(
        lambda h, w: fj.linear_grpo_loss(h, w, ids, mask, adv, old_per_token_logps=old)[0], (0, 1)
    )(hb, wb)
    assert grads[0].dtype == jnp.bfloat16 and grads[1].dtype == jnp.bfloat16
    want = _trl_loss(hb, wb, None, ids, mask, adv, old, ref, "dapo", 0.0, 1.0, True)
    _close(lb, want, 2e-2, "bf16 loss")


def test_vmap_runs_each_batch_element_alone():
    hidden, weight, _, ids, mask, adv, old, _ = _inputs(2, 4, 8, 129, seed=3)
    hs = jnp.stack([hidden, hidden * 0.5, -hidden])

    def one(h):
        return fj.linear_grpo_loss(h, weight, ids, mask, adv, old_per_token_logps=old)[0]

    batched = jax.vmap(one)(hs)
    for k in range(3):
        _close(batched[k], one(hs[k]), 1e-6, f"vmap {k}")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_donated_inputs_give_the_same_step(dtype):
    """A jitted training step that donates hidden, weight and bias (the gradients have
    their shapes and dtypes, so XLA may reuse the donated buffers for them) gives the
    step without donation, bit for bit."""
    hidden, weight, bias, ids, mask, adv, old, ref = _inputs(2, 5, 8, 257, seed=9, bias=True)

    def step(h, w, b):
        def loss(h, w, b):
            out = fj.linear_grpo_loss(h, w, ids, mask, adv, bias=b, old_per_token_logps=old,
                                      ref_per_token_logps=ref, beta=0.04)  # fmt: skip
            return out[0] + fj.linear_cross_entropy(h, w, ids, bias=b)

        value, grads = jax.value_and_grad(loss, (0, 1, 2))(h, w, b)
        return value, tuple(x - 0.1 * g.astype(x.dtype) for x, g in zip((h, w, b), grads))

    args = tuple(x.astype(dtype) for x in (hidden, weight, bias))
    want = jax.jit(step)(*args)
    copies = tuple(jnp.array(x, copy=True) for x in args)
    donated = jax.jit(step, donate_argnums=(0, 1, 2))(*copies)
    assert all(x.is_deleted() for x in copies)  # XLA took the buffers
    for a, b_ in zip(jax.tree.leaves(donated), jax.tree.leaves(want)):
        assert a.dtype == b_.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b_, np.float32))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_linear_cross_entropy_matches_the_reference(reduction):
    hidden, weight, bias, ids, _, _, _, _ = _inputs(3, 6, 16, 777, seed=4, bias=True)
    targets = ids.at[0, :2].set(-100)
    kw = dict(label_smoothing=0.1, z_loss=1e-3, softcap=30.0, temperature=0.8)

    def ours(h, w, b):
        out = fj.linear_cross_entropy(h, w, targets, bias=b, reduction=reduction, **kw)
        return out.sum() if reduction == "none" else out

    def theirs(h, w, b):
        z = h.reshape(-1, h.shape[-1]) @ w.T + b
        s = 30.0 * jnp.tanh(z / 30.0) / 0.8
        lse = jax.nn.logsumexp(s, -1)
        t = targets.reshape(-1)
        keep = t != -100
        st = jnp.take_along_axis(s, jnp.where(keep, t, 0)[:, None], 1)[:, 0]
        rows = 0.9 * (lse - st) + 0.1 * (lse - s.mean(-1)) + 1e-3 * lse**2
        rows = jnp.where(keep, rows, 0.0)
        if reduction == "mean":
            return rows.sum() / keep.sum()
        return rows.sum()

    got, g_got = jax.jit(jax.value_and_grad(ours, argnums=(0, 1, 2)))(hidden, weight, bias)
    want, g_want = jax.value_and_grad(theirs, argnums=(0, 1, 2))(hidden, weight, bias)
    _close(got, want, 1e-5, "loss")
    for name, a, b_ in zip(("dhidden", "dweight", "dbias"), g_got, g_want):
        _close(a, b_, 1e-4, name)


def test_logits_level_grpo_and_logprobs():
    hidden, weight, _, ids, mask, adv, old, ref = _inputs(2, 6, 8, 513, seed=5)
    logits = (hidden.reshape(12, -1) @ weight.T).reshape(2, 6, -1)

    def ours(z):
        return fj.grpo_loss(
            z, ids, mask, adv, old_per_token_logps=old, ref_per_token_logps=ref, beta=0.04, temperature=0.7
        )[0]

    def theirs(z):
        lp = jax.nn.log_softmax(z / 0.7, -1)
        logp = jnp.take_along_axis(lp, ids[..., None], -1)[..., 0]
        r = jnp.exp(logp - old)
        loss = -jnp.minimum(r * adv[:, None], jnp.clip(r, 0.8, 1.2) * adv[:, None])
        kl = jnp.exp(ref - logp) - (ref - logp) - 1
        loss = loss + 0.04 * kl * r
        m = mask.astype(jnp.float32)
        return (loss * m).sum() / m.sum()

    got, g = jax.jit(jax.value_and_grad(ours))(logits)
    want, gw = jax.value_and_grad(theirs)(logits)
    _close(got, want, 1e-5, "loss")
    _close(g, gw, 1e-4, "dlogits")
    logp, entropy = fj.linear_logprobs(hidden, weight, ids, temperature=0.7, return_entropy=True)[:2]
    lp = jax.nn.log_softmax(logits / 0.7, -1)
    _close(logp, jnp.take_along_axis(lp, ids[..., None], -1)[..., 0], 1e-5, "logprobs")
    _close(entropy, -(jnp.exp(lp) * lp).sum(-1), 1e-5, "entropy")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_linear_logprobs_is_differentiable(dtype):
    hidden, weight, bias, ids, mask, _, _, _ = _inputs(3, 5, 8, 301, seed=7, bias=True)
    hidden, weight, bias = (x.astype(dtype) for x in (hidden, weight, bias))
    g = np.random.default_rng(8)
    cl, ce = (jnp.asarray(g.standard_normal(ids.shape), jnp.float32) for _ in range(2))

    def ours(x, w, b):
        lp, ent = fj.linear_logprobs(x, w, ids, temperature=0.8, return_entropy=True, bias=b, mask=mask)[:2]
        return (lp * cl).sum() + (ent * ce).sum()

    def theirs(x, w, b):
        z = (x.astype(jnp.float32) @ w.astype(jnp.float32).T + b.astype(jnp.float32)) / 0.8
        lp = jax.nn.log_softmax(z, -1)
        logp = jnp.take_along_axis(lp, ids[..., None], -1)[..., 0]
        ent = -(jnp.exp(lp) * lp).sum(-1)
        return jnp.where(mask, logp * cl + ent * ce, 0.0).sum()

    got, g_got = jax.jit(jax.value_and_grad(ours, (0, 1, 2)))(hidden, weight, bias)
    want, g_want = jax.value_and_grad(theirs, (0, 1, 2))(hidden, weight, bias)
    tol = 1e-5 if dtype == "float32" else 1e-2
    _close(got, want, tol, "objective")
    for name, a, b_ in zip(("dhidden", "dweight", "dbias"), g_got, g_want):
        assert a.dtype == b_.dtype
        _close(a.astype(jnp.float32), b_.astype(jnp.float32), 1e-4 if dtype == "float32" else 2e-2, name)


def test_bad_input_names_the_argument_and_the_process_goes_on():
    hidden, weight, _, ids, mask, adv, old, _ = _inputs(2, 4, 8, 65, seed=6)
    with pytest.raises(ValueError, match="`hidden`"):
        fj.linear_grpo_loss(hidden[..., :5], weight, ids, mask, adv)
    with pytest.raises(ValueError, match="`completion_ids`"):
        fj.linear_grpo_loss(hidden, weight, ids.astype(jnp.float32), mask, adv)
    runtime = jax.errors.JaxRuntimeError
    with pytest.raises(ValueError, match="`loss_type`: unknown variant `nope`"):  # at trace time, on both paths
        jax.make_jaxpr(lambda x: fj.linear_grpo_loss(x, weight, ids, mask, adv, loss_type="nope")[0])(hidden)
    bad = ids.at[1, 2].set(65)
    with pytest.raises(runtime, match="`completion_ids`: id 65 at index 6 .* outside"):
        jax.block_until_ready(fj.linear_grpo_loss(hidden, weight, bad, jnp.ones_like(mask), adv)[0])
    nan = hidden.at[0, 0, 0].set(jnp.nan)
    with pytest.raises(runtime, match="`hidden`: value NaN at index 0 is not finite"):
        jax.block_until_ready(fj.linear_cross_entropy(nan, weight, ids))
    for axis in ("vocab_axis", "token_axis"):
        with pytest.raises(ValueError, match=f"`{axis}`: no mesh axis 'x'"):
            fj.linear_grpo_loss(hidden, weight, ids, mask, adv, **{axis: "x"})
    # The process is intact: a good call still runs.
    assert np.isfinite(float(fj.linear_cross_entropy(hidden, weight, ids)))


@pytest.mark.parametrize("min_length", [0.5, 1.0])
def test_bench_paths_agree_on_loss_and_gradients(min_length):
    bench = pytest.importorskip("flashloss.jax.bench")
    sets = ["tokens=96", "batch=3", "hidden=16", "vocab=3001", "vocab_tile=512", "temperature=0.8", "interpret=true"]
    cfg = bench.load(None, sets + [f"min_length={min_length}"])
    args = bench.inputs(cfg)
    mask = np.asarray(args[-1])
    assert mask.all() == (min_length == 1.0) and mask[:, : 32 // 2].all()
    results = {}
    for name, fn in bench.IMPLS.items():
        step = jax.jit(jax.value_and_grad(lambda h, w, *rest: fn(h, w, *rest, cfg), argnums=(0, 1)))
        results[name] = step(*args)
    want, (dh, dw) = results["baseline"]
    for name in ("tiled", "fused", "pallas"):
        got, (gh, gw) = results[name]
        _close(got, want, 1e-5, f"{name} loss")
        _close(gh, dh, 1e-4, f"{name} dhidden")
        _close(gw, dw, 1e-4, f"{name} dweight")


def test_bench_rejects_a_min_length_beyond_t():
    bench = pytest.importorskip("flashloss.jax.bench")
    with pytest.raises(ValueError, match="min_length: expected a fraction of T"):
        bench.load(None, ["min_length=1.5"])


def test_only_the_loss_types_parameters_are_validated():
    """A bnpo call with sapo_temperature_neg=False runs; a bad sapo temperature is an
    error naming it, at trace time on both paths (issue 33)."""
    hidden, weight, _, ids, mask, adv, old, _ = _inputs(2, 4, 8, 65, seed=7)
    for impl in ("ffi", "pallas"):
        kw = dict(impl=impl, interpret=impl == "pallas")
        loss, _ = fj.linear_grpo_loss(hidden, weight, ids, mask, adv, loss_type="bnpo", sapo_temperature_neg=False,
                                      **kw)  # fmt: skip
        assert np.isfinite(float(loss))
        with pytest.raises(ValueError, match="`sapo_temperature_neg`: must be > 0, got 0"):
            fj.linear_grpo_loss(hidden, weight, ids, mask, adv, loss_type="sapo", sapo_temperature_neg=0.0, **kw)


@pytest.mark.parametrize("impl", ["ffi", "pallas"])
def test_sequence_level_clip_metrics_are_means_over_sequences(impl):
    """TRL 1.16's global_masked_mean of [B, 1] clip flags (sequence level, per-sequence
    advantages): a mean over the B sequences; per-token advantages: over live tokens."""
    hidden, weight, _, ids, mask, adv, old, _ = _inputs(6, 5, 8, 65, seed=8)
    old = old + jnp.asarray([-0.6, -0.3, 0.0, 0.0, 0.3, 0.6])[:, None]
    kw = dict(loss_type="grpo", importance_sampling_level="sequence", impl=impl, interpret=impl == "pallas")
    for advantages in (adv, jnp.broadcast_to(adv[:, None], ids.shape)):
        _, out = fj.linear_grpo_loss(hidden, weight, ids, mask, advantages, old_per_token_logps=old, **kw)
        m = mask.astype(jnp.float32)
        log_r = ((out.logp - old) * m).sum(-1, keepdims=True) / jnp.maximum(m.sum(-1, keepdims=True), 1.0)
        a = advantages if advantages.ndim == 2 else advantages[:, None]
        r = jnp.exp(log_r)
        region = (((r < 0.8) & (a < 0)) | ((r > 1.2) & (a > 0))).astype(jnp.float32)
        want = (region * m).sum() / m.sum() if advantages.ndim == 2 else region.mean()
        assert abs(float(out.metrics["clip_ratio/region_mean"]) - float(want)) < 1e-6, (advantages.ndim, want)
        assert 0 < float(want) < 1


@pytest.mark.parametrize("impl", ["ffi", "pallas"])
def test_f16_inputs(impl):
    """float16 heads and logits (issue 33): widened exactly (the FFI kernels read them;
    the Pallas path widens them to float32), gradients in float16."""
    hidden, weight, _, ids, mask, adv, old, ref = _inputs(2, 5, 8, 257, seed=9)
    hh, wh = hidden.astype(jnp.float16), weight.astype(jnp.float16)
    kw = dict(impl=impl, interpret=impl == "pallas")
    lh, grads = jax.value_and_grad(
        lambda h, w: fj.linear_grpo_loss(h, w, ids, mask, adv, old_per_token_logps=old, **kw)[0], (0, 1)
    )(hh, wh)
    assert grads[0].dtype == jnp.float16 and grads[1].dtype == jnp.float16
    h32, w32 = hh.astype(jnp.float32), wh.astype(jnp.float32)
    l32, g32 = jax.value_and_grad(
        lambda h, w: fj.linear_grpo_loss(h, w, ids, mask, adv, old_per_token_logps=old, **kw)[0], (0, 1)
    )(h32, w32)
    _close(lh, l32, 1e-5, "f16 loss")
    for a, b in zip(grads, g32):
        _close(a, b, 2e-3, "f16 grads")
    ce = fj.linear_cross_entropy(hh, wh, ids, **kw)
    _close(ce, fj.linear_cross_entropy(h32, w32, ids, **kw), 1e-5, "f16 ce")
    logits = (hidden @ weight.T).astype(jnp.float16)
    lz, gz = jax.value_and_grad(lambda z: fj.grpo_loss(z, ids, mask, adv, old_per_token_logps=old, **kw)[0])(logits)
    assert gz.dtype == jnp.float16
    _close(lz, fj.grpo_loss(logits.astype(jnp.float32), ids, mask, adv, old_per_token_logps=old, **kw)[0], 1e-5, "z")


def _per_token_reference(z, ids, mask, adv, old, ref, level, beta):
    """TRL's clipped per-token loss ``ℓ + β·kl`` (bias-corrected KL) times the mask, in f32."""
    logp = jnp.take_along_axis(jax.nn.log_softmax(z, -1), ids[..., None], -1)[..., 0]
    m = mask.astype(jnp.float32)
    log_ratio = logp - old
    if level == "sequence":
        log_ratio = ((log_ratio * m).sum(-1) / jnp.maximum(m.sum(-1), 1.0))[:, None]
    r, a = jnp.exp(log_ratio), adv[:, None]
    loss = -jnp.minimum(r * a, jnp.clip(r, 0.8, 1.2) * a)
    d = ref - logp
    return jnp.broadcast_to(loss, logp.shape) * m + beta * (jnp.exp(d) - d - 1) * r * m


@pytest.mark.parametrize("impl", ["ffi", "pallas"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_grpo_loss_reduce_false(impl, level):
    """``reduce=False``: Liger's per-token losses, KL and clip flags, and the gradient of
    ``Σ g·ℓ_tot`` for an upstream ``g`` (sequence level: through R_b) (issue 33)."""
    hidden, weight, _, ids, mask, adv, old, ref = _inputs(3, 5, 8, 65, seed=10)
    z = hidden @ weight.T
    g = jnp.asarray(np.random.default_rng(1).standard_normal(ids.shape), jnp.float32)
    kw = dict(loss_type="grpo", beta=0.04, importance_sampling_level=level, old_per_token_logps=old,
              ref_per_token_logps=ref, impl=impl, interpret=impl == "pallas")  # fmt: skip
    rows, kl, clipped = fj.grpo_loss(z, ids, mask, adv, reduce=False, **kw)
    want = _per_token_reference(z, ids, mask, adv, old, ref, level, 0.04)
    _close(rows, want, 1e-5, "per-token loss")
    assert kl.shape == clipped.shape == ids.shape and float(jnp.abs(jnp.where(mask, 0, rows)).max()) == 0
    got = jax.grad(lambda x: (fj.grpo_loss(x, ids, mask, adv, reduce=False, **kw)[0] * g).sum())(z)
    ref_grad = jax.grad(lambda x: (_per_token_reference(x, ids, mask, adv, old, ref, level, 0.04) * g).sum())(z)
    _close(got, ref_grad, 1e-4, "per-token gradient")
    none = fj.grpo_loss(z, ids, mask, adv, reduce=False, loss_type="dapo", impl=impl, interpret=impl == "pallas")
    assert none[1] is None
