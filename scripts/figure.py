"""Draw docs/figure.png, the README's figure, from recorded runs in the repository: the time and
peak memory of one GRPO step (forward, dH and dW) at the LM head, fused against the plain path
and the peers. Run: python scripts/figure.py [--out docs/figure.png]

Sources (nothing is measured here):
- H100 (fa8bd11, 2026-11-23): docs/results/data/gpu_h100_2026-11-23.md, the team's table;
- H200 (17878ef): docs/bench/results/gpu_h200_17878ef/bench_grpo_*.json (`flashloss bench`);
- CPU (2 cores, AVX-512): docs/bench/results/issue24_round3_{f32,bf16}_pad0.json (`flashloss bench`).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "bench" / "results"
GIB = 2**30
H100_ROWS = {  # label in the figure: the row's first cell in the H100 table
    "flashloss fused\n(two-pass, auto)": "fused two-pass, budget 192 MiB (auto)",
    "unfused cuBLAS": "unfused cuBLAS baseline",
    "pure JAX (jit)": "pure-JAX path (jit), the original system's baseline",
    "PyTorch eager\n(TRL's formulas)": "PyTorch eager, TRL's formulas",
    "Liger fused\nlinear GRPO": "Liger `LigerFusedLinearGRPOLoss`",
}


def h100() -> list[tuple[str, float, float]]:
    """(label, ms, peak GB) from the GRPO table of the H100 record (ranges: their first value)."""
    text = (ROOT / "docs" / "results" / "data" / "gpu_h100_2026-11-23.md").read_text()
    table = text.split("## GRPO", 1)[1].split("\n## ", 1)[0]
    cells = {}
    for line in table.splitlines():
        parts = [p.strip() for p in line.strip().strip("|").split("|")]
        if len(parts) == 3 and re.match(r"[\d.]+", parts[1]):
            cells[parts[0]] = (float(re.match(r"[\d.]+", parts[1]).group()), float(parts[2]))
    return [(label, *cells[row]) for label, row in H100_ROWS.items()]


def bench(path: pathlib.Path, implementation: str) -> tuple[float, float]:
    """(ms, peak GiB) of one implementation in a `flashloss bench --json` file."""
    for r in json.loads(path.read_text())["results"]:
        if r["implementation"] == implementation:
            return r["step_seconds"]["median"] * 1e3, r["peak_bytes"] / GIB
    raise KeyError(f"{path}: no {implementation!r}")


def h200() -> list[tuple[str, float, float]]:
    d = RESULTS / "gpu_h200_17878ef"
    rows = [("unfused cuBLAS", *bench(d / "bench_grpo_compact.json", "baseline"))]
    for label, name in [("fused, bf16 chunk\n(mode=compact)", "compact"), ("fused, f32\nsingle-pass", "single_pass"),
                        ("fused, two-pass\n(auto)", "two_pass")]:  # fmt: skip
        rows.append((label, *bench(d / f"bench_grpo_{name}.json", "fused")))
    return rows


def cpu() -> list[tuple[str, float, float]]:
    rows = []
    for dtype in ("f32", "bf16"):
        f = RESULTS / f"issue24_round3_{dtype}_pad0.json"
        rows.append((f"unfused, {dtype}", *bench(f, "baseline")))
        rows.append((f"flashloss fused, {dtype}", *bench(f, "fused")))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "figure.png"))
    out = pathlib.Path(ap.parse_args().out)
    panels = [
        ("H100, bf16, N=8192, H=4096, V=151936\n(fa8bd11)", h100(), "ms", "GB"),
        ("H200, bf16, N=8192, H=4096, V=151936\n(17878ef)", h200(), "ms", "GiB"),
        ("CPU, 2 cores, N=2048, H=1024, V=151936", [(n, ms / 1e3, p) for n, ms, p in cpu()], "s", "GiB"),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5))
    for col, (title, rows, time_unit, mem_unit) in enumerate(panels):
        labels = [r[0] for r in rows]
        colors = ["tab:orange" if "flashloss" in n or n.startswith("fused") else "tab:gray" for n in labels]
        for row, (values, unit, what) in enumerate([([r[1] for r in rows], time_unit, "step time"),
                                                     ([r[2] for r in rows], mem_unit, "peak memory")]):  # fmt: skip
            ax = axes[row][col]
            bars = ax.barh(labels, values, color=colors)
            ax.bar_label(bars, labels=[f"{v:.3g}" for v in values], padding=2, fontsize=8)
            ax.invert_yaxis()
            ax.set_xlabel(f"{what} ({unit})")
            ax.tick_params(axis="y", labelsize=8)
            ax.margins(x=0.18)
            if row == 0:
                ax.set_title(title, fontsize=10)
    fig.suptitle("One GRPO step at the LM head (loss, dH, dW): flashloss (orange) against the plain path and peers")
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
