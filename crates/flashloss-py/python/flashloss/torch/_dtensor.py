"""LM heads given as ``torch.distributed.tensor.DTensor`` (torch's tensor parallelism,
TorchTitan's ``ColwiseParallel`` output layer, FSDP2's sharded parameters): the
placement the DTensors carry says how the call runs, so no argument is added.

On a 1-D mesh, ``weight`` ``[V, H]`` (and ``bias`` ``[V]``) may be

- ``Shard(0)``, the vocabulary split over the mesh: the call runs vocab-parallel over the
  mesh's process group (as ``vocab_parallel_group=mesh.get_group()`` would), each rank on
  its local block (``torch.chunk``'s blocks: contiguous, in rank order). ``hidden`` must
  hold the same rows on every rank: a ``DTensor`` with ``Replicate()`` on the same mesh,
  or a plain tensor together with ``vocab_parallel_group`` set to the mesh's group (the
  caller's statement that it is the same on every rank). A plain ``hidden`` alone is
  refused: it is what data parallelism (FSDP2's sharded weight outside the module's
  forward, e.g. the LM head wrapped as an FSDP unit of its own, which a patched forward
  never calls) passes, a different batch per rank: running it vocab-parallel would be a
  wrong answer, and gathering the weight is FSDP's job, not the loss's;
- ``Replicate()``: the call runs on the local tensors of each rank, unsharded, with
  ``hidden`` a ``Replicate()`` DTensor on the same mesh: the weight's gradient comes back
  ``Replicate()``, which a plain ``hidden`` (maybe different per rank) cannot promise.

The tensors reach the kernels through ``DTensor.to_local()``, whose backward wraps each
local gradient back in the input's placement: ``weight.grad`` (and ``bias.grad``) is a
``DTensor`` with the weight's placement, holding this rank's block of the one-process
gradient; a ``Replicate()`` ``hidden`` gets the whole (replicated) ``hidden`` gradient, a
plain one a plain gradient. The loss and per-token outputs are plain tensors, the same on
every rank. Every other layout is a ``ValueError`` naming the argument and its placement
(``Shard(1)``: the hidden dimension split, ``Partial``, a mesh of 2 or more dimensions, a
sharded ``hidden``, a ``bias`` placed unlike ``weight``, DTensors on different meshes).
Placements are the same on every rank, so every rank raises the same error.
"""

from __future__ import annotations

from typing import Optional

import torch

try:
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # torch built without distributed
    DTensor = None


def _where(t) -> str:
    return f"{list(t.placements)} on a {t.device_mesh.ndim}-D mesh {tuple(t.device_mesh.shape)}"


def _replicated(t) -> bool:
    return all(isinstance(p, Replicate) for p in t.placements)


def _vocab_sharded(t) -> bool:
    return len(t.placements) == 1 and isinstance(t.placements[0], Shard) and t.placements[0].dim == 0


