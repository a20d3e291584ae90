"""One JSON line for one check of scripts/gpu/check.sh, from its exit code, times and log
(and the bench's JSON report): name, ok, seconds, exit code, and the check's key numbers.
Usage: summarize.py NAME CODE T0 T1 LOG [BENCH_JSON]"""

import json
import re
import sys


def gradcheck(log):
    """The CLI's text report: the loss difference, the kernel's time, the failed gates."""
    out = {}
    for key in ("abs_diff_loss", "kernel_seconds"):
        m = re.search(rf"^{key}\s+(\S+)", log, re.MULTILINE)
        if m:
            out[key] = float(m.group(1))
    failed = re.findall(r"^FAIL (\S+)", log, re.MULTILINE)
    if failed:
        out["failed_gates"] = failed
    return out


def pytest(log):
    """The counts of pytest's last line (``3 passed, 2 skipped, 1 xfailed in 4.2s``)."""
    lines = [ln for ln in log.splitlines() if re.search(r"\d+ (passed|failed|error)", ln)]
    return {k: int(n) for n, k in re.findall(r"(\d+) (\w+)", lines[-1])} if lines else {}


def sanitizer(log):
    m = re.search(r"ERROR SUMMARY: (\d+) error", log)
    return {"sanitizer_errors": int(m.group(1))} if m else {}


def bench(path):
    """Per implementation: the median step, the peak device bytes, the plan, and each
    fused plan's time and peak against the unfused path's (``baseline``) of the same run."""
    with open(path) as f:
        report = json.load(f)
    out = {
        r["implementation"]: {
            "median_s": r["step_seconds"]["median"],
            "peak_bytes": r["peak_bytes"],
            "plan": {k: (r.get("plan") or {}).get(k) for k in ("single_pass", "compact", "block_rows", "vocab_tile")},
        }
        for r in report["results"]
    }
    base = out.get("baseline")
    for name, r in out.items():
        if base is not None and name != "baseline":
            r["time_vs_unfused"] = round(r["median_s"] / base["median_s"], 4)
            r["peak_vs_unfused"] = round(r["peak_bytes"] / base["peak_bytes"], 4)
    return out


def chunk_logp(log):
    """scripts/gpu/chunk_logp.py's JSON (its stdout): the logp and entropy errors."""
    start = log.find("{")
    r = json.loads(log[start:]) if start >= 0 else {}
    ways = ("default", "auto_f32", "unfused_bf16")
    out = {w: {k: v for k, v in r.get(w, {}).items() if k.endswith("_vs_f64") or k == "loss"} for w in ways}
    out["ratio_default_over_unfused"] = r.get("ratio_default_over_unfused")
    return out


def main(name, code, t0, t1, log_path, bench_json=None):
    code = int(code)
    line = {"check": name, "ok": code == 0, "seconds": round(float(t1) - float(t0), 2), "code": code}
    if code in (124, 137):
        line["timed_out"] = True
    try:
        with open(log_path, errors="replace") as f:
            log = f.read()
    except OSError:
        log = ""
    parse = gradcheck if name.startswith("gc_") else pytest if name.startswith("pytest") else sanitizer
    parse = chunk_logp if name == "chunk_logp" else parse
    try:
        if bench_json is None:
            line.update(parse(log))
        elif code == 0:
            line.update(bench(bench_json))
    except (OSError, ValueError, KeyError, TypeError) as e:
        line["numbers_error"] = str(e)[:200]
    if code != 0:
        tail = [ln for ln in log.splitlines() if ln.strip()]
        line["error"] = tail[-1][-300:] if tail else ""
    print(json.dumps(line))


if __name__ == "__main__":
    main(*sys.argv[1:])
