"""Compile flashloss's Pallas steps with the real XLA TPU compiler on a host without a TPU.

libtpu (``pip install "jax[tpu]"``) compiles for a TPU topology described by name
(``jax.experimental.topologies``): XLA's TPU compiler and Mosaic run on the host, so a
kernel whose blocks overflow the chip's VMEM fails here as it would on the chip, and
``memory_analysis()`` / ``cost_analysis()`` give the compiled step's temporaries, FLOPs and
bytes. Nothing runs: compiled for a TPU is not run on one.

Each :class:`Case` is one ``jit(value_and_grad)`` step at shape-only inputs
(``jax.ShapeDtypeStruct`` on the topology's devices, nothing allocated), compiled under
:func:`flashloss.jax.pallas.target_chip` so the kernels pick that chip's blocks. One JSON
line per (chip, case): ``ok``, the error (its VMEM line), compile seconds, XLA's temp,
argument and output bytes, FLOPs, bytes accessed, the roofline time from them (an estimate),
and whether temp stays within the case's bound. XLA counts a loop's body once: the FLOPs
and bytes add (trips − 1) × the body's, its trip count read from the compiled HLO
(:func:`loop_trips`) and the body compiled alone (``Case.body``). The ``default`` cases
(the call with no plan given) add their ratios to the pure-JAX baseline (:data:`BASELINE`);
in bf16 the line fails over 1.0x its roofline or 0.5x its peak (the CI gate).

    python -m flashloss.jax.tpu_compile --chips v5e,v6e,v5p,7x --cases all [--json OUT]
    python -m flashloss.jax.tpu_compile --chips v6e --cases grpo_token_bf16_vh,baseline_bf16
    python -m flashloss.jax.tpu_compile --chips v5e --cases all,-mesh   # every one-device case
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import flashloss.jax as fj

from . import _policy
from .pallas import _chips, losses, single_pass, target_chip

#: libtpu's topology name of each chip (``pltpu.ChipVersion`` value → topology).
TOPOLOGIES = {"v5e": "v5e:2x2", "v6e": "v6e:2x4", "v5p": "v5p:2x2x1", "7x": "tpu7x:2x2x1"}
#: The original system's shape: B=1, T=8192, H=4096, V=151936.
B, T, H, V = 1, 8192, 4096, 151936
MIB = 1 << 20
#: Temporaries the two-pass head path may hold at the original shape (the issue's bound).
HEAD_TEMP_BOUND = 64 * MIB
#: The materialized logits' steps: the logits and their gradient are arguments and outputs,
#: the temporaries a few per-row vectors.
LOGITS_TEMP_BOUND = 64 * MIB
#: The single-pass plan's budget at the original shape (its bound too): a block of 1024
#: rows (1.24 GB of f32 logits and dZ) and the f32 dW carry (2.49 GB).
SINGLE_PASS_BUDGET_MIB = 4096
#: The pure-JAX baseline's step at the original shape, as compiled by
#: ``python -m flashloss.jax.bench --compile tpu --set chip=CHIP [--set dtype=bfloat16]``
#: (docs/jax.md, "The step against the baselines"; bdfdbac, libtpu 0.0.42): ``(FLOPs,
#: bytes accessed, temp + arguments + outputs bytes)`` by chip and the inputs' dtype.
BASELINE = {
    (chip, dtype): (30.61e12, accessed, int(9496.4 * MIB) + 2 * (T * H + V * H) * (2 if dtype == "bf16" else 4))
    for chip, dtype, accessed in (
        ("v5e", "bf16", 34.1e9), ("v6e", "bf16", 34.1e9), ("v5p", "bf16", 33.8e9), ("7x", "bf16", 33.8e9),
        ("v5e", "f32", 37.8e9), ("v6e", "f32", 37.8e9), ("v5p", "f32", 37.8e9), ("7x", "f32", 37.8e9),
    )
}  # fmt: skip
#: The gate of the default call: its roofline estimate at most the baseline's, its peak at
#: most half the baseline's.
GATE_ROOFLINE, GATE_PEAK = 1.0, 0.5


@dataclass(frozen=True)
class Case:
    """One step to compile: ``step(*structs)`` with ``structs`` from :func:`_inputs`."""

    name: str
    step: Callable
    inputs: Callable  # (devices) -> tuple of ShapeDtypeStruct
    #: The most temp bytes allowed, or None where the case is a reference (a baseline).
    temp_bound: Optional[int] = HEAD_TEMP_BOUND
    #: Devices the case runs on (8: a v6e-8 mesh; only chips whose topology has them).
    devices: int = 1
    tags: tuple[str, ...] = field(default=())
    #: ``(dtype) -> (f, structs) or None``: one trip of the step's loop, when it has one
    #: (:func:`flashloss.jax.pallas.single_pass.one_block`), for its cost × the trip count.
    body: Optional[Callable] = None
    #: A ``default`` case whose line fails outside the gate against the baseline
    #: (:data:`BASELINE`: roofline <= 1.0x, peak <= 0.5x); the others record it.
    gated: bool = False


@functools.lru_cache(maxsize=None)
def devices(chip: str) -> tuple:
    """The compile-only devices of ``chip``'s topology (libtpu, no TPU needed)."""
    from jax.experimental import topologies

    if chip not in TOPOLOGIES:
        raise ValueError(f"argument `chip`: expected one of {sorted(TOPOLOGIES)}, got {chip!r}")
    return tuple(topologies.get_topology_desc(platform="tpu", topology_name=TOPOLOGIES[chip]).devices)


