"""``flashloss.jax``'s dispatch table (``_paths.PATHS``): every loss on both paths, every
implementation ``impl(call, *operands)`` with the same operands on either path, and
``dispatch``'s choice of path (``impl``, ``interpret``)."""

import inspect

import pytest

pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import flashloss.jax as fj  # noqa: E402
from flashloss.jax import _paths  # noqa: E402


def test_every_loss_on_both_paths_with_one_signature():
    assert set(_paths.PATHS) == {(loss, path) for loss in _paths.LOSSES for path in ("ffi", "pallas")}
    for loss in _paths.LOSSES:
        ffi, pallas = (inspect.signature(_paths.PATHS[loss, path]) for path in ("ffi", "pallas"))
        assert list(ffi.parameters)[0] == "call", loss
        assert [p.kind for p in ffi.parameters.values()] == [p.kind for p in pallas.parameters.values()], loss
        assert len(ffi.parameters) == len(pallas.parameters), loss


def test_dispatch_picks_the_path(monkeypatch):
    seen = []
    for path in ("ffi", "pallas"):
        monkeypatch.setitem(_paths.PATHS, ("linear_logprobs", path), lambda call, *xs, p=path: seen.append(p) or p)

    class Call:
        interpret = False

    assert _paths.dispatch("linear_logprobs", "ffi", Call(), 1) == "ffi"
    assert _paths.dispatch("linear_logprobs", "pallas", Call(), 1) == "pallas"
    Call.interpret = True
    assert _paths.dispatch("linear_logprobs", "auto", Call(), 1) == "pallas"
    with pytest.raises(ValueError, match="argument `impl`"):
        _paths.dispatch("linear_logprobs", "cuda", Call(), 1)
    assert seen == ["ffi", "pallas", "pallas"]


def test_bad_impl_names_the_argument():
    rng = np.random.default_rng(0)
    h, w = jnp.asarray(rng.normal(size=(3, 8)), jnp.float32), jnp.asarray(rng.normal(size=(11, 8)), jnp.float32)
    with pytest.raises(ValueError, match="argument `impl`"):
        fj.linear_logprobs(h, w, jnp.zeros((3,), jnp.int32), impl="tpu")
    with pytest.raises(ValueError, match="argument `impl`"):
        fj.linear_cross_entropy(h, w, jnp.zeros((3,), jnp.int32), impl="tpu")
