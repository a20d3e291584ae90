#!/usr/bin/env bash
# CI stage for the Pallas TPU path (issue 40): the real XLA TPU compiler and Mosaic (libtpu
# from PyPI, deviceless: no TPU) compile every case of flashloss.jax.tpu_compile, and the
# stage fails on any compile error (a VMEM overflow is one) or on temporaries above a
# case's bound. Nothing runs on a TPU.
#   - v6e: every case but the f32 support ones (the options of linear_logprobs, CE,
#     sequence-level GRPO, the single pass, the sampler's truncated support in bf16, the
#     8-chip mesh over the vocabulary, the tokens and both);
#   - v5e, v5p, v7x: the `core` cases (GRPO in both dtypes and layouts, the statistics,
#     the logits level, the ragged shapes).
# Two processes at a time (libtpu's compiles are mostly single-threaded). The lines go to
# target/tpu_compile.jsonl (one per chip and case).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${TPU_VENV:-target/tpu-venv}
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q "jax[tpu]==0.10.2" pyyaml
CARGO_TARGET_DIR="$PWD/target" "$VENV/bin/pip" install -q --no-deps ./crates/flashloss-py
PYBIN="$(cd "$VENV" && pwd)/bin/python"
OUT="$PWD/target/tpu_compile.jsonl"
rm -f "$OUT"
export ALLOW_MULTIPLE_LIBTPU_LOAD=1  # two compiling processes share libtpu
LOG="$PWD/target/tpu_compile.stderr"  # libtpu's warnings, and a traceback if a process fails
rm -f "$LOG"
run() { (cd crates/flashloss-py/tests && "$PYBIN" -m flashloss.jax.tpu_compile --json "$OUT" "$@" 2>>"$LOG"); }
start=$(date +%s)
support=logprobs_support_top_k50_bf16,logprobs_support_top_p0.9_bf16,logprobs_support_min_p0.05_bf16
support=$support,logprobs_support_top_k50_top_p0.9_bf16
run --chips v6e --cases "core,v6e,mesh,$support" & first=$!
run --chips v5e,v5p,7x --cases core & second=$!
status=0
wait "$first" || status=1
wait "$second" || status=1
echo "tpu_compile: $(wc -l < "$OUT") cases compiled in $(( $(date +%s) - start )) s, $(grep -c '"ok": false' "$OUT" || true) failed"
if [ "$status" -ne 0 ]; then
  grep '"ok": false' "$OUT" || true
  grep -v -E '^(W|I|E)[0-9]{4} ' "$LOG" | tail -n 30 || true
fi
exit "$status"