def _structs(devs, specs, shapes) -> tuple:
    mesh = Mesh(np.array(devs), ("d",))
    return tuple(jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, p)) for (s, d), p in zip(shapes, specs))


def placed(devs, structs: tuple) -> tuple:
    """``structs`` (shape-only inputs) replicated on the devices ``devs``."""
    return _structs(devs, (P(),) * len(structs), [(s.shape, s.dtype) for s in structs])


def _batch_shapes(b, t, h, v, dtype, layout="vh", rows_2d=False) -> list:
    """hidden, weight, ids, old, ref, adv, mask (bench's order); ``rows_2d``: hidden as
    ``[B·T, H]`` (at an odd T, XLA lays a ``[1, T, H]`` argument out in ``(1, 128)`` tiles
    and copies it into the kernels' ``(8, 128)``: 2·T·H·4 bytes of temporaries in f32 that
    are the argument's layout, not the step's)."""
    w = (v, h) if layout == "vh" else (h, v)
    f32 = ((b, t), jnp.float32)
    x = (b * t, h) if rows_2d else (b, t, h)
    return [(x, dtype), (w, dtype), ((b, t), jnp.int32), f32, f32, ((b,), jnp.float32), ((b, t), jnp.bool_)]


def _batch(b=B, t=T, h=H, v=V, dtype=jnp.bfloat16, layout="vh", specs=None, rows_2d=False) -> Callable:
    shapes = _batch_shapes(b, t, h, v, dtype, layout, rows_2d)
    return lambda devs: _structs(devs, specs or (P(),) * len(shapes), shapes)


def _grpo(layout="vh", **kw) -> Callable:
    def loss(h, w, ids, old, ref, adv, mask):
        out = fj.linear_grpo_loss(h, w, ids, mask, adv, old_per_token_logps=old, ref_per_token_logps=ref, beta=0.04,
                                  impl="pallas", weight_layout=layout, **kw)  # fmt: skip
        return out[0]

    return jax.value_and_grad(loss, (0, 1))


