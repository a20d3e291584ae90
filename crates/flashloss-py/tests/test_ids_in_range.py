"""An id outside the vocabulary is an error naming the caller's argument (``ids``,
``targets``, ``completion_ids``; never the core's ``target_ids``) in both bindings, on one
device and with the head split over a mesh axis, for every loss and every path that
merges partial softmax states (where an id no block holds would otherwise be a target
logit of 0: a wrong answer, not an error)."""

import os
import re
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
ft = pytest.importorskip("flashloss.torch")
fj = pytest.importorskip("flashloss.jax")
jnp = pytest.importorskip("jax.numpy")

V = 34


def _inputs():
    g = np.random.default_rng(0)
    hidden = g.normal(size=(1, 4, 8)).astype(np.float32)
    weight = g.normal(size=(V, 8)).astype(np.float32)
    ids = np.array([[1, 2, 3, V + 6]])
    return hidden, weight, ids, np.ones((1, 4), bool), np.ones(1, np.float32)


def _calls(f, a, **kw):
    """Per argument name, calls of ``(hidden, weight)`` with the bad ids."""
    _, _, ids, mask, adv = (a(x) for x in _inputs())
    return {
        "ids": [
            lambda h, w: f.linear_logprobs(h, w, ids, **kw).logp,
            lambda h, w: f.linear_logprobs(h, w, ids, top_k=5, **kw).logp,
        ],
        "targets": [lambda h, w: f.linear_cross_entropy(h[0], w, ids[0], **kw)],
        "completion_ids": [
            lambda h, w: f.linear_grpo_loss(h, w, ids, mask, adv, **kw)[0],
            lambda h, w: f.linear_grpo_loss(h, w, ids, mask, adv, top_k=5, **kw)[0],
            lambda h, w: f.linear_grpo_loss(h, w, ids, mask, adv, loss_type="vespo", **kw)[0],
        ],
    }


@pytest.mark.parametrize("binding", ["torch", "jax"])
def test_one_device(binding):
    f, a = (ft, torch.as_tensor) if binding == "torch" else (fj, jnp.asarray)
    calls = _calls(f, a)
    hidden, weight, ids, mask, adv = (a(x) for x in _inputs())
    calls["completion_ids"].append(lambda h, w: f.grpo_loss(h @ w.T, ids, mask, adv)[0])
    for arg, fns in calls.items():
        for fn in fns:
            with pytest.raises(Exception, match=f"argument `{arg}`: id {V + 6} at index 3"):
                np.asarray(fn(hidden, weight))


def test_vocab_axis():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    out = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.count("ok ") == 6, out.stdout


def _sharded():
    import jax
    from jax.sharding import Mesh, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:2]), ("v",))
    hidden, weight = (jnp.asarray(x) for x in _inputs()[:2])
    for arg, fns in _calls(fj, jnp.asarray, vocab_axis="v").items():
        for fn in fns:
            g = jax.shard_map(
                lambda h, w: fn(h, w).sum(), mesh=mesh, in_specs=(P(), P("v", None)), out_specs=P(), check_vma=False
            )
            try:
                np.asarray(g(hidden, weight))
            except Exception as e:  # noqa: BLE001 (JAX's runtime error wraps the message)
                assert re.search(f"argument `{arg}`: id {V + 6} at index 3", str(e)), str(e)[-2000:]
                print("ok", arg, flush=True)
            else:
                raise AssertionError(f"{arg}: no error")


if __name__ == "__main__":
    _sharded()
