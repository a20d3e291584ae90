"""The original system's A/B in JAX: one GRPO training step's loss and gradients w.r.t.
the hidden states and the LM head, ``jit(value_and_grad)``, by one of three paths:

- ``baseline``: pure JAX as the original system wrote it (f32 ``h @ W.T``, ``log_softmax``,
  ``take_along_axis``, clipped ratio, k3 KL, masked mean);
- ``tiled``: what a JAX user can write today after MaxText's vocabulary tiling: a
  ``lax.scan`` over vocabulary tiles with an online logsumexp under ``custom_vjp`` (the
  backward recomputes each tile), then the same policy stage;
- ``fused``: :func:`flashloss.jax.linear_grpo_loss` on the FFI handlers (``impl="ffi"``);
- ``pallas``: :func:`flashloss.jax.linear_grpo_loss` on the Pallas TPU kernels
  (``impl="pallas"``; ``interpret: true`` to run them on the CPU).

One path per process (its peak RSS is its own), JSON out: the step time (median after
compile), XLA's compiled ``memory_analysis`` (temp, argument, output bytes; a fused
call's own workspace is outside XLA and shows only in the RSS) and the process's peak
RSS above the inputs. Progress goes to stderr.

``--compile tpu`` runs nothing either: it compiles the step of each of ``pallas`` (its
plan by ``budget_mib``: ``--set budget_mib=4096`` takes the single pass), ``baseline`` and
``tiled`` with libtpu for the TPU chip ``chip`` (``v5e``, ``v6e``, ``v5p``,
``7x``; ``pip install "jax[tpu]"``, no TPU needed) at the same default shape, and prints one
JSON line per step: XLA's temp, argument and output bytes, FLOPs and bytes accessed, and
the roofline time they give on that chip, an estimate (:mod:`flashloss.jax.tpu_compile`).

``--lower tpu`` runs nothing: it lowers the jitted step for TPU from shape-only inputs
(``jax.ShapeDtypeStruct``: nothing large is allocated), by default at the original shape
B=1, T=8192, H=4096, V=151936 (``batch``, ``tokens``, ``hidden``, ``vocab``, ``dtype``
still settable), and prints what the StableHLO module holds: its largest array, the
bytes of its inputs, outputs and intermediates (by count), its ``tpu_custom_call``s,
and whether any array has both the dims ``N = B·T`` and ``V`` (see :func:`module_arrays`).

    python -m flashloss.jax.bench --config configs/jax/fused.yaml [--set tokens=512 ...] [--json OUT]
    python -m flashloss.jax.bench --set impl=pallas --lower tpu
    python -m flashloss.jax.bench --compile tpu --set chip=v6e [--set dtype=float32]
"""

from __future__ import annotations

import argparse
import functools
import json
import resource
import statistics
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import flashloss.jax as fj
from flashloss._config import DEFAULT_BUDGET_MIB, load_yaml
from flashloss._spec import GrpoArgs

DEFAULTS = dict(impl="fused", tokens=2048, hidden=1024, vocab=151936, batch=4, dtype="float32",
                beta=0.04, epsilon=GrpoArgs().epsilon_low, temperature=1.0, warmup=1, repeat=3, vocab_tile=8192,
                budget_mib=DEFAULT_BUDGET_MIB, seed=0, min_length=0.5, interpret=False, chip="v6e")  # fmt: skip
#: The shape ``--lower`` defaults to: the original system's B=1, T=8192, H=4096, V=151936.
LOWER_DEFAULTS = dict(DEFAULTS, tokens=8192, batch=1, hidden=4096, vocab=151936)


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _policy(logp, old, ref, adv, mask, beta, eps):
    """dapo with k3 KL (bias-corrected), the masked token mean."""
    r = jnp.exp(logp - old)
    a = adv[:, None]
    loss = -jnp.minimum(r * a, jnp.clip(r, 1 - eps, 1 + eps) * a)
    d = ref - logp
    loss = loss + beta * (jnp.exp(d) - d - 1) * r
    m = mask.astype(jnp.float32)
    return (loss * m).sum() / jnp.maximum(m.sum(), 1.0)