def _grpo_body(mode: str = "auto", budget_mib: Optional[float] = None) -> Callable:
    """The loop's body of :func:`_grpo`'s step (``Case.body``): ``structs -> (f, structs)``
    of one block of the single pass that ``mode`` and ``budget_mib`` plan for the chip
    (under :func:`target_chip`), or None for the two kernels' plan (no loop)."""

    def body(structs):
        h, w, ids, old, ref, adv, mask = structs
        x = jax.ShapeDtypeStruct((h.size // h.shape[-1], h.shape[-1]), h.dtype, sharding=h.sharding)
        args = _policy.GrpoArgs(beta=0.04).validate()
        spec = losses.spec_for("vh", 1.0, None, None, w.shape[0], False)
        plan = losses.single_pass_plan(mode, budget_mib, x, w, spec, args)
        if plan is None:
            return None
        one = single_pass.one_block(args, "vh", plan)
        carry = (None, None) if plan.stored else (jax.ShapeDtypeStruct(w.shape, jnp.float32, sharding=w.sharding), None)

        def f(x, w, ids, mask, adv, old, ref, carry):
            return one(x, w, None, ids, mask, adv, old, ref, None, carry)

        return f, (x, w, ids, mask, adv, old, ref, carry)

    return body


def _ce(layout="vh") -> Callable:
    def loss(h, w, ids, old, ref, adv, mask):
        targets = jnp.where(mask, ids, -100).reshape(-1)
        return fj.linear_cross_entropy(h.reshape(-1, h.shape[-1]), w, targets, impl="pallas", weight_layout=layout)

    return jax.value_and_grad(loss, (0, 1))


def _logprobs(layout="vh", **kw) -> Callable:
    """``linear_logprobs`` with ``kw``'s options; every differentiable output feeds the loss."""

    def loss(h, w, ids, old, ref, adv, mask):
        k = kw.get("gather", 0)
        opts = {key: value for key, value in kw.items() if key != "gather"}
        cand = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), ids.shape + (k,)) if k else None
        out = fj.linear_logprobs(
            h,
            w,
            ids,
            temperature=0.7,
            return_entropy=True,
            mask=mask,
            gather_ids=cand,
            impl="pallas",
            weight_layout=layout,
            **opts,
        )
        if not isinstance(out, tuple) or isinstance(out, fj.LogprobOutputs):
            lp = jnp.where(out.outside_support, 0.0, out.logp) if out.outside_support is not None else out.logp
            total = lp.sum() + 0.1 * out.entropy.sum()
            total = total + (0.0 if out.lse is None else 0.01 * out.lse.sum())
            return total + (0.0 if out.gathered_logp is None else 0.01 * out.gathered_logp.sum())
        return out[0].sum() + 0.1 * out[1].sum()

    return jax.value_and_grad(loss, (0, 1))


def _logits_step(dtype) -> tuple[Callable, Callable]:
    def step(z, ids, mask, adv, old, ref):
        def loss(z):
            return fj.grpo_loss(z, ids, mask, adv, old_per_token_logps=old, ref_per_token_logps=ref, beta=0.04,
                                impl="pallas")[0]  # fmt: skip

        return jax.value_and_grad(loss)(z)

    f32 = ((B, T), jnp.float32)
    shapes = [((B, T, V), dtype), ((B, T), jnp.int32), ((B, T), jnp.bool_), ((B,), jnp.float32), f32, f32]
    return step, lambda devs: _structs(devs, (P(),) * 6, shapes)


def _sharded(split: str) -> Case:
    """GRPO bf16 on an 8-chip v6e mesh: the head split over the vocabulary, the sequences
    over the tokens, or both (2 x 4)."""
    if split == "2d":
        mesh_shape, names = (2, 4), ("t", "v")
        rows, block, axes, b, t = P("t"), P("v"), {"token_axis": "t", "vocab_axis": "v"}, 2, T // 2
    else:
        mesh_shape, names = (8,), ("d",)
        rows, block = (P(), P("d")) if split == "vocab" else (P("d"), P())
        axes = {f"{split}_axis": "d"}
        b, t = (1, T) if split == "vocab" else (8, T // 8)
    specs = (rows, block) + (rows,) * 5
    shapes = _batch_shapes(b, t, H, V - V % 8, jnp.bfloat16)

    meshes = []  # the mesh the inputs were placed on (made before the step is traced)

    def inputs(devs):
        meshes[:] = [Mesh(np.array(devs).reshape(mesh_shape), names)]
        return tuple(
            jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(meshes[0], p)) for (s, d), p in zip(shapes, specs)
        )

    def step(*args):
        inner = jax.shard_map(_grpo(**axes), mesh=meshes[0], in_specs=specs, out_specs=(P(), (rows, block)))
        return inner(*args)

    return Case(f"grpo_mesh_{split}_bf16", step, inputs, devices=8, tags=("mesh",))


