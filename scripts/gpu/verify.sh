#!/usr/bin/env bash
# Issue 5's verification on a GPU machine (CUDA 13 driver, PyTorch/JAX/Triton wheels,
# no Rust): the binary built elsewhere with
#   cargo build --release -p flashloss-cli --features cuda
# is at target/release/flashloss. Writes every JSON line and log under ${OUT:-gpu_out}.
# The Python package's CUDA tests need its wheel built elsewhere with
#   (cd crates/flashloss-py && maturin build --release --features cuda --out ../../target/wheels)
# Usage: scripts/gpu/verify.sh [gradcheck|bench|peers|python|all]
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
BIN=target/release/flashloss
what=${1:-all}

# The CUDA libraries of the Python packages (cuBLAS, NVRTC, NCCL); cudarc looks for
# libnccl.so, the wheel ships libnccl.so.2.
SITE=$(python3 -c 'import site; print(site.getsitepackages()[0])')
LIBS=$(ls -d "$SITE"/nvidia/*/lib 2>/dev/null | tr '\n' ':')
mkdir -p "$OUT/lib"
NCCL2=$(ls "$SITE"/nvidia/nccl/lib/libnccl.so.2 2>/dev/null | head -n 1)
[ -n "$NCCL2" ] && ln -sf "$NCCL2" "$OUT/lib/libnccl.so"
export LD_LIBRARY_PATH="$OUT/lib:$LIBS${LD_LIBRARY_PATH:-}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/device.txt" 2>&1

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
  for dtype in f32 bf16; do
    run "gc_logits_t8192_v151936_$dtype" $BIN gradcheck \
      --config configs/gradcheck/gpu/logits_b1_t8192_v151936_$dtype.yaml
    for loss in grpo bnpo dr_grpo dapo cispo sapo luspo vespo; do
      extra=()
      [ $loss = dr_grpo ] && extra=(--set loss.max_completion_length=17)  # dr_grpo's normalizer
      for mode in auto two_pass; do
        run "gc_linear_${loss}_${mode}_$dtype" $BIN gradcheck \
          --config configs/gradcheck/gpu/linear_grpo.yaml --set dtype=$dtype \
          --set loss.loss_type=$loss --set mode=$mode "${extra[@]}"
      done
      # TRL 1.16: sequence level for every type but vespo, with policy and entropy masks.
      [ $loss = vespo ] && continue
      run "gc_linear_${loss}_sequence_masks_$dtype" $BIN gradcheck \
        --config configs/gradcheck/gpu/linear_grpo.yaml --set dtype=$dtype \
        --set loss.loss_type=$loss --set loss.importance_sampling_level=sequence \
        --set policy_mask_fraction=0.3 --set entropy_mask_fraction=0.5 --set sampler_ratio=true \
        "${extra[@]}"
    done
    run "gc_logits_trl_1_16_$dtype" $BIN gradcheck \
      --config configs/gradcheck/trl_1_16.yaml --set device=cuda --set dtype=$dtype
    run "gc_linear_grpo_sequence_$dtype" $BIN gradcheck \
      --config configs/gradcheck/gpu/linear_grpo.yaml --set dtype=$dtype \
      --set loss.importance_sampling_level=sequence
    for mode in auto two_pass; do
      run "gc_linear_ce_${mode}_$dtype" $BIN gradcheck \
        --config configs/gradcheck/gpu/linear_ce.yaml --set dtype=$dtype --set mode=$mode
    done
  done
  # The CUDA kernels sharded through NCCL (a world of one): vocab-parallel and token.
  for parallel in vocab token; do
    run "gc_nccl_world_of_one_$parallel" $BIN gradcheck --collective nccl \
      --config configs/gradcheck/linear_grpo.yaml --set parallel=$parallel --set device=cuda
  done
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
