#!/usr/bin/env python3
"""Peer implementations of issue 5's GPU comparison, one per process (so each peak is
its own): prints one JSON line {peer, loss, n, h, v, dtype, median_s, min_s, max_s,
peak_bytes}. Inputs follow flashloss bench's distributions (hidden ~ N(0, 1), weight
~ N(0, 4/H), never zeros), on-policy (old logp = current, ratio 1), beta = 0.04, one
sequence of N tokens, advantages ~ N(0, 1). Times: CUDA events (torch) or
block_until_ready (JAX) around forward + backward w.r.t. hidden and weight; warm-up,
then the median.

  peers.py {jax,torch,liger,liger_triton,cce,torch_ce} --n 8192 --h 4096 --v 151936 --dtype bf16

Written for, and not yet run on, the GPU machine (see docs/results/gpu.md).
"""

import argparse
import json
import statistics
import time

BETA = 0.04
EPS_LOW, EPS_HIGH = 0.2, 0.2


def torch_inputs(n, h, v, dtype, seed=0):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(n, h, device="cuda", generator=g).to(dtype)
    weight = (torch.randn(v, h, device="cuda", generator=g) * (2.0 / h**0.5)).to(dtype)
    ids = torch.randint(0, v, (n,), device="cuda", generator=g)
    adv = torch.randn(1, device="cuda", generator=g)
    ref_logp = -torch.rand(n, device="cuda", generator=g) * 5.0
    return hidden, weight, ids, adv, ref_logp


def torch_time(step, warmup, repeat):
    import torch

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times, loss = [], None
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return float(loss), times, torch.cuda.max_memory_allocated()


def trl_grpo_loss(logp, old_logp, ref_logp, adv, mask):
    """TRL's token-level `grpo` loss: clipped ratio, k3 KL, per-sequence masked mean."""
    import torch

    ratio = torch.exp(logp - old_logp)
    clipped = torch.clamp(ratio, 1 - EPS_LOW, 1 + EPS_HIGH)
    per_token = -torch.min(ratio * adv[:, None], clipped * adv[:, None])
    kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1
    per_token = per_token + BETA * kl
    return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()


def run_torch(a):
    import torch
    import torch.nn.functional as F

    dtype = {"bf16": torch.bfloat16, "f32": torch.float32}[a.dtype]
    hidden, weight, ids, adv, ref_logp = torch_inputs(a.n, a.h, a.v, dtype)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    mask = torch.ones(1, a.n, device="cuda")

    def step():
        hidden.grad = weight.grad = None
        logits = (hidden @ weight.t()).float()
        if a.peer == "torch_ce":
            loss = F.cross_entropy(logits, ids)
        else:
            logp = torch.log_softmax(logits, -1).gather(-1, ids[:, None]).squeeze(-1)[None]
            loss = trl_grpo_loss(logp, logp.detach(), ref_logp[None], adv, mask)
        loss.backward()
        return loss.detach()

    return torch_time(step, a.warmup, a.repeat)


def run_liger(a):
    import torch
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    dtype = {"bf16": torch.bfloat16, "f32": torch.float32}[a.dtype]
    hidden, weight, ids, adv, ref_logp = torch_inputs(a.n, a.h, a.v, dtype)
    hidden = hidden[None].detach().requires_grad_(True)
    weight.requires_grad_(True)
    mask = torch.ones(1, a.n, device="cuda")
    loss_fn = LigerFusedLinearGRPOLoss(beta=BETA, use_ref_model=True, loss_type="grpo")

    def step():
        hidden.grad = weight.grad = None
        loss, _ = loss_fn(hidden, weight, ids[None], mask, adv, None, ref_logp[None], None)
        loss.backward()
        return loss.detach()

    return torch_time(step, a.warmup, a.repeat)


