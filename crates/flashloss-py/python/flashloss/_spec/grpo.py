"""TRL's GRPO arguments, written once: :class:`GrpoArgs` (every field and default of
``GRPOConfig`` that the loss reads), the loss types, the metrics' order and which
normalizer each loss type divides by. The Rust ``GrpoLossConfig`` is what
:meth:`GrpoArgs.config_json` feeds."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from typing import Optional

from .. import _native
from .bound import Bound
from .filters import SamplerFilters

#: TRL's loss types, in the order of the spec's table.
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")

#: TRL's logged metrics, in the order of the native calls' metrics vector.
METRICS = ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")

#: What each loss type divides its summed token losses by: ``"sequences"`` (B: grpo and sapo
#: as a mean of sequence means, dr_grpo over ``B·max_completion_length``, luspo),
#: ``"tokens"`` (the live token count), or ``"items"`` (``num_items_in_batch`` when given,
#: else the live token count).
NORMALIZERS = {
    "grpo": "sequences",
    "bnpo": "tokens",
    "dr_grpo": "sequences",
    "dapo": "items",
    "cispo": "items",
    "sapo": "sequences",
    "luspo": "sequences",
    "vespo": "items",
}


@dataclass(frozen=True, kw_only=True)
class GrpoArgs(Bound):
    """TRL's GRPO arguments with ``GRPOConfig``'s names (``epsilon_low`` is its
    ``epsilon``; ``epsilon_high=None`` means ``epsilon_low``). Frozen and hashable, so a
    JAX static argument. ``top_k``, ``top_p``, ``min_p`` follow :class:`SamplerFilters`'
    rule and are stored as it leaves them (None where unset); ``num_items_in_batch`` is
    stored as a float (a framework scalar is read once)."""

    loss_type: str = "dapo"
    beta: float = 0.0
    epsilon_low: float = 0.2
    epsilon_high: Optional[float] = None
    delta: Optional[float] = None
    importance_sampling_level: str = "token"
    temperature: float = 1.0
    use_bias_correction_kl: bool = True
    entropy_coef: float = 0.0
    num_items_in_batch: Optional[float] = None
    max_completion_length: Optional[int] = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    min_p: Optional[float] = None

    def __post_init__(self) -> None:
        def put(name, value):
            object.__setattr__(self, name, value)

        for name in ("beta", "epsilon_low", "temperature", "entropy_coef", "sapo_temperature_pos",
                     "sapo_temperature_neg", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg",
                     "vespo_lambda_neg"):  # fmt: skip
            put(name, float(getattr(self, name)))
        for name in ("epsilon_high", "delta", "num_items_in_batch"):
            value = getattr(self, name)
            put(name, None if value is None else float(value))
        if self.max_completion_length is not None:
            put("max_completion_length", int(self.max_completion_length))
        put("use_bias_correction_kl", bool(self.use_bias_correction_kl))
        f = SamplerFilters.of(self.top_k, self.top_p, self.min_p)
        put("top_k", f.top_k)
        put("top_p", f.top_p)
        put("min_p", f.min_p)

    @property
    def eps_high(self) -> float:
        """``epsilon_high``, or ``epsilon_low`` when unset."""
        return self.epsilon_low if self.epsilon_high is None else self.epsilon_high

    @property
    def sequence_level(self) -> bool:
        return self.importance_sampling_level == "sequence"

    @property
    def filters(self) -> SamplerFilters:
        return SamplerFilters(self.top_k, self.top_p, self.min_p)

    @property
    def normalizer(self) -> str:
        """``"sequences"`` or ``"tokens"`` (:data:`NORMALIZERS`, with ``"items"`` resolved:
        ``"given"`` when ``num_items_in_batch`` is, else ``"tokens"``)."""
        kind = NORMALIZERS[self.loss_type]
        if kind == "items":
            return "tokens" if self.num_items_in_batch is None else "given"
        return kind

    def with_filters(self, filters: SamplerFilters) -> "GrpoArgs":
        return replace(self, top_k=filters.top_k, top_p=filters.top_p, min_p=filters.min_p)

    def config_json(self) -> str:
        """The JSON of the Rust ``GrpoLossConfig`` (unset fields left out)."""
        fields = asdict(self)
        fields["epsilon_high"] = self.eps_high
        return json.dumps({k: v for k, v in fields.items() if v is not None})

    def validate(self) -> "GrpoArgs":
        """Raises ``ValueError`` (the native config check's message, naming the argument)
        for a bad configuration: an unknown ``loss_type``, a level the loss type does not
        allow, ``epsilon_low`` outside [0, 1), ``temperature <= 0``, dr_grpo without
        ``max_completion_length``, ... Only the fields ``loss_type`` uses are checked."""
        _native.check_grpo_config(self.config_json())
        return self
