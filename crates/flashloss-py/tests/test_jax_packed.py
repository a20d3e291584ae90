"""Packed (padding-free) GRPO batches in flashloss.jax: ``linear_grpo_loss`` and
``grpo_loss`` on ``[total_tokens, ...]`` rows with ``cu_seqlens`` or ``position_ids``
(concrete, or traced under ``jax.jit``) equal the padded ``[B, T_max]`` call (loss,
metrics, per-token outputs, dH, dW, dbias) for every loss type and both levels, and over a
``token_axis`` or a ``vocab_axis`` (2 simulated devices, in a subprocess); bad sequences are a ValueError
with torch's message (test_packed.py)."""

import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("jax")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import flashloss.jax as fj  # noqa: E402
from packed_batches import LENGTHS, LEVELS, H, V  # noqa: E402
from packed_batches import batch as _batch  # noqa: E402

N = sum(LENGTHS)


def _close(got, want, what, rel=2e-5):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    same = got == want  # equal infinities (-inf outside a support)
    got, want = np.where(same, 0.0, got), np.where(same, 0.0, want)
    err = float(np.abs(got - want).max()) / max(float(np.abs(want).max()), 1e-3)
    assert err <= rel, (what, err)


def _linear(data, shared, packed_by=None, ratio=None, jit=False, **kw):
    masks = {k: jnp.asarray(data[k]) for k in kw.pop("masks", ())}
    rho = {"seq": shared["rho_seq"], "seq1": shared["rho_seq"][:, None], "token": data["rho_token"], None: None}[ratio]
    seqs = {}
    if packed_by == "cu":
        seqs["cu_seqlens"] = jnp.asarray(shared["cu"])
    elif packed_by == "pos":
        seqs["position_ids"] = jnp.asarray(shared["position_ids"])[None]

    def f(x, w, b, seqs):
        loss, out = fj.linear_grpo_loss(
            x, w, data["ids"], data["mask"], shared["adv"], bias=b, old_per_token_logps=data["old"],
            ref_per_token_logps=data["ref"], importance_sampling_ratio=rho, **seqs, **masks, **kw,
        )  # fmt: skip
        return loss, out

    g = jax.value_and_grad(f, (0, 1, 2), has_aux=True)
    if jit:
        g = jax.jit(g)
    (loss, out), grads = g(jnp.asarray(data["hidden"]), jnp.asarray(shared["weight"]), jnp.asarray(shared["bias"]),
                           seqs)  # fmt: skip
    return loss, out, grads


def _compare(shared, packed, padded, what):
    (lp, op, gp), (lq, oq, gq) = packed, padded
    seq, pos = shared["seq"], shared["pos"]
    _close(lp, lq, (what, "loss"))
    for k in oq.metrics:
        _close(op.metrics[k], oq.metrics[k], (what, k))
    for k in ("logp", "entropy", "kl"):
        _close(getattr(op, k), np.asarray(getattr(oq, k))[seq, pos], (what, k))
    _close(gp[0], np.asarray(gq[0])[seq, pos], (what, "dhidden"))
    _close(gp[1], gq[1], (what, "dweight"))
    _close(gp[2], gq[2], (what, "dbias"))


@pytest.mark.parametrize("loss_type,level", LEVELS)
def test_linear_packed_equals_padded(loss_type, level):
    packed, padded, shared = _batch()
    kw = dict(loss_type=loss_type, importance_sampling_level=level, beta=0.04, max_completion_length=7,
              temperature=0.9, epsilon_low=0.1)  # fmt: skip
    want = _linear(padded, shared, **kw)
    _compare(shared, _linear(packed, shared, "cu", **kw), want, (loss_type, level, "cu_seqlens"))
    if (loss_type, level) in (("grpo", "sequence"), ("luspo", "sequence"), ("vespo", "token")):
        # traced sequences (jit; placed in [B, total_tokens])
        _compare(shared, _linear(packed, shared, "pos", jit=True, **kw), want, (loss_type, level, "position_ids"))


