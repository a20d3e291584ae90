"""The FFI path's implementation of each loss (:data:`flashloss.jax._paths.PATHS`), every
one ``impl(call, *operands)``: the statics in ``call`` (:mod:`flashloss.jax._calls`), the
arrays as the public function prepared them. Each picks the handlers' call for the
case: one device (:mod:`.fused`, :mod:`.support`), or a head split over ``vocab_axis``
(:mod:`.vocab`, :mod:`.support_vocab`)."""

from __future__ import annotations

from .. import _checks, _logprobs
from . import fused, support, support_vocab, vocab


def linear_grpo(call, hidden, weight, bias, ids, mask, adv, old, ref, rho):
    """``(loss, (logp, entropy, kl, metrics))`` (:class:`LinearGrpoCall`)."""
    layout = call.weight_layout
    if call.vocab_axis is None:
        return fused.grpo(hidden, weight, bias, ids, mask, adv, old, ref, rho, call.config, call.mode, call.budget,
                          layout)  # fmt: skip
    if call.support is not None:  # the policy handler takes no support: the loss in JAX
        _checks.ids_in_range("completion_ids", ids, mask, call.vocab, ids.shape[-1], True)
        k_spec = (call.support, layout, call.transform)
        stats = (call.vocab_axis, call.temperature, call.budget, call.mode, layout)
        return support_vocab.grpo(hidden, weight, bias, ids, mask, adv, old, ref, rho, call.args, k_spec, stats)
    return vocab.grpo(
        hidden, weight, bias, ids, mask, adv, old, ref, call.config, call.vocab_axis, call.temperature,
        int(call.vocab), call.mode, call.budget, layout, ratio=rho,
    )  # fmt: skip


def grpo_logits(call, logits, ids, mask, adv, old, ref, rho):
    """``(loss, (logp, entropy, kl, metrics))`` (:class:`LogitsGrpoCall`)."""
    return fused.grpo_logits(logits, ids, mask, adv, old, ref, rho, call.config)


def grpo_logits_rows(call, logits, ids, mask, adv, old, ref, rho):
    """``(token_loss, (kl, clipped))`` ``[B, T]`` (:class:`LogitsGrpoCall`)."""
    return fused.grpo_logits_rows(logits, ids, mask, adv, old, ref, rho, call.config)


def linear_cross_entropy(call, x, weight, bias, targets):
    """``(loss, lse)`` (:class:`CeCall`): rows ``x`` ``[N, H]``, ``targets`` ``[N]``."""
    a, plan = call.args, (call.mode, call.budget, call.weight_layout)
    if call.vocab_axis is not None:
        statics = (call.vocab_axis, call.config, float(a.temperature), int(a.ignore_index), int(call.vocab))
        return vocab.cross_entropy(x, weight, bias, targets, *statics, a.reduction, call.budget, call.mode,
                                   call.weight_layout)  # fmt: skip
    if a.reduction == "none":
        return fused.cross_entropy_rows(x, weight, bias, targets, call.config, *plan)
    return fused.cross_entropy(x, weight, bias, targets, call.config, *plan)


def linear_logprobs(call, x, weight, bias, ids, live, cand):
    """``(logp, entropy, lse, max, sum_p2, gathered_logp, outside)`` of rows ``x``
    ``[N, H]`` (:class:`LogprobCall`; None for ``sum_p2``, ``gathered_logp`` and
    ``outside`` where not asked)."""
    stats = (call.temperature, call.budget, call.mode, call.weight_layout)
    # The handlers merge partial states, in which an id no block holds is a target logit
    # of 0: every live id is checked here, against the whole vocabulary.
    _checks.ids_in_range("ids", ids, live, call.vocab, call.seq_len, True)
    if call.filtered and call.vocab_axis is None:
        *out, outside = support.ffi_logprobs(x, weight, bias, ids, live, call.support, *stats)
    else:
        out = vocab.logprobs(x, weight, bias, ids, live, call.vocab_axis, *stats)
        outside = _logprobs.all_inside(call, live)
        if call.filtered:  # vocab-parallel: logp^K in plain JAX, the rest the full softmax's
            k_spec = (call.support, call.weight_layout, call.transform)
            logp_k, outside = support_vocab.truncated(x, weight, bias, ids, live, k_spec, call.vocab_axis)
            out = (logp_k, *out[1:])
    logp, entropy, lse, top, p2 = out
    p2 = p2 if call.request.return_sum_p2 else None
    return logp, entropy, lse, top, p2, _logprobs.gathered(call, x, weight, bias, live, lse, cand, True), outside