def baseline_loss(h, w, ids, old, ref, adv, mask, cfg):
    b, t = ids.shape
    z = h.reshape(b * t, -1).astype(jnp.float32) @ w.astype(jnp.float32).T / cfg["temperature"]
    lp = jax.nn.log_softmax(z, axis=-1)
    logp = jnp.take_along_axis(lp, ids.reshape(-1, 1), 1).reshape(b, t)
    return _policy(logp, old, ref, adv, mask, cfg["beta"], cfg["epsilon"])


def _tiles(w, tile):
    v, h = w.shape
    pad = (-v) % tile
    wp = jnp.concatenate([w, jnp.zeros((pad, h), w.dtype)]) if pad else w
    return wp.reshape(-1, tile, h), v


def _tile_logits(x, wt, k, tile, v, inv_t):
    z = (x @ wt.T).astype(jnp.float32) * inv_t
    cols = k * tile + jnp.arange(tile)
    return jnp.where(cols[None, :] < v, z, -jnp.inf), cols


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def tiled_logp(x, w, ids, tile, inv_t):
    return _tiled_fwd(x, w, ids, tile, inv_t)[0]


def _tiled_fwd(x, w, ids, tile, inv_t):
    wt, v = _tiles(w, tile)
    n = x.shape[0]

    def step(carry, kw):
        m, s, tgt = carry
        k, wk = kw
        z, cols = _tile_logits(x, wk, k, tile, v, inv_t)
        m2 = jnp.maximum(m, z.max(1))
        s = s * jnp.exp(m - m2) + jnp.exp(z - m2[:, None]).sum(1)
        hit = cols[None, :] == ids[:, None]
        return (m2, s, tgt + jnp.where(hit, z, 0.0).sum(1)), None

    init = (jnp.full((n,), -jnp.inf), jnp.zeros((n,)), jnp.zeros((n,)))
    (m, s, tgt), _ = jax.lax.scan(step, init, (jnp.arange(wt.shape[0]), wt))
    lse = m + jnp.log(s)
    return tgt - lse, (x, w, ids, lse)


def _tiled_bwd(tile, inv_t, res, g):
    x, w, ids, lse = res
    wt, v = _tiles(w, tile)

    def step(dx, kw):
        k, wk = kw
        z, cols = _tile_logits(x, wk, k, tile, v, inv_t)
        p = jnp.exp(z - lse[:, None])
        dz = (g[:, None] * ((cols[None, :] == ids[:, None]) - p) * inv_t).astype(x.dtype)
        return dx + dz @ wk, dz.T @ x

    dx, dw = jax.lax.scan(step, jnp.zeros_like(x), (jnp.arange(wt.shape[0]), wt))
    return dx, dw.reshape(-1, w.shape[1])[: w.shape[0]], None


tiled_logp.defvjp(_tiled_fwd, _tiled_bwd)


def tiled_loss(h, w, ids, old, ref, adv, mask, cfg):
    b, t = ids.shape
    logp = tiled_logp(h.reshape(b * t, -1), w, ids.reshape(-1), cfg["vocab_tile"], 1.0 / cfg["temperature"])
    return _policy(logp.reshape(b, t), old, ref, adv, mask, cfg["beta"], cfg["epsilon"])


def fused_loss(h, w, ids, old, ref, adv, mask, cfg):
    return fj.linear_grpo_loss(
        h, w, ids, mask, adv, old_per_token_logps=old, ref_per_token_logps=ref, loss_type="dapo",
        beta=cfg["beta"], epsilon_low=cfg["epsilon"], temperature=cfg["temperature"], budget_mib=cfg["budget_mib"],
    )[0]  # fmt: skip


def pallas_loss(h, w, ids, old, ref, adv, mask, cfg):
    return fj.linear_grpo_loss(
        h, w, ids, mask, adv, old_per_token_logps=old, ref_per_token_logps=ref, loss_type="dapo",
        beta=cfg["beta"], epsilon_low=cfg["epsilon"], temperature=cfg["temperature"], impl="pallas",
        interpret=bool(cfg["interpret"]), budget_mib=cfg["budget_mib"],
    )[0]  # fmt: skip


