"""The forward of ``linear_cross_entropy(..., reduction="none")`` (one statistics pass over
the vocabulary, 2NHV FLOPs) against the fused mean call (loss and gradients, 6NHV), best
of 3 each, in one process:

    python crates/flashloss-py/examples/ce_rows_forward.py [--tokens 2048 --hidden 1024 --vocab 32000]
"""

import argparse
import json
import time

import torch

import flashloss.torch as fl


def best_of(f, k=3):
    best = float("inf")
    for _ in range(k):
        start = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - start)
    return best


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32000)
    a = p.parse_args()
    torch.manual_seed(0)
    h = torch.randn(a.tokens, a.hidden)
    w = torch.randn(a.vocab, a.hidden) / a.hidden**0.5
    t = torch.randint(0, a.vocab, (a.tokens,))
    with torch.no_grad():
        rows = best_of(lambda: fl.linear_cross_entropy(h, w, t, reduction="none"))
        fused = best_of(lambda: fl.linear_cross_entropy(h, w, t, reduction="mean"))
    print(json.dumps(dict(rows_forward_s=rows, fused_mean_s=fused, ratio=rows / fused)))


if __name__ == "__main__":
    main()
