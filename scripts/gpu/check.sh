#!/usr/bin/env bash
# Issue 41: the whole GPU check in one command, meant to take at most 6 minutes on an
# H100, run from the repository root on the GPU machine (CUDA 13 driver, Python 3.12 with
# torch, triton, jax[cuda] and the nvidia wheels, compute-sanitizer; no Rust, no network)
# with the folder scripts/gpu/prepare.sh filled (CARRY, default gpu-carry/: the stripped
# CLI and the abi3 wheel, both built with --features cuda). Installs the wheel, then runs
# in order, each stage within its time budget:
#   1. every gradcheck of verify.sh (gradchecks.sh), the logits-level ones at a small T;
#   2. pytest crates/flashloss-py/tests/test_cuda.py;
#   3. compute-sanitizer memcheck and racecheck on two small gradchecks;
#   4. the bench, fused against the unfused cuBLAS path, N=8192 H=4096 V=151936 bf16,
#      GRPO and CE, each with three plans: median step and peak device bytes.
# One JSON line per check in $OUT/summary.jsonl (and one log per check); a failing check
# does not stop the others. Exit code 0 when every check passed.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
OUT=${OUT:-gpu_out}
CARRY=${CARRY:-gpu-carry}
BIN=$CARRY/flashloss
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
SUMMARY=$OUT/summary.jsonl
: > "$SUMMARY"
. scripts/gpu/env.sh
. scripts/gpu/gradchecks.sh

STAGE_END=0
stage() { # name, seconds: the checks that follow share this budget
  echo "== stage $1 (${2} s)"
  STAGE_END=$(($(date +%s) + $2))
}

check() { # name, cap in seconds, command...: one log and one summary line
  local name=$1 cap=$2 json=() code t0 t1
  shift 2
  [ "$1" = --bench-json ] && { json=("$2"); shift 2; }
  local left=$((STAGE_END - $(date +%s)))
  [ "$left" -lt "$cap" ] && cap=$left
  echo "$name: $*" >> "$OUT/commands.txt"
  t0=$(date +%s.%N)
  if [ "$cap" -gt 0 ]; then
    timeout -k 5 "$cap" "$@" > "$OUT/$name.log" 2>&1
    code=$?
  else
    echo "not run: the stage's time budget is spent" > "$OUT/$name.log"
    code=124
  fi
  t1=$(date +%s.%N)
  python3 scripts/gpu/summarize.py "$name" "$code" "$t0" "$t1" "$OUT/$name.log" "${json[@]}" >> "$SUMMARY" \
    || echo "{\"check\": \"$name\", \"ok\": false, \"code\": $code, \"error\": \"summarize.py failed\"}" >> "$SUMMARY"
  tail -n 1 "$SUMMARY"
}

gc() { check "$1" 30 "${@:2}"; }

stage install 20
WHEEL=$(ls "$CARRY"/flashloss-*.whl 2>/dev/null | head -n 1)
check install 20 python3 -m pip install -q --no-deps --no-index --force-reinstall "${WHEEL:-$CARRY/no-wheel.whl}"

stage gradcheck 150
gradchecks gc --set seq_len=512

stage pytest 80
check pytest_test_cuda 80 bash -c 'cd crates/flashloss-py/tests && python3 -m pytest -q -p no:cacheprovider -rsx test_cuda.py'

stage sanitizer 60
for tool in memcheck racecheck; do
  for cfg in linear_grpo linear_ce; do
    check "sanitizer_${tool}_$cfg" 30 compute-sanitizer --tool "$tool" --error-exitcode 3 \
      "$BIN" gradcheck --config "configs/gradcheck/gpu/$cfg.yaml"
  done
done

# Per loss: the committed config (auto at 192 MiB: two-pass), auto with 1536 MiB (f32
# single-pass blocks of 1730 rows) and the bf16 chunk of 4096 rows (mode: compact,
# 1248 MiB); each beside the unfused path in the same run.
stage bench 240
for loss in grpo ce; do
  cfg=${loss}_n8192_h4096_v151936_bf16
  for plan in two_pass:"" single_pass:"--set budget_mib=1536" compact:"--set mode=compact --set budget_mib=1248"; do
    name=bench_${loss}_${plan%%:*}
    # shellcheck disable=SC2086
    check "$name" 40 --bench-json "$OUT/$name.json" \
      "$BIN" bench --config "configs/bench/gpu/$cfg.yaml" ${plan#*:} --json "$OUT/$name.json"
  done
done
# The options' own cost (issue 41): the log-prob gradient plain and with the option, both
# two-pass, side by side.
for opt in top_k64 gather_k64; do
  name=bench_logprobs_$opt
  check "$name" 40 --bench-json "$OUT/$name.json" \
    "$BIN" bench --config "configs/bench/gpu/logprobs_${opt}_n8192_h4096_v151936_bf16.yaml" --json "$OUT/$name.json"
done

failed=$(grep -c '"ok": false' "$SUMMARY")
echo "== $(wc -l < "$SUMMARY") checks, $failed failed: $SUMMARY"
[ "$failed" -eq 0 ]
