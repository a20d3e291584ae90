# shellcheck shell=bash
# Sourced: `gradchecks RUN [SMALL...]` calls `RUN NAME COMMAND...` once per gradcheck of
# the GPU verification (verify.sh, check.sh); BIN is the CLI. SMALL (extra --set
# arguments) shrinks the logits-level checks' T=8192, V=151936 rows; the fused ones
# are small already.
gradchecks() {
  local run=$1; shift
  local small=("$@") dtype loss mode parallel extra
  for dtype in f32 bf16; do
    "$run" "gc_logits_t8192_v151936_$dtype" "$BIN" gradcheck \
      --config "configs/gradcheck/gpu/logits_b1_t8192_v151936_$dtype.yaml" "${small[@]}"
    for loss in grpo bnpo dr_grpo dapo cispo sapo luspo vespo; do
      extra=()
      [ $loss = dr_grpo ] && extra=(--set loss.max_completion_length=17)  # dr_grpo's normalizer
      for mode in auto two_pass; do
        "$run" "gc_linear_${loss}_${mode}_$dtype" "$BIN" gradcheck \
          --config configs/gradcheck/gpu/linear_grpo.yaml --set dtype=$dtype \
          --set loss.loss_type=$loss --set mode=$mode "${extra[@]}"
      done
      # TRL 1.16: sequence level for every type but vespo, with policy and entropy masks.
      [ $loss = vespo ] && continue
      "$run" "gc_linear_${loss}_sequence_masks_$dtype" "$BIN" gradcheck \
        --config configs/gradcheck/gpu/linear_grpo.yaml --set dtype=$dtype \
        --set loss.loss_type=$loss --set loss.importance_sampling_level=sequence \
        --set policy_mask_fraction=0.3 --set entropy_mask_fraction=0.5 --set sampler_ratio=true \
        "${extra[@]}"
    done
    "$run" "gc_logits_trl_1_16_$dtype" "$BIN" gradcheck \
      --config configs/gradcheck/trl_1_16.yaml --set device=cuda --set dtype=$dtype
    "$run" "gc_linear_grpo_sequence_$dtype" "$BIN" gradcheck \
      --config configs/gradcheck/gpu/linear_grpo.yaml --set dtype=$dtype \
      --set loss.importance_sampling_level=sequence
    for mode in auto two_pass; do
      "$run" "gc_linear_ce_${mode}_$dtype" "$BIN" gradcheck \
        --config configs/gradcheck/gpu/linear_ce.yaml --set dtype=$dtype --set mode=$mode
    done
    # Log-probs with Σp², lse and candidate sets (issue 41): pass A's gather and pass B's
    # sparse terms (two_pass), the single pass's (single_pass), and a frozen head.
    for mode in auto two_pass single_pass; do
      "$run" "gc_linear_logprobs_${mode}_$dtype" "$BIN" gradcheck \
        --config configs/gradcheck/gpu/linear_logprobs.yaml --set dtype=$dtype --set mode=$mode
    done
    "$run" "gc_linear_logprobs_frozen_$dtype" "$BIN" gradcheck \
      --config configs/gradcheck/gpu/linear_logprobs.yaml --set dtype=$dtype --set head_grad=frozen
    # The truncated support (issue 41): top-p alone on flat rows (extra passes); min-p,
    # top-k and top-p with K = 5 candidates beside them; GRPO under the support. The CPU
    # passes the same runs (gradcheck_logprobs.rs::the_gpu_support_config_passes_on_the_cpu).
    "$run" "gc_linear_logprobs_top_p_$dtype" "$BIN" gradcheck \
      --config configs/gradcheck/gpu/linear_logprobs_support.yaml --set dtype=$dtype
    "$run" "gc_linear_logprobs_support_$dtype" "$BIN" gradcheck \
      --config configs/gradcheck/gpu/linear_logprobs_support.yaml --set dtype=$dtype \
      --set logprobs.top_k=400 --set logprobs.min_p=0.02 --set logprobs.temperature=0.7 \
      --set logprobs.gather_k=5
    "$run" "gc_linear_grpo_support_$dtype" "$BIN" gradcheck \
      --config configs/gradcheck/linear_grpo_support.yaml --set device=cuda --set dtype=$dtype
  done
  # A top-k beyond the largest buffer (4096 keys): searched over extra passes.
  "$run" gc_linear_logprobs_top_k4500_f32 "$BIN" gradcheck \
    --config configs/gradcheck/gpu/linear_logprobs_support.yaml --set logprobs.top_k=4500
  # The bf16 chunk (mode: compact, issue 41 item 3): the logits GEMM writes bf16 and the
  # row kernel overwrites them with dZ. Its logits carry bf16's rounding (unit roundoff
  # 2^-8), so logp, entropy, lse and Σp² are gated at 5e-2 and the loss at 1e-2 (a wrong
  # offset or kernel is off by O(1)); the logs give the errors measured. 32.2 MiB of
  # budget: blocks of 20 rows (several blocks, masked rows between them).
  local compact=(--set dtype=bf16 --set mode=compact --set tolerance.logp_rel=5e-2
    --set tolerance.loss_rel=1e-2)
  for loss in grpo dapo; do
    "$run" "gc_linear_${loss}_compact_bf16" "$BIN" gradcheck \
      --config configs/gradcheck/gpu/linear_grpo.yaml --set loss.loss_type=$loss "${compact[@]}"
  done
  "$run" gc_linear_grpo_compact_20_rows_bf16 "$BIN" gradcheck \
    --config configs/gradcheck/gpu/linear_grpo.yaml --set budget_mib=32.2 "${compact[@]}"
  "$run" gc_linear_ce_compact_bf16 "$BIN" gradcheck \
    --config configs/gradcheck/gpu/linear_ce.yaml "${compact[@]}"
  "$run" gc_linear_logprobs_compact_bf16 "$BIN" gradcheck \
    --config configs/gradcheck/gpu/linear_logprobs.yaml "${compact[@]}"
  # float16 heads, widened to f32 on the host before the device (issue 41).
  "$run" gc_linear_grpo_auto_f16 "$BIN" gradcheck \
    --config configs/gradcheck/gpu/linear_grpo.yaml --set dtype=f16
  "$run" gc_linear_logprobs_two_pass_f16 "$BIN" gradcheck \
    --config configs/gradcheck/gpu/linear_logprobs.yaml --set dtype=f16 --set mode=two_pass
  # The CUDA kernels sharded through NCCL (a world of one): vocab-parallel and token.
  for parallel in vocab token; do
    "$run" "gc_nccl_world_of_one_$parallel" "$BIN" gradcheck --collective nccl \
      --config configs/gradcheck/linear_grpo.yaml --set parallel=$parallel --set device=cuda
  done
}
