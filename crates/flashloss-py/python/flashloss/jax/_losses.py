"""``flashloss.jax``'s cross-entropy and per-token log-probabilities from the hidden
states and the LM head: :func:`linear_cross_entropy`, :func:`linear_logprobs`."""

from __future__ import annotations

from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from .._config import budget_or_unset as _budget
from .._spec import CeArgs, LogprobOutputs, LogprobRequest, with_params
from . import _args as A
from . import _head as H
from . import _logprobs
from ._calls import CeCall, LogprobCall
from ._paths import dispatch

#: The options' defaults, the signatures' (``flashloss._spec``).
_CE = CeArgs()
_REQUEST = LogprobRequest()


@with_params
def linear_cross_entropy(
    hidden: ArrayLike,
    weight: ArrayLike,
    targets: ArrayLike,
    bias: Optional[ArrayLike] = None,
    *,
    ignore_index: int = _CE.ignore_index,
    label_smoothing: float = _CE.label_smoothing,
    z_loss: float = _CE.z_loss,
    softcap: Optional[float] = _CE.softcap,
    reduction: str = _CE.reduction,
    temperature: float = _CE.temperature,
    return_lse: bool = False,
    mode: str = "auto",
    budget_mib: Optional[float] = None,
    vocab_axis: Optional[str] = None,
    impl: str = "auto",
    interpret: Any = False,
    weight_layout: str = "vh",
) -> Union[jax.Array, tuple[jax.Array, jax.Array]]:
    """Cross-entropy of ``hidden @ weight.T + bias`` at ``targets`` (Cut Cross-Entropy's
    call): ``hidden`` ``[..., H]``, ``targets`` ``[...]``; ``bias`` is the fourth positional argument, as CCE's,
    and every other option is keyword-only.

    {ce_args}
    On the FFI path a cotangent on ``lse`` runs the kernel once more, or joins reduction
    none's backward pass.

    {plan} (the FFI path's)

    ``vocab_axis``: inside ``jax.shard_map``, the mesh axis over which the head's
    vocabulary is split in equal contiguous blocks, as in :func:`linear_grpo_loss`; every
    device passes all the rows and gets the loss, the whole ``hidden`` gradient and its
    block's gradients. ``impl``, ``interpret``, ``weight_layout``: see :mod:`flashloss.jax`."""
    args = CeArgs.of_bound(locals()).validate()  # first: the call's options, by name
    hidden, weight, bias = A.head(hidden, weight, bias, weight_layout)
    targets = A.int_ids("targets", targets)
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(
            f"argument `targets`: shape {list(targets.shape)} does not match hidden's rows {list(hidden.shape[:-1])}"
        )
    h2, t1 = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    budget = _budget(budget_mib)
    vocab = A.vocab_size(weight, weight_layout, vocab_axis)
    if vocab_axis is not None:
        h2 = jax.lax.pcast(h2, vocab_axis, to="varying")
    call = CeCall(
        args=args, weight_layout=weight_layout, vocab_axis=vocab_axis, vocab=int(vocab), mode=mode, budget=budget,
        interpret=interpret,
    )  # fmt: skip
    out, lse = dispatch("linear_cross_entropy", impl, call, h2, weight, bias, t1)
    out = out.reshape(targets.shape) if args.reduction == "none" else out
    return (out, lse.reshape(targets.shape)) if return_lse else out


@with_params
def linear_logprobs(
    hidden: ArrayLike,
    weight: ArrayLike,
    ids: ArrayLike,
    *,
    temperature: float = _REQUEST.temperature,
    return_entropy: bool = _REQUEST.return_entropy,
    bias: Optional[ArrayLike] = None,
    mask: Optional[ArrayLike] = None,
    return_lse: bool = _REQUEST.return_lse,
    return_max: bool = _REQUEST.return_max,
    return_sum_p2: bool = _REQUEST.return_sum_p2,
    gather_ids: Optional[ArrayLike] = None,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    min_p: Optional[float] = None,
    budget_mib: Optional[float] = None,
    mode: str = "auto",
    vocab_axis: Optional[str] = None,
    impl: str = "auto",
    interpret: Any = False,
    weight_layout: str = "vh",
) -> LogprobOutputs:
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
    streamed (``ffi/support.py``, ``ffi/support_vocab.py``).

    {plan} (the FFI path's)"""
    request = LogprobRequest.of_bound(locals())  # first: the call's request, by name
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
    budget = _budget(budget_mib)
    x = hidden.reshape(-1, hidden.shape[-1])
    vocab = A.vocab_size(weight, weight_layout, vocab_axis)
    support = None
    if request.support is not None:  # named: the filters that cut, or none (outside_support all False)
        f = request.support
        support = H.filters(f, vocab)
    if vocab_axis is not None:
        x = jax.lax.pcast(x, vocab_axis, to="varying")
    call = LogprobCall(
        request=request, support=support, seq_len=ids.shape[-1] if ids.ndim else 1, weight_layout=weight_layout,
        vocab_axis=vocab_axis, vocab=int(vocab), mode=mode, budget=budget, interpret=interpret,
    )  # fmt: skip
    out = dispatch("linear_logprobs", impl, call, x, weight, bias, ids.reshape(-1), m.reshape(-1), candidates)
    logp, entropy, lse, top, p2, g, out_k = (None if y is None else y.reshape(ids.shape + y.shape[1:]) for y in out)
    return LogprobOutputs(
        logp=logp,
        entropy=entropy if request.return_entropy else None,
        lse=lse if request.return_lse else None,
        max_logit=jax.lax.stop_gradient(top) if request.return_max else None,
        sum_p2=None if p2 is None else jax.lax.stop_gradient(p2),
        gathered_logp=g,
        outside_support=out_k,
    )
