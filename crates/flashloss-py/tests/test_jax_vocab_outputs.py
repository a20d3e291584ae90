"""flashloss.jax's issue-33 outputs with the head's vocabulary split over 8 simulated CPU
devices (``vocab_axis`` inside ``jax.shard_map``), on the FFI path and the Pallas path
(interpret mode): ``linear_cross_entropy``'s ``return_lse`` (every reduction, soft-cap,
an lse cotangent with and without the loss's) and ``linear_logprobs``' ``gather_ids``
(candidates in other devices' blocks, repeats, masked rows), against the materialized
float64 reference of ``test_jax_logprob_outputs``: values, and the gradients of
``hidden``, each device's block of ``weight`` and ``bias``. ``impl="auto"`` traces both
paths (``platform_dependent``) and takes the FFI one on the CPU. Also ``top_k``/``top_p``
with the rows (not the head) split. Runs in a subprocess,
since the device count must be set before JAX starts."""

import importlib
import os
import subprocess
import sys

import pytest

pytest.importorskip("jax")
pytest.importorskip("flashloss.jax")

CASES = 2 * 4 + 1 + 2 * 2 + 2


def test_vocab_axis_outputs_match_f64():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    out = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    done = [line for line in out.stdout.splitlines() if line.startswith("ok ")]
    assert len(done) == CASES, out.stdout


