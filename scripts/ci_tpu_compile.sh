#!/usr/bin/env bash
# CI stage for the Pallas TPU path (issue 40): the real XLA TPU compiler and Mosaic (libtpu
# from PyPI, deviceless: no TPU) compile cases of flashloss.jax.tpu_compile, and the stage
# fails on any compile error (a VMEM overflow is one) or on temporaries above a case's bound.
# Nothing runs on a TPU.
#
# TPU_COMPILE_SET=ci (the default, about 10 min on CI's 2 cores): every kernel family on
# every chip it can fail on, the expensive duplicates left out:
#   - v7x (the least VMEM) and v5p: the `core` cases (GRPO in both dtypes and layouts, the
#     statistics, the logits level, the ragged shapes); on v7x also the bf16 single pass
#     (whose compiler copies the head), on v5p the bf16 support with top-k and top-p (its
#     top-p search was once over its bound there alone);
#   - v5e (the slowest compiles, 60-110 s each): GRPO f32 [V,H] and bf16 [H,V], the logits level;
#   - v6e: GRPO bf16 [V,H] and f32 [H,V], the f32 statistics, the logits level, one ragged
#     shape, sequence-level GRPO, CE, log-probs with entropy and with `gather_ids`, the single
#     pass, the 2-D mesh of 8 chips, the streamed support with min-p;
#   - the gate (issue 49), on v6e and v7x: the bf16 GRPO call with no `mode` or `budget_mib`
#     (`grpo_default_bf16`) fails when its roofline estimate (XLA's cost analysis with the
#     loop's body times its trip count) is over 1.0x the pure-JAX baseline's or its peak (temp +
#     arguments + outputs) over 0.5x the baseline's (flashloss.jax.tpu_compile.BASELINE); two
#     compiles each (the step, and its loop's body alone): 42.6 s on v6e, 55.3 s on v7x (a
#     2-core host under other load, at the commit of docs/results/tpu_default_plan.md).
# TPU_COMPILE_SET=full (about 25 min): v6e every case but the f32 support ones, v5e, v5p and
# v7x every `core` case and the bf16 default call.
# TPU_COMPILE_SET=all: every one-device case on v5e, v6e, v5p and v7x, and the v6e-8 mesh
# cases (the set of docs/results/tpu_compile.md; see there for its time).
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
case "${TPU_COMPILE_SET:-ci}" in
  full)
    support=logprobs_support_top_k50_bf16,logprobs_support_top_p0.9_bf16,logprobs_support_min_p0.05_bf16
    support=$support,logprobs_support_top_k50_top_p0.9_bf16
    run --chips v6e --cases "core,v6e,default,mesh,$support" & first=$!
    run --chips v5e,v5p,7x --cases core,grpo_default_bf16 & second=$!
    ;;
  all)
    # v5e's compiles are the slowest: one process takes v5e and the mesh, the other the rest
    (rc=0; run --chips v5e --cases all,-mesh || rc=1; run --chips v6e --cases mesh || rc=1; exit "$rc") & first=$!
    run --chips v6e,v5p,7x --cases all,-mesh & second=$!
    ;;
  ci)
    v6e=grpo_token_bf16_vh,grpo_token_f32_hv,logprobs_stats_f32,logits_grpo_bf16,logits_grpo_f32
    v6e=$v6e,grpo_ragged_h3584_f32,grpo_sequence_f32,ce_f32,logprobs_entropy_f32,logprobs_gather64_bf16
    v6e=$v6e,grpo_single_pass_bf16,grpo_mesh_2d_bf16,logprobs_support_min_p0.05_bf16,grpo_default_bf16
    v5e=grpo_token_f32_vh,grpo_token_bf16_hv,logits_grpo_bf16,logits_grpo_f32
    run --chips v6e --cases "$v6e" & first=$!
    (
      rc=0
      run --chips 7x --cases core,grpo_single_pass_bf16,grpo_default_bf16 || rc=1
      run --chips v5p --cases core,logprobs_support_top_k50_top_p0.9_bf16 || rc=1
      run --chips v5e --cases "$v5e" || rc=1
      exit "$rc"
    ) & second=$!
    ;;
  *) echo "TPU_COMPILE_SET: ci, full or all, not ${TPU_COMPILE_SET}"; exit 2 ;;
esac
status=0
wait "$first" || status=1
wait "$second" || status=1
echo "tpu_compile: $(wc -l < "$OUT") cases compiled in $(( $(date +%s) - start )) s, $(grep -c '"ok": false' "$OUT" || true) failed"
if [ "$status" -ne 0 ]; then
  grep '"ok": false' "$OUT" || true
  grep -v -E '^(W|I|E)[0-9]{4} ' "$LOG" | tail -n 30 || true
fi
exit "$status"
