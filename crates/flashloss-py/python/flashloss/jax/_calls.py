"""One frozen call per loss: the statics of one ``flashloss.jax`` call, built once by the
public function after it has checked its arguments, and handed with the arrays to the
path's implementation (:data:`flashloss.jax._paths.PATHS`). Every implementation reads
what it needs from the call; none takes a loose static argument.

- :class:`LinearGrpoCall`: ``linear_grpo_loss`` (the fused GRPO loss from the head);
- :class:`LogitsGrpoCall`: ``grpo_loss`` (reduced, and ``reduce=False``'s rows);
- :class:`CeCall`: ``linear_cross_entropy``;
- :class:`LogprobCall`: ``linear_logprobs``.

``interpret`` (the Pallas kernels' interpret mode, or ``False``) is in each call, since
the dispatch's ``auto`` reads it too; ``support`` is the sampler's filters as the kernels
take them (:class:`flashloss.jax._head.Filters`, each None where it keeps
everything), or None."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from .._spec import CeArgs, GrpoArgs, LogprobRequest
from ._head import Transform, active


@dataclass(frozen=True, kw_only=True)
class _Head:
    """What every call over the LM head holds: the head's layout, the mesh axis its
    vocabulary is split over (or None), the whole vocabulary ``V``, the FFI path's plan
    (``mode``, ``budget`` in MiB, None: unset, the backend's default) and the Pallas path's
    ``interpret``."""

    weight_layout: str
    vocab_axis: Optional[str]
    vocab: int
    mode: str
    budget: Optional[float]
    interpret: Any = False
    #: Whether the caller passed ``budget_mib`` (else the Pallas path takes its chip's).
    budget_given: bool = True


@dataclass(frozen=True, kw_only=True)
class LinearGrpoCall(_Head):
    """``linear_grpo_loss``'s statics: the validated :class:`GrpoArgs` (with the filters
    resolved against ``V``), the support, and ``token_axis`` (the Pallas path then takes
    the two kernels' plan)."""

    args: GrpoArgs
    support: Optional[Any] = None
    token_axis: Optional[str] = None

    @property
    def temperature(self) -> float:
        return float(self.args.temperature)

    @property
    def config(self) -> str:
        """The native ``GrpoLossConfig`` JSON."""
        return self.args.config_json()

    @property
    def transform(self) -> Transform:
        return Transform(self.temperature, None)


@dataclass(frozen=True, kw_only=True)
class LogitsGrpoCall:
    """``grpo_loss``'s statics on materialized logits: the validated :class:`GrpoArgs`."""

    args: GrpoArgs
    interpret: Any = False

    @property
    def config(self) -> str:
        return self.args.config_json()


@dataclass(frozen=True, kw_only=True)
class CeCall(_Head):
    """``linear_cross_entropy``'s statics: the validated :class:`CeArgs`."""

    args: CeArgs

    @property
    def config(self) -> str:
        return self.args.config_json()


@dataclass(frozen=True, kw_only=True)
class LogprobCall(_Head):
    """``linear_logprobs``' statics: the :class:`LogprobRequest`, the support (None when
    no filter was named; all-None filters when named but keeping everything) and the
    sequence length (the Pallas path's run-time checks name a token by it)."""

    request: LogprobRequest
    support: Optional[Any] = None
    seq_len: int = 1

    @property
    def temperature(self) -> float:
        return self.request.temperature

    @property
    def transform(self) -> Transform:
        return Transform(self.temperature, None)

    @property
    def filtered(self) -> bool:
        """Whether a filter drops anything (else the full softmax's ``logp``)."""
        return active(self.support) is not None
