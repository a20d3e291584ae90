"""Tunix's GRPO train step compiled for a TPU on a host without one, with and without
:func:`flashloss.tunix.patch`: XLA's memory and cost analysis of each.

The model is Tunix's Qwen2 (``tunix.models.qwen2``) built from shapes only
(``nnx.eval_shape``, nothing allocated), by default at Qwen2.5-0.5B's size (V = 151936,
H = 896, 24 layers, tied embedding). The step is :func:`flashloss.tunix.ab.compile_train_step`
(the registered ``"grpo"`` policy loss, its gradient and the AdamW update), compiled by
libtpu (``pip install "jax[tpu]"``) for one chip of a TPU topology, the Pallas kernels
choosing that chip's blocks (:func:`flashloss.jax.pallas.target_chip`). Nothing runs on a
TPU. One JSON line per arm: temp, argument, output and alias bytes, the peak they make,
FLOPs, bytes accessed, compile seconds, and the shapes in the compiled step whose last axis
is the vocabulary (Tunix's logits; none when patched)::

    python -m flashloss.tunix.tpu_memory [--set KEY=VALUE ...] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from typing import Any, Optional

from flashloss._config import load_yaml
from flashloss.integrations.tunix import _task, ab

DEFAULTS: dict[str, Any] = {
    "chip": "v6e",  # of flashloss.jax.tpu_compile.TOPOLOGIES
    "arms": "tunix,flashloss",  # "tunix": Tunix's own step; "flashloss": patched
    "flashloss_mode": "auto",
    "seed": 0,
    # model: Qwen2.5-0.5B's shape (tunix.models.qwen2.ModelConfig.qwen2p5_0p5b)
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "tie_word_embeddings": True,
    "dtype": "float32",
    "remat": "decoder",  # each layer recomputed in the backward; "none" (Tunix's default) nears v6e's 32 GiB
    "init_embedding_std": None,
    # batch: prompts_per_step x group_size completions of max_new_tokens after prompt_len
    "prompts_per_step": 1,
    "group_size": 8,
    "prompt_len": 256,
    "max_new_tokens": 1024,
    "temperature": 1.0,
    # GRPO and AdamW, as ab.py
    "lr": 1.0e-4,
    "max_grad_norm": 1.0,
    "beta": 0.04,
    "epsilon": 0.2,
    "loss_algo": "grpo",
    "loss_agg_mode": "sequence-mean-token-mean",
    "kl_loss_mode": "low_var_kl",
}


def compile_arm(cfg: dict, arm: str) -> dict:
    """Compiles the train step of ``arm`` (``tunix`` or ``flashloss``) for ``cfg["chip"]``:
    one result line (see the module)."""
    import jax
    import numpy as np
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import flashloss.tunix as ft
    from flashloss.jax.pallas import target_chip
    from flashloss.jax.tpu_compile import devices

    if arm not in ("tunix", "flashloss"):
        raise ValueError(f"arms: expected tunix or flashloss, got {arm!r}")
    if ft.is_patched():
        raise ValueError("flashloss.tunix is already patched in this process")
    sharding = NamedSharding(Mesh(np.array(devices(cfg["chip"])[:1]), ("x",)), P())
    model = nnx.eval_shape(lambda: ab._model(cfg, cfg["seed"]))
    row = {"chip": cfg["chip"], "arm": arm, "completions": cfg["prompts_per_step"] * cfg["group_size"]}
    row.update({k: cfg[k] for k in ("prompt_len", "max_new_tokens", "num_hidden_layers", "dtype", "remat")})
    start = time.perf_counter()
    if arm == "flashloss":
        ft.patch(mode=cfg["flashloss_mode"])
    try:
        with target_chip(cfg["chip"]):
            compiled = ab.compile_train_step(
                model, cfg, ab.algo_config(cfg), _task.CharTokenizer(), prompt_len=cfg["prompt_len"], sharding=sharding
            )  # fmt: skip
    except jax.errors.JaxRuntimeError as e:  # the compiler's own message is the result (an HBM overflow)
        return {**row, "ok": False, "compile_seconds": round(time.perf_counter() - start, 1),
                "error": str(e).splitlines()[0][:400]}  # fmt: skip
    finally:
        ft.unpatch()
    seconds = time.perf_counter() - start
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    v = cfg["vocab_size"]
    vocab_shapes = sorted(set(re.findall(rf"\w+\[(?:\d+,)+{v}\]", compiled.as_text())))
    return {
        **row,
        "ok": True,
        **ab.memory_row(compiled),
        "flops": float(cost.get("flops", 0.0)),
        "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
        "compile_seconds": round(seconds, 1),
        "vocab_last_axis_shapes": vocab_shapes,
    }


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flashloss.tunix.tpu_memory", description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a key of DEFAULTS")
    ap.add_argument("--json", metavar="OUT", help="also append the lines to OUT")
    args = ap.parse_args(argv)
    try:
        cfg = load_yaml(None, args.set, DEFAULTS)
        for arm in str(cfg["arms"]).split(","):
            line = json.dumps(compile_arm(cfg, arm))
            print(line, flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(line + "\n")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    sys.exit(main())
