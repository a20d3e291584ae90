"""A roofline ESTIMATE of the Pallas kernels on TPU chips (no TPU runs it here): each
kernel's FLOPs and HBM bytes from its blocks (:mod:`._chips`), and its time at the chip's
peak, ``max(FLOPs / rate, bytes / bandwidth)``, with the rate and bandwidth of JAX's
record of the chip. bf16 products at the chip's bf16 rate; f32 products (precision
HIGHEST) at 1/6 of it, an assumption (six bf16 passes), not a measured rate.

HBM bytes per kernel (``e`` the dtype's size, ``bn``/``bv`` the chosen blocks):
forward ``⌈N/bn⌉·V·H·e + N·H·e``; dH ``⌈N/bn⌉·V·H·e + 2·N·H·e``; dW ``⌈V/bv⌉·N·H·e +
2·V·H·e``; the logits level ``2·N·V·e`` (one read, one write).

    python -m flashloss.jax.pallas.roofline [--tokens 8192 --hidden 4096 --vocab 151936] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys

import jax.numpy as jnp

from . import _chips, logits

#: f32 products at HIGHEST precision: six bf16 passes (an assumption of this estimate).
F32_PASSES = 6


def rows(n: int, h: int, v: int, chips=_chips.CHIPS) -> list[dict]:
    out = []
    for name in chips:
        chip = _chips.chip(name)
        for dtype, e in (("bfloat16", 2), ("float32", 4)):
            rate = chip.bf16_flops_per_s / (1 if e == 2 else F32_PASSES)
            for kernel in ("forward", "dh", "dw"):
                b = _chips.choose(kernel, n, v, h, e, chip)
                if kernel == "forward":
                    flops, hbm = 2 * n * h * v, -(-n // b.rows) * v * h * e + n * h * e
                elif kernel == "dh":
                    flops, hbm = 4 * n * h * v, -(-n // b.rows) * v * h * e + 2 * n * h * e
                else:
                    flops, hbm = 4 * n * h * v, -(-v // b.vocab) * n * h * e + 2 * v * h * e
                vmem = _chips.vmem_bytes(kernel, b, h, e)
                out.append(_row(name, kernel, dtype, f"{b.rows}x{b.vocab}", vmem, chip, flops, hbm, rate))
            bn = logits.block_rows(n, v, jnp.dtype(dtype), chip.block_budget_bytes)
            vmem = logits.logits_vmem_bytes(bn, v, jnp.dtype(dtype))
            out.append(_row(name, "logits_fused", dtype, f"{bn}xV", vmem, chip, 0, 2 * n * v * e, rate))
    return out


def _row(chip_name, kernel, dtype, blocks, vmem, chip, flops, hbm, rate) -> dict:
    compute, memory = flops / rate, hbm / chip.hbm_bytes_per_s
    return dict(chip=chip_name, kernel=kernel, dtype=dtype, blocks=blocks, vmem_mib=vmem / 2**20,
                vmem_limit_mib=chip.vmem_limit_bytes / 2**20, tflop=flops / 1e12, hbm_gb=hbm / 1e9,
                compute_ms=compute * 1e3, memory_ms=memory * 1e3, estimate_ms=max(compute, memory) * 1e3)  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    table = rows(a.tokens, a.hidden, a.vocab)
    if a.json:
        print(json.dumps(table))
        return 0
    print("| chip | kernel | dtype | blocks | VMEM MiB (limit) | TFLOP | HBM GB | compute ms | HBM ms | estimate ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in table:
        print(f"| {r['chip']} | {r['kernel']} | {r['dtype']} | {r['blocks']} | {r['vmem_mib']:.1f} "
              f"({r['vmem_limit_mib']:.0f}) | {r['tflop']:.2f} | {r['hbm_gb']:.2f} | {r['compute_ms']:.1f} | "
              f"{r['memory_ms']:.1f} | {r['estimate_ms']:.1f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
