"""The summary of a ``scripts/tpu/check.sh`` result folder, as one JSON object on stdout:
the environment, each gradcheck's loss and largest relative differences with its gates,
each bench's step time and device peak, the A/B's last-step metrics, and the steps that
failed (passed as arguments after the folder).

    python scripts/tpu/summarize.py OUT_DIR [FAILED_STEP ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _lines(path: Path) -> list[dict]:
    """The JSON objects of a step's stdout, one a line (other lines skipped)."""
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _gradcheck(row: dict) -> dict:
    keep = ("loss_ref", "loss_kernel", "abs_diff_loss", "passed")
    return {
        **{k: row[k] for k in keep if k in row},
        **{k: v for k, v in row.items() if k.startswith("max_rel_diff_")},
        "gates": {g["name"]: [g["value"], g["limit"], g["passed"]] for g in row.get("gates", [])},
    }


def _bench(row: dict) -> dict:
    keep = ("impl", "loss", "step_seconds_mean", "step_seconds_median", "peak_bytes_in_use", "bytes_in_use_inputs",
            "temp_bytes", "argument_bytes", "output_bytes", "peak_rss_above_inputs_bytes")  # fmt: skip
    cfg = row.get("config", {})
    shape = {k: cfg.get(k) for k in ("batch", "tokens", "hidden", "vocab", "dtype")}
    return {**shape, **{k: row.get(k) for k in keep}}


def _ab(run_dir: Path) -> dict | None:
    metrics = run_dir / "metrics.jsonl"
    rows = _lines(metrics)
    return {"steps": len(rows), "last": rows[-1]} if rows else None


def summarize(out: Path, failed: list[str]) -> dict:
    env = _lines(out / "environment.json")
    summary: dict = {"environment": env[0] if env else None, "failed": failed, "gradcheck": {}, "bench": {}}
    for path in sorted(out.glob("*.out")):
        name, rows = path.stem, _lines(path)
        if name.startswith(("gradcheck_", "sharded_")) and rows:
            summary["gradcheck"][name] = _gradcheck(rows[-1])
        elif name.startswith("bench_") and rows:
            summary["bench"][name] = _bench(rows[-1])
    summary["ab"] = {arm: _ab(out / f"ab_{arm}") for arm in ("baseline", "flashloss")}
    return summary


if __name__ == "__main__":
    print(json.dumps(summarize(Path(sys.argv[1]), sys.argv[2:]), indent=1))
