"""``flashloss.torch``'s cross-entropy and per-token log-probabilities from the hidden
states and the LM head: :func:`linear_cross_entropy`, :func:`linear_logprobs` (as
``flashloss.jax._losses``)."""

from __future__ import annotations

from typing import Any, Optional, Union

import torch

from .._config import budget_or_unset as _budget
from .._spec import CeArgs, LogprobOutputs, LogprobRequest, with_params
from . import _args as A
from . import _dist, _dtensor
from . import _ops as ops
from ._logprobs import check_gather_ids

#: The options' defaults, the signatures' (``flashloss._spec``).
_CE = CeArgs()
_REQUEST = LogprobRequest()


@torch.compiler.assume_constant_result
def _ce_json(**fields) -> str:
    return CeArgs(**fields).config_json()


@with_params
def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
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
    vocab_parallel_group: Optional[Any] = None,
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Cross-entropy of ``hidden @ weight.T + bias`` at ``targets``, as Cut Cross-Entropy's
    ``linear_cross_entropy(e, c, targets, ...)`` and PyTorch's
    ``F.linear_cross_entropy(input, linear_weight, target, ...)`` compute it: ``hidden``
    ``[..., H]`` and ``targets`` ``[...]``; ``bias`` is the fourth positional argument, as CCE's,
    and every other option is keyword-only.

    {ce_args}

    {plan}"""
    fields = CeArgs.fields_of(locals())  # first: the call's options, by name
    hidden, weight, bias, vocab_parallel_group = _dtensor.local_head(hidden, weight, bias, vocab_parallel_group)
    group = _dist.register(vocab_parallel_group)

    def prepare(fields=fields):
        device = A.same_device(dict(hidden=hidden, weight=weight, targets=targets, bias=bias))
        config = _ce_json(**fields)
        if targets.dtype.is_floating_point or targets.dtype == torch.bool:
            raise ValueError(f"argument `targets`: expected an integer dtype, got {targets.dtype}")
        if hidden.shape[:-1] != targets.shape:
            rows = list(hidden.shape[:-1])
            raise ValueError(f"argument `targets`: shape {list(targets.shape)} does not match hidden's rows {rows}")
        h, w, b = A.head(hidden, weight, bias)
        if b is not None and device.type == "cuda":
            b = b.float()  # the GPU kernels read the bias in f32
        return h.reshape(-1, h.shape[-1]), w, b, config

    h2, w, b, config = _dist.agreed(group, prepare)
    tgt = targets.reshape(-1).to(device="cpu", dtype=torch.int64).contiguous()
    budget = _budget(budget_mib)
    if return_lse:
        args = (h2, w, b, tgt, config, mode, budget, group)
        if fields["reduction"] == "none":
            rows, lse = ops.ce_linear_rows_lse(*args)
            return rows.reshape(targets.shape), lse.reshape(targets.shape)
        loss, lse = ops.ce_linear_lse(*args)[:2]
        return loss, lse.reshape(targets.shape)
    if fields["reduction"] == "none":
        return ops.ce_linear_rows(h2, w, b, tgt, config, mode, budget, group).reshape(targets.shape)
    return ops.ce_linear(h2, w, b, tgt, config, mode, budget, group, A.head_grad(weight, bias))[0]


@with_params
def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    *,
    temperature: float = _REQUEST.temperature,
    return_entropy: bool = _REQUEST.return_entropy,
    bias: Optional[torch.Tensor] = None,
    mask: Optional[torch.Tensor] = None,
    return_lse: bool = _REQUEST.return_lse,
    return_max: bool = _REQUEST.return_max,
    return_sum_p2: bool = _REQUEST.return_sum_p2,
    gather_ids: Optional[torch.Tensor] = None,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    min_p: Optional[float] = None,
    budget_mib: Optional[float] = None,
    mode: str = "auto",
    vocab_parallel_group: Optional[Any] = None,
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
    request = LogprobRequest.of_bound(locals())  # first: the call's request, by name
    hidden, weight, bias, vocab_parallel_group = _dtensor.local_head(hidden, weight, bias, vocab_parallel_group)
    group = _dist.register(vocab_parallel_group)

    def prepare():
        named = {"hidden": hidden, "weight": weight, "ids": ids, "bias": bias, "mask": mask, "gather_ids": gather_ids}
        A.same_device(named)
        if hidden.shape[:-1] != ids.shape:
            raise ValueError(
                f"argument `ids`: shape {list(ids.shape)} does not match hidden's rows {list(hidden.shape[:-1])}"
            )
        if gather_ids is not None:
            check_gather_ids(ids, gather_ids)
        return A.head(hidden, weight, bias)

    h, w, b = _dist.agreed(group, prepare)
    if b is not None and h.device.type == "cuda":
        b = b.float()  # the GPU kernels read the bias in f32
    # Per-row inputs go to the kernels as CPU tensors (on a GPU: one copy each to the host).
    m = None if mask is None else (mask != 0).cpu().contiguous()
    budget = _budget(budget_mib)
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
