"""A/B of ``flashloss.torch.linear_logprobs`` forward and backward with issue 33's options
against the plain call, at N tokens, H, V, on an f32 or a bf16 head. Arms:

- ``plain``: log-probs and entropy, their gradients (hidden and head);
- ``gather64``: the same plus the log-probs of 64 candidate ids per token (``gather_ids``);
- ``top_k64``, ``top_k64_top_p``, ``top_p``, ``min_p``: the log-probs under the sampler's
  truncated support (``top_k=64``; ``top_k=64, top_p=0.9``; ``top_p=0.9``; ``min_p=0.05``);
- ``sum_p2``: the plain call with ``return_sum_p2``.

The loss is ``Σ g_logp·logp + Σ g_H·H (+ Σ c·gathered)`` with fixed random upstream
gradients (a target outside the support contributes nothing). ``--logit-scale`` sets the
logits' spread: the hidden states are ``randn·scale`` and the weight ``randn/√H``, so a
logit has standard deviation ``scale`` (0.5: flat rows, top-p's nucleus most of the
vocabulary; 4: peaked rows). Each (arm, dtype) runs in its own process, rounds alternate
the arms, each process prints its median step (after one warm-up step) and the peak RSS
sampled every 2 ms during the steps above the RSS before them, as one JSON line; the parent
prints them all and each arm's ratio to ``plain`` of the best medians, as JSON.

    python crates/flashloss-py/examples/logprobs_options_ab.py [--tokens 2048] [--hidden 1024] \\
        [--vocab 151936] [--dtypes f32] [--arms plain,gather64,top_k64] [--rounds 2] [--steps 3] \\
        [--logit-scale 4]
"""

import argparse
import json
import os
import subprocess
import sys
import threading
import time

import torch

ARMS = {
    "plain": {},
    "gather64": {"gather_k": 64},
    "top_k64": {"top_k": 64},
    "top_k64_top_p": {"top_k": 64, "top_p": 0.9},
    "top_p": {"top_p": 0.9},
    "min_p": {"min_p": 0.05},
    "sum_p2": {"return_sum_p2": True},
}


def inputs(n, h, v, dtype, scale, gather_k, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g) * scale).to(dtype)
    weight = (torch.randn(v, h, generator=g) * h**-0.5).to(dtype)
    ids = torch.randint(0, v, (n,), generator=g)
    g_logp, g_entropy = torch.randn(n, generator=g), torch.randn(n, generator=g)
    gather = torch.randint(0, v, (n, gather_k), generator=g) if gather_k else None
    g_gather = torch.randn(n, gather_k, generator=g) if gather_k else None
    return hidden, weight, ids, (g_logp, g_entropy), (gather, g_gather)


def step(hidden, weight, ids, upstream, gathered, options):
    import flashloss.torch as fl

    (g_logp, g_entropy), (gather, g_gather) = upstream, gathered
    kwargs = {k: v for k, v in options.items() if k != "gather_k"}
    if gather is not None:
        kwargs["gather_ids"] = gather
    out = fl.linear_logprobs(hidden, weight, ids, temperature=1.0, return_entropy=True, **kwargs)
    logp, entropy = out[0], out[1]
    loss = (torch.where(torch.isfinite(logp), logp, 0.0) * g_logp).sum() + (entropy * g_entropy).sum()
    if gather is not None:
        loss = loss + (out.gathered_logp * g_gather).sum()
    loss.backward()
    return float(loss)


def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def child(args):
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    options = ARMS[args.arm]
    hidden, weight, ids, upstream, gathered = inputs(
        args.tokens,
        args.hidden,
        args.vocab,
        dtype,
        args.logit_scale,
        options.get("gather_k", 0),
    )
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    step(hidden, weight, ids, upstream, gathered, options)  # warm-up
    times, base, peak, stop = [], rss_mib(), [0.0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], rss_mib())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    for _ in range(args.steps):
        hidden.grad = weight.grad = None
        t0 = time.perf_counter()
        loss = step(hidden, weight, ids, upstream, gathered, options)
        times.append(time.perf_counter() - t0)
    stop.set()
    sampler.join()
    times.sort()
    print(
        json.dumps(
            {
                "arm": args.arm,
                "dtype": args.dtype,
                "median_s": times[len(times) // 2],
                "times_s": times,
                "step_peak_rss_mib": peak[0] - base,
                "loss": loss,
            }
        )
    )


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--dtypes", default="f32")
    p.add_argument("--arms", default="plain,gather64,top_k64,top_k64_top_p,top_p")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--logit-scale", type=float, default=4.0)
    p.add_argument("--arm")
    p.add_argument("--dtype")
    args = p.parse_args()
    if args.arm:
        return child(args)
    shape = [
        "--tokens",
        str(args.tokens),
        "--hidden",
        str(args.hidden),
        "--vocab",
        str(args.vocab),
    ]
    common = shape + [
        "--steps",
        str(args.steps),
        "--logit-scale",
        str(args.logit_scale),
    ]
    runs = []
    for _ in range(args.rounds):
        for dtype in args.dtypes.split(","):
            for arm in args.arms.split(","):
                cmd = [
                    sys.executable,
                    __file__,
                    "--arm",
                    arm,
                    "--dtype",
                    dtype,
                ] + common
                out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
                runs.append(json.loads(out.strip().splitlines()[-1]))
    best = {}
    for r in runs:
        key = (r["arm"], r["dtype"])
        best[key] = min(best.get(key, float("inf")), r["median_s"])
    ratios = {
        f"{arm}/plain {dtype}": best[(arm, dtype)] / best[("plain", dtype)]
        for (arm, dtype) in best
        if ("plain", dtype) in best and arm != "plain"
    }
    config = {
        "tokens": args.tokens,
        "hidden": args.hidden,
        "vocab": args.vocab,
        "logit_scale": args.logit_scale,
    }
    print(json.dumps({"config": config, "runs": runs, "ratios_of_best_medians": ratios}, indent=1))


if __name__ == "__main__":
    main()
