"""The workspace budget's default and the YAML configs of the bench and gradcheck
scripts; shared by :mod:`flashloss.torch` and :mod:`flashloss.jax`, importing neither
framework (the losses' arguments are :mod:`flashloss._spec`'s)."""

from __future__ import annotations

from typing import Optional

from . import _native

#: Workspace budget of the fused kernels (MiB) on the CPU when a call gives none: the Rust
#: plan's default (``fused/plan.rs::DEFAULT_BUDGET_MIB``, the one place it is written). On
#: CUDA a call without a budget plans from the device's memory (``gpu_plan::default_budget``).
DEFAULT_BUDGET_MIB: float = _native.defaults()["budget_mib"]


def budget_or_unset(given: Optional[float]) -> Optional[float]:
    """A call's ``budget_mib`` for the native side: the one given, else None, which the
    native spec leaves out: unset, the backend's default (the CPU's
    :data:`DEFAULT_BUDGET_MIB`; on CUDA a share of the device's free memory within half the
    unfused path's peak)."""
    return None if given is None else float(given)


def load_yaml(path: Optional[str], overrides: list, defaults: dict) -> dict:
    """``defaults`` updated from the YAML file at ``path`` and ``KEY=VALUE`` overrides
    (as ``--set``); unknown keys are errors naming them. A float key given ``1e-2`` (which
    YAML reads as a string) is read as a number."""
    import yaml

    cfg = dict(defaults)
    if path:
        with open(path) as f:
            cfg.update(yaml.safe_load(f) or {})
    unknown = set(cfg) - set(defaults)
    if unknown:
        raise ValueError(f"{path}: unknown keys {sorted(unknown)}")
    for item in overrides:
        key, _, value = item.partition("=")
        if key not in defaults:
            raise ValueError(f"--set {key}: unknown key (known: {', '.join(defaults)})")
        cfg[key] = yaml.safe_load(value)
        if isinstance(defaults[key], float) and isinstance(cfg[key], (int, str)):
            cfg[key] = float(cfg[key])
    return cfg
