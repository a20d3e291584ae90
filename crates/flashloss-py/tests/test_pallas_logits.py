"""flashloss.jax.pallas.logits (the logits-level Pallas TPU kernels) in TPU interpret mode
against an f64 numpy reference and against the FFI ``flashloss.jax.grpo_loss``; its TPU
(Mosaic) lowering by ``jax.export`` from this CPU host, at a small and the original shape."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import flashloss.jax as fj
from flashloss.jax.pallas import logits as L

TPU = pltpu.InterpretParams()  # TPU semantics: uninitialised VMEM (rows beyond N) reads NaN


def draw(seed, n, v, dtype=jnp.float32, scale=3.0, masked=()):
    rng = np.random.default_rng(seed)
    z = jnp.asarray(rng.normal(size=(n, v)) * scale, dtype)
    ids = rng.integers(0, v, n).astype(np.int32)
    mask = np.ones(n, bool)
    mask[list(masked)] = False
    return z, ids, mask, rng


def reference(z, ids, temperature):
    """f64 (lse, logp, entropy, p, log p) of ``z / temperature`` (``-inf`` entries allowed)."""
    s = np.asarray(jnp.asarray(z, jnp.float32), np.float64) / temperature
    mu = s.max(1, keepdims=True)
    lse = mu[:, 0] + np.log(np.exp(s - mu).sum(1))
    lp = s - lse[:, None]
    p = np.exp(lp)
    lp0 = np.where(p > 0, lp, 0.0)  # no 0·(-inf)
    ent = -(p * lp0).sum(1)
    return lse, lp[np.arange(len(ids)), ids], ent, p, lp0


def ref_grad(z, ids, g_logp, g_ent, temperature, mask):
    _, _, ent, p, lp = reference(z, ids, temperature)
    onehot = np.arange(p.shape[1])[None, :] == ids[:, None]
    ds = g_logp[:, None] * (onehot - p) - g_ent[:, None] * p * (lp + ent[:, None])
    return np.where(mask[:, None], ds / temperature, 0.0)


def close(x, r, rel):
    x, r = np.asarray(x, np.float64), np.asarray(r, np.float64)
    assert np.all(np.isfinite(x))
    err = np.abs(x - r) / np.maximum(1.0, np.abs(r))
    assert err.max() <= rel, (err.max(), np.argmax(err))


def close_max(x, r, rel):
    x, r = np.asarray(jnp.asarray(x, jnp.float32), np.float64), np.asarray(r, np.float64)
    assert np.all(np.isfinite(x))
    assert np.abs(x - r).max() <= rel * np.abs(r).max(), np.abs(x - r).max() / np.abs(r).max()


CASES = [  # n, v, bn, temperature, masked rows
    (13, 1003, 8, 0.7, (2, 12)),  # ragged N (the last block holds 3 live rows), odd V
    (16, 257, 8, 1.0, ()),
    (5, 130, None, 0.7, (4,)),  # N < 8: the block equals the array
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("n,v,bn,temperature,masked", CASES)
def test_stats_and_grad(n, v, bn, temperature, masked, dtype):
    z, ids, mask, rng = draw(n + v, n, v, dtype, masked=masked)
    lse, logp, ent = L.logits_stats(z, ids, mask=mask, temperature=temperature, interpret=TPU, bn=bn)
    r_lse, r_logp, r_ent, _, _ = reference(z, ids, temperature)
    for x, r in ((lse, r_lse), (logp, r_logp), (ent, r_ent)):
        assert x.shape == (n,) and x.dtype == jnp.float32
        close(x, np.where(mask, r, 0.0), 1e-5)
    assert np.all(np.asarray(logp)[~mask] == 0) and np.all(np.asarray(ent)[~mask] == 0)
    g_logp, g_ent = rng.normal(size=n), rng.normal(size=n)
    dz = L.logits_grad(
        z,
        ids,
        lse,
        ent,
        jnp.asarray(g_logp, jnp.float32),
        jnp.asarray(g_ent, jnp.float32),
        mask=mask,
        temperature=temperature,
        interpret=TPU,
        bn=bn,
    )
    assert dz.shape == (n, v) and dz.dtype == dtype
    close_max(dz, ref_grad(z, ids, g_logp, g_ent, temperature, mask), 1e-4 if dtype == jnp.float32 else 1e-2)
    assert np.all(np.asarray(dz, np.float32)[~mask] == 0)


def test_extreme_logits_never_nan():
    n, v = 10, 300
    z, ids, mask, rng = draw(3, n, v, scale=1.0)
    z = np.asarray(z) * 1e4  # logits of ±1e4
    z[:, ::7] = -np.inf  # banned tokens
    z[0] = -1e4
    z[0, 5] = 1e4  # one dominant entry
    ids[ids % 7 == 0] += 1
    ids[0] = 5
    mask[3] = False
    z = jnp.asarray(z, jnp.float32)
    g_logp, g_ent = rng.normal(size=n), rng.normal(size=n)
    for t in (1.0, 0.7):
        lse, logp, ent = L.logits_stats(z, ids, mask=mask, temperature=t, interpret=TPU, bn=8)
        dz = L.logits_grad(
            z,
            ids,
            lse,
            ent,
            jnp.asarray(g_logp, jnp.float32),
            jnp.asarray(g_ent, jnp.float32),
            mask=mask,
            temperature=t,
            interpret=TPU,
            bn=8,
        )
        loss, logp2, _, dz2 = L.logits_fused(
            z, ids, (), lambda lp, h: -lp - 0.1 * h, mask=mask, temperature=t, interpret=TPU, bn=8
        )
        for x in (lse, logp, ent, dz, loss, dz2):
            assert np.all(np.isfinite(np.asarray(x)))
        assert np.all(np.asarray(dz)[:, ::7] == 0) and np.all(np.asarray(dz2)[:, ::7] == 0)
        if t == 1.0:  # s = z exactly: the f32 statistics keep their bounds even at ±1e4
            r_lse, r_logp, r_ent, _, _ = reference(z, ids, t)
            close(logp, np.where(mask, r_logp, 0.0), 1e-5)
            close(ent, np.where(mask, r_ent, 0.0), 1e-5)
            close(logp2, logp, 0.0)
            close_max(dz, ref_grad(z, ids, g_logp, g_ent, t, mask), 1e-4)
            close_max(dz2, ref_grad(z, ids, -np.ones(n), -0.1 * np.ones(n), t, mask), 1e-4)


def test_fused_with_an_entropy_term():
    n, v, temperature = 13, 300, 0.7
    z, ids, mask, rng = draw(11, n, v, masked=(0, 9))
    a, c = rng.normal(size=n).astype(np.float32), rng.normal(size=n).astype(np.float32)
    row_fn = lambda lp, h, a, c: a * jnp.exp(lp) + c * h * h  # noqa: E731
    loss, logp, ent, dz = L.logits_fused(
        z, ids, (a, c), row_fn, mask=mask, temperature=temperature, interpret=TPU, bn=8
    )
    _, r_logp, r_ent, _, _ = reference(z, ids, temperature)
    close(loss, np.where(mask, a * np.exp(r_logp) + c * r_ent**2, 0.0), 1e-5)
    close(logp, np.where(mask, r_logp, 0.0), 1e-5)
    close(ent, np.where(mask, r_ent, 0.0), 1e-5)
    close_max(dz, ref_grad(z, ids, a * np.exp(r_logp), 2 * c * r_ent, temperature, mask), 1e-4)


def test_no_races_and_the_detector_works():
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc

    racy = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2)
    z, ids, mask, _ = draw(5, 24, 256)
    L.logits_fused(z, ids, (), lambda lp, h: -lp, mask=mask, interpret=racy, bn=8)
    assert ipc.races is not None and not ipc.races.races_found

    def clobber(x_ref, o_ref):  # every grid point writes the one output block
        o_ref[...] = x_ref[...]

    pltpu.reset_tpu_interpret_mode_state()
    pl.pallas_call(
        clobber,
        out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        grid=(4,),
        in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((8, 128), lambda i: (0, 0)),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=racy,
    )(jnp.ones((32, 128), jnp.float32))
    assert ipc.races.races_found
    pltpu.reset_tpu_interpret_mode_state()


def dapo_row_fn(beta, corrected, eps=0.2):
    """TRL's dapo per-token term times the reduction weight w (row inputs old, ref, adv, w)."""

    def row_fn(logp, ent, old, ref, adv, w):
        log_r = logp - old
        r = jnp.exp(log_r)
        loss = -jnp.minimum(r * adv, jnp.clip(r, 1 - eps, 1 + eps) * adv)
        if beta:
            d = ref - logp
            kl = jnp.exp(d + log_r) - (d + 1) * r if corrected else jnp.exp(d) - d - 1
            loss = loss + beta * kl
        return loss * w

    return row_fn


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("beta,corrected", [(0.0, True), (0.04, False), (0.04, True)])
def test_fused_matches_ffi_grpo_loss(beta, corrected, dtype):
    b, t, v, temperature = 3, 4, 257, 0.7
    z, ids, _, rng = draw(int(beta * 100) + corrected, b * t, v, dtype)
    z3, ids2 = z.reshape(b, t, v), ids.reshape(b, t)
    mask = rng.random((b, t)) > 0.25
    mask[-1, -1] = False
    adv = rng.normal(size=b).astype(np.float32)
    _, logp_true, _, _, _ = reference(z, ids, temperature)
    old = (logp_true + 0.3 * rng.normal(size=b * t)).astype(np.float32).reshape(b, t)
    ref = (logp_true + 0.3 * rng.normal(size=b * t)).astype(np.float32).reshape(b, t)
    kw = dict(
        old_per_token_logps=old,
        ref_per_token_logps=ref,
        loss_type="dapo",
        beta=beta,
        temperature=temperature,
        use_bias_correction_kl=corrected,
    )
    ffi = functools.partial(fj.grpo_loss, completion_ids=ids2, completion_mask=mask, advantages=adv, **kw)
    loss_ffi, out = ffi(z3)
    dz_ffi = jax.grad(lambda x: ffi(x)[0])(z3)

    w = mask.reshape(-1) / max(1.0, mask.sum())  # dapo's weight without num_items_in_batch
    rows = (old.reshape(-1), ref.reshape(-1), np.repeat(adv, t), w)
    row_loss, logp, ent, dz = L.logits_fused(
        z, ids, rows, dapo_row_fn(beta, corrected), mask=mask.reshape(-1), temperature=temperature, interpret=TPU, bn=8
    )
    assert dz.dtype == dtype
    close(jnp.sum(row_loss), loss_ffi, 1e-5)
    close(logp, out.logp.reshape(-1), 1e-5)
    close(ent, out.entropy.reshape(-1), 1e-5)
    dz_ffi = np.asarray(jnp.asarray(dz_ffi, jnp.float32)).reshape(b * t, v)
    close_max(dz, dz_ffi, 1e-4 if dtype == jnp.float32 else 1e-2)


