"""The parameters' documentation, written once and put into both bindings' docstrings
(as Cut Cross-Entropy's ``doc.py`` does): a docstring names a section as ``{grpo_args}``
and :func:`with_params` fills it in."""

from __future__ import annotations

from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)

SECTIONS = {
    "grpo_args": """\
    TRL's arguments (``GRPOConfig``'s names and defaults, ``flashloss._spec.GrpoArgs``):
    ``loss_type`` (grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo, vespo), ``beta``,
    ``epsilon_low`` (TRL's ``epsilon``), ``epsilon_high`` (None: ``epsilon_low``),
    ``delta``, ``importance_sampling_level`` (token or sequence), ``temperature``,
    ``use_bias_correction_kl``, ``num_items_in_batch`` (the loss's normalizer for dapo,
    cispo and vespo, taken as global; a number, or a 0-d array or tensor),
    ``max_completion_length`` (dr_grpo), ``sapo_temperature_pos``/``_neg``,
    ``vespo_k_pos``, ``vespo_lambda_pos``, ``vespo_k_neg``, ``vespo_lambda_neg``. Only the
    fields ``loss_type`` uses are checked; an error is a ``ValueError`` naming the
    argument. ``old_per_token_logps=None`` means on-policy (ratio 1);
    ``ref_per_token_logps`` is required when ``beta > 0``. ``importance_sampling_ratio``:
    TRL's vLLM importance-sampling correction ``ρ`` ``[B]``, ``[B, 1]`` or ``[B, T]``
    (finite, ``>= 0``, detached), which multiplies each token's policy loss
    (``ℓ·ρ + β·kl``; for vespo it enters ``log w_b``).""",
    "grpo_masks": """\
    ``policy_mask`` (TRL's off-policy mask) and ``entropy_mask`` (its top-entropy mask)
    ``[B, T]`` multiply each token's policy loss (not the KL); the entropy bonus
    ``entropy_coef`` is the mean entropy over ``completion_mask * entropy_mask``.""",
    "packed": """\
    A packed (padding-free) batch: ``cu_seqlens`` ``[B + 1]`` (integer offsets from 0,
    strictly increasing, ending at ``total_tokens``: flash-attention's and TRL's
    padding-free collator's) or ``position_ids`` ``[total_tokens]`` / ``[1, total_tokens]``
    (0 at each sequence's first token, counting up by 1), not both. Then ``hidden`` is
    ``[total_tokens, H]`` (or ``[1, total_tokens, H]``), ``completion_ids``, the masks and
    the old/ref log-probs ``[total_tokens]`` (or ``[1, total_tokens]``), ``advantages``
    ``[B]`` or ``[B, 1]``, ``importance_sampling_ratio`` ``[B]``, ``[B, 1]`` or
    ``[total_tokens]``; the loss, metrics and gradients are those of the padded
    ``[B, T_max]`` call (``flashloss._spec.packed``), and ``GRPOOutputs``' per-token
    fields are ``[total_tokens]``. The head runs on the packed rows (no padded copy of
    ``hidden``); only the per-token statistics are placed at ``(b, t)`` for the
    per-sequence reductions. Bad sequences are a ``ValueError`` naming the argument.""",
    "filters": """\
    ``top_k``, ``top_p``, ``min_p``: the sampler's filters (vLLM V1's, in its order:
    min-p, top-k, top-p), one rule in every function and binding: ``top_k`` None, 0 or -1,
    ``top_p`` None or 1, ``min_p`` None or 0 are unset (a ``top_k`` at or above the
    vocabulary keeps everything too); another ``top_k`` below 1 or a non-integer,
    ``top_p`` outside ``(0, 1]``, ``min_p`` outside ``[0, 1]`` are a ``ValueError`` naming
    the argument. The log-prob is then taken under the truncated support ``K``,
    ``s_y - logsumexp_{j∈K} s_j``, ``-inf`` where the target is outside ``K`` (flagged in
    ``outside_support``), differentiable with ``K`` held fixed; the entropy stays the full
    softmax's.""",
    "ce_args": """\
    Cut Cross-Entropy's options (``flashloss._spec.CeArgs``): rows whose target is
    ``ignore_index`` take no part, ``label_smoothing`` ε, ``z_loss`` λ (``λ·lse²``),
    ``softcap`` (``cap·tanh(z/cap)`` before the temperature), ``reduction`` (mean, sum or
    none: ``[...]``), ``temperature``. ``return_lse`` returns ``(loss, lse)``: ``lse``
    ``[...]`` float32, each row's log-sum-exp of the logits as the loss sees them
    (soft-capped, divided by the temperature), 0 at ignored rows, differentiable.""",
    "plan": """\
    ``mode`` (auto, auto_f32, single_pass, compact, two_pass) and ``budget_mib`` are the
    fused kernel's plan, as in ``flashloss bench``. ``budget_mib=None`` (the default) is the
    backend's own: 160 MiB on the CPU; on CUDA the largest workspace that keeps the call's
    peak within half the unfused path's (and half the free memory), blocks of at most 4096
    rows (``flashloss plan`` prints it for a GPU without one). On JAX's Pallas path a
    token-local GRPO step (token-level ratios, not vespo) on one device without a sampler
    support runs in one pass over blocks of rows (6NHV) under ``single_pass``, or under
    ``auto`` where a block fits ``budget_mib``; every other step there runs two passes. On
    CUDA with a bf16 head, ``compact`` keeps each block's logits as bf16 and overwrites
    them with the gradient (the fastest plan; logp, entropy and the loss carry bf16's
    rounding of the logits, as the unfused bf16 path's do), and ``auto`` takes it where the
    rate model finds it faster; ``auto_f32`` keeps f32 statistics.""",
}


def with_params(f: F) -> F:
    """``f`` with the sections its docstring names (``{name}`` on a line of its own) filled in."""
    doc = f.__doc__
    for name, text in SECTIONS.items():
        doc = doc.replace("    {" + name + "}", text)
    f.__doc__ = doc
    return f
