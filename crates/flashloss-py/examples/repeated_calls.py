"""Per-call time of repeated fused GRPO steps from Python (forward and backward of
``flashloss.torch.linear_grpo_loss``) at a small shape, where fixed per-call costs show:
the median of ``--calls`` steps after one warm-up step, as one JSON line. Run it once per
installed build to compare builds side by side.

    python crates/flashloss-py/examples/repeated_calls.py [--tokens 256] [--hidden 512] [--vocab 32000]
"""

import argparse
import json
import statistics
import time

import torch

import flashloss
import flashloss.torch as fl


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--label", default="")
    a = p.parse_args()
    torch.manual_seed(0)
    b, t = 4, a.tokens // 4
    hidden = torch.randn(b, t, a.hidden, requires_grad=True)
    weight = (torch.randn(a.vocab, a.hidden) * 0.02).requires_grad_()
    ids = torch.randint(0, a.vocab, (b, t))
    mask = torch.ones(b, t, dtype=torch.bool)
    adv = torch.randn(b)
    old = torch.full((b, t), -10.0)
    times = []
    for k in range(a.calls + 1):
        hidden.grad, weight.grad = None, None
        start = time.perf_counter()
        loss, _ = fl.linear_grpo_loss(hidden, weight, ids, mask, adv, old_per_token_logps=old, beta=0.0)
        loss.backward()
        if k > 0:
            times.append(time.perf_counter() - start)
    print(
        json.dumps(
            {
                "label": a.label,
                "flashloss": flashloss.__file__,
                "tokens": a.tokens,
                "hidden": a.hidden,
                "vocab": a.vocab,
                "calls": a.calls,
                "median_s": statistics.median(times),
                "min_s": min(times),
                "threads": torch.get_num_threads(),
            }
        )
    )


if __name__ == "__main__":
    main()