def test_logprobs_custom_vjp():
    n, v, temperature = 9, 200, 0.7
    z, ids, mask, rng = draw(7, n, v, masked=(1,))
    a, c = rng.normal(size=n), rng.normal(size=n)

    def f(x):
        logp, ent = L.logits_logprobs(x, ids, mask=mask, temperature=temperature, interpret=True)
        return jnp.sum(logp * a + ent * c)

    close_max(jax.grad(f)(z), ref_grad(z, ids, a, c, temperature, mask), 1e-4)


def test_bad_arguments():
    z, ids, _, _ = draw(0, 8, 128)
    with pytest.raises(ValueError, match="`ids`"):
        L.logits_stats(z, ids[:5], interpret=True)
    with pytest.raises(ValueError, match="`bn`"):
        L.logits_stats(z, ids, bn=12, interpret=True)
    with pytest.raises(ValueError, match="`logits2d`"):
        L.logits_stats(z.astype(jnp.float16), ids, interpret=True)


def _dapo_exports(n, v, dtype):
    zs, i, r = (
        jax.ShapeDtypeStruct((n, v), dtype),
        jax.ShapeDtypeStruct((n,), jnp.int32),
        jax.ShapeDtypeStruct((n,), jnp.float32),
    )
    return {
        "stats": (lambda z, i, m: L.logits_stats(z, i, mask=m, temperature=0.7), (zs, i, r)),
        "grad": (lambda z, i, a, b, c, d: L.logits_grad(z, i, a, b, c, d, temperature=0.7), (zs, i, r, r, r, r)),
        "fused": (
            lambda z, i, a, b, c, d, m: L.logits_fused(
                z, i, (a, b, c, d), dapo_row_fn(0.04, True), mask=m, temperature=0.7
            ),
            (zs, i, r, r, r, r, r),
        ),
        "fused_sigmoid": (lambda z, i, a, b: L.logits_fused(z, i, (a, b), sapo_row_fn, temperature=0.7), (zs, i, r, r)),
    }


