"""``flashloss.torch.linear_logprobs``: per-token log-probabilities (and entropy, ``lse``,
max logit, ``Σp²``, candidates' log-probs) of an LM head's scaled logits from hidden
states, differentiable, without the ``[N, V]`` logits (see :func:`linear_logprobs`)."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from . import _dist
from . import _torch_ops as ops
from ._config import DEFAULT_BUDGET_MIB
from ._torch_args import _head, _same_device


class LogprobOutputs(NamedTuple):
    """What :func:`linear_logprobs` returns when asked for more than ``logp`` and the
    entropy (float32, ``ids``' shape; ``None`` for what was not asked)."""

    #: ``logp = s_y - lse``.
    logp: torch.Tensor
    #: The entropy (``return_entropy``).
    entropy: Optional[torch.Tensor]
    #: ``lse = logsumexp_j s_j`` (``return_lse``).
    lse: Optional[torch.Tensor]
    #: ``max_j s_j`` (``return_max``; not differentiated).
    max_logit: Optional[torch.Tensor]
    #: ``Σ_j p_j²`` (``return_sum_p2``; not differentiated).
    sum_p2: Optional[torch.Tensor]
    #: ``s_k - lse`` at ``gather_ids`` ``[..., K]`` (``gather_ids``' shape).
    gathered_logp: Optional[torch.Tensor]
    #: Whether each target is outside the truncated support (bool; ``top_k``, ``top_p`` or
    #: ``min_p`` given), where ``logp`` is ``-inf``.
    outside_support: Optional[torch.Tensor] = None


def _check_gather_ids(ids: torch.Tensor, gather_ids) -> None:
    if gather_ids.dtype.is_floating_point or gather_ids.dtype.is_complex or gather_ids.dtype == torch.bool:
        raise ValueError(f"argument `gather_ids`: expected an integer dtype, got {gather_ids.dtype}")
    if gather_ids.dim() != ids.dim() + 1 or gather_ids.shape[:-1] != ids.shape or gather_ids.shape[-1] < 1:
        raise ValueError(
            f"argument `gather_ids`: expected shape {list(ids.shape)} + [K] with K >= 1 (ids' shape and K "
            f"candidates per token), got {list(gather_ids.shape)}"
        )


def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    temperature: float = 1.0,
    return_entropy: bool = False,
    *,
    bias: Optional[torch.Tensor] = None,
    mask: Optional[torch.Tensor] = None,
    budget_mib: Optional[float] = None,
    vocab_parallel_group=None,
    return_lse: bool = False,
    return_max: bool = False,
    return_sum_p2: bool = False,
    gather_ids: Optional[torch.Tensor] = None,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    min_p: Optional[float] = None,
):
    """Per-token log-probabilities of ``ids`` ``[...]`` under ``s = (hidden @ weight.T + bias) /
    temperature`` (``hidden`` ``[..., H]``): the old- and reference-policy passes of GRPO
    (one statistics pass, 2NHV FLOPs), and the primitive a loss written in PyTorch builds
    on. Returns ``logp`` (float32, ``ids``' shape), and the entropy too when
    ``return_entropy``. Rows where ``mask`` is false are not computed (zero, no gradient).

    Asking for more returns a :class:`LogprobOutputs` (``None`` for what was not asked):
    ``return_lse`` (``logsumexp_j s_j``), ``return_max`` (``max_j s_j``), ``return_sum_p2``
    (``Σ_j p_j²``), ``gather_ids`` ``[..., K]`` (integer, any ``K >= 1``, repeats allowed:
    ``gathered_logp = s_k - lse`` at each id, with no ``[N, V]`` array). ``top_k``,
    ``top_p`` and ``min_p`` (vLLM V1's sampler filters, in its order: min-p, top-k, top-p;
    ``None``, ``top_k >= V``, ``top_p = 1`` and ``min_p = 0`` cut nothing) make ``logp`` the
    log-prob under the truncated support ``K`` the sampler draws from, ``s_y - logsumexp_{j∈K}
    s_j``, ``-inf`` where the target is outside ``K`` (flagged in ``outside_support``; such a
    token takes no gradient); the entropy and ``lse`` stay the full softmax's. Ties at a cut
    are kept (top-k, min-p) or split by index, the lower dropped first (top-p); rows whose
    cut the kernel's top buffers cannot decide (flat rows under top-p) take extra passes.

    Differentiable in ``hidden``, ``weight`` and ``bias`` through ``logp``, the entropy,
    ``lse`` and ``gathered_logp``: the backward runs the head again with each row's
    upstream gradients (6NHV FLOPs; 4NHV when ``weight`` and ``bias`` need no gradient, a
    frozen head, which gets no ``[V, H]`` buffer; ``gather_ids`` keep the single pass, while a
    support, whose ``K`` is held fixed, runs two-pass, 8NHV)."""
    group = _dist.register(vocab_parallel_group)

    def prepare():
        named = {"hidden": hidden, "weight": weight, "ids": ids, "bias": bias, "mask": mask, "gather_ids": gather_ids}
        _same_device(named, cuda=False)
        if hidden.shape[:-1] != ids.shape:
            raise ValueError(
                f"argument `ids`: shape {list(ids.shape)} does not match hidden's rows {list(hidden.shape[:-1])}"
            )
        if gather_ids is not None:
            _check_gather_ids(ids, gather_ids)
        return _head(hidden, weight, bias)

    h, w, b = _dist.agreed(group, prepare)
    m = None if mask is None else (mask != 0).contiguous()
    budget = DEFAULT_BUDGET_MIB if budget_mib is None else float(budget_mib)
    g = None if gather_ids is None else gather_ids.to(torch.int64).contiguous()
    support = (top_k, top_p, min_p)
    args = (m, float(temperature), budget, group, g, bool(return_sum_p2), *support)
    out = ops.logp_linear(h, w, b, ids.to(torch.int64).contiguous(), *args)
    logp, entropy, lse, max_logit, sum_p2, gathered, outside = out
    truncated = any(x is not None for x in support)
    if not (return_lse or return_max or return_sum_p2 or g is not None or truncated):
        return (logp, entropy) if return_entropy else logp
    return LogprobOutputs(
        logp,
        entropy if return_entropy else None,
        lse if return_lse else None,
        max_logit if return_max else None,
        sum_p2 if return_sum_p2 else None,
        gathered if g is not None else None,
        outside != 0 if truncated else None,
    )
