"""Packed (padding-free) GRPO batches in flashloss.torch: ``linear_grpo_loss`` and
``grpo_loss`` on ``[total_tokens, ...]`` rows with ``cu_seqlens`` or ``position_ids``
equal the padded ``[B, T_max]`` call (loss, metrics, per-token outputs, dH, dW, dbias)
for every loss type and both importance-sampling levels, on ragged sequences with a
length-1 one and a fully masked one; bad sequences are a ValueError naming the argument.
The JAX binding's counterpart: test_jax_packed.py."""

import numpy as np
import pytest
import torch

import flashloss.torch as ft
from packed_batches import LENGTHS, LEVELS, H, V
from packed_batches import batch as _batch

N = sum(LENGTHS)


def _close(got, want, what, rel=2e-5):
    got, want = torch.as_tensor(got).detach().double(), torch.as_tensor(want).detach().double()
    same = got == want  # equal infinities (-inf outside a support)
    got, want = torch.where(same, 0.0, got), torch.where(same, 0.0, want)
    err = float((got - want).abs().max()) / max(float(want.abs().max()), 1e-3)
    assert err <= rel, (what, err)


def _linear(data, shared, packed_by=None, ratio=None, **kw):
    t = {k: torch.as_tensor(v) for k, v in data.items()}
    hidden = t["hidden"].clone().requires_grad_(True)
    weight = torch.as_tensor(shared["weight"]).clone().requires_grad_(True)
    bias = torch.as_tensor(shared["bias"]).clone().requires_grad_(True)
    extra = {}
    if packed_by == "cu":
        extra["cu_seqlens"] = torch.as_tensor(shared["cu"])
    elif packed_by == "pos":
        extra["position_ids"] = torch.as_tensor(shared["position_ids"])[None]  # TRL's [1, N]
    rho = None if ratio is None else (torch.as_tensor(shared["rho_seq"]) if ratio == "seq" else t["rho_token"])
    if ratio == "seq1":
        rho = torch.as_tensor(shared["rho_seq"])[:, None]
    loss, out = ft.linear_grpo_loss(
        hidden, weight, t["ids"], t["mask"], torch.as_tensor(shared["adv"]), bias=bias,
        old_per_token_logps=t["old"], ref_per_token_logps=t["ref"], importance_sampling_ratio=rho, **extra, **kw,
    )  # fmt: skip
    loss.backward()
    return loss, out, (hidden.grad, weight.grad, bias.grad)


def _compare(shared, packed, padded, what, rel=2e-5):
    (lp, op, gp), (lq, oq, gq) = packed, padded
    seq, pos = shared["seq"], shared["pos"]
    _close(lp, lq, (what, "loss"), rel)
    for k in oq.metrics:
        _close(op.metrics[k], oq.metrics[k], (what, k), rel)
    for k in ("logp", "entropy", "kl"):
        _close(getattr(op, k), getattr(oq, k)[seq, pos], (what, k), rel)
    _close(gp[0], gq[0][seq, pos], (what, "dhidden"), rel)
    _close(gp[1], gq[1], (what, "dweight"), rel)
    _close(gp[2], gq[2], (what, "dbias"), rel)


@pytest.mark.parametrize("loss_type,level", LEVELS)
def test_linear_packed_equals_padded(loss_type, level):
    packed, padded, shared = _batch()
    kw = dict(loss_type=loss_type, importance_sampling_level=level, beta=0.04, max_completion_length=7,
              temperature=0.9, epsilon_low=0.1)  # fmt: skip
    want = _linear(padded, shared, **kw)
    if loss_type not in ("vespo", "sapo"):
        assert float(want[1].metrics["clip_ratio/region_mean"]) > 0 or level == "sequence", "some tokens clip"
    _compare(shared, _linear(packed, shared, "cu", **kw), want, (loss_type, level, "cu_seqlens"))
    _compare(shared, _linear(packed, shared, "pos", **kw), want, (loss_type, level, "position_ids"))


@pytest.mark.parametrize("ratio", ["seq", "seq1", "token"])
@pytest.mark.parametrize("loss_type,level", [("grpo", "sequence"), ("dapo", "token"), ("vespo", "token")])
def test_linear_packed_sampler_ratio(ratio, loss_type, level):
    packed, padded, shared = _batch(1)
    kw = dict(loss_type=loss_type, importance_sampling_level=level, beta=0.04)
    want = _linear(padded, shared, ratio=ratio, **kw)
    _compare(shared, _linear(packed, shared, "cu", ratio=ratio, **kw), want, (ratio, loss_type))