def local_head(hidden, weight, bias, group):
    """``(hidden, weight, bias, vocab_parallel_group)`` as the kernels take them: plain
    tensors (``to_local()`` views, differentiable into the DTensors) and the group the
    placement implies; the arguments unchanged when none is a ``DTensor``."""
    if DTensor is None:
        return hidden, weight, bias, group
    named = {"hidden": hidden, "weight": weight, "bias": bias}
    dts = {k: t for k, t in named.items() if isinstance(t, DTensor)}
    if not dts:
        return hidden, weight, bias, group
    (first, mesh), *rest = [(k, t.device_mesh) for k, t in dts.items()]
    for k, m in rest:
        if m != mesh:
            raise ValueError(
                f"arguments `{first}` and `{k}`: DTensors on different device meshes; put the head on one mesh"
            )
    for k, t in dts.items():
        if t.device_mesh.ndim != 1 and not _replicated(t):
            raise ValueError(
                f"argument `{k}`: a DTensor placed {_where(t)}: flashloss splits the vocabulary over a 1-D mesh; "
                "pass the head's tensor-parallel sub-mesh (`mesh['tp']`), e.g. `t.redistribute(...)` onto it, "
                "or local tensors with `vocab_parallel_group`"
            )
    if isinstance(hidden, DTensor) and not _replicated(hidden):
        raise ValueError(
            f"argument `hidden`: a DTensor placed {_where(hidden)}: flashloss needs every row of `hidden` on every "
            "rank of the head's mesh; `hidden.redistribute(placements=[Replicate()])` it (tensor parallelism), or "
            "pass `hidden.to_local()` with a local (unsharded) head for a per-rank loss"
        )
    if not isinstance(weight, DTensor):
        if isinstance(bias, DTensor):
            raise ValueError(
                f"argument `bias`: a DTensor placed {_where(bias)} with a plain `weight`: give `weight` and `bias` "
                "the same kind and placement"
            )
        return hidden.to_local(), weight, bias, group  # a replicated hidden with a plain head
    sharded = _vocab_sharded(weight)
    if not (sharded or _replicated(weight)):
        what = "the hidden dimension H split" if any(getattr(p, "dim", None) == 1 for p in weight.placements) else ""
        raise ValueError(
            f"argument `weight`: a DTensor [V, H] placed {_where(weight)}"
            + (f" ({what})" if what else "")
            + ": flashloss runs a head sharded over the vocabulary (Shard(0)) or replicated (Replicate()); "
            "`weight.redistribute(placements=[Shard(0)])` it, or `full_tensor()` it for a local head"
        )
    if bias is not None:
        if not isinstance(bias, DTensor) or tuple(bias.placements) != tuple(weight.placements):
            where = _where(bias) if isinstance(bias, DTensor) else "a plain tensor"
            raise ValueError(
                f"argument `bias`: {where}, but `weight` is placed {_where(weight)}: place `bias` as `weight` "
                "(the same mesh and placement)"
            )
    n, v = weight.device_mesh.size(), weight.shape[0]
    if sharded and -(-v // n) * (n - 1) >= v:
        raise ValueError(
            f"argument `weight`: Shard(0) of {v} rows over {n} ranks leaves the last rank an empty block "
            f"(torch.chunk's blocks of {-(-v // n)} rows); shard it over fewer ranks"
        )
    mesh_group = weight.device_mesh.get_group()
    if not sharded:
        if group is not None:
            raise ValueError(
                f"argument `vocab_parallel_group`: given with a replicated DTensor `weight` ({_where(weight)}); "
                "a replicated head runs on each rank: leave `vocab_parallel_group` None"
            )
        if not isinstance(hidden, DTensor):
            raise ValueError(
                f"argument `hidden`: a plain tensor with a replicated DTensor `weight` ({_where(weight)}), whose "
                "gradient comes back Replicate(), true only if `hidden` is the same on every rank: pass `hidden` as "
                "a DTensor with Replicate() on the weight's mesh, or `weight.to_local()` for a per-rank loss (data "
                "parallelism: reduce that gradient as DDP does)"
            )
        return hidden.to_local(), weight.to_local(), _local(bias), None
    if group is not None and getattr(group, "group_name", None) != mesh_group.group_name:
        raise ValueError(
            f"argument `vocab_parallel_group`: not the process group of `weight`'s mesh ({_where(weight)}); "
            "a DTensor `weight` runs over its own mesh: leave `vocab_parallel_group` None"
        )
    if not isinstance(hidden, DTensor) and group is None:
        raise ValueError(
            f"argument `hidden`: a plain tensor with a vocabulary-sharded DTensor `weight` ({_where(weight)}). "
            "Tensor parallelism (the same `hidden` on every rank): pass `hidden` as a DTensor with Replicate() "
            "on the weight's mesh (`DTensor.from_local(hidden, mesh, [Replicate()])`), or set "
            "`vocab_parallel_group=mesh.get_group()`. Data parallelism (FSDP2; a different batch per rank): "
            "the loss must run where FSDP has unsharded the weight, inside the forward of the FSDP module that "
            "holds it (the root that `fully_shard(model)` wraps; not the LM head as an FSDP unit of its own)"
        )
    return _local(hidden), weight.to_local(), _local(bias), mesh_group


def _local(t: Optional[torch.Tensor]):
    return t.to_local() if isinstance(t, DTensor) else t
