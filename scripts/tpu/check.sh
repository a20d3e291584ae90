#!/usr/bin/env bash
# The TPU user's check: on a TPU VM, what the original system recorded on its v6e-8, in one
# command, with every result in one tar to send back (docs/jax.md, "Check on your TPU").
#
#   bash scripts/tpu/check.sh [OUT_DIR]            # on a TPU VM (default OUT_DIR: target/tpu_check)
#   INTERPRET=1 bash scripts/tpu/check.sh [OUT_DIR] # here, no TPU: small shapes in TPU interpret mode
#
# 1. gradcheck: the Pallas kernels against the f64 reference (computed on the host CPU) on
#    one chip, f32 in both head layouts and bf16, printing the loss and gradient differences;
# 2. bench: the microbench A/B at B=1, T=8192, H=4096, V=151936 with bf16 and f32 heads:
#    pure JAX (baseline), MaxText-style vocabulary tiling (tiled) and flashloss (pallas), one
#    process each, recording the mean and median step time and the device's
#    peak_bytes_in_use as JSON;
# 3. sharded: the gradcheck under shard_map over every chip of the host (token, vocab and
#    2-D meshes; 8 chips on a v6e-8);
# 4. ab: the 100-step GRPO A/B on Tunix's GRPOLearner, the arms one YAML key apart
#    (configs/jax/grpo_ab_{baseline,flashloss}.yaml), and its plot.
# Needs the package with its `tunix` extra (pip install "./crates/flashloss-py[tunix]"; on
# a TPU VM also "jax[tpu]"). PYTHON picks the interpreter (default: python3). Exits non-zero
# if any step fails; the tar holds what ran either way.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
OUT=${1:-target/tpu_check}
rm -rf "$OUT" && mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
CONFIGS=$PWD/configs/jax
failed=()
# Runs one step: its stdout to OUT/NAME.out (JSON lines, where the step prints them), its stderr to
# OUT/NAME.log; a failure is recorded and the check goes on.
step() {
  local name=$1
  shift
  local start=$SECONDS
  echo "tpu check: $name" >&2
  if (cd "$OUT" && "$@") >"$OUT/$name.out" 2>"$OUT/$name.log"; then
    echo "tpu check: $name passed ($((SECONDS - start)) s)" >&2
  else
    echo "tpu check: $name FAILED ($((SECONDS - start)) s; see $OUT/$name.log)" >&2
    failed+=("$name")
  fi
}

if [ "${INTERPRET:-0}" = 1 ]; then
  GRADCHECK=(--set impl=pallas --set interpret=tpu)
  SHARDED=(--set impl=pallas --set interpret=true --set devices=8)
  BENCH=(--set impl=pallas --set interpret=true --set batch=1 --set tokens=256 --set hidden=128 --set vocab=4099
    --set warmup=1 --set repeat=2)
  AB=(--set steps=2 --set sft_steps=2 --set prompts_per_step=2 --set group_size=2 --set max_new_tokens=6
    --set flashloss_impl=pallas --set flashloss_interpret=true --set memory_analysis=false)
else
  chips=$("$PY" -c 'import jax; d = jax.devices(); assert d[0].platform == "tpu", d; print(len(d))') || {
    echo "tpu check: no TPU found by jax (jax.devices() above); on a machine without one run INTERPRET=1" >&2
    exit 2
  }
  GRADCHECK=(--set impl=pallas)
  SHARDED=(--set impl=pallas --set devices="$chips")
  BENCH=(--set impl=pallas --set batch=1 --set tokens=8192 --set hidden=4096 --set vocab=151936
    --set warmup=2 --set repeat=10)
  AB=(--set flashloss_impl=pallas)
fi

"$PY" - >"$OUT/environment.json" <<'PYEOF'
import json, platform, subprocess
import jax, flashloss
try:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or None
except OSError:
    commit = None
print(json.dumps({"flashloss": flashloss.__version__, "commit": commit, "jax": jax.__version__,
                  "backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
                  "device_kind": jax.devices()[0].device_kind, "python": platform.python_version()}))
PYEOF

for layout in vh hv; do
  step "gradcheck_f32_$layout" "$PY" -m flashloss.jax.gradcheck --config "$CONFIGS/gradcheck.yaml" --json \
    "${GRADCHECK[@]}" --set weight_layout="$layout"
done
# bf16: dH and dW come back in bf16, whose rounding alone is up to 2^-8 relative.
step gradcheck_bf16 "$PY" -m flashloss.jax.gradcheck --config "$CONFIGS/gradcheck.yaml" --json \
  "${GRADCHECK[@]}" --set dtype=bfloat16 --set loss_rel=1e-4 --set grad_rel=1e-2

for dtype in bfloat16 float32; do
  for impl in baseline tiled pallas; do
    step "bench_${impl}_$dtype" "$PY" -m flashloss.jax.bench "${BENCH[@]}" --set impl="$impl" --set dtype="$dtype"
  done
done

for parallel in token vocab 2d; do
  step "sharded_$parallel" "$PY" -m flashloss.jax.gradcheck --config "$CONFIGS/gradcheck.yaml" --json \
    "${SHARDED[@]}" --set parallel="$parallel" --set batch=8
done

for arm in baseline flashloss; do
  step "ab_$arm" "$PY" -m flashloss.tunix.ab --config "$CONFIGS/grpo_ab_$arm.yaml" "${AB[@]}" \
    --set out_dir="$OUT/ab_$arm"
done
step ab_plot "$PY" -m flashloss.tunix.ab --plot "$OUT/ab_baseline" "$OUT/ab_flashloss" --out "$OUT/ab"

"$PY" scripts/tpu/summarize.py "$OUT" "${failed[@]}" >"$OUT/summary.json"
cat "$OUT/summary.json"
tar -czf "$OUT.tar.gz" -C "$(dirname "$OUT")" "$(basename "$OUT")"
echo "tpu check: ${#failed[@]} failed; send back $OUT.tar.gz" >&2
[ ${#failed[@]} -eq 0 ]
