"""One rank of test_dtensor.py: the LM head as a DTensor on a 1-D mesh of WORLD Gloo
ranks (``init_device_mesh("cpu", (WORLD,))``, torch.chunk's uneven blocks of 37 rows).
Every check compares the call on DTensors with the one-process call on the whole head,
computed in this process: the loss, per-token outputs, the hidden gradient and this rank's
block of the weight and bias gradients, which must come back as DTensors of the weight's
placement. Then the same under torch.compile, a replicated head, and the layouts flashloss
refuses. Prints one JSON line: the checks run and every bad layout's error message (the
test compares them across ranks)."""

import json
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import flashloss.torch as fl
from flashloss.liger import LigerFusedLinearGRPOLoss

from dist_worker import close, data, leaves  # dist_worker's shapes (V = 37), inputs and check


def dleaves(mesh, hidden, weight, bias, placement, hidden_dtensor=True):
    """``hidden`` replicated (a DTensor, or the plain tensor), ``weight`` and ``bias``
    distributed as ``placement``: leaves that require grad."""
    h = distribute_tensor(hidden, mesh, [Replicate()]) if hidden_dtensor else hidden.clone()
    w = distribute_tensor(weight, mesh, [placement])
    b = distribute_tensor(bias, mesh, [placement])
    return [t.detach().requires_grad_() for t in (h, w, b)]


def check_grads(name, mesh, h, w, b, h1, w1, b1, placement):
    """DTensor gradients: the weight's placement, this rank's block of the one-process ones."""
    for arg, t, want in (("weight", w, w1), ("bias", b, b1)):
        g = t.grad
        if not isinstance(g, DTensor) or tuple(g.placements) != (placement,):
            raise AssertionError(f"{name}: d{arg} is {type(g).__name__} {getattr(g, 'placements', None)}")
        local = distribute_tensor(want.grad, mesh, [placement]).to_local()
        close(f"{name} d{arg} local", g.to_local(), local)
        close(f"{name} d{arg} full", g.full_tensor(), want.grad)
    if isinstance(h, DTensor):
        if not isinstance(h.grad, DTensor) or tuple(h.grad.placements) != (Replicate(),):
            raise AssertionError(f"{name}: dhidden is {type(h.grad).__name__}")
        close(name + " dhidden", h.grad.to_local(), h1.grad)
    else:
        if isinstance(h.grad, DTensor):
            raise AssertionError(f"{name}: a plain hidden got a DTensor gradient")
        close(name + " dhidden", h.grad, h1.grad)


def grpo(h, w, b, ids, mask, adv, old, group=None, loss_type="dapo", level="token"):
    loss, out = fl.linear_grpo_loss(
        h, w, ids, mask, adv, bias=b, old_per_token_logps=old, ref_per_token_logps=old - 0.1, beta=0.04,
        loss_type=loss_type, importance_sampling_level=level, temperature=0.9, epsilon_high=0.28,
        entropy_coef=0.01, vocab_parallel_group=group,
    )  # fmt: skip
    return loss * 1.5, out.logp, out.entropy


def ce(h, w, b, targets, group=None, reduction="mean"):
    loss = fl.linear_cross_entropy(h, w, targets, bias=b, reduction=reduction, label_smoothing=0.1,
                                   vocab_parallel_group=group)  # fmt: skip
    return loss.sum() * 0.7 if reduction == "none" else loss * 0.7


def logprobs(h, w, b, ids, mask, group=None):
    out = fl.linear_logprobs(
        h, w, ids, temperature=0.7, return_entropy=True, bias=b, mask=mask, vocab_parallel_group=group
    )
    return (out.logp * 0.3).sum() + (out.entropy * 0.2).sum(), out.logp, out.entropy


def all_three(h, w, b, ids, mask, adv, old, targets, group=None):
    """The three losses on one head, summed (one compiled function)."""
    loss, logp, entropy = grpo(h, w, b, ids, mask, adv, old, group)
    lp_loss, lp, lp_entropy = logprobs(h, w, b, ids, mask, group)
    return loss + ce(h, w, b, targets, group) + lp_loss, logp, entropy, lp, lp_entropy


