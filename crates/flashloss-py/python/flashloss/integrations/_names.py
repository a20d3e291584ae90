"""Errors in the caller's names. A drop-in runs flashloss's functions under flashloss's
argument names (``hidden``, ``weight``, ``completion_ids``, ...); an error that names one
of them is re-raised, with its type and traceback, naming the argument the caller of the
drop-in passed (Liger's ``_input``, verl's ``hidden_states``, ...)::

    try:
        ...
    except (ValueError, TypeError) as e:
        in_caller_names(e, NAMES)
        raise
"""

from __future__ import annotations

import re
from collections.abc import Mapping

_ARGUMENT = re.compile(r"argument `([A-Za-z_][A-Za-z0-9_]*)`")


def in_caller_names(error: BaseException, names: Mapping[str, str]) -> None:
    """Rewrites ``error``'s message in place: ``argument `x``` becomes ``argument `names[x]```
    (``x`` where it is not in ``names``)."""
    if error.args and isinstance(error.args[0], str):
        message = _ARGUMENT.sub(lambda m: f"argument `{names.get(m.group(1), m.group(1))}`", error.args[0])
        error.args = (message, *error.args[1:])