@pytest.mark.parametrize("ratio", ["seq", "seq1", "token"])
def test_linear_packed_sampler_ratio(ratio):
    packed, padded, shared = _batch(1)
    for loss_type, level in [("grpo", "sequence"), ("vespo", "token")]:
        kw = dict(loss_type=loss_type, importance_sampling_level=level, beta=0.04)
        want = _linear(padded, shared, ratio=ratio, **kw)
        # [B, 1] with concrete position_ids; per token with cu_seqlens traced under jit
        by = "pos" if ratio == "seq1" else "cu"
        got = _linear(packed, shared, by, ratio=ratio, jit=ratio == "token", **kw)
        _compare(shared, got, want, (ratio, loss_type))


@pytest.mark.parametrize(
    "options",
    [
        dict(loss_type="dapo", entropy_coef=0.01, num_items_in_batch=9.0),
        dict(loss_type="grpo", top_k=5, top_p=0.9),
        dict(
            loss_type="bnpo",
            importance_sampling_level="sequence",
            masks=("policy_mask", "entropy_mask"),
            entropy_coef=0.02,
        ),  # fmt: skip
    ],
)
def test_linear_packed_options(options):
    packed, padded, shared = _batch(2)
    want = _linear(padded, shared, **dict(options))
    got = _linear(packed, shared, "cu", **dict(options))
    _compare(shared, got, want, options)
    if "top_k" in options:
        seq, pos = shared["seq"], shared["pos"]
        assert (np.asarray(got[1].outside_support) == np.asarray(want[1].outside_support)[seq, pos]).all()


def test_linear_packed_pallas_path():
    """The Pallas path (TPU kernels in interpret mode) on the packed rows."""
    packed, padded, shared = _batch(3)
    kw = dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.04)
    want = _linear(padded, shared, **kw)
    _compare(shared, _linear(packed, shared, "cu", impl="pallas", interpret=True, **kw), want, "pallas")


def test_logits_packed_equals_padded():
    packed, padded, shared = _batch(4)
    rng = np.random.default_rng(5)
    (b, t), seq, pos = padded["ids"].shape, shared["seq"], shared["pos"]
    z = rng.standard_normal((N, V)).astype(np.float32)
    zp = np.zeros((b, t, V), np.float32)
    zp[seq, pos] = z
    for loss_type, level in [("grpo", "token"), ("luspo", "sequence"), ("vespo", "token")]:
        kw = dict(loss_type=loss_type, importance_sampling_level=level, beta=0.04, temperature=0.8,
                  importance_sampling_ratio=shared["rho_seq"])  # fmt: skip

        def f(logits, data, **extra):
            return fj.grpo_loss(logits, data["ids"], data["mask"], shared["adv"], old_per_token_logps=data["old"],
                                ref_per_token_logps=data["ref"], **kw, **extra)  # fmt: skip

        (lq, oq), gq = jax.value_and_grad(f, has_aux=True)(jnp.asarray(zp), padded)
        (lp, op), gp = jax.value_and_grad(f, has_aux=True)(jnp.asarray(z), packed, cu_seqlens=shared["cu"])
        _close(lp, lq, (loss_type, "loss"))
        for k in oq.metrics:
            _close(op.metrics[k], oq.metrics[k], (loss_type, k))
        for k in ("logp", "entropy", "kl"):
            _close(getattr(op, k), np.asarray(getattr(oq, k))[seq, pos], (loss_type, k))
        _close(gp, np.asarray(gq)[seq, pos], (loss_type, "dlogits"))


