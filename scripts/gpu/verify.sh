#!/usr/bin/env bash
# Issue 5's verification on a GPU machine (CUDA 13 driver, PyTorch/JAX/Triton wheels,
# no Rust): the binary built elsewhere with
#   cargo build --release -p flashloss-cli --features cuda
# is at target/release/flashloss. Writes every JSON line and log under ${OUT:-gpu_out}.
# The Python package's CUDA tests need its wheel built elsewhere with
#   (cd crates/flashloss-py && maturin build --release --features cuda --out ../../target/wheels)
# Usage: scripts/gpu/verify.sh [gradcheck|bench|peers|python|all]
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
BIN=target/release/flashloss
what=${1:-all}

. scripts/gpu/env.sh
. scripts/gpu/gradchecks.sh

status=0
run() { # name, command...: one log per run; a failure marks the script failed
  local name=$1; shift
  echo "== $name: $*" | tee -a "$OUT/commands.txt"
  "$@" > "$OUT/$name.log" 2>&1
  local code=$?
  tail -n 3 "$OUT/$name.log"
  [ $code -eq 0 ] || { echo "!! $name exited $code"; status=1; }
}

if [ "$what" = gradcheck ] || [ "$what" = all ]; then
  gradchecks run
fi

if [ "$what" = bench ] || [ "$what" = all ]; then
  for cfg in grpo_n8192_h4096_v151936_bf16 grpo_n8192_h4096_v151936_f32 \
             ce_n8192_h4096_v151936_bf16 ce_gemma2_n8192_h2304_v256000_bf16; do
    run "bench_$cfg" $BIN bench --config configs/bench/gpu/$cfg.yaml --json "$OUT/bench_$cfg.json"
  done
  run bench_grpo_bf16_single_pass $BIN bench --config configs/bench/gpu/grpo_n8192_h4096_v151936_bf16.yaml \
    --set impl=fused --set budget_mib=1024 --set mode=single_pass \
    --json "$OUT/bench_grpo_bf16_single_pass.json"
fi

if [ "$what" = peers ] || [ "$what" = all ]; then
  for dtype in bf16 f32; do
    for peer in jax torch liger liger_triton; do
      run "peer_${peer}_$dtype" python3 scripts/gpu/peers.py $peer --dtype $dtype
    done
  done
  for peer in cce torch_ce; do
    run "peer_${peer}_qwen" python3 scripts/gpu/peers.py $peer --n 8192 --h 4096 --v 151936
    run "peer_${peer}_gemma2" python3 scripts/gpu/peers.py $peer --n 8192 --h 2304 --v 256000
  done
fi
if [ "$what" = python ] || [ "$what" = all ]; then
  WHEEL=$(ls target/wheels/flashloss-*.whl 2>/dev/null | head -n 1)
  if [ -n "$WHEEL" ]; then
    run py_install python3 -m pip install --no-deps --force-reinstall "$WHEEL"
    run py_cuda_tests python3 -m pytest -q crates/flashloss-py/tests/test_cuda.py
  else
    echo "!! python: no wheel under target/wheels (build it with maturin --features cuda)"; status=1
  fi
fi
exit $status
