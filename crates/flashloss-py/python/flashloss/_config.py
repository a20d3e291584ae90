"""The JSON configs the native losses take (the Rust ``GrpoLossConfig`` and
``CeConfig``), built from TRL's and Cut Cross-Entropy's argument names; shared by
:mod:`flashloss.torch` and :mod:`flashloss.jax`, importing neither framework."""

from __future__ import annotations

import json
from typing import Any, Optional

#: Workspace budget of the fused kernels (MiB) when a call gives none: the CLI's default.
DEFAULT_BUDGET_MIB = 160.0


def _json(**kw: Any) -> str:
    return json.dumps({k: v for k, v in kw.items() if v is not None})


def sampler_filters(top_k, top_p, min_p) -> tuple:
    """The sampler's ``(top_k, top_p, min_p)`` with TRL's and vLLM's unset values
    (``top_k`` 0, ``top_p`` 1, ``min_p`` 0) as None; ``top_k`` must be an integer >= 0 (a
    ``ValueError`` naming it); the other ranges are the kernel config's to check."""
    if top_k is not None and (isinstance(top_k, bool) or int(top_k) != top_k or top_k < 0):
        raise ValueError(f"argument `top_k`: must be an integer >= 0 (None or 0: no top-k), got {top_k!r}")
    return (
        None if not top_k else int(top_k),
        None if top_p is None or float(top_p) == 1.0 else float(top_p),
        None if min_p is None or float(min_p) == 0.0 else float(min_p),
    )


def grpo_config(
    loss_type: str,
    beta: float,
    epsilon_low: float,
    epsilon_high: Optional[float],
    delta: Optional[float],
    importance_sampling_level: str,
    temperature: float,
    use_bias_correction_kl: bool,
    entropy_coef: float,
    num_items_in_batch: Any,
    max_completion_length: Optional[int],
    sapo_temperature_pos: float,
    sapo_temperature_neg: float,
    vespo_k_pos: float,
    vespo_lambda_pos: float,
    vespo_k_neg: float,
    vespo_lambda_neg: float,
    *,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    min_p: Optional[float] = None,
) -> str:
    """TRL's GRPO arguments as the JSON of ``GrpoLossConfig`` (``epsilon_high=None``
    means ``epsilon_low``; ``num_items_in_batch`` may be a framework scalar). ``top_k``,
    ``top_p``, ``min_p``: the sampler's truncation (``None``, ``top_k=0``, ``top_p=1`` and
    ``min_p=0`` are unset, as in TRL and vLLM); the ranges are checked by the kernel's
    config."""
    top_k, top_p, min_p = sampler_filters(top_k, top_p, min_p)
    return _json(
        loss_type=loss_type,
        beta=float(beta),
        epsilon_low=float(epsilon_low),
        epsilon_high=float(epsilon_low if epsilon_high is None else epsilon_high),
        delta=None if delta is None else float(delta),
        importance_sampling_level=importance_sampling_level,
        temperature=float(temperature),
        use_bias_correction_kl=bool(use_bias_correction_kl),
        entropy_coef=float(entropy_coef),
        num_items_in_batch=None if num_items_in_batch is None else float(num_items_in_batch),
        max_completion_length=None if max_completion_length is None else int(max_completion_length),
        sapo_temperature_pos=float(sapo_temperature_pos),
        sapo_temperature_neg=float(sapo_temperature_neg),
        vespo_k_pos=float(vespo_k_pos),
        vespo_lambda_pos=float(vespo_lambda_pos),
        vespo_k_neg=float(vespo_k_neg),
        vespo_lambda_neg=float(vespo_lambda_neg),
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
    )


def ce_config(
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: Optional[float],
    reduction: str,
    temperature: float,
) -> str:
    """Cut Cross-Entropy's arguments as the JSON of ``CeConfig``."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"argument `reduction`: expected 'mean', 'sum' or 'none', got {reduction!r}")
    return _json(
        ignore_index=int(ignore_index),
        label_smoothing=float(label_smoothing),
        z_loss=float(z_loss),
        softcap=None if softcap is None else float(softcap),
        reduction=reduction,
        temperature=float(temperature),
    )


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
