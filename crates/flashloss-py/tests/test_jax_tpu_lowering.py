"""The Pallas path of flashloss.jax lowered for TPU from this CPU host at the original
shapes (B=1, T=8192, H=4096, V=151936; nothing runs on a TPU and nothing large is
allocated: the inputs are ``jax.ShapeDtypeStruct``s): ``impl="auto"`` taking the Pallas
branch (also under a truncated support), and an 8-device abstract mesh split over the
vocabulary or the tokens, each without an ``[N, V]`` array where the pure-JAX baseline
step holds one; the chip the kernels are traced for; and the gradcheck CLI on the Pallas
path in interpret mode. Lowering does not run Mosaic's VMEM passes: the real TPU compiler
does, in ``scripts/ci_tpu_compile.sh`` (``flashloss.jax.tpu_compile``), and its CI set
covers what lowering checked of ``impl="pallas"`` on one device (the logits level on f32
logits, the head step in both dtypes and layouts: compiled for v5p and v7x, XLA's temp
bytes at most 64 MiB, so no ``[N, V]`` array), which is why those tests are gone."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from jax._src.lib.mlir import ir
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import flashloss.jax as fj
from flashloss.jax import bench
from flashloss.jax.pallas import _chips
from flashloss.jax.pallas import logits as L

B, T, H, V = 1, 8192, 4096, 151936
N = B * T
DEVICES = 8
S = jax.ShapeDtypeStruct


def _lower(f: Callable, *structs: Any) -> ir.Module:
    """``jit(f)`` lowered for TPU: its StableHLO module."""
    return jax.jit(f).trace(*structs).lower(lowering_platforms=("tpu",)).compiler_ir("stablehlo")


def _structs(b: int, t: int, dtype: Any, layout: str = "vh", specs: Any = None, mesh: Any = None) -> tuple:
    """hidden, weight, ids, old, ref, adv, mask (bench's order) as shape-only inputs."""
    w = (V, H) if layout == "vh" else (H, V)
    shapes = [((b, t, H), dtype), (w, dtype), ((b, t), jnp.int32), ((b, t), jnp.float32), ((b, t), jnp.float32),
              ((b,), jnp.float32), ((b, t), jnp.bool_)]  # fmt: skip
    if specs is None:
        return tuple(S(s, d) for s, d in shapes)
    return tuple(S(s, d, sharding=NamedSharding(mesh, p)) for (s, d), p in zip(shapes, specs))


def _grpo(layout: str = "vh", impl: str = "pallas", **axes: Any) -> Callable:
    def loss(h, w, ids, old, ref, adv, mask):
        return fj.linear_grpo_loss(
            h, w, ids, mask, adv, old_per_token_logps=old, ref_per_token_logps=ref, beta=0.04, impl=impl,
            weight_layout=layout, **axes,
        )[0]  # fmt: skip

    return jax.value_and_grad(loss, (0, 1))


def _baseline() -> Callable:
    cfg = {"temperature": 1.0, "beta": 0.04, "epsilon": 0.2}
    return jax.value_and_grad(lambda h, w, *rest: bench.baseline_loss(h, w, *rest, cfg), (0, 1))


def _report(module: ir.Module, n: int = N, v: int = V, b: int = B, t: int = T) -> dict:
    return bench.module_arrays(module, n, v, b, t)


def _assert_pallas(module: ir.Module) -> dict:
    """The Pallas branch: Mosaic kernels, no flashloss FFI call."""
    r = _report(module)
    assert r["tpu_custom_calls"] >= 1, r["custom_call_targets"]
    assert not [k for k in r["custom_call_targets"] if k.startswith("flashloss")], r["custom_call_targets"]
    return r


def test_auto_takes_the_pallas_branch_on_tpu():
    """(c) ``impl="auto"`` lowered for TPU: ``platform_dependent`` keeps the TPU branch only
    (it traces both branches, so the FFI branch must trace too). The two kernels' plan holds
    no ``[N, V]`` array; the default plan at the original shape (the single pass with every
    block's ``dZ`` stored, pallas/single_pass.py) holds only that ``dZ``, in bf16, never the
    logits beyond a block."""
    try:
        module = _lower(_grpo(impl="auto", mode="two_pass"), *_structs(B, T, jnp.bfloat16))
    except TypeError as e:  # the FFI mirror (_ops) not yet taking weight_layout: being added on another branch
        if "weight_layout" not in str(e):
            raise
        pytest.skip(f"the FFI branch does not trace yet: {e}")
    r = _assert_pallas(module)
    assert r["tpu_custom_calls"] == 3 and not r["has_NxV"]
    r = _assert_pallas(_lower(_grpo(impl="auto"), *_structs(B, T, jnp.bfloat16)))
    assert r["NxV_shapes"] and all(a["dtype"] == "bf16" for a in r["NxV_shapes"]), r["NxV_shapes"]


def test_truncated_support_lowers_for_tpu_without_nxv():
    """``linear_logprobs`` with ``top_k``/``top_p`` and ``impl="auto"`` lowered for TPU: the
    Pallas branch (its support in plain JAX over blocks of rows) holds no ``[N, V]`` array."""

    def step(h, w, ids, mask):
        def loss(h, w):
            out = fj.linear_logprobs(h, w, ids, temperature=0.7, return_entropy=True, mask=mask, top_k=50, top_p=0.9)
            return jnp.where(out.outside_support, 0.0, out.logp).sum() + 0.1 * out.entropy.sum()

        return jax.value_and_grad(loss, (0, 1))(h, w)

    h, w, ids, _, _, _, mask = _structs(B, T, jnp.bfloat16)
    r = _assert_pallas(_lower(step, h, w, ids, mask))
    assert not r["has_NxV"], r["NxV_shapes"]


def _mesh(axis_type: AxisType = AxisType.Explicit) -> AbstractMesh:
    return AbstractMesh((DEVICES,), ("d",), (axis_type,))


def _nxv(module: ir.Module, pairs: list[tuple[int, int, int, int]]) -> list:
    """The shapes holding any of ``pairs`` ``(n, v, b, t)``'s ``[n, v]``."""
    found = []
    for n, v, b, t in pairs:
        found += _report(module, n, v, b, t)["NxV_shapes"]
    return found


@pytest.mark.parametrize("split", ["vocab", "token"])
def test_sharded_steps_hold_no_nxv(split):
    """(d) inside ``jax.shard_map`` over an 8-device abstract mesh (``check_vma=True``):
    the head split over the vocabulary (V = 8·18992, B=1, T=8192), or the sequences over
    the tokens (B=8, T=1024): no ``[N, V]``, ``[N_local, V_local]``, ``[N, V/8]`` or
    ``[N/8, V]`` array, where the pure-JAX baseline step at the same shapes and
    shardings (``Auto`` axes: the baseline is not written for sharding in types) holds
    ``[N, V]``."""
    mesh = _mesh()
    b, t = (1, N) if split == "vocab" else (DEVICES, N // DEVICES)
    rows = P() if split == "vocab" else P("d")
    block = P("d") if split == "vocab" else P()
    specs = (rows, block) + (rows,) * 5
    structs = _structs(b, t, jnp.bfloat16, "vh", specs, mesh)
    axes = {f"{split}_axis": "d"}
    step = jax.shard_map(_grpo(**axes), mesh=mesh, in_specs=specs, out_specs=(P(), (rows, block)))
    module = _lower(step, *structs)
    r = _assert_pallas(module)
    assert r["tpu_custom_calls"] == 3
    n8, v8 = N // DEVICES, V // DEVICES
    local = (N, v8, b, t) if split == "vocab" else (n8, V, 1, t)
    pairs = [(N, V, b, t), local, (N, v8, b, t), (n8, V, 1, n8)]
    assert not _nxv(module, pairs)
    base = _lower(_baseline(), *_structs(b, t, jnp.bfloat16, "vh", specs, _mesh(AxisType.Auto)))
    assert [N, V] in [a["shape"] for a in _nxv(base, pairs)]


def test_target_chip_sets_the_blocks_and_the_vmem_request():
    """``target_chip`` picks the chip a step is traced for (the default on a host without a
    TPU is v7x, the least VMEM); the real compile of every kernel for each chip is
    ``scripts/ci_tpu_compile.sh`` (``flashloss.jax.tpu_compile``)."""
    assert _chips.chip().name == _chips.DEFAULT_CHIP == "7x"
    for name in _chips.CHIPS:
        with _chips.target_chip(name):
            target = _chips.chip()
            assert target.name == name
            assert L.block_rows(N, V, jnp.bfloat16, target.block_budget_bytes) >= 8
        assert _chips.choose("forward", N, V, H, 2, target).rows >= 128
    with pytest.raises(ValueError, match="argument `chip`"):
        with _chips.target_chip("v9z"):
            pass
    small, large = _chips.chip("7x"), _chips.chip("v6e")
    assert small.vmem_limit_bytes < large.vmem_limit_bytes
    e = 4
    assert _chips.vmem_bytes("forward", _chips.choose("forward", N, V, H, e, small), H, e) <= small.block_budget_bytes


def test_gradcheck_cli_on_the_pallas_path():
    """The f64 gradcheck on ``impl=pallas interpret=true`` (default small config): exit 0,
    every gate PASS."""
    config = os.path.join(os.path.dirname(__file__), "..", "..", "..", "configs", "jax", "gradcheck.yaml")
    cmd = [sys.executable, "-m", "flashloss.jax.gradcheck", "--config", config, "--set", "impl=pallas", "--set",
           "interpret=true"]  # fmt: skip
    out = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    gates = [line for line in out.stdout.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert len(gates) == 3 and all(g.startswith("PASS") for g in gates), out.stdout
    for field in ("loss_ref", "loss_kernel", "abs_diff_loss", "max_rel_diff_dhidden", "max_rel_diff_dweight"):
        assert field in out.stdout


def test_tpu_compile_selects_cases_by_name_and_tag():
    """``flashloss.jax.tpu_compile --cases``: names and tags in order, ``-NAME`` drops a case
    or tag chosen before it (``all,-mesh``: every one-device case), an unknown word a
    ValueError naming the argument."""
    from flashloss.jax import tpu_compile as tc

    every = tc.cases()
    one = [c.name for c in tc.select("all,-mesh")]
    assert one == [c.name for c in every.values() if c.devices == 1] and len(one) == len(every) - 3
    assert {c.name for c in tc.select("core,-grpo_token_bf16_vh")} == {
        c.name for c in every.values() if "core" in c.tags
    } - {"grpo_token_bf16_vh"}
    assert [c.name for c in tc.select("mesh,-mesh,ce_f32")] == ["ce_f32"]
    with pytest.raises(ValueError, match="argument `cases`"):
        tc.select("all,-nonesuch")