IMPLS = {"baseline": baseline_loss, "tiled": tiled_loss, "fused": fused_loss, "pallas": pallas_loss}


def step_fn(cfg):
    """The jitted step: the loss and its gradients w.r.t. ``hidden`` and ``weight``."""
    loss_fn = IMPLS[cfg["impl"]]
    return jax.jit(jax.value_and_grad(lambda h, w, *rest: loss_fn(h, w, *rest, cfg), argnums=(0, 1)))


def input_structs(cfg) -> tuple:
    """:func:`inputs`' shapes and dtypes (``jax.ShapeDtypeStruct``), nothing allocated."""
    b, n, h, v = cfg["batch"], cfg["tokens"], cfg["hidden"], cfg["vocab"]
    t = n // b
    s, dtype = jax.ShapeDtypeStruct, jnp.dtype(cfg["dtype"])
    f32 = s((b, t), jnp.float32)
    return s((b, t, h), dtype), s((v, h), dtype), s((b, t), jnp.int32), f32, f32, s((b,), jnp.float32), s((b, t), bool)


def inputs(cfg):
    rng = np.random.default_rng(cfg["seed"])
    b, n, h, v = cfg["batch"], cfg["tokens"], cfg["hidden"], cfg["vocab"]
    t = n // b
    dtype = jnp.dtype(cfg["dtype"])
    hid = jnp.asarray(rng.standard_normal((b, t, h), np.float32), dtype)
    w = jnp.asarray(rng.standard_normal((v, h), np.float32) * (1.0 / np.sqrt(h)), dtype)
    ids = jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32)
    base = -float(np.log(v))
    old = jnp.asarray(base + 0.1 * rng.standard_normal((b, t)), jnp.float32)
    ref = jnp.asarray(base + 0.1 * rng.standard_normal((b, t)), jnp.float32)
    adv = jnp.asarray(rng.standard_normal(b), jnp.float32)
    # Each sequence's completion: a length drawn from [min_length·T, T], padding after it.
    lengths = rng.integers(round(cfg["min_length"] * t), t + 1, b)
    mask = jnp.asarray(np.arange(t)[None, :] < lengths[:, None])
    return hid, w, ids, old, ref, adv, mask


def run(cfg) -> dict:
    args = inputs(cfg)
    jax.block_until_ready(args)
    rss_inputs = _rss_bytes()
    step = step_fn(cfg)
    compiled = step.lower(*args).compile()
    mem = compiled.memory_analysis()
    times = []
    for k in range(cfg["warmup"] + cfg["repeat"]):
        start = time.perf_counter()
        loss, grads = compiled(*args)
        jax.block_until_ready((loss, grads))
        if k >= cfg["warmup"]:
            times.append(time.perf_counter() - start)
        print(
            f"{cfg['impl']}: step {k + 1}/{cfg['warmup'] + cfg['repeat']} {times[-1] if times else 0:.3f} s",
            file=sys.stderr,
        )
    return {
        "impl": cfg["impl"],
        "config": cfg,
        "loss": float(loss),
        "step_seconds_median": statistics.median(times),
        "step_seconds": times,
        "temp_bytes": int(mem.temp_size_in_bytes),
        "argument_bytes": int(mem.argument_size_in_bytes),
        "output_bytes": int(mem.output_size_in_bytes),
        "peak_rss_above_inputs_bytes": _rss_bytes() - rss_inputs,
        "logits_bytes_f32": 4 * cfg["tokens"] * cfg["vocab"],
        "devices": str(jax.devices()),
    }


#: Bytes of an element of an MLIR element type (``i1``, a bool, takes a byte).
_ELEMENT_BYTES = {"i1": 1, "i8": 1, "ui8": 1, "bf16": 2, "f16": 2, "i16": 2, "ui16": 2, "f32": 4, "i32": 4, "ui32": 4,
                  "f64": 8, "i64": 8, "ui64": 8}  # fmt: skip