def sapo_row_fn(logp, ent, old, adv):
    """sapo's soft gate (``jax.nn.sigmoid``) with an entropy bonus: the export checks it lowers."""
    r = jnp.exp(logp - old)
    tau = jnp.where(adv > 0, 1.0, 1.05)
    return -adv * (4 / tau) * jax.nn.sigmoid(tau * (r - 1)) - 0.01 * ent


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("n,v", [(13, 1003), (8192, 151936)])  # small ragged; the original B=1, T=8192, Qwen vocab
def test_exports_for_tpu(n, v, dtype):
    for name, (f, args) in _dapo_exports(n, v, dtype).items():
        exported = jax.export.export(jax.jit(f), platforms=("tpu",))(*args)
        assert exported.platforms == ("tpu",)
        assert "tpu_custom_call" in exported.mlir_module(), name


def test_export_rejects_what_mosaic_lacks():  # the lowering does check the kernel body
    zs, i = jax.ShapeDtypeStruct((16, 256), jnp.float32), jax.ShapeDtypeStruct((16,), jnp.int32)
    f = lambda z, i: L.logits_fused(z, i, (), lambda lp, h: jnp.sort(lp, axis=0))  # noqa: E731
    with pytest.raises(NotImplementedError, match="sort"):
        jax.export.export(jax.jit(f), platforms=("tpu",))(zs, i)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_vmem_footprint_at_the_original_vocab(dtype):
    v, limit = 151936, 32 * 2**20
    bn = L.block_rows(8192, v, dtype, limit)
    assert bn == (8 if dtype == jnp.float32 else 16)
    need = L.logits_vmem_bytes(bn, v, dtype)
    assert need <= limit
    assert need >= 4 * bn * v * jnp.dtype(dtype).itemsize  # the in and out blocks, double-buffered
    assert L.logits_vmem_bytes(2 * bn, v, dtype) > limit  # bn is the largest that fits
    # bf16 packs 16 rows a tile: 8 rows cost as much as 16
    assert L.logits_vmem_bytes(8, v, jnp.bfloat16) >= 4 * 16 * v * 2
    assert L.block_rows(8192, v, dtype, 64 * 2**20) == 2 * bn
    assert L.block_rows(5, v, dtype, limit) == 5
    with pytest.raises(ValueError, match="budget"):
        L.block_rows(8192, v, dtype, 8 * 2**20)