@pytest.mark.parametrize(
    "options",
    [
        dict(loss_type="dapo", entropy_coef=0.01, num_items_in_batch=9.0),
        dict(loss_type="grpo", top_k=5, top_p=0.9),
        dict(
            loss_type="bnpo",
            importance_sampling_level="sequence",
            policy_mask=True,
            entropy_mask=True,
            entropy_coef=0.02,
        ),  # fmt: skip
    ],
)
def test_linear_packed_options(options):
    """Entropy bonus and a given normalizer, the sampler's filters, TRL's masks."""
    packed, padded, shared = _batch(2)
    options = dict(options)
    masks = [k for k in ("policy_mask", "entropy_mask") if options.pop(k, False)]
    want = _linear({**padded}, shared, **options, **{k: torch.as_tensor(padded[k]) for k in masks})
    got = _linear(packed, shared, "cu", **options, **{k: torch.as_tensor(packed[k]) for k in masks})
    _compare(shared, got, want, options)
    if "top_k" in options:
        assert got[1].outside_support.shape == (len(packed["ids"]),)
        assert bool((got[1].outside_support == want[1].outside_support[shared["seq"], shared["pos"]]).all())


def test_linear_packed_2d_layouts_and_bf16():
    """[1, N, H] hidden and [1, N] ids (TRL's padding-free shapes); a bfloat16 head."""
    packed, padded, shared = _batch(3)
    p1 = {k: v[None] for k, v in packed.items()}
    kw = dict(loss_type="dr_grpo", max_completion_length=6, beta=0.04)
    got = _linear(p1, shared, "cu", **kw)
    want = _linear(packed, shared, "cu", **kw)
    _close(got[0], want[0], "loss [1, N]")
    _close(got[2][0][0], want[2][0], "dhidden [1, N]")
    assert got[1].logp.shape == (len(packed["ids"]),)
    bf16 = {**shared, "weight": shared["weight"]}
    half = [dict(data, hidden=torch.as_tensor(data["hidden"]).bfloat16()) for data in (packed, padded)]
    got, want = _linear(half[0], bf16, "cu", **kw), _linear(half[1], bf16, **kw)
    _compare(shared, got, want, "bfloat16", rel=2e-2)


@pytest.mark.parametrize("loss_type,level", [("grpo", "token"), ("dapo", "sequence"), ("luspo", "sequence"),
                                             ("vespo", "token"), ("sapo", "token")])  # fmt: skip
def test_logits_packed_equals_padded(loss_type, level):
    packed, padded, shared = _batch(4)
    rng = np.random.default_rng(5)
    n, (b, t) = len(packed["ids"]), padded["ids"].shape
    z = rng.standard_normal((n, V)).astype(np.float32)
    zp = np.zeros((b, t, V), np.float32)
    zp[shared["seq"], shared["pos"]] = z
    kw = dict(loss_type=loss_type, importance_sampling_level=level, beta=0.04, max_completion_length=7,
              temperature=0.8, importance_sampling_ratio=torch.as_tensor(shared["rho_seq"]))  # fmt: skip

    def run(data, logits, **extra):
        logits = torch.as_tensor(logits).clone().requires_grad_(True)
        t_ = {k: torch.as_tensor(v) for k, v in data.items()}
        loss, out = ft.grpo_loss(
            logits, t_["ids"], t_["mask"], torch.as_tensor(shared["adv"]), old_per_token_logps=t_["old"],
            ref_per_token_logps=t_["ref"], **kw, **extra,
        )  # fmt: skip
        loss.backward()
        return loss, out, logits.grad

    lq, oq, gq = run(padded, zp)
    lp, op, gp = run(packed, z, cu_seqlens=torch.as_tensor(shared["cu"]))
    seq, pos = shared["seq"], shared["pos"]
    _close(lp, lq, "loss")
    for k in oq.metrics:
        _close(op.metrics[k], oq.metrics[k], k)
    for k in ("logp", "entropy", "kl"):
        _close(getattr(op, k), getattr(oq, k)[seq, pos], k)
    _close(gp, gq[seq, pos], "dlogits")


def _call_error(match, **over):
    packed, _, shared = _batch()
    args = dict(
        hidden=torch.as_tensor(packed["hidden"]), weight=torch.as_tensor(shared["weight"]),
        completion_ids=torch.as_tensor(packed["ids"]), completion_mask=torch.as_tensor(packed["mask"]),
        advantages=torch.as_tensor(shared["adv"]), cu_seqlens=torch.as_tensor(shared["cu"]),
    )  # fmt: skip
    args.update(over)
    with pytest.raises(ValueError, match=match):
        ft.linear_grpo_loss(*[args.pop(k) for k in ("hidden", "weight", "completion_ids", "completion_mask",
                                                      "advantages")], **args)  # fmt: skip


