"""One rank of test_fsdp.py's GRPO check: TRL's ``GRPOTrainer`` and ``FlashlossGRPOTrainer``
(built in this process as one-process trainers: accelerate 1.15 runs FSDP on accelerators
only), their tiny Qwen2 models then wrapped with ``fully_shard`` as accelerate's FSDP2
plugin wraps a causal LM (each decoder layer, the input embedding, the final norm with the
LM head as one unit kept unsharded after forward, the root) on a 1-D mesh of WORLD Gloo
ranks. Each rank scores its own completions (data parallel); then STEPS steps of
``_compute_loss``, backward and SGD, and the same steps on an unwrapped copy with the
gradients all-reduced by hand. Each trainer's FSDP2 losses and gradients must equal its
own data-parallel ones, and flashloss's losses TRL's. Prints one JSON line."""

import copy
import json
import os
import pathlib
import sys

import torch
import torch.distributed as dist
import trl
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(__file__))
from test_trl_trainer import dataset, trainer  # noqa: E402

from flashloss.trl import FlashlossGRPOTrainer  # noqa: E402

STEPS = 2


def wrap(model, mesh):
    """accelerate's ``fsdp2_prepare_model`` wrapping (accelerate 1.15) of an untied causal LM."""
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model.model.embed_tokens, mesh=mesh)
    fully_shard([model.model.norm, model.lm_head], mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh)
    return model


def train(t, inputs, world, mesh=None):
    """STEPS steps of the trainer's loss: under FSDP2 on ``mesh``, or (None) on the unwrapped
    model with its gradients averaged over the ranks by hand. The losses, and each step's
    full gradients."""
    t.model.train()
    t.current_gradient_accumulation_steps = 1
    if mesh is not None:
        wrap(t.model, mesh)
        with torch.no_grad():  # the root's first forward, as generation's is in training
            t.model(input_ids=inputs["prompt_ids"], attention_mask=inputs["prompt_mask"])
        for m in t.model.modules():  # a no-grad forward leaves reshard_after_forward=False units unsharded
            if isinstance(m, FSDPModule):
                m.reshard()
    opt = torch.optim.SGD(t.model.parameters(), lr=0.5)
    losses, grads = [], []
    for _ in range(STEPS):
        loss = t._compute_loss(t.model, inputs)
        loss.backward()
        losses.append(loss.item())
        step = {}
        for name, p in t.model.named_parameters():
            if mesh is not None:
                assert isinstance(p, DTensor) and isinstance(p.grad, DTensor), f"{name}: not sharded"
                step[name] = p.grad.full_tensor()
            else:
                dist.all_reduce(p.grad)
                p.grad /= world
                step[name] = p.grad.clone()
        grads.append(step)
        opt.step()
        opt.zero_grad()
    return losses, grads


def main():
    world, rank, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    tmp = pathlib.Path(os.path.dirname(store)) / f"rank{rank}"
    cfg = dict(loss_type="grpo", beta=0.04)
    stock = trainer(trl.GRPOTrainer, tmp, **cfg)
    ours = trainer(FlashlossGRPOTrainer, tmp, **cfg)
    torch.manual_seed(1 + rank)
    batch = [{"prompt": p} for p in dataset()["prompt"][4 * rank : 4 * rank + 4]]
    inputs = stock._generate_and_score_completions(batch)
    assert inputs["advantages"].abs().max() > 0
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for name, t in (("trl", stock), ("flashloss", ours)):
        plain = copy.deepcopy(t.model)
        results[name] = train(t, inputs, world, mesh)
        t.model = plain  # the same trainer on an unwrapped copy of its initial model
        results[name + " data parallel"] = train(t, inputs, world)
    worst = {}
    for a, b, rtol in (
        ("flashloss", "flashloss data parallel", 1e-5),
        ("trl", "trl data parallel", 1e-5),
        ("flashloss", "trl", 0.1),  # f32 cancellation in TRL's path (these gradients sum ± advantages)
    ):
        (la, ga), (lb, gb) = results[a], results[b]
        for s in range(STEPS):
            # flashloss against TRL: the same step-0 loss; then models a step apart by TRL's gradient error
            tol = 1e-4 if b != "trl" or s == 0 else 1e-2
            if abs(la[s] - lb[s]) > tol * abs(lb[s]) + 1e-6:
                raise AssertionError(f"rank {rank} step {s}: {a} loss {la[s]} != {b} {lb[s]}")
        err = max(
            (ga[s][n] - gb[s][n]).abs().max().item() / max(gb[s][n].abs().max().item(), 1e-6)
            for s in range(STEPS)
            for n in gb[s]
        )
        if err > rtol:
            raise AssertionError(f"rank {rank}: {a} against {b}: relative gradient error {err:.3g}")
        worst[f"{a} vs {b}"] = err
    print(json.dumps({"rank": rank, "losses": results["flashloss"][0], "worst_grad_error": worst}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