def cases() -> dict[str, Case]:
    """Every case by name. Tags: ``core`` (compiled for every chip in CI), ``default`` (the
    call with no plan given, against the baseline: :data:`BASELINE`), ``v6e`` (the
    rest of the options, for one chip), ``support`` (the sampler's truncated support),
    ``mesh`` (8 devices). The baselines' steps are :mod:`flashloss.jax.bench`'s
    (``--compile tpu``)."""
    out: list[Case] = []
    for dtype, d in ((jnp.bfloat16, "bf16"), (jnp.float32, "f32")):
        for layout in ("vh", "hv"):
            out.append(Case(f"grpo_token_{d}_{layout}", _grpo(layout, mode="two_pass"),
                            _batch(dtype=dtype, layout=layout), tags=("core",)))  # fmt: skip
        # the call with no mode or budget: the plan the chip's default takes, gated in bf16 (in
        # f32 the dW carry's traffic keeps v6e over the baseline: docs/results/tpu_default_plan.md)
        out.append(Case(f"grpo_default_{d}", _grpo(), _batch(dtype=dtype), temp_bound=None, tags=("default",),
                        body=_grpo_body(), gated=d == "bf16"))  # fmt: skip
        out.append(Case(f"grpo_sequence_{d}", _grpo(loss_type="grpo", importance_sampling_level="sequence"),
                        _batch(dtype=dtype), tags=("v6e",)))  # fmt: skip
        out.append(Case(f"ce_{d}", _ce(), _batch(dtype=dtype), tags=("v6e",)))
        out.append(Case(f"grpo_single_pass_{d}", _grpo(mode="single_pass", budget_mib=SINGLE_PASS_BUDGET_MIB),
                        _batch(dtype=dtype), temp_bound=SINGLE_PASS_BUDGET_MIB * MIB, tags=("v6e",),
                        body=_grpo_body("single_pass", SINGLE_PASS_BUDGET_MIB)))  # fmt: skip
        out.append(Case(f"logprobs_entropy_{d}", _logprobs(), _batch(dtype=dtype), tags=("v6e",)))
        out.append(Case(f"logprobs_stats_{d}", _logprobs(return_lse=True, return_max=True, return_sum_p2=True),
                        _batch(dtype=dtype), tags=("core",)))  # fmt: skip
        # the candidate set's plain-JAX term accumulates its own dW: one more [V, H] in the head's dtype
        gather_bound = HEAD_TEMP_BOUND + V * H * jnp.dtype(dtype).itemsize
        out.append(
            Case(f"logprobs_gather64_{d}", _logprobs(gather=64), _batch(dtype=dtype), gather_bound, tags=("v6e",))
        )
        for opt in ({"top_k": 50}, {"top_p": 0.9}, {"min_p": 0.05}, {"top_k": 50, "top_p": 0.9}):
            tag = "_".join(f"{k}{v}" for k, v in opt.items())
            out.append(Case(f"logprobs_support_{tag}_{d}", _logprobs(**opt), _batch(dtype=dtype), tags=("support",)))
        step, inputs = _logits_step(dtype)
        out.append(Case(f"logits_grpo_{d}", step, inputs, temp_bound=LOGITS_TEMP_BOUND, tags=("core",)))
    for h in (896, 1536, 3584):  # ragged: V=151643 (odd), N=8191 (a multiple of no block)
        for dtype, d in ((jnp.bfloat16, "bf16"), (jnp.float32, "f32")):
            out.append(Case(f"grpo_ragged_h{h}_{d}", _grpo(mode="two_pass"),
                            _batch(t=T - 1, h=h, v=151643, dtype=dtype, rows_2d=True), tags=("core",)))  # fmt: skip
    out += [_sharded(split) for split in ("vocab", "token", "2d")]
    return {c.name: c for c in out}


def select(spec: str) -> list[Case]:
    """Cases by comma-separated names or tags, in order (``all``: every case); a word
    ``-NAME`` drops that case or tag from those chosen before it (``all,-mesh``)."""
    table = cases()
    chosen: dict[str, Case] = {}
    for word in spec.split(","):
        drop = word.startswith("-")
        key = word[1:] if drop else word
        hits = [c for c in table.values() if key == "all" or c.name == key or key in c.tags]
        if not hits:
            raise ValueError(f"argument `cases`: no case or tag {key!r} (tags: core, default, v6e, support, mesh)")
        for c in hits:
            if drop:
                chosen.pop(c.name, None)
            else:
                chosen[c.name] = c
    return list(chosen.values())


_VMEM = re.compile(r"(Scoped allocation with size [\d.]+\w* and limit [\d.]+\w*|Used [\d.]+\w* of [\d.]+\w*\s*vmem"
                   r"|Ran out of memory in memory space \w+[^\n]*)")  # fmt: skip