ERRORS = [
    ("argument `cu_seqlens`: must start at 0", dict(cu_seqlens=torch.tensor([1, 3, 4, 9, 11, N]))),
    ("argument `cu_seqlens`: must be strictly increasing", dict(cu_seqlens=torch.tensor([0, 3, 3, 9, 11, N]))),
    ("argument `cu_seqlens`: must end at total_tokens", dict(cu_seqlens=torch.tensor([0, 3, 4, 9, 11, N + 1]))),
    ("argument `cu_seqlens`: expected an integer dtype", dict(cu_seqlens=torch.tensor([0.0, 3.0, 4.0, 9.0, 11.0, N]))),
    ("argument `position_ids`: must start at 0", dict(cu_seqlens=None, position_ids=torch.arange(1, N + 1))),
    (
        "argument `position_ids`: must restart at 0 or count up by 1",
        dict(cu_seqlens=None, position_ids=torch.tensor([0, 1, 2, 0, 2] + [0] * (N - 5))),
    ),  # fmt: skip
    ("argument `position_ids`: give `cu_seqlens` or `position_ids`, not both", dict(position_ids=torch.zeros(N))),
    ("argument `advantages`: expected shape \\[B=5\\]", dict(advantages=torch.zeros(4))),
    ("argument `hidden`: a packed batch takes \\[total_tokens=15", dict(hidden=torch.zeros(3, 5, H))),
    ("argument `completion_ids`: expected shape \\[total_tokens=5\\]", dict(completion_ids=torch.zeros(3, 5).long())),
    ("argument `completion_mask`: expected shape \\[total_tokens=15\\]", dict(completion_mask=torch.ones(N + 1))),
    ("argument `importance_sampling_ratio`: expected shape \\[B=5\\]", dict(importance_sampling_ratio=torch.ones(7))),
    ("argument `old_per_token_logps`: expected shape", dict(old_per_token_logps=torch.zeros(5, 3))),
    ("argument `loss_type`", dict(loss_type="nope")),
]


@pytest.mark.parametrize("match,over", ERRORS)
def test_packed_errors(match, over):
    _call_error(match, **over)


def test_logits_packed_errors():
    packed, _, shared = _batch()
    z = torch.zeros(len(packed["ids"]), V)
    ids, adv, cu = torch.as_tensor(packed["ids"]), torch.as_tensor(shared["adv"]), torch.as_tensor(shared["cu"])
    with pytest.raises(ValueError, match="argument `reduce`"):
        ft.grpo_loss(z, ids, None, adv, cu_seqlens=cu, reduce=False)
    with pytest.raises(ValueError, match="argument `logits`: a packed batch takes"):
        ft.grpo_loss(z[:-1], ids, None, adv, cu_seqlens=cu)
    with pytest.raises(ValueError, match="argument `cu_seqlens`: must end at"):
        ft.grpo_loss(z, ids, None, adv, cu_seqlens=cu[:-1])


def test_vocab_parallel_packed(tmp_path):
    """2 Gloo ranks, each with its block of the head's rows ([5, 8]): the packed call over
    the group equals the one-process padded call on every rank (loss, metrics, dH, its
    block of dW and dbias); bad sequences on one rank are the same error on both."""
    import os
    import subprocess
    import sys

    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    env = dict(os.environ, OMP_NUM_THREADS="1", RAYON_NUM_THREADS="1")
    store = str(tmp_path / "store")
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(rank), store],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=os.path.dirname(__file__),
        )  # fmt: skip
        for rank in range(2)
    ]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert out.count("ok ") == 3, (out, err[-4000:])
        assert p.returncode == 0, (out, err[-4000:])


def _rank(rank, store):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    lo, hi = (0, 5) if rank == 0 else (5, V)
    packed, padded, shared = _batch(6)
    for loss_type, level in [("grpo", "sequence"), ("dapo", "token")]:
        kw = dict(loss_type=loss_type, importance_sampling_level=level, beta=0.04)
        lq, oq, gq = _linear(padded, shared, **kw)
        t = {k: torch.as_tensor(v) for k, v in packed.items()}
        hidden = t["hidden"].clone().requires_grad_(True)
        weight = torch.as_tensor(shared["weight"][lo:hi]).clone().requires_grad_(True)
        bias = torch.as_tensor(shared["bias"][lo:hi]).clone().requires_grad_(True)
        loss, out = ft.linear_grpo_loss(
            hidden, weight, t["ids"], t["mask"], torch.as_tensor(shared["adv"]), bias=bias,
            old_per_token_logps=t["old"], ref_per_token_logps=t["ref"], cu_seqlens=torch.as_tensor(shared["cu"]),
            vocab_parallel_group=dist.group.WORLD, **kw,
        )  # fmt: skip
        loss.backward()
        _close(loss, lq, "loss")
        for k in oq.metrics:
            _close(out.metrics[k], oq.metrics[k], k)
        _close(hidden.grad, gq[0][shared["seq"], shared["pos"]], "dhidden")
        _close(weight.grad, gq[1][lo:hi], "dweight")
        _close(bias.grad, gq[2][lo:hi], "dbias")
        print("ok", loss_type, level, flush=True)
    # bad sequences on rank 1 only: the same error on both ranks, before any collective
    cu = torch.as_tensor(shared["cu"]).clone()
    if rank == 1:
        cu[0] = 1
    t = {k: torch.as_tensor(v) for k, v in packed.items()}
    with pytest.raises(ValueError, match="rank 1: argument `cu_seqlens`: must start at 0"):
        ft.linear_grpo_loss(
            t["hidden"],
            torch.as_tensor(shared["weight"][lo:hi]),
            t["ids"],
            t["mask"],
            torch.as_tensor(shared["adv"]),
            cu_seqlens=cu,
            vocab_parallel_group=dist.group.WORLD,
        )
    print("ok errors", flush=True)
    # Both ranks done before either tears the group (and its file store) down.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    import sys

    _rank(int(sys.argv[1]), sys.argv[2])
