"""One rank of test_fsdp.py: a tiny Qwen2 under FSDP2 (``fully_shard`` on each decoder
layer and on the root, a 1-D mesh of WORLD Gloo ranks, CPU, float32), trained for a few
AdamW steps on a different batch per rank, twice from the same initial weights: unpatched
(transformers' logits and ``ForCausalLMLoss``) and patched by ``flashloss.transformers``
after wrapping. The losses of every step and every parameter's (reduce-scattered, DTensor)
gradient must agree. Then the LM head as its own FSDP unit, whose weight is still sharded
when the patched forward reads it: a ValueError on every rank. Prints one JSON line."""

import copy
import json
import sys

import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import flashloss.transformers as flt

VOCAB, STEPS = 300, 3


def build():
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )  # fmt: skip
    return transformers.Qwen2ForCausalLM(cfg)


def wrap(model, mesh, head_unit=False):
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    if head_unit:
        fully_shard(model.lm_head, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def batch(rank, step, b=2, t=9):
    g = torch.Generator().manual_seed(100 * rank + step)
    ids = torch.randint(3, VOCAB, (b, t), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0
    labels[1, -2:] = -100
    return ids, mask, labels


def train(model, rank):
    """Per step: the loss and every parameter's full gradient (after FSDP's reduce-scatter)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], []
    for step in range(STEPS):
        ids, mask, labels = batch(rank, step)
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        losses.append(out.loss.item())
        step_grads = {}
        for name, p in model.named_parameters():
            assert isinstance(p, DTensor) and isinstance(p.grad, DTensor), f"{name}: not sharded"
            step_grads[name] = p.grad.full_tensor()
        grads.append(step_grads)
        opt.step()
        opt.zero_grad()
    return losses, grads


def main():
    world, rank, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    base = build()
    ref = wrap(copy.deepcopy(base), mesh)
    pat = flt.patch(wrap(copy.deepcopy(base), mesh))  # patched after wrapping: FSDP's subclass
    assert flt.is_patched(pat) and not flt.is_patched(ref)
    ref_losses, ref_grads = train(ref, rank)
    losses, grads = train(pat, rank)
    worst = 0.0
    for step in range(STEPS):
        if abs(losses[step] - ref_losses[step]) > 1e-5 * abs(ref_losses[step]):
            raise AssertionError(f"rank {rank} step {step}: loss {losses[step]} != {ref_losses[step]}")
        for name, want in ref_grads[step].items():
            got = grads[step][name]
            err = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-6)
            worst = max(worst, err)
            if err > 1e-4:
                raise AssertionError(f"rank {rank} step {step} {name}: relative gradient error {err:.3g}")
    error = None
    try:
        lone = flt.patch(wrap(copy.deepcopy(base), mesh, head_unit=True))
        ids, mask, labels = batch(rank, 0)
        lone(input_ids=ids, attention_mask=mask, labels=labels)
    except ValueError as e:
        error = str(e)
    print(json.dumps({"rank": rank, "losses": losses, "worst_grad_error": worst, "head_unit_error": error}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
