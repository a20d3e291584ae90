"""The one spec of a native call: what every ``flashloss._native`` function and every
JAX FFI handler takes beside its arrays, built here once and parsed once in Rust
(``crates/flashloss-py/src/spec.rs``). It is a JSON object::

    {"config": {...}, "mode": "auto", "budget_mib": 160.0, "grad_output": 1.0,
     "head_grad": "full", "weight_layout": "vh", "temperature": 1.0, ...}

``config`` is the loss's config (the JSON of ``GrpoArgs.config_json()`` or
``CeArgs.config_json()``, embedded as it is); each other field is given where the call
takes it, and an unknown field is an error naming it."""

from __future__ import annotations

import json
import math
from typing import Optional


def _value(name: str, v) -> str:
    if hasattr(v, "item") and not isinstance(v, str):  # a NumPy or 0-d array scalar
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        # JSON has no NaN or inf: the Rust side names the field in its error.
        return json.dumps(repr(v))
    return json.dumps(v)


def call_spec(config: Optional[str] = None, **fields) -> str:
    """The JSON spec of one native call: ``config`` (a loss config's JSON text) and
    ``fields`` (those that are None left out)."""
    parts = [] if config is None else [f'"config": {config}']
    parts += [f"{json.dumps(k)}: {_value(k, v)}" for k, v in fields.items() if v is not None]
    return "{" + ", ".join(parts) + "}"
