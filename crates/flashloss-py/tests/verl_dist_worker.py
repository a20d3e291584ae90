"""One rank of test_verl.py's vocab-parallel test: a Gloo group of WORLD ranks over a
file store, each rank holding its block of the LM head's rows (V = 151, blocks of unequal
sizes), calling verl's Triton entry ``linear_cross_entropy(..., dist_process_group)`` as
Megatron's fused forward does, with flashloss.verl patched. The one-process answer is
verl's own torch path (``FusedLinearForPPO``) on the whole head, in this process. Prints
one JSON line: the largest relative errors."""

import json
import sys

import flashloss.verl as fverl
import torch
import torch.distributed as dist
from verl.utils.experimental.torch_functional import FusedLinearForPPO
from verl.utils.kernel import linear_cross_entropy as verl_lce

V, H, N, TEMPERATURE = 151, 32, 19, 0.9
BLOCKS = {2: [70, 81], 3: [50, 64, 37]}


def rel(got, want):
    return float((got - want).abs().max() / want.abs().max())


def main():
    world, rank, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    group = dist.new_group(list(range(world)))
    start = sum(BLOCKS[world][:rank])
    block = slice(start, start + BLOCKS[world][rank])
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g)
    weight = torch.randn(V, H, generator=g) / H**0.5
    ids = torch.randint(0, V, (N,), generator=g)
    g_logp, g_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)

    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp1, ent1 = FusedLinearForPPO()(h1, w1, ids, TEMPERATURE)
    dh1, dw1 = torch.autograd.grad((logp1 * g_logp).sum() + (ent1 * g_ent).sum(), [h1, w1])

    fverl.patch()
    h, w = hidden.clone().requires_grad_(), weight[block].clone().requires_grad_()
    logp, ent = verl_lce.linear_cross_entropy(h, w, ids, TEMPERATURE, "none", group)
    dh, dw = torch.autograd.grad((logp * g_logp).sum() + (ent * g_ent).sum(), [h, w])
    fverl.unpatch()
    dh_summed = dh.clone()
    dist.all_reduce(dh_summed, group=group)  # verl's contract: the caller sums dH over the group
    out = {
        "rank": rank,
        "logp": rel(logp, logp1),
        "entropy": rel(ent, ent1),
        "dhidden_summed": rel(dh_summed, dh1),
        "dhidden_share": rel(dh * world, dh1),
        "dweight_block": rel(dw, dw1[block]),
    }
    dist.destroy_process_group()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
