"""The arguments of every flashloss loss, written once and importing neither torch nor
jax: what each argument means, its default and its check. :mod:`flashloss.torch`,
:mod:`flashloss.jax` and the integrations (verl, TRL, Tunix) build their native calls
from it."""

from .ce import REDUCTIONS, CeArgs
from .doc import with_params
from .filters import NO_TOP_K, SamplerFilters
from .grpo import LOSS_TYPES, METRICS, NORMALIZERS, GrpoArgs
from .logprobs import GRPOOutputs, LogprobOutputs, LogprobRequest

__all__ = [
    "LOSS_TYPES",
    "METRICS",
    "NORMALIZERS",
    "NO_TOP_K",
    "REDUCTIONS",
    "CeArgs",
    "GRPOOutputs",
    "GrpoArgs",
    "LogprobOutputs",
    "LogprobRequest",
    "SamplerFilters",
    "with_params",
]