def compare(name, mesh, placement, fn, extra, hidden_dtensor=True, opt_in=False, compiled=False):
    """``fn(h, w, b, *extra)`` -> (loss, *outputs) on the whole head and on DTensors."""
    hidden, weight, bias = extra[0]
    args = extra[1:]
    h1, w1, b1 = leaves(hidden, weight, bias)
    want = fn(h1, w1, b1, *args)
    want[0].backward()
    h, w, b = dleaves(mesh, hidden, weight, bias, placement, hidden_dtensor)
    group = dict(group=mesh.get_group()) if opt_in else {}
    call = torch.compile(fn, backend="aot_eager") if compiled else fn
    got = call(h, w, b, *args, **group)
    got[0].backward()
    for k, (g, x) in enumerate(zip(got, want)):
        if isinstance(g, DTensor):
            raise AssertionError(f"{name}: output {k} is a DTensor")
        close(f"{name} output {k}", g.detach(), x.detach())
    check_grads(name, mesh, h, w, b, h1, w1, b1, placement)


def bad_layouts(mesh, world):
    hidden, weight, bias, ids, mask, adv, _ = data(9)
    rep = distribute_tensor(hidden, mesh, [Replicate()])
    shard0 = distribute_tensor(weight, mesh, [Shard(0)])
    mesh2 = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    cases = {
        "weight Shard(1)": lambda: fl.linear_cross_entropy(rep, distribute_tensor(weight, mesh, [Shard(1)]), ids),
        "weight Partial": lambda: fl.linear_logprobs(rep, DTensor.from_local(weight, mesh, [Partial()]), ids),
        "plain per-rank hidden": lambda: fl.linear_grpo_loss(hidden, shard0, ids, mask, adv),
        "hidden Shard(0)": lambda: fl.linear_cross_entropy(distribute_tensor(hidden, mesh, [Shard(0)]), shard0, ids),
        "plain bias with a sharded weight": lambda: fl.linear_cross_entropy(rep, shard0, ids, bias=bias),
        "2-D mesh": lambda: fl.linear_cross_entropy(
            distribute_tensor(hidden, mesh2, [Replicate(), Replicate()]),
            distribute_tensor(weight, mesh2, [Replicate(), Shard(0)]), ids),
        "an empty block": lambda: fl.linear_cross_entropy(rep, distribute_tensor(weight[:1], mesh, [Shard(0)]), ids),
        "another group": lambda: fl.linear_cross_entropy(rep, shard0, ids, vocab_parallel_group=dist.new_group()),
        "plain hidden with a replicated weight": lambda: fl.linear_logprobs(
            hidden, distribute_tensor(weight, mesh, [Replicate()]), ids),
        "group with a replicated weight": lambda: fl.linear_cross_entropy(
            rep, distribute_tensor(weight, mesh, [Replicate()]), ids, vocab_parallel_group=mesh.get_group()),
    }  # fmt: skip
    errors = {}
    for name, call in cases.items():
        try:
            call()
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)
    return errors


def main():
    world, rank, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    hidden, weight, bias, ids, mask, adv, old = data(1)
    head = (hidden, weight, bias)
    targets = ids.masked_fill(~mask, -100)
    checks = []

    def run(name, *a, **k):
        t0 = time.perf_counter()
        compare(f"{name} rank {rank}", mesh, *a, **k)
        checks.append(name)
        print(f"{name}: {time.perf_counter() - t0:.2f} s", file=sys.stderr)

    for loss_type, level in (("dapo", "token"), ("grpo", "sequence")):
        run(f"grpo {loss_type}/{level}", Shard(0), lambda *a, **k: grpo(*a, loss_type=loss_type, level=level, **k),
            (head, ids, mask, adv, old))  # fmt: skip
    for reduction in ("mean", "none"):
        run(f"ce {reduction}", Shard(0), lambda *a, **k: (ce(*a, reduction=reduction, **k),), (head, targets))
    run("logprobs", Shard(0), logprobs, (head, ids, mask))
    run("grpo, plain hidden + the mesh's group", Shard(0), grpo, (head, ids, mask, adv, old), False, True)
    run("ce, plain hidden + the mesh's group", Shard(0), lambda *a, **k: (ce(*a, **k),), (head, targets), False, True)
    run("grpo replicated", Replicate(), grpo, (head, ids, mask, adv, old))
    run("logprobs replicated", Replicate(), logprobs, (head, ids, mask))
    if world == 2:  # the compile (most of this test's time) once
        run("grpo + ce + logprobs compiled", Shard(0), all_three, (head, ids, mask, adv, old, targets), compiled=True)

    def liger(h, w, b, ids, mask, adv, old):
        module = LigerFusedLinearGRPOLoss(beta=0.0, loss_type="dapo")
        return (module(h, w, ids, mask, adv, bias=b, old_per_token_logps=old)[0],)

    run("liger module", Shard(0), liger, (head, ids, mask, adv, old))
    errors = bad_layouts(mesh, world) if world > 1 else {}
    print(json.dumps({"rank": rank, "checks": checks, "errors": errors}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