def run_liger_triton(a):
    """Liger's logits-level Triton GRPO loss after a cuBLAS logits product."""
    import torch
    from liger_kernel.transformers.grpo_loss import _reduce_grpo_loss, triton_grpo_loss

    dtype = {"bf16": torch.bfloat16, "f32": torch.float32}[a.dtype]
    hidden, weight, ids, adv, ref_logp = torch_inputs(a.n, a.h, a.v, dtype)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    mask = torch.ones(1, a.n, device="cuda")
    pad = torch.zeros(1, a.h, device="cuda", dtype=dtype)

    def step():
        hidden.grad = weight.grad = None
        # triton_grpo_loss drops the last position of [B, L + 1, V] logits.
        logits = (torch.cat([hidden, pad]) @ weight.t())[None]
        per_token, _, _ = triton_grpo_loss(
            logits,
            None,
            ref_logp[None],
            ids[None],
            adv,
            mask,
            temperature=1.0,
            beta=BETA,
            eps_low=EPS_LOW,
            eps_high=EPS_HIGH,
            inplace=True,
        )
        loss = _reduce_grpo_loss(per_token, mask, "grpo")
        loss.backward()
        return loss.detach()

    return torch_time(step, a.warmup, a.repeat)


def run_cce(a):
    import torch
    from cut_cross_entropy import linear_cross_entropy

    dtype = {"bf16": torch.bfloat16, "f32": torch.float32}[a.dtype]
    hidden, weight, ids, _, _ = torch_inputs(a.n, a.h, a.v, dtype)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)

    def step():
        hidden.grad = weight.grad = None
        loss = linear_cross_entropy(hidden, weight, ids)
        loss.backward()
        return loss.detach()

    return torch_time(step, a.warmup, a.repeat)


def run_jax(a):
    """The original system's pure-JAX baseline: logits hidden @ W, f32 log-softmax,
    the GRPO loss, jax.grad; peak from device.memory_stats()."""
    import jax
    import jax.numpy as jnp

    dtype = {"bf16": jnp.bfloat16, "f32": jnp.float32}[a.dtype]
    k = jax.random.split(jax.random.PRNGKey(0), 5)
    hidden = jax.random.normal(k[0], (a.n, a.h)).astype(dtype)
    weight = (jax.random.normal(k[1], (a.h, a.v)) * (2.0 / a.h**0.5)).astype(dtype)
    ids = jax.random.randint(k[2], (a.n,), 0, a.v)
    adv = jax.random.normal(k[3], (1,))
    ref_logp = -jax.random.uniform(k[4], (a.n,)) * 5.0

    def loss_fn(hidden, weight):
        logits = (hidden @ weight).astype(jnp.float32)
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), ids[:, None], -1)[:, 0]
        ratio = jnp.exp(logp - jax.lax.stop_gradient(logp))
        clipped = jnp.clip(ratio, 1 - EPS_LOW, 1 + EPS_HIGH)
        per_token = -jnp.minimum(ratio * adv[0], clipped * adv[0])
        kl = jnp.exp(ref_logp - logp) - (ref_logp - logp) - 1
        return jnp.mean(per_token + BETA * kl)

    step = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1)))
    for _ in range(a.warmup):
        jax.block_until_ready(step(hidden, weight))
    times, loss = [], None
    for _ in range(a.repeat):
        t = time.perf_counter()
        loss, grads = step(hidden, weight)
        jax.block_until_ready(grads)
        times.append(time.perf_counter() - t)
    peak = jax.devices()[0].memory_stats().get("peak_bytes_in_use", -1)
    return float(loss), times, peak


RUNNERS = {
    "jax": run_jax,
    "torch": run_torch,
    "torch_ce": run_torch,
    "liger": run_liger,
    "liger_triton": run_liger_triton,
    "cce": run_cce,
}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("peer", choices=sorted(RUNNERS))
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--h", type=int, default=4096)
    p.add_argument("--v", type=int, default=151936)
    p.add_argument("--dtype", choices=["bf16", "f32"], default="bf16")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeat", type=int, default=20)
    a = p.parse_args()
    loss, times, peak = RUNNERS[a.peer](a)
    print(
        json.dumps(
            {
                "peer": a.peer,
                "loss": loss,
                "n": a.n,
                "h": a.h,
                "v": a.v,
                "dtype": a.dtype,
                "median_s": statistics.median(times),
                "min_s": min(times),
                "max_s": max(times),
                "peak_bytes": peak,
            }
        )
    )


if __name__ == "__main__":
    main()