ERRORS = [
    ("argument `cu_seqlens`: must start at 0", dict(cu_seqlens=np.array([1, 3, 4, 9, 11, N]))),
    ("argument `cu_seqlens`: must be strictly increasing", dict(cu_seqlens=np.array([0, 3, 3, 9, 11, N]))),
    ("argument `cu_seqlens`: must end at total_tokens", dict(cu_seqlens=np.array([0, 3, 4, 9, 11, N + 1]))),
    ("argument `cu_seqlens`: expected an integer dtype", dict(cu_seqlens=np.array([0.0, 3, 4, 9, 11, N]))),
    ("argument `position_ids`: must start at 0", dict(cu_seqlens=None, position_ids=np.arange(1, N + 1))),
    (
        "argument `position_ids`: must restart at 0 or count up by 1",
        dict(cu_seqlens=None, position_ids=np.array([0, 1, 2, 0, 2] + [0] * (N - 5))),
    ),  # fmt: skip
    ("argument `position_ids`: give `cu_seqlens` or `position_ids`, not both", dict(position_ids=np.zeros(N, int))),
    ("argument `advantages`: expected shape \\[B=5\\]", dict(advantages=np.zeros(4, np.float32))),
    ("argument `hidden`: a packed batch takes \\[total_tokens=15", dict(hidden=np.zeros((3, 5, H), np.float32))),
    ("argument `completion_ids`: expected shape \\[total_tokens=5\\]", dict(completion_ids=np.zeros((3, 5), int))),
    ("argument `completion_mask`: expected shape \\[total_tokens=15\\]", dict(completion_mask=np.ones(N + 1))),
    (
        "argument `importance_sampling_ratio`: expected shape \\[B=5\\]",
        dict(importance_sampling_ratio=np.ones(7, np.float32)),
    ),  # fmt: skip
    ("argument `old_per_token_logps`: expected shape", dict(old_per_token_logps=np.zeros((5, 3), np.float32))),
    ("argument `loss_type`", dict(loss_type="nope")),
]


@pytest.mark.parametrize("match,over", ERRORS)
def test_packed_errors(match, over):
    packed, _, shared = _batch()
    args = dict(
        hidden=packed["hidden"], weight=shared["weight"], completion_ids=packed["ids"], completion_mask=packed["mask"],
        advantages=shared["adv"], cu_seqlens=shared["cu"],
    )  # fmt: skip
    args.update(over)
    pos = [args.pop(k) for k in ("hidden", "weight", "completion_ids", "completion_mask", "advantages")]
    with pytest.raises(ValueError, match=match):
        fj.linear_grpo_loss(*pos, **args)


def test_traced_sequences_checked_at_run_time():
    """Under jit a bad cu_seqlens is found by the host callback, with the same message."""
    packed, _, shared = _batch()

    @jax.jit
    def f(cu):
        return fj.linear_grpo_loss(packed["hidden"], shared["weight"], packed["ids"], packed["mask"], shared["adv"],
                                   cu_seqlens=cu)[0]  # fmt: skip

    assert np.isfinite(float(f(jnp.asarray(shared["cu"]))))
    with pytest.raises(Exception, match="argument `cu_seqlens`: must be strictly increasing"):
        float(f(jnp.asarray([0, 3, 3, 9, 11, N])))


def test_token_axis_and_vocab_axis_packed():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    out = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(__file__))  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("ok ") == 4, out.stdout


