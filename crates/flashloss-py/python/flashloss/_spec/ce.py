"""Cut Cross-Entropy's arguments, written once: :class:`CeArgs`, what the Rust
``CeConfig`` takes."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Optional

from .. import _native
from .bound import Bound

#: ``reduction``'s values.
REDUCTIONS = ("mean", "sum", "none")


@dataclass(frozen=True, kw_only=True)
class CeArgs(Bound):
    """The cross-entropy's options (Cut Cross-Entropy's names): rows whose target is
    ``ignore_index`` take no part; ``label_smoothing`` ε, ``z_loss`` λ, ``softcap``,
    ``reduction``, ``temperature`` (docs/spec/losses.md)."""

    ignore_index: int = -100
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    softcap: Optional[float] = None
    reduction: str = "mean"
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"argument `reduction`: expected 'mean', 'sum' or 'none', got {self.reduction!r}")
        object.__setattr__(self, "ignore_index", int(self.ignore_index))
        for name in ("label_smoothing", "z_loss", "temperature"):
            object.__setattr__(self, name, float(getattr(self, name)))
        if self.softcap is not None:
            object.__setattr__(self, "softcap", float(self.softcap))

    def config_json(self) -> str:
        """The JSON of the Rust ``CeConfig`` (unset fields left out)."""
        return json.dumps({k: v for k, v in asdict(self).items() if v is not None})

    def validate(self) -> "CeArgs":
        """Raises ``ValueError`` (the native config check's message) for a bad config."""
        _native.check_ce_config(self.config_json())
        return self
