"""The sampler's filters (vLLM V1's ``top_k``, ``top_p``, ``min_p``) under one rule, for
every loss and both bindings: ``top_k`` None, 0 or -1, ``top_p`` None or 1 and ``min_p``
None or 0 are unset (as vLLM and TRL have them); anything else out of range is a
``ValueError`` naming the argument."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from .bound import Bound

#: The values of ``top_k`` that mean "no top-k" (besides None), as vLLM and TRL take them.
NO_TOP_K = (0, -1)


def _top_k(top_k) -> Optional[int]:
    if top_k is None:
        return None
    if isinstance(top_k, bool) or int(top_k) != top_k or (top_k < 1 and top_k not in NO_TOP_K):
        raise ValueError(f"argument `top_k`: must be an integer >= 1 (None, 0 or -1: no top-k), got {top_k!r}")
    return None if top_k in NO_TOP_K else int(top_k)


def _top_p(top_p) -> Optional[float]:
    if top_p is None:
        return None
    if not 0.0 < float(top_p) <= 1.0:  # NaN fails too
        raise ValueError(f"argument `top_p`: must be in (0, 1] (None or 1: no top-p), got {top_p!r}")
    return None if float(top_p) == 1.0 else float(top_p)


def _min_p(min_p) -> Optional[float]:
    if min_p is None:
        return None
    if math.isnan(float(min_p)) or not 0.0 <= float(min_p) <= 1.0:
        raise ValueError(f"argument `min_p`: must be in [0, 1] (None or 0: no min-p), got {min_p!r}")
    return None if float(min_p) == 0.0 else float(min_p)


@dataclass(frozen=True)
class SamplerFilters(Bound):
    """The sampler's filters, checked, each None where it is unset (build with
    :meth:`of`). A ``top_k`` at or above the vocabulary also keeps everything; only the
    kernels know the vocabulary, so it stays set here."""

    top_k: Optional[int] = None
    top_p: Optional[float] = None
    min_p: Optional[float] = None

    @classmethod
    def of(cls, top_k=None, top_p=None, min_p=None) -> "SamplerFilters":
        """The filters of a call's ``top_k``, ``top_p``, ``min_p`` under the one rule."""
        return cls(_top_k(top_k), _top_p(top_p), _min_p(min_p))

    @staticmethod
    def asked(top_k=None, top_p=None, min_p=None) -> bool:
        """Whether a call named any filter (even an unset value): ``linear_logprobs`` then
        returns ``outside_support``."""
        return any(x is not None for x in (top_k, top_p, min_p))

    @property
    def truncates(self) -> bool:
        """Whether any filter is set (the support may drop tokens)."""
        return any(x is not None for x in (self.top_k, self.top_p, self.min_p))
