"""A/B of one GRPO step on an LM head from Python (issue 24's table): dapo, beta 0.04,
forward and the gradients of the hidden states and the head, at N tokens, H, V, on an
f32 or a bf16 head. Arms:

- ``flashloss``: ``flashloss.torch.linear_grpo_loss`` (shipped defaults) and ``backward``;
- ``flashloss_frozen``: the same with a frozen head (``weight.requires_grad`` False: the
  gradient of the hidden states only, no dW buffer or product);
- ``torch``: PyTorch eager with TRL's formulas on materialized logits (``hidden @ W.T`` in
  the head's dtype, ``log_softmax`` of the logits in f32, ``gather``, the clipped ratio, the
  k3 KL, dapo's masked mean) and ``backward``.

Each (arm, dtype) runs in its own process, rounds alternate the arms, and each process
prints its median step (after one warm-up step), its peak RSS above the inputs
(``ru_maxrss``, a high-water mark that the inputs' own temporaries may already hold), the
peak of the RSS sampled every 2 ms during the steps above the RSS before them
(``step_peak_rss_mib``), and its loss, as one JSON line; the parent prints all of them and
the ratios of the best medians (and the frozen head's memory saved) as JSON.

    python crates/flashloss-py/examples/head_step_ab.py [--tokens 2048] [--hidden 1024] \\
        [--vocab 151936] [--dtypes f32,bf16] [--arms flashloss,torch] [--rounds 2] [--steps 3] \\
        [--padding 0.125]
    python crates/flashloss-py/examples/head_step_ab.py --arms flashloss,flashloss_frozen --padding 0
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time

import torch

EPS, BETA = 0.2, 0.04


def inputs(n, h, v, dtype, padding, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g) * 0.5).to(dtype)
    weight = (torch.randn(v, h, generator=g) * h**-0.5).to(dtype)
    ids = torch.randint(0, v, (1, n), generator=g)
    mask = torch.ones(1, n)
    mask[:, n - round(padding * n) :] = 0  # padding at the end
    adv = torch.randn(1, generator=g)
    old = -torch.rand(1, n, generator=g) * 3 - 9
    ref = old + 0.05 * torch.randn(1, n, generator=g)
    return hidden, weight, ids, mask, adv, old, ref


def torch_step(hidden, weight, ids, mask, adv, old, ref):
    logits = hidden @ weight.T
    logps = torch.log_softmax(logits.float(), -1).gather(-1, ids.reshape(-1, 1))[:, 0].reshape(ids.shape)
    coef_1 = torch.exp(logps - old)
    coef_2 = torch.clamp(coef_1, 1 - EPS, 1 + EPS)
    per_token = -torch.min(coef_1 * adv[:, None], coef_2 * adv[:, None])
    kl = torch.exp(ref - logps) - (ref - logps) - 1
    per_token = per_token + BETA * kl
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)


def flashloss_step(hidden, weight, ids, mask, adv, old, ref):
    import flashloss.torch as fl

    loss, _ = fl.linear_grpo_loss(
        hidden,
        weight,
        ids,
        mask,
        adv,
        old_per_token_logps=old,
        ref_per_token_logps=ref,
        loss_type="dapo",
        beta=BETA,
        epsilon_low=EPS,
        use_bias_correction_kl=False,
    )
    return loss


def rss_bytes():
    """The resident set now (``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class RssPeak:
    """The largest RSS seen every 2 ms while running (a thread; the GIL is released by
    the kernels and by torch's operators)."""

    def __init__(self):
        self.peak, self._stop = rss_bytes(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, rss_bytes())

    def stop(self):
        self._stop.set()
        self._thread.join()
        return max(self.peak, rss_bytes())


def child(arm, dtype, args):
    dt = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype]
    hidden, weight, *rest = inputs(args.tokens, args.hidden, args.vocab, dt, args.padding)
    hidden.requires_grad_(True)
    weight.requires_grad_(arm != "flashloss_frozen")
    step_fn = {"torch": torch_step, "flashloss": flashloss_step, "flashloss_frozen": flashloss_step}[arm]
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    base_rss, sampler = rss_bytes(), RssPeak()
    times, loss = [], None
    for _ in range(args.steps + 1):
        hidden.grad = weight.grad = None
        start = time.perf_counter()
        loss = step_fn(hidden, weight, *rest)
        loss.backward()
        times.append(time.perf_counter() - start)
    step_peak = sampler.stop() - base_rss
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = sorted(times[1:])
    print(
        json.dumps(
            {
                "arm": arm,
                "dtype": dtype,
                "median_s": times[len(times) // 2],
                "best_s": times[0],
                "peak_above_inputs_mib": (peak - base) / 1024,
                "step_peak_rss_mib": step_peak / 2**20,
                "loss": loss.item(),
                "threads": torch.get_num_threads(),
            }
        )
    )


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--dtypes", default="f32,bf16")
    p.add_argument("--arms", default="flashloss,torch")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--padding", type=float, default=0.125, help="fraction of the tokens masked at the end")
    p.add_argument("--child", nargs=2, metavar=("ARM", "DTYPE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(*args.child, args)
        return
    runs = []
    for r in range(args.rounds):
        for dtype in args.dtypes.split(","):
            for arm in args.arms.split(","):
                cmd = [sys.executable, __file__, "--child", arm, dtype] + [
                    f"--{k}={getattr(args, k)}" for k in ("tokens", "hidden", "vocab", "steps", "padding")
                ]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
                run = json.loads(out.strip().splitlines()[-1])
                run["round"] = r
                print(json.dumps(run), file=sys.stderr, flush=True)
                runs.append(run)
    best, peak = {}, {}
    for run in runs:
        key = f"{run['arm']}_{run['dtype']}"
        best[key] = min(best.get(key, float("inf")), run["median_s"])
        peak[key] = max(peak.get(key, 0.0), run["step_peak_rss_mib"])
    ratios = {
        f"flashloss_over_torch_{d}": best[f"flashloss_{d}"] / best[f"torch_{d}"]
        for d in args.dtypes.split(",")
        if f"flashloss_{d}" in best and f"torch_{d}" in best
    }
    if "flashloss_bf16" in best and "flashloss_f32" in best:
        ratios["flashloss_bf16_over_f32"] = best["flashloss_bf16"] / best["flashloss_f32"]
    for d in args.dtypes.split(","):
        if f"flashloss_frozen_{d}" in best and f"flashloss_{d}" in best:
            ratios[f"frozen_over_trainable_{d}"] = best[f"flashloss_frozen_{d}"] / best[f"flashloss_{d}"]
            ratios[f"peak_saved_by_frozen_{d}_mib"] = peak[f"flashloss_{d}"] - peak[f"flashloss_frozen_{d}"]
    print(
        json.dumps(
            {
                "shape": [args.tokens, args.hidden, args.vocab],
                "padding": args.padding,
                "runs": runs,
                "best_median_s": best,
                "max_step_peak_rss_mib": peak,
                "ratios": ratios,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