def _array(t) -> tuple[tuple[int, ...], str, int] | None:
    """``(shape, dtype, bytes)`` of an MLIR type, or None when it is not a ranked tensor."""
    from jax._src.lib.mlir import ir

    if not isinstance(t, ir.RankedTensorType):
        return None
    tensor = t
    shape, dtype = tuple(tensor.shape), str(tensor.element_type)
    size = 1
    for d in shape:
        size *= d
    return shape, dtype, size * _ELEMENT_BYTES.get(dtype, 4)


def module_arrays(module, n: int, v: int, b: int = 1, t: int | None = None) -> dict:
    """What a lowered StableHLO ``module`` (``ir.Module``) holds, from the tensor types of
    every op's results and every function's (and region's) arguments; a
    ``tpu_custom_call``'s kernel is an opaque attribute, so its VMEM tiles are not here.

    - ``largest_array``: shape, dtype and bytes of the largest value;
    - ``input_bytes`` / ``output_bytes``: ``main``'s arguments and results;
    - ``intermediate_bytes_by_count``: the sum over op results that are not ``main``'s
      outputs (followed through the calls that return them), each op counted once (a loop
      body once, a function once; a ``func.call``'s results are its callee's, not counted
      again). An upper bound of the temporaries, not a peak: XLA fuses most of them away
      and reuses buffers;
    - ``custom_call_targets`` (with ``tpu_custom_call`` counted in ``tpu_custom_calls``);
    - ``has_NxV``: whether a value has both the dims ``n`` (``B·T``; or ``b`` and ``t``) and
      ``v``, with ``NxV_shapes`` the distinct shapes of those values."""
    from jax._src.lib.mlir import ir

    t = n // b if t is None else t
    values: list[tuple[tuple[int, ...], str, int]] = []  # every op result and region argument
    results: list = []  # (value, array) of every op result but a call's
    main_args: list = []
    returns: dict[str, list] = {}  # function name -> its returned values
    targets: dict[str, int] = {}

    def symbol(attr) -> str:
        return str(attr).strip('"').lstrip("@")

    def visit(op) -> Any:
        name = op.name
        for region in op.regions:
            for block in region.blocks:
                for arg in block.arguments:
                    a = _array(arg.type)
                    if a is not None:
                        values.append(a)
                        if name == "func.func" and str(op.attributes["sym_name"]).strip('"') == "main":
                            main_args.append(a)
        if name == "func.return":
            returns[symbol(op.parent.attributes["sym_name"])] = list(op.operands)
        if name == "stablehlo.custom_call":
            target = str(op.attributes["call_target_name"]).strip('"')
            targets[target] = targets.get(target, 0) + 1
        for r in op.results:
            a = _array(r.type)
            if a is not None:
                values.append(a)
                if name != "func.call":
                    results.append((r, a))
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    largest = max(values, key=lambda a: a[2])
    outputs = [x for x in (_array(o.type) for o in returns["main"]) if x is not None]
    produced, todo = set(), list(returns["main"])  # the values main returns, through calls
    while todo:
        value = todo.pop()
        produced.add(value)
        owner = value.owner
        if isinstance(value, ir.OpResult) and owner.name == "func.call":
            todo.append(returns[symbol(owner.attributes["callee"])][value.result_number])

    def has_nv(shape: tuple[int, ...]) -> bool:
        return v in shape and (n in shape or (b in shape and t in shape and b * t == n))

    nxv = sorted({(a[0], a[1]) for a in values if has_nv(a[0])})
    return {
        "largest_array": {"shape": list(largest[0]), "dtype": largest[1], "bytes": largest[2]},
        "input_bytes": sum(a[2] for a in main_args),
        "output_bytes": sum(a[2] for a in outputs),
        "intermediate_bytes_by_count": sum(a[2] for r, a in results if r not in produced),
        "intermediate_bytes_note": "sum over the module's op results that are not main's outputs, each op once: an "
        "upper bound of the temporaries (XLA fuses and reuses buffers), not a peak",
        "tpu_custom_calls": targets.get("tpu_custom_call", 0),
        "custom_call_targets": targets,
        "has_NxV": bool(nxv),
        "NxV_shapes": [{"shape": list(s), "dtype": d} for s, d in nxv],
    }


