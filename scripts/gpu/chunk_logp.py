"""On a GPU (scripts/gpu/check.sh, issue 51): the default call's log-probs against f32
statistics, the unfused bf16 path and float64, at the issue shape.

A bf16 head (N = 8192 by default, H = 4096, V = 151936, logits of spread ``--spread``):
``flashloss.torch.linear_grpo_loss`` with no mode or budget (the device's default plan:
the bf16 chunk where ``auto`` takes it), then ``mode="auto_f32"`` (f32 statistics), and
the unfused bf16 path users run today (``F.linear`` in bf16, ``.float().log_softmax``).
Each one's per-token logp and entropy against float64 on the first ``--ref-rows`` rows
(the same bf16 inputs), the losses against each other, the plans' times. One JSON object
on stdout (and in ``--json``). The host-side model of the same comparison is
scripts/chunk_rounding.py (docs/results/gpu_chunk_rounding.md).

    python3 scripts/gpu/chunk_logp.py --json OUT/chunk_logp.json
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F

import flashloss.torch as fl


def rms(x: torch.Tensor) -> float:
    return float(x.double().pow(2).mean().sqrt())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--h", type=int, default=4096)
    ap.add_argument("--v", type=int, default=151936)
    ap.add_argument("--spread", type=float, default=3.0)
    ap.add_argument("--ref-rows", type=int, default=256)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    hidden = torch.randn(1, a.n, a.h, device=dev, generator=g).bfloat16()
    weight = (torch.randn(a.v, a.h, device=dev, generator=g) * (a.spread / math.sqrt(a.h))).bfloat16()
    ids = torch.randint(a.v, (1, a.n), device=dev, generator=g)
    mask = torch.ones(1, a.n, dtype=torch.long, device=dev)
    adv = torch.randn(1, device=dev, generator=g)
    out = {"shape": {"n": a.n, "h": a.h, "v": a.v, "spread": a.spread, "ref_rows": a.ref_rows}}

    def run(name, **kw):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss, o = fl.linear_grpo_loss(h, w, ids, mask, adv, loss_type="dapo", **kw)
        loss.backward()
        torch.cuda.synchronize()
        out[name] = {"loss": float(loss), "seconds_first_call": time.perf_counter() - t0}
        return o.logp[0].float(), o.entropy[0].float()

    ways = {"default": run("default"), "auto_f32": run("auto_f32", mode="auto_f32")}
    with torch.no_grad():
        z = F.linear(hidden[0], weight)  # bf16 logits, as TRL's model forward gives them
        lp_all = z.float().log_softmax(-1)
        ways["unfused_bf16"] = (
            lp_all.gather(-1, ids[0, :, None])[:, 0],
            -(lp_all.exp() * lp_all).sum(-1),
        )
        del z, lp_all
        r = a.ref_rows
        z64 = hidden[0, :r].double() @ weight.double().T
        lp64 = z64.log_softmax(-1)
        ref = (lp64.gather(-1, ids[0, :r, None])[:, 0], -(lp64.exp() * lp64).sum(-1))
        del z64, lp64
    for name, (lp, en) in ways.items():
        out.setdefault(name, {}).update(
            logp_rms_vs_f64=rms(lp[:r].double() - ref[0]),
            entropy_rms_vs_f64=rms(en[:r].double() - ref[1]),
            logp_rms_vs_auto_f32=rms(lp.double() - ways["auto_f32"][0].double()),
        )
    d, u = out["default"], out["unfused_bf16"]
    out["ratio_default_over_unfused"] = {
        "logp": d["logp_rms_vs_f64"] / max(u["logp_rms_vs_f64"], 1e-300),
        "entropy": d["entropy_rms_vs_f64"] / max(u["entropy_rms_vs_f64"], 1e-300),
    }
    text = json.dumps(out, indent=1)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
