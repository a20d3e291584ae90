"""``flashloss.jax``'s cross-entropy and per-token log-probabilities from the hidden
states and the LM head: :func:`linear_cross_entropy`, :func:`linear_logprobs`."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp

from .._config import DEFAULT_BUDGET_MIB
from .._spec import CeArgs, LogprobOutputs, LogprobRequest, with_params
from . import _args as A
from . import _ffi, _logprobs, _support, _support_vocab, _vocab
from .pallas import checks as _checks
from .pallas import losses as _pallas


@with_params
def linear_cross_entropy(
    hidden,
    weight,
    targets,
    *,
    bias=None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: Optional[float] = None,
    reduction: str = "mean",
    temperature: float = 1.0,
    return_lse: bool = False,
    mode: str = "auto",
    budget_mib: Optional[float] = None,
    vocab_axis: Optional[str] = None,
    impl: str = "auto",
    interpret: Any = False,
    weight_layout: str = "vh",
):
    """Cross-entropy of ``hidden @ weight.T + bias`` at ``targets`` (Cut Cross-Entropy's
    call): ``hidden`` ``[..., H]``, ``targets`` ``[...]``; every option is keyword-only.

    {ce_args}
    On the FFI path a cotangent on ``lse`` runs the kernel once more, or joins reduction
    none's backward pass.

    {plan} (the FFI path's)

    ``vocab_axis``: inside ``jax.shard_map``, the mesh axis over which the head's
    vocabulary is split in equal contiguous blocks, as in :func:`linear_grpo_loss`; every
    device passes all the rows and gets the loss, the whole ``hidden`` gradient and its
    block's gradients. ``impl``, ``interpret``, ``weight_layout``: see :mod:`flashloss.jax`."""
    config = CeArgs(
        ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
        reduction=reduction, temperature=temperature,
    ).validate().config_json()  # fmt: skip
    hidden, weight, bias = A.head(hidden, weight, bias, weight_layout)
    targets = A.int_ids("targets", targets)
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(
            f"argument `targets`: shape {list(targets.shape)} does not match hidden's rows {list(hidden.shape[:-1])}"
        )
    h2, t1 = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    budget = DEFAULT_BUDGET_MIB if budget_mib is None else float(budget_mib)
    vocab = A.vocab_size(weight, weight_layout, vocab_axis)
    if vocab_axis is not None:
        h2 = jax.lax.pcast(h2, vocab_axis, to="varying")
    spec = _pallas.spec_for(weight_layout, temperature, softcap, vocab_axis, vocab, interpret)

    def ffi(h2, weight, bias, t1):
        if vocab_axis is not None:
            args = (vocab_axis, config, float(temperature), int(ignore_index), int(vocab), reduction, budget, mode)
            return _vocab.cross_entropy(h2, weight, bias, t1, *args, weight_layout)
        if reduction == "none":
            return _ffi.cross_entropy_rows(h2, weight, bias, t1, config, mode, budget, weight_layout)
        return _ffi.cross_entropy(h2, weight, bias, t1, config, mode, budget, weight_layout)

    def pallas(h2, weight, bias, t1):
        out, lse = _pallas.cross_entropy(
            *A.wide(h2, weight, bias), t1, spec, ignore_index=int(ignore_index), label_smoothing=float(label_smoothing),
            z_loss=float(z_loss), reduction=reduction,
        )  # fmt: skip
        return out, lse

    out, lse = A.on_path(impl, interpret, pallas, ffi, h2, weight, bias, t1)
    out = out.reshape(targets.shape) if reduction == "none" else out
    return (out, lse.reshape(targets.shape)) if return_lse else out


@with_params
def linear_logprobs(
    hidden,
    weight,
    ids,
    temperature: float = 1.0,
    return_entropy: bool = False,
    *,
    bias=None,
    mask=None,
    return_lse: bool = False,
    return_max: bool = False,
    return_sum_p2: bool = False,
    gather_ids=None,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    min_p: Optional[float] = None,
    budget_mib: Optional[float] = None,
    mode: str = "auto",
    vocab_axis: Optional[str] = None,
    impl: str = "auto",
    interpret: Any = False,
    weight_layout: str = "vh",
):
    """Per-token log-probabilities of ``ids`` ``[...]`` under ``s = (hidden @ weight.T + bias) /
    temperature`` (``hidden`` ``[..., H]``). Returns a :class:`LogprobOutputs` (``ids``'
    shape; None for what was not asked): ``logp``, and the entropy when
    ``return_entropy``. Rows where ``mask`` is false are zero. Differentiable in
    ``hidden``, ``weight`` and ``bias`` through both (the forward keeps each row's ``max``,
    ``log Σexp`` and entropy; the backward is one more pass over the head, and no dW pass
    for a head that needs no gradient on the Pallas path); ``vocab_axis`` as in
    :func:`linear_grpo_loss`. ``impl``, ``interpret``, ``weight_layout``: see
    :mod:`flashloss.jax`.

    More per-row outputs (``docs/spec/losses.md``, all of the scaled logits ``s``):
    ``return_lse`` (``log Σ_j e^{s_j}``, differentiable), ``return_max`` (``max_j s_j``),
    ``return_sum_p2`` (``Σ_j p_j²``; neither takes a gradient) and ``gather_ids``
    ``[..., K]`` (candidate ids per row, repeats allowed: ``log p`` of each,
    ``s_{ik} - lse``, differentiable).

    {filters}
    ``outside_support`` is returned whenever a filter is named. On the Pallas path, and
    with ``vocab_axis`` on both, the support is plain JAX over blocks of rows, not
    streamed (``_support``, ``_support_vocab``).

    {plan} (the FFI path's)"""
    hidden, weight, bias = A.head(hidden, weight, bias, weight_layout)
    ids = A.int_ids("ids", ids)
    if hidden.shape[:-1] != ids.shape:
        raise ValueError(
            f"argument `ids`: shape {list(ids.shape)} does not match hidden's rows {list(hidden.shape[:-1])}"
        )
    m = jnp.ones(ids.shape, bool) if mask is None else jnp.asarray(mask) != 0
    if m.shape != ids.shape:
        raise ValueError(f"argument `mask`: expected shape {list(ids.shape)}, got {list(m.shape)}")
    candidates = None if gather_ids is None else _logprobs.gather_ids(gather_ids, ids.shape)
    budget = DEFAULT_BUDGET_MIB if budget_mib is None else float(budget_mib)
    x = hidden.reshape(-1, hidden.shape[-1])
    vocab = A.vocab_size(weight, weight_layout, vocab_axis)
    request = LogprobRequest.of(
        temperature=temperature, return_entropy=return_entropy, return_lse=return_lse, return_max=return_max,
        return_sum_p2=return_sum_p2, top_k=top_k, top_p=top_p, min_p=min_p,
    )  # fmt: skip
    support = None
    if request.support is not None:  # named: the filters that cut, or none (outside_support all False)
        f = request.support
        support = _support.filters(f.top_k, f.top_p, f.min_p, vocab) or _support.Filters(None, None, None)
    if vocab_axis is not None:
        x = jax.lax.pcast(x, vocab_axis, to="varying")
    spec = _pallas.spec_for(weight_layout, temperature, None, vocab_axis, vocab, interpret)
    spec = dataclasses.replace(spec, sum_p2=bool(return_sum_p2))
    filtered = _support.active(support) is not None
    seq_len = ids.shape[-1] if ids.ndim else 1
    gather_kw = dict(layout=weight_layout, transform=spec.transform, vocab_axis=vocab_axis)

    def gathered(x, weight, bias, live, lse, cand, check: bool):
        if cand is None:
            return None
        if check:
            _logprobs.check_gather_ids(cand, live, vocab)
        return _logprobs.gathered_logp(x, weight, bias, cand, live, lse, **gather_kw)

    def outside(flat_mask):  # where the support is asked but keeps everything
        return None if support is None else jnp.zeros(flat_mask.shape, bool)

    def truncated(x, weight, bias, flat_ids, flat_mask):
        k_spec = (support, weight_layout, spec.transform)
        return _support_vocab.truncated(x, weight, bias, flat_ids, flat_mask, k_spec, vocab_axis)

    def ffi(x, weight, bias, flat_ids, flat_mask, cand):
        stats_args = (float(temperature), budget, mode, weight_layout)
        if filtered and vocab_axis is None:
            *out, out_k = _support.ffi_logprobs(x, weight, bias, flat_ids, flat_mask, support, *stats_args)
        else:
            out = _vocab.logprobs(x, weight, bias, flat_ids, flat_mask, vocab_axis, *stats_args)
            out_k = outside(flat_mask)
            if filtered:  # vocab-parallel: logp^K in plain JAX, the rest the full softmax's
                logp_k, out_k = truncated(x, weight, bias, flat_ids, flat_mask)
                out = (logp_k, *out[1:])
        logp, entropy, lse, top, p2 = out
        p2 = p2 if return_sum_p2 else None
        return logp, entropy, lse, top, p2, gathered(x, weight, bias, flat_mask, lse, cand, True), out_k

    def pallas(x, weight, bias, flat_ids, flat_mask, cand):
        x, weight, bias = A.wide(x, weight, bias)
        head = dataclasses.replace(spec, support=support if filtered else None)
        st = _pallas.logprob_stats(x, weight, bias, flat_ids, flat_mask, head, seq_len)
        p2 = st.sum_p2 if return_sum_p2 else None
        g = gathered(x, weight, bias, flat_mask, st.lse, cand, _checks.runs_here(interpret))
        logp, out_k = st.logp, outside(flat_mask)
        if filtered:
            logp, out_k = st.logp_k, st.outside
        return logp, st.entropy, st.lse, st.max, p2, g, out_k

    out = A.on_path(impl, interpret, pallas, ffi, x, weight, bias, ids.reshape(-1), m.reshape(-1), candidates)
    logp, entropy, lse, top, p2, g, out_k = (None if y is None else y.reshape(ids.shape + y.shape[1:]) for y in out)
    return LogprobOutputs(
        logp=logp,
        entropy=entropy if return_entropy else None,
        lse=lse if return_lse else None,
        max_logit=jax.lax.stop_gradient(top) if return_max else None,
        sum_p2=None if p2 is None else jax.lax.stop_gradient(p2),
        gathered_logp=g,
        outside_support=out_k,
    )