_WHILE = re.compile(r"\bwhile\([^\n]*?condition=%?([\w.\-]+)")


def loop_trips(hlo: str) -> list[int]:
    """The trip count of every ``while`` in the compiled module's text: the integer constant
    its condition compares the counter with (a ``lax.scan``'s length; the compare may sit in
    a fusion the condition calls)."""
    trips = []
    for name in _WHILE.findall(hlo):
        start = hlo.find(f"\n%{name} ")
        block = hlo[start : hlo.find("\n}", start)] if start >= 0 else ""
        found = re.findall(r"s32\[\]\S* constant\((\d+)\)", block)
        trips += [int(found[-1])] if found else []
    return trips


def _cost(compiled) -> tuple[float, float]:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))


def _gate(row: dict, dtype: str) -> dict:
    """The gate's figures of a line: the baseline's roofline and peak on the line's chip
    (:data:`BASELINE`) and this step's against them."""
    flops, accessed, peak = BASELINE[row["chip"], dtype]
    target = _chips.chip(row["chip"])
    base = max(flops / target.bf16_flops_per_s, accessed / target.hbm_bytes_per_s)
    mine = row["temp_bytes"] + row["argument_bytes"] + row["output_bytes"]
    gate = {"baseline_roofline_seconds_estimate": base, "roofline_vs_baseline": row["roofline_seconds_estimate"] / base,
            "peak_bytes": mine, "peak_vs_baseline": mine / peak}  # fmt: skip
    gate["within_gate"] = gate["roofline_vs_baseline"] <= GATE_ROOFLINE and gate["peak_vs_baseline"] <= GATE_PEAK
    return gate


def compile_case(case: Case, chip: str) -> dict[str, Any]:
    """Compile ``case`` for ``chip``: one result line (see the module)."""
    devs = devices(chip)
    row: dict[str, Any] = {"chip": chip, "case": case.name, "devices": case.devices}
    if len(devs) < case.devices:
        return {**row, "ok": None, "skipped": f"the {TOPOLOGIES[chip]} topology has {len(devs)} devices"}
    start = time.perf_counter()
    try:
        with target_chip(chip):
            structs = case.inputs(devs[: case.devices])
            compiled = jax.jit(case.step).lower(*structs).compile()
    except Exception as e:  # the compiler's own message is the result
        text = str(e)
        found = _VMEM.search(text)
        return {**row, "ok": False, "compile_seconds": round(time.perf_counter() - start, 1),
                "error": found.group(0) if found else text.splitlines()[0][:400]}  # fmt: skip
    seconds = time.perf_counter() - start
    mem = compiled.memory_analysis()
    flops, accessed = _cost(compiled)
    trips = loop_trips(compiled.as_text())
    body_flops = body_accessed = 0.0
    if case.body is not None and len(trips) == 1 and trips[0] > 1:
        with target_chip(chip):
            one = case.body(structs)
            if one is not None:
                body_flops, body_accessed = _cost(jax.jit(one[0]).lower(*one[1]).compile())
    extra = (trips[0] - 1) if body_flops else 0
    target = _chips.chip(chip)
    temp = int(mem.temp_size_in_bytes)
    within = None if case.temp_bound is None else temp <= case.temp_bound
    out = {
        **row,
        "ok": within is not False,
        "compile_seconds": round(seconds, 1),
        "temp_bytes": temp,
        "temp_bound_bytes": case.temp_bound,
        "temp_within_bound": within,
        "argument_bytes": int(mem.argument_size_in_bytes),
        "output_bytes": int(mem.output_size_in_bytes),
        "flops_body_once": flops,
        "bytes_accessed_body_once": accessed,
        "loop_trips": trips,
        "body_flops": body_flops,
        "body_bytes_accessed": body_accessed,
        "flops": flops + extra * body_flops,
        "bytes_accessed": accessed + extra * body_accessed,
    }
    out["roofline_seconds_estimate"] = max(out["flops"] / target.bf16_flops_per_s,
                                           out["bytes_accessed"] / target.hbm_bytes_per_s)  # fmt: skip
    if "default" in case.tags:  # against the baseline; failing the line only where gated
        out.update(_gate(out, "bf16" if structs[0].dtype == jnp.bfloat16 else "f32"))
        out["ok"] = out["ok"] and (out["within_gate"] or not case.gated)
    return out


