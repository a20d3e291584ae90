"""Errors in the caller's names. The native core names its arguments as Rust does
(``target_ids``, ``mask``, ``old_logp``, ...), and a drop-in runs flashloss's functions
under flashloss's names (``hidden``, ``weight``, ``completion_ids``, ...). An error that
names one of them is re-raised, with its type and traceback, naming the argument the
caller passed: ``completion_ids`` to a caller of ``linear_grpo_loss``, ``targets`` of
``linear_cross_entropy``, ``ids`` of ``linear_logprobs``; Liger's ``_input`` and verl's
``hidden_states`` to a caller of the drop-ins::

    try:
        ...
    except (ValueError, TypeError) as e:
        in_caller_names(e, NAMES)
        raise
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Callable, TypeVar

T = TypeVar("T")

_ARGUMENT = re.compile(r"argument `([A-Za-z_][A-Za-z0-9_]*)`")

#: The core's argument names -> those of each public function's (``grpo``: ``linear_grpo_loss``
#: and ``grpo_loss``; ``ce``: ``linear_cross_entropy``; ``logprobs``: ``linear_logprobs``).
CORE_NAMES: dict[str, dict[str, str]] = {
    "grpo": {
        "target_ids": "completion_ids",
        "mask": "completion_mask",
        "old_logp": "old_per_token_logps",
        "ref_logp": "ref_per_token_logps",
    },
    "ce": {"target_ids": "targets"},
    "logprobs": {"target_ids": "ids"},
}


def in_caller_names(error: BaseException, names: Mapping[str, str]) -> None:
    """Rewrites ``error``'s message in place: ``argument `x``` becomes ``argument `names[x]```
    (``x`` where it is not in ``names``)."""
    if error.args and isinstance(error.args[0], str):
        message = _ARGUMENT.sub(lambda m: f"argument `{names.get(m.group(1), m.group(1))}`", error.args[0])
        error.args = (message, *error.args[1:])


def native(api: str, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` (a ``flashloss._native`` function), its errors in the names of ``api``'s
    public function (:data:`CORE_NAMES`)."""
    try:
        return fn(*args)
    except (ValueError, TypeError) as e:
        in_caller_names(e, CORE_NAMES[api])
        raise
