#!/usr/bin/env bash
# Issues 41 and 51: the whole GPU check in one command, meant to take at most 8 minutes on
# an H200 (the stage budgets sum to 480 s; at 17878ef the same checks took 74 s of
# gradchecks, 31 s of pytest, 7 s of sanitizer and 10-13 s a bench), run from the repository root on the GPU machine
# (CUDA 13 driver, Python 3.12 with torch, triton, jax[cuda] and the nvidia wheels,
# compute-sanitizer; no Rust, no network) with the folder scripts/gpu/prepare.sh filled
# (CARRY, default gpu-carry/: the stripped CLI and the abi3 wheel, both built with
# --features cuda). Installs the wheel, then runs in order, each stage within its budget:
#   1. issue 51's default call (no mode, no budget) at N=8192 H=4096 V=151936 bf16, GRPO
#      and CE, beside the unfused path (the plan chosen, time and peak against it), the
#      same with mode auto_f32, and scripts/gpu/chunk_logp.py (the default call's logp and
#      entropy against f32 statistics, the unfused bf16 path and float64);
#   2. every gradcheck of verify.sh (gradchecks.sh), the logits-level ones at a small T;
#   3. pytest crates/flashloss-py/tests/test_cuda.py;
#   4. compute-sanitizer memcheck and racecheck on two small gradchecks;
#   5. the bench, fused against the unfused cuBLAS path, N=8192 H=4096 V=151936 bf16,
#      GRPO and CE, each with three given plans: median step and peak device bytes.
# One JSON line per check in summary.jsonl (and one log per check), all in ONE tar,
# $OUT/gpu_check.tar.gz, packed again after each stage (so a run cut short keeps what
# ran); a failing check does not stop the others. Exit code 0 when every check passed.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
OUT=${OUT:-gpu_out}
CARRY=${CARRY:-gpu-carry}
BIN=$CARRY/flashloss
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
TAR=$OUT/gpu_check.tar.gz
WORK=$(mktemp -d)  # the logs, packed into $TAR (only the tar is left under $OUT)
SUMMARY=$WORK/summary.jsonl
: > "$SUMMARY"
pack() { tar -czf "$TAR.part" -C "$WORK" . && mv "$TAR.part" "$TAR"; }
trap 'pack; rm -rf "$WORK"' EXIT
DEST=$OUT OUT=$WORK  # env.sh writes device.txt and lib/ under $OUT: into the tar too
. scripts/gpu/env.sh
OUT=$DEST
. scripts/gpu/gradchecks.sh

STAGE_END=0
stage() { # name, seconds: the checks that follow share this budget
  pack
  echo "== stage $1 (${2} s)"
  STAGE_END=$(($(date +%s) + $2))
}

check() { # name, cap in seconds, command...: one log and one summary line
  local name=$1 cap=$2 json=() code t0 t1
  shift 2
  [ "$1" = --bench-json ] && { json=("$2"); shift 2; }
  local left=$((STAGE_END - $(date +%s)))
  [ "$left" -lt "$cap" ] && cap=$left
  echo "$name: $*" >> "$WORK/commands.txt"
  t0=$(date +%s.%N)
  if [ "$cap" -gt 0 ]; then
    timeout -k 5 "$cap" "$@" > "$WORK/$name.log" 2>&1
    code=$?
  else
    echo "not run: the stage's time budget is spent" > "$WORK/$name.log"
    code=124
  fi
  t1=$(date +%s.%N)
  python3 scripts/gpu/summarize.py "$name" "$code" "$t0" "$t1" "$WORK/$name.log" "${json[@]}" >> "$SUMMARY" \
    || echo "{\"check\": \"$name\", \"ok\": false, \"code\": $code, \"error\": \"summarize.py failed\"}" >> "$SUMMARY"
  tail -n 1 "$SUMMARY"
}

gc() { check "$1" 30 "${@:2}"; }

stage install 20
WHEEL=$(ls "$CARRY"/flashloss-*.whl 2>/dev/null | head -n 1)
check install 20 python3 -m pip install -q --no-deps --no-index --force-reinstall "${WHEEL:-$CARRY/no-wheel.whl}"

# Issue 51: the call a user makes (no mode, no budget): the plan the device's default
# budget gives (predicted: the bf16 chunk at 4096 rows, docs/results/gpu_prediction.md),
# and auto_f32 within the same default budget; each beside the unfused path.
stage default 100
for run in grpo:auto ce:auto chunk grpo:auto_f32 ce:auto_f32; do
  if [ "$run" = chunk ]; then
    check chunk_logp 30 python3 scripts/gpu/chunk_logp.py --json "$WORK/chunk_logp.json"
    continue
  fi
  loss=${run%%:*} mode=${run#*:}
  name=bench_${loss}_default_$mode
  check "$name" 25 --bench-json "$WORK/$name.json" \
    "$BIN" bench --config "configs/bench/gpu/${loss}_n8192_h4096_v151936_bf16.yaml" \
    --set budget_mib=null --set mode="$mode" --json "$WORK/$name.json"
done

stage gradcheck 110
gradchecks gc --set seq_len=512

stage pytest 60
check pytest_test_cuda 60 bash -c 'cd crates/flashloss-py/tests && python3 -m pytest -q -p no:cacheprovider -rsx test_cuda.py'

stage sanitizer 40
for tool in memcheck racecheck; do
  for cfg in linear_grpo linear_ce; do
    check "sanitizer_${tool}_$cfg" 25 compute-sanitizer --tool "$tool" --error-exitcode 3 \
      "$BIN" gradcheck --config "configs/gradcheck/gpu/$cfg.yaml"
  done
done

# Per loss: the committed config (auto at 192 MiB: two-pass), auto_f32 with 1536 MiB (f32
# single-pass blocks of 1730 rows; plain auto there takes the bf16 chunk since issue 51)
# and the bf16 chunk of 4096 rows (mode: compact, 1248 MiB); each beside the unfused path.
stage bench 150
for loss in grpo ce; do
  cfg=${loss}_n8192_h4096_v151936_bf16
  for plan in two_pass:"" single_pass:"--set mode=auto_f32 --set budget_mib=1536" compact:"--set mode=compact --set budget_mib=1248"; do
    name=bench_${loss}_${plan%%:*}
    # shellcheck disable=SC2086
    check "$name" 20 --bench-json "$WORK/$name.json" \
      "$BIN" bench --config "configs/bench/gpu/$cfg.yaml" ${plan#*:} --json "$WORK/$name.json"
  done
done
# The options' own cost (issue 41): the log-prob gradient plain and with the option, both
# two-pass, side by side.
for opt in top_k64 gather_k64; do
  name=bench_logprobs_$opt
  check "$name" 25 --bench-json "$WORK/$name.json" \
    "$BIN" bench --config "configs/bench/gpu/logprobs_${opt}_n8192_h4096_v151936_bf16.yaml" --json "$WORK/$name.json"
done

failed=$(grep -c '"ok": false' "$SUMMARY")
echo "== issue 51's default call:"
grep -E '"check": "(bench_(grpo|ce)_default_|chunk_logp)' "$SUMMARY"
echo "== $(wc -l < "$SUMMARY") checks, $failed failed: summary.jsonl in $TAR"
pack
[ "$failed" -eq 0 ]