def table(lines: list[dict]) -> str:
    """The result lines as a markdown table (MiB, TFLOP, GB, ms)."""
    out = ["| chip | case | ok | compile s | temp MiB | bound MiB | argument MiB | output MiB | loop trips | TFLOP | "
           "GB accessed | roofline ms (estimate) | roofline / baseline's | peak / baseline's |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in lines:
        if r.get("ok") is None:
            continue
        if "temp_bytes" not in r:
            out.append(f"| {r['chip']} | {r['case']} | **no**: {r['error']} | {r['compile_seconds']} |||||||||||")
            continue
        ok = "yes" if r["ok"] else "**no** (temp above its bound)" if r.get("within_gate", True) else "**no** (gate)"
        bound = "-" if r.get("temp_bound_bytes") is None else f"{r['temp_bound_bytes'] / MIB:.0f}"
        gate = [f"{r[k]:.3f}" if k in r else "-" for k in ("roofline_vs_baseline", "peak_vs_baseline")]
        out.append(
            f"| {r['chip']} | {r['case']} | {ok} | {r['compile_seconds']} | {r['temp_bytes'] / MIB:.1f} | {bound} | "
            f"{r['argument_bytes'] / MIB:.0f} | {r['output_bytes'] / MIB:.0f} | {r.get('loop_trips') or '-'} | "
            f"{r['flops'] / 1e12:.2f} | {r['bytes_accessed'] / 1e9:.1f} | {r['roofline_seconds_estimate'] * 1e3:.1f} | "
            f"{gate[0]} | {gate[1]} |"
        )
    return "\n".join(out)


def matrix(lines: list[dict]) -> str:
    """The result lines as one row per case and a column per chip: temp MiB and compile
    seconds where it compiled within its bound, else what failed (the last line of a
    (chip, case) pair counts)."""
    chips = [c for c in TOPOLOGIES if any(r["chip"] == c for r in lines)]
    cells: dict[str, dict[str, str]] = {}
    bounds: dict[str, str] = {}
    for r in lines:
        if r.get("ok") is None:
            continue
        if "temp_bytes" not in r:
            cell = f"**no**: {r['error']}"
        else:
            cell = f"{r['temp_bytes'] / MIB:.1f} ({r['compile_seconds']:.0f} s)"
            cell = cell if r["ok"] else f"**{cell}: over**"
        cells.setdefault(r["case"], {})[r["chip"]] = cell
        bound = r.get("temp_bound_bytes")
        bounds[r["case"]] = "-" if bound is None else f"{bound / MIB:.0f}"
    names = [n for n in cases() if n in cells]
    out = ["| case | bound MiB | " + " | ".join(chips) + " |", "|---|---|" + "---|" * len(chips)]
    for n in names:
        out.append(f"| {n} | {bounds.get(n, '')} | " + " | ".join(cells[n].get(c, "") for c in chips) + " |")
    return "\n".join(out)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chips", default="v6e", help=f"comma-separated, of {sorted(TOPOLOGIES)}")
    p.add_argument("--cases", default="core", help="names or tags (comma-separated), all; -NAME: drop it")
    p.add_argument("--json", metavar="OUT", help="also append the lines to OUT")
    p.add_argument("--list", action="store_true", help="print the case names and tags, compile nothing")
    p.add_argument("--table", metavar="JSONL", help="print the lines of JSONL as a markdown table, compile nothing")
    p.add_argument("--matrix", metavar="JSONL", help="print JSONL as a case x chip table (temp MiB, compile s)")
    a = p.parse_args(argv)
    if a.table or a.matrix:
        with open(a.table or a.matrix) as f:
            lines = [json.loads(line) for line in f if line.strip()]
        print(table(lines) if a.table else matrix(lines))
        return 0
    chosen = select(a.cases)
    if a.list:
        for c in chosen:
            print(c.name, ",".join(c.tags))
        return 0
    failed = 0
    for chip in a.chips.split(","):
        for case in chosen:
            line = json.dumps(compile_case(case, chip))
            print(line, flush=True)
            failed += '"ok": false' in line
            if a.json:
                with open(a.json, "a") as f:
                    f.write(line + "\n")
    print(f"tpu_compile: {failed} of the compiled cases failed", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
