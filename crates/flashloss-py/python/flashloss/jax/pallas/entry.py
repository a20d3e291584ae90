"""The Pallas path's implementation of each loss (:data:`flashloss.jax._paths.PATHS`),
every one ``impl(call, *operands)`` as the FFI path's (:mod:`flashloss.jax.ffi.entry`):
float16 widened to float32 (:func:`flashloss.jax._args.wide`), the kernels' statics
(:class:`.stats.HeadSpec`, the chip resolved now) from the call, then :mod:`.losses`."""

from __future__ import annotations

import dataclasses

from .. import _logprobs
from .._args import wide
from .. import _checks as checks
from . import losses


def _spec(call, softcap=None, **kw) -> losses.HeadSpec:
    spec = losses.spec_for(call.weight_layout, call.temperature, softcap, call.vocab_axis, call.vocab, call.interpret)
    return dataclasses.replace(spec, **kw) if kw else spec


def linear_grpo(call, hidden, weight, bias, ids, mask, adv, old, ref, rho):
    """``(loss, (logp, entropy, kl, metrics))`` (:class:`LinearGrpoCall`); across
    ``token_axis`` the two kernels' plan (the loss's normalizers are summed after). No
    ``budget_mib``: the chip's default (:func:`.single_pass.default_budget_bytes`)."""
    hidden, weight, bias = wide(hidden, weight, bias)
    budget = call.budget if call.budget_given else None
    plan = (call.mode, budget) if call.token_axis is None else ("two_pass", budget)
    spec = _spec(call, support=call.support)
    return losses.grpo(hidden, weight, bias, ids, mask, adv, old, ref, rho, call.args, spec, *plan)


def grpo_logits(call, logits, ids, mask, adv, old, ref, rho):
    """``(loss, (logp, entropy, kl, metrics))`` (:class:`LogitsGrpoCall`)."""
    return losses.grpo_logits(*wide(logits), ids, mask, adv, old, ref, rho, call.args, call.interpret)


def grpo_logits_rows(call, logits, ids, mask, adv, old, ref, rho):
    """``(token_loss, (kl, clipped))`` ``[B, T]`` (:class:`LogitsGrpoCall`)."""
    return losses.grpo_logits_rows(*wide(logits), ids, mask, adv, old, ref, rho, call.args, call.interpret)


def linear_cross_entropy(call, x, weight, bias, targets):
    """``(loss, lse)`` (:class:`CeCall`): rows ``x`` ``[N, H]``, ``targets`` ``[N]``."""
    a = call.args
    spec = losses.spec_for(call.weight_layout, a.temperature, a.softcap, call.vocab_axis, call.vocab, call.interpret)
    return losses.cross_entropy(
        *wide(x, weight, bias), targets, spec, ignore_index=int(a.ignore_index),
        label_smoothing=float(a.label_smoothing), z_loss=float(a.z_loss), reduction=a.reduction,
    )  # fmt: skip


def linear_logprobs(call, x, weight, bias, ids, live, cand):
    """``(logp, entropy, lse, max, sum_p2, gathered_logp, outside)`` as the FFI path's."""
    x, weight, bias = wide(x, weight, bias)
    spec = _spec(call, sum_p2=bool(call.request.return_sum_p2), support=call.support if call.filtered else None)
    st = losses.logprob_stats(x, weight, bias, ids, live, spec, call.seq_len)
    p2 = st.sum_p2 if call.request.return_sum_p2 else None
    g = _logprobs.gathered(call, x, weight, bias, live, st.lse, cand, checks.runs_here(call.interpret))
    logp, outside = st.logp, _logprobs.all_inside(call, live)
    if call.filtered:
        logp, outside = st.logp_k, st.outside
    return logp, st.entropy, st.lse, st.max, p2, g, outside