def _token_axis():
    """Each of 2 devices holds its own pack (its sequences, equal row counts); the
    sharded packed call equals the one-device padded call over all sequences."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    assert len(jax.devices()) == 2
    halves = [[3, 1, 4], [2, 5, 1]]
    parts = [_batch(7 + i, lengths) for i, lengths in enumerate(halves)]
    whole = _batch(7, halves[0] + halves[1])[2]
    mesh = jax.make_mesh((2,), ("t",))
    for loss_type, level in [("grpo", "sequence"), ("dapo", "token"), ("luspo", "sequence")]:
        kw = dict(loss_type=loss_type, importance_sampling_level=level, beta=0.04)
        # the one-device padded call over both packs' sequences
        cat = {k: np.concatenate([p[0][k] for p in parts]) for k in parts[0][0]}
        b, t = sum(len(h) for h in halves), max(max(h) for h in halves)
        seq = np.concatenate([p[2]["seq"] + i * len(halves[0]) for i, p in enumerate(parts)])
        pos = np.concatenate([p[2]["pos"] for p in parts])
        pad = {}
        for k, x in cat.items():
            if k == "hidden":
                continue
            pad[k] = np.zeros((b, t), x.dtype)
            pad[k][seq, pos] = x
        hidden = np.zeros((b, t, H), np.float32)
        hidden[seq, pos] = cat["hidden"]
        adv = np.concatenate([p[2]["adv"] for p in parts])

        def padded(x, w):
            return fj.linear_grpo_loss(x, w, pad["ids"], pad["mask"], adv, old_per_token_logps=pad["old"],
                                       ref_per_token_logps=pad["ref"], **kw)  # fmt: skip

        (want, wo), wg = jax.value_and_grad(padded, (0, 1), has_aux=True)(hidden, whole["weight"])
        cu = np.concatenate([p[2]["cu"] for p in parts])

        def local(x, w, i, m, a, o, r, c):
            def f(x, w):
                return fj.linear_grpo_loss(x, w, i, m, a, old_per_token_logps=o, ref_per_token_logps=r, cu_seqlens=c,
                                           token_axis="t", **kw)  # fmt: skip

            (loss, out), g = jax.value_and_grad(f, (0, 1), has_aux=True)(x, w)
            return loss, out.metrics, g

        specs = (P("t"), P(), P("t"), P("t"), P("t"), P("t"), P("t"), P("t"))
        sm = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=(P(), P(), (P("t"), P())))
        args = (cat["hidden"], whole["weight"], cat["ids"], cat["mask"], adv, cat["old"], cat["ref"], cu)
        placed = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(args, specs)]
        got, gm, gg = jax.jit(sm)(*placed)
        _close(got, want, (loss_type, "loss"))
        for k in wo.metrics:
            _close(gm[k], wo.metrics[k], (loss_type, k))
        _close(gg[0], np.asarray(wg[0])[seq, pos], (loss_type, "dhidden"))
        _close(gg[1], wg[1], (loss_type, "dweight"))
        print("ok", loss_type, level)


def _vocab_axis():
    """The head's rows split over 2 devices (``vocab_axis``), every device passing the whole
    pack: the packed call equals the one-device padded call."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    packed, padded, shared = _batch(9, [2, 4, 1, 3, 5])
    kw = dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.04, top_k=6)
    weight, bias = shared["weight"][:12], shared["bias"][:12]  # V = 12: 6 rows a device
    seq, pos = shared["seq"], shared["pos"]

    def f(x, w, b, data, axis=None, **seqs):
        return fj.linear_grpo_loss(x, w, data["ids"] % 12, data["mask"], shared["adv"], bias=b,
                                   old_per_token_logps=data["old"], ref_per_token_logps=data["ref"], vocab_axis=axis,
                                   **seqs, **kw)  # fmt: skip

    (want, wo), wg = jax.value_and_grad(f, (0, 1, 2), has_aux=True)(padded["hidden"], weight, bias, padded)

    def local(x, w, b):
        g = jax.value_and_grad(lambda *a: f(*a, packed, "v", cu_seqlens=shared["cu"]), (0, 1, 2), has_aux=True)
        (loss, out), grads = g(x, w, b)
        return loss, out.metrics, grads

    mesh = jax.make_mesh((2,), ("v",))
    specs = (P(), P("v"), P("v"))
    sm = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=(P(), P(), (P(), P("v"), P("v"))))
    placed = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip((packed["hidden"], weight, bias), specs)]
    got, gm, gg = jax.jit(sm)(*placed)
    _close(got, want, "vocab_axis loss")
    for k in wo.metrics:
        _close(gm[k], wo.metrics[k], ("vocab_axis", k))
    _close(gg[0], np.asarray(wg[0])[seq, pos], "vocab_axis dhidden")
    _close(gg[1], wg[1], "vocab_axis dweight")
    _close(gg[2], wg[2], "vocab_axis dbias")
    print("ok vocab_axis")


if __name__ == "__main__":
    _token_axis()
    _vocab_axis()
