"""``flashloss.torch.linear_logprobs``: per-token log-probabilities (and entropy, ``lse``,
max logit, ``Σp²``, candidates' log-probs) of an LM head's scaled logits from hidden
states, differentiable, without the ``[N, V]`` logits (see :func:`linear_logprobs`)."""

from __future__ import annotations

from typing import Optional

import torch

from . import _dist, _dtensor
from . import _torch_ops as ops
from ._config import DEFAULT_BUDGET_MIB
from ._spec import LogprobOutputs, LogprobRequest, with_params
from ._torch_args import _head, _same_device


def _check_gather_ids(ids: torch.Tensor, gather_ids) -> None:
    if gather_ids.dtype.is_floating_point or gather_ids.dtype.is_complex or gather_ids.dtype == torch.bool:
        raise ValueError(f"argument `gather_ids`: expected an integer dtype, got {gather_ids.dtype}")
    if gather_ids.dim() != ids.dim() + 1 or gather_ids.shape[:-1] != ids.shape or gather_ids.shape[-1] < 1:
        raise ValueError(
            f"argument `gather_ids`: expected shape {list(ids.shape)} + [K] with K >= 1 (ids' shape and K "
            f"candidates per token), got {list(gather_ids.shape)}"
        )


@with_params
def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    temperature: float = 1.0,
    return_entropy: bool = False,
    *,
    bias: Optional[torch.Tensor] = None,
    mask: Optional[torch.Tensor] = None,
    return_lse: bool = False,
    return_max: bool = False,
    return_sum_p2: bool = False,
    gather_ids: Optional[torch.Tensor] = None,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    min_p: Optional[float] = None,
    budget_mib: Optional[float] = None,
    mode: str = "auto",
    vocab_parallel_group=None,
) -> LogprobOutputs:
    """Per-token log-probabilities of ``ids`` ``[...]`` under ``s = (hidden @ weight.T + bias) /
    temperature`` (``hidden`` ``[..., H]``): the old- and reference-policy passes of GRPO
    (one statistics pass, 2NHV FLOPs), and the primitive a loss written in PyTorch builds
    on. Returns a :class:`LogprobOutputs` (float32, ``ids``' shape; ``None`` for what was not
    asked): ``logp``, and the entropy when ``return_entropy``. Rows where ``mask`` is false
    are not computed (zero, no gradient).

    CPU tensors, or CUDA tensors in a build with the ``cuda`` feature: the head stays on the
    GPU (PyTorch's current stream), ``ids``, ``mask`` and ``gather_ids`` are copied to the
    host, the outputs come back on the head's device. On CUDA every option runs, the
    truncated support (``top_k``/``top_p``/``min_p``) included (compiled, not yet run on a
    GPU).

    More per-row outputs: ``return_lse`` (``logsumexp_j s_j``), ``return_max``
    (``max_j s_j``), ``return_sum_p2`` (``Σ_j p_j²``), ``gather_ids`` ``[..., K]`` (integer,
    any ``K >= 1``, repeats allowed: ``gathered_logp = s_k - lse`` at each id, with no
    ``[N, V]`` array).

    {filters}
    ``outside_support`` is returned whenever a filter is named. Ties at a cut are kept
    (top-k, min-p) or split by index, the lower dropped first (top-p); rows whose cut the
    kernel's top buffers cannot decide (flat rows under top-p) take extra passes.

    Differentiable in ``hidden``, ``weight`` and ``bias`` through ``logp``, the entropy,
    ``lse`` and ``gathered_logp``: the backward runs the head again with each row's
    upstream gradients (6NHV FLOPs; 4NHV when ``weight`` and ``bias`` need no gradient, a
    frozen head, which gets no ``[V, H]`` buffer; ``gather_ids`` keep the single pass, while a
    support, whose ``K`` is held fixed, runs two-pass, 8NHV).

    {plan} (the backward's; the forward is one statistics pass)"""
    hidden, weight, bias, vocab_parallel_group = _dtensor.local_head(hidden, weight, bias, vocab_parallel_group)
    group = _dist.register(vocab_parallel_group)
    request = LogprobRequest.of(
        temperature=temperature, return_entropy=return_entropy, return_lse=return_lse, return_max=return_max,
        return_sum_p2=return_sum_p2, top_k=top_k, top_p=top_p, min_p=min_p,
    )  # fmt: skip

    def prepare():
        named = {"hidden": hidden, "weight": weight, "ids": ids, "bias": bias, "mask": mask, "gather_ids": gather_ids}
        _same_device(named)
        if hidden.shape[:-1] != ids.shape:
            raise ValueError(
                f"argument `ids`: shape {list(ids.shape)} does not match hidden's rows {list(hidden.shape[:-1])}"
            )
        if gather_ids is not None:
            _check_gather_ids(ids, gather_ids)
        return _head(hidden, weight, bias)

    h, w, b = _dist.agreed(group, prepare)
    if b is not None and h.device.type == "cuda":
        b = b.float()  # the GPU kernels read the bias in f32
    # Per-row inputs go to the kernels as CPU tensors (on a GPU: one copy each to the host).
    m = None if mask is None else (mask != 0).cpu().contiguous()
    budget = DEFAULT_BUDGET_MIB if budget_mib is None else float(budget_mib)
    g = None if gather_ids is None else gather_ids.to(device="cpu", dtype=torch.int64).contiguous()
    f = request.filters
    args = (m, request.temperature, budget, group, g, request.return_sum_p2, f.top_k, f.top_p, f.min_p, mode)
    logp, entropy, lse, max_logit, sum_p2, gathered, outside = ops.logp_linear(
        h, w, b, ids.to(device="cpu", dtype=torch.int64).contiguous(), *args
    )
    if request.support is not None:
        outside = outside != 0 if f.truncates else torch.zeros(ids.shape, dtype=torch.bool, device=logp.device)
    return LogprobOutputs(
        logp,
        entropy if request.return_entropy else None,
        lse if request.return_lse else None,
        max_logit if request.return_max else None,
        sum_p2 if request.return_sum_p2 else None,
        gathered if g is not None else None,
        outside if request.support is not None else None,
    )