def lower(cfg, platform: str = "tpu") -> dict:
    """Lower the jitted step for ``platform`` from shape-only inputs (nothing runs, nothing
    large is allocated) and describe the module (:func:`module_arrays`)."""
    if cfg["impl"] == "fused" and platform == "tpu":
        raise ValueError(
            "impl: fused (flashloss's XLA FFI handlers, registered for CPU and CUDA) cannot lower for TPU: "
            "use impl=pallas (or baseline, tiled)"
        )
    start = time.perf_counter()
    lowered = step_fn(cfg).trace(*input_structs(cfg)).lower(lowering_platforms=(platform,))
    module = lowered.compiler_ir("stablehlo")
    seconds = time.perf_counter() - start
    b, n, v = cfg["batch"], cfg["tokens"], cfg["vocab"]
    return {
        "impl": cfg["impl"],
        "lowered_for": platform,
        "config": cfg,
        "N": n,
        "V": v,
        **module_arrays(module, n, v, b),
        "logits_bytes_f32": 4 * n * v,
        "lower_seconds": round(seconds, 3),
    }


def compile_tpu(cfg) -> list[dict]:
    """Each of the ``pallas``, ``baseline`` and ``tiled`` steps compiled for TPU ``chip``
    from shape-only inputs (:func:`flashloss.jax.tpu_compile.compile_case`): one row each."""
    from . import tpu_compile  # needs libtpu: imported only here

    rows = []
    for impl in ("pallas", "baseline", "tiled"):
        step_cfg = dict(cfg, impl=impl)
        # the Pallas step's plan is within budget_mib (two-pass: 64 MiB at the original shape)
        bound = max(tpu_compile.HEAD_TEMP_BOUND, int(cfg["budget_mib"] * tpu_compile.MIB)) if impl == "pallas" else None
        case = tpu_compile.Case(
            impl, step_fn(step_cfg), lambda devs: tpu_compile.placed(devs, input_structs(cfg)), bound
        )
        rows.append({**tpu_compile.compile_case(case, cfg["chip"]), "config": step_cfg})
    return rows


def load(path, overrides, defaults: dict | None = None):
    cfg = load_yaml(path, overrides, DEFAULTS if defaults is None else defaults)
    if cfg["impl"] not in IMPLS:
        raise ValueError(f"impl: expected one of {sorted(IMPLS)}, got {cfg['impl']!r}")
    if not 0.0 <= cfg["min_length"] <= 1.0:
        raise ValueError(f"min_length: expected a fraction of T in [0, 1], got {cfg['min_length']!r}")
    if cfg["tokens"] % cfg["batch"]:
        raise ValueError(f"tokens: {cfg['tokens']} is not a multiple of batch {cfg['batch']}")
    return cfg


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--json", metavar="OUT")
    p.add_argument("--lower", choices=("tpu",), help="lower the step for TPU (B=1, T=8192, H=4096, V=151936 unless "
                   "set) and describe its StableHLO module; nothing runs")  # fmt: skip
    p.add_argument("--compile", choices=("tpu",), help="compile the pallas, baseline and tiled steps for TPU "
                   "chip `chip` with libtpu (the --lower shape) and print XLA's memory and cost figures; "
                   "nothing runs")  # fmt: skip
    a = p.parse_args(argv)
    shape_only = a.lower or a.compile
    cfg = load(a.config, a.set, LOWER_DEFAULTS if shape_only else DEFAULTS)
    what = f"lower for {a.lower}" if a.lower else f"compile for {cfg['chip']}" if a.compile else "run"
    print(f"bench: {what} {cfg['impl']} B={cfg['batch']} N={cfg['tokens']} H={cfg['hidden']} V={cfg['vocab']} "
          f"{cfg['dtype']}", file=sys.stderr)  # fmt: skip
    if a.compile:
        rows = compile_tpu(cfg)
        text = "\n".join(json.dumps(r) for r in rows)
        print(text)
        if a.json:
            with open(a.json, "w") as f:
                f.write(text + "\n")
        return
    result = lower(cfg, a.lower) if a.lower else run(cfg)
    text = json.dumps(result)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