def _sharded(jax, fn, args, layout):
    """``jax.value_and_grad(fn, (0, 1, 2), has_aux=True)`` of ``fn(x, w, bias, axis)`` inside
    a ``shard_map`` over 8 devices splitting the head (``layout``) and the bias over "v"."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((8,), ("v",), axis_types=(AxisType.Explicit,))
    block = P("v") if layout == "vh" else P(None, "v")
    specs = (P(), block, P("v"))

    def local(x, w, bb):
        return jax.value_and_grad(lambda *a: fn(*a, "v"), (0, 1, 2), has_aux=True)(x, w, bb)

    step = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=((P(), P()), specs))
    placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
    return jax.jit(step)(*placed)


def _ce_return_lse(jax, jnp, np, fj, ref):
    n, h, v = 9, 8, 8 * 13
    x, w, _, b, targets, _, _, _ = ref._inputs(31, n, h, v, 1, "vh")
    targets = np.where(np.arange(n) % 4 == 2, -100, targets)
    live = targets != -100
    rng = np.random.default_rng(32)
    coef_lse, g_rows = rng.standard_normal(n), rng.standard_normal(n)
    cases = [("mean", None, 1.0, True), ("sum", 4.0, 0.9, True), ("none", 3.0, 0.8, True), ("mean", None, 1.0, False)]
    for impl in ("ffi", "pallas"):
        for reduction, softcap, temperature, with_loss in cases:
            kw = dict(softcap=softcap, temperature=temperature, reduction=reduction, return_lse=True, impl=impl,
                      interpret=impl == "pallas")  # fmt: skip

            def f(x, w, bias, axis):
                loss, lse = fj.linear_cross_entropy(x, w, jnp.asarray(targets), bias=bias, vocab_axis=axis, **kw)
                total = (loss * jnp.asarray(g_rows, jnp.float32)).sum() if reduction == "none" else loss
                return (total if with_loss else 0.0) + (lse * jnp.asarray(coef_lse, jnp.float32)).sum(), (loss, lse)

            (_, (loss, lse)), grads = _sharded(jax, f, (jnp.asarray(x), jnp.asarray(w), jnp.asarray(b)), "vh")
            safe = np.where(live, targets, 0)
            weight = {"mean": 1.0 / live.sum(), "sum": 1.0, "none": None}[reduction]
            rows = np.where(live, g_rows if weight is None else weight, 0.0) * with_loss
            coef = [-rows, np.zeros(n), coef_lse, np.zeros((n, 1))]
            values, want_grads = ref._reference(x, w, b, safe, live, safe[:, None], coef, temperature, softcap)
            want_rows = -values[0]
            want_loss = want_rows if reduction == "none" else want_rows.sum() * weight
            assert ref._rel(loss, want_loss) <= 1e-5, (impl, reduction, "loss")
            assert ref._rel(lse, values[2]) <= 1e-5 and not np.asarray(lse)[~live].any(), (impl, reduction, "lse")
            for name, got, want in zip(("dhidden", "dweight", "dbias"), grads, want_grads):
                assert ref._rel(got, want) <= 1e-4, (impl, reduction, softcap, with_loss, name, ref._rel(got, want))
            print("ok ce return_lse", impl, reduction, softcap, with_loss)

    def auto(x, w, bias, axis):  # both branches traced; the FFI one runs
        loss, lse = fj.linear_cross_entropy(x, w, jnp.asarray(targets), bias=bias, vocab_axis=axis, return_lse=True)
        return loss + (lse * jnp.asarray(coef_lse, jnp.float32)).sum(), lse

    (_, lse), grads = _sharded(jax, auto, (jnp.asarray(x), jnp.asarray(w), jnp.asarray(b)), "vh")
    safe = np.where(live, targets, 0)
    coef = [-live.astype(float) / live.sum(), np.zeros(n), coef_lse, np.zeros((n, 1))]
    values, want_grads = ref._reference(x, w, b, safe, live, safe[:, None], coef, 1.0)
    assert ref._rel(lse, values[2]) <= 1e-5
    for got, want in zip(grads, want_grads):
        assert ref._rel(got, want) <= 1e-4
    print("ok ce return_lse auto")


def _gather_ids(jax, jnp, np, fj, ref):
    n, h, v, k = 10, 8, 8 * 11, 4
    for layout in ("vh", "hv"):
        x, w, wt, b, ids, live, cand, coef = ref._inputs(41, n, h, v, k, layout)
        cand[1] = [0, v - 1, 44, 0]  # the first and last blocks, a repeat
        temperature = 0.7
        for impl in ("ffi", "pallas"):

            def f(x, w, bias, axis):
                out = fj.linear_logprobs(
                    x,
                    w,
                    jnp.asarray(ids),
                    temperature=temperature,
                    return_entropy=True,
                    bias=bias,
                    mask=jnp.asarray(live),
                    return_lse=True,
                    gather_ids=jnp.asarray(cand),
                    vocab_axis=axis,
                    impl=impl,
                    interpret=impl == "pallas",
                    weight_layout=layout,
                )
                a, e, c, d = (jnp.asarray(g, jnp.float32) for g in coef)
                loss = (a * out.logp).sum() + (e * out.entropy).sum() + (c * out.lse).sum()
                return loss + (d * out.gathered_logp).sum(), (out.logp, out.gathered_logp)

            (_, (logp, gathered)), grads = _sharded(jax, f, (jnp.asarray(x), jnp.asarray(wt), jnp.asarray(b)), layout)
            want, (dx, dw, db) = ref._reference(x, w, b, ids, live, cand, coef, temperature)
            assert gathered.shape == (n, k)
            assert ref._rel(logp, want[0]) <= 1e-5 and ref._rel(gathered, want[5]) <= 1e-5, (layout, impl)
            assert not np.asarray(gathered)[~live].any()
            for name, got, w_ in zip(("dhidden", "dweight", "dbias"), grads, (dx, dw if layout == "vh" else dw.T, db)):
                assert ref._rel(got, w_) <= 1e-4, (layout, impl, name, ref._rel(got, w_))
            print("ok gather_ids", layout, impl)


def _support_rows_split(jax, jnp, np, fj):
    """top_k/top_p with the rows split over 8 devices (the head passed whole, cast to
    varying): the Pallas path's scan carries the varying type; equal to one device."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    rng = np.random.default_rng(51)
    n, h, v = 16, 8, 90
    x = jnp.asarray(rng.standard_normal((n, h)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((v, h)) * 0.5, jnp.float32)
    ids = jnp.asarray(rng.integers(0, v, n), jnp.int32)
    mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Explicit,))
    for impl in ("ffi", "pallas"):

        def loss(x, w, ids):
            out = fj.linear_logprobs(
                x, w, ids, temperature=0.7, top_k=30, top_p=0.9, impl=impl, interpret=impl == "pallas"
            )
            return jnp.where(out.outside_support, 0.0, out.logp).sum()

        want, (dx, dw) = jax.value_and_grad(loss, (0, 1))(x, w, ids)

        def local(x, w, ids):
            w = jax.lax.pcast(w, "d", to="varying")
            value, (gx, gw) = jax.value_and_grad(loss, (0, 1))(x, w, ids)
            return jax.lax.psum(value, "d"), gx, jax.lax.psum(gw, "d")

        specs = (P("d"), P(), P("d"))
        step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=(P(), P("d"), P())))
        got, gx, gw = step(*[jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, w, ids), specs)])
        assert abs(float(got) - float(want)) <= 1e-5 * max(1.0, abs(float(want))), (impl, got, want)
        assert float(jnp.abs(gx - dx).max()) <= 1e-5 * float(jnp.abs(dx).max()), impl
        assert float(jnp.abs(gw - dw).max()) <= 1e-5 * float(jnp.abs(dw).max()), impl
        print("ok support rows split", impl)


def _main():
    import jax
    import jax.numpy as jnp
    import numpy as np

    import flashloss.jax as fj

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    ref = importlib.import_module("test_jax_logprob_outputs")  # its f64 reference

    assert len(jax.devices()) == 8
    _ce_return_lse(jax, jnp, np, fj, ref)
    _gather_ids(jax, jnp, np, fj, ref)
    _support_rows_split(jax, jnp, np, fj)


if __name__ == "__main__":
    _main()
