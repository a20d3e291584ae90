"""What a ``linear_logprobs`` call asks for, and what the losses return, written once:
:class:`LogprobRequest`, :class:`LogprobOutputs`, :class:`GRPOOutputs`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple, Optional

from .bound import Bound
from .filters import SamplerFilters


@dataclass(frozen=True, kw_only=True)
class LogprobRequest(Bound):
    """The scaling and the outputs asked beyond ``logp``: ``temperature``, the entropy, the
    log-sum-exp, the largest scaled logit, ``Σp²``, and the sampler's filters (``support``
    None when the call named none; else :class:`SamplerFilters`, which may keep everything,
    and ``outside_support`` is returned)."""

    temperature: float = 1.0
    return_entropy: bool = False
    return_lse: bool = False
    return_max: bool = False
    return_sum_p2: bool = False
    support: Optional[SamplerFilters] = None

    @classmethod
    def of_bound(cls, bound: Mapping[str, Any]) -> "LogprobRequest":
        """The request of a call's bound arguments (``locals()``): its flags, and its filters
        under :class:`SamplerFilters`' rule (``support`` None when it named none)."""
        named = SamplerFilters.fields_of(bound)
        support = SamplerFilters.of(**named) if SamplerFilters.asked(**named) else None
        return cls(**{k: v for k, v in cls.fields_of(bound).items() if k != "support"}, support=support)

    def __post_init__(self) -> None:
        object.__setattr__(self, "temperature", float(self.temperature))

    @property
    def filters(self) -> SamplerFilters:
        """The filters (all unset when none was named)."""
        return SamplerFilters() if self.support is None else self.support


class LogprobOutputs(NamedTuple):
    """What ``linear_logprobs`` returns, in either binding (float32 arrays or tensors of
    ``ids``' shape; None for what was not asked)."""

    #: ``logp = s_y - lse`` (under the truncated support when a filter is set).
    logp: Any
    #: The entropy (``return_entropy``).
    entropy: Optional[Any] = None
    #: ``lse = logsumexp_j s_j`` (``return_lse``; differentiable).
    lse: Optional[Any] = None
    #: ``max_j s_j`` (``return_max``; not differentiated).
    max_logit: Optional[Any] = None
    #: ``Σ_j p_j²`` (``return_sum_p2``; not differentiated).
    sum_p2: Optional[Any] = None
    #: ``s_k - lse`` at ``gather_ids`` ``[..., K]`` (``gather_ids``' shape; differentiable).
    gathered_logp: Optional[Any] = None
    #: Whether each target is outside the truncated support (bool; a filter named), where
    #: ``logp`` is ``-inf``.
    outside_support: Optional[Any] = None


@dataclass
class GRPOOutputs:
    """What a GRPO call returns besides the loss, in either binding (no gradient flows
    through it)."""

    #: Per-token log-probabilities of ``completion_ids`` ``[B, T]`` (float32).
    logp: Any
    #: Per-token entropy ``[B, T]`` (float32).
    entropy: Any
    #: Per-token KL as it enters the loss ``[B, T]`` (float32; zero without a reference
    #: or at ``beta=0``).
    kl: Any
    #: TRL's logged metrics, named as ``flashloss._spec.METRICS`` (0-d float32 arrays or tensors in either binding,
    #: ``float()`` them to log).
    metrics: dict
    #: Under ``top_k``/``top_p``/``min_p``: whether each token's target is outside the
    #: sampler's truncated support ``[B, T]`` (bool; such tokens were masked); else None.
    outside_support: Optional[Any] = None
