"""The collectives of a vocab-parallel LM head over ``torch.distributed``.

``GroupOps`` runs, on a ``ProcessGroup``, the operations the native kernels call back
for (the flashloss crate's ``Collective``: an all-gather of bytes and all-reduces of
float buffers), on the CPU for Gloo and on the current CUDA device for NCCL. Groups are
registered by name so that a custom op (which takes strings, not objects) can find
them. ``agreed`` runs the Python-side checks of a call and raises the same
``ValueError`` on every rank when any rank's checks fail, so no rank waits for peers
that gave up (its exchange runs eagerly: a graph break under ``torch.compile``).
"""

from __future__ import annotations

from typing import Callable, Optional, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")

_DTYPES = {"float32": torch.float32, "float64": torch.float64}
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
_GROUPS: dict[str, "GroupOps"] = {}


class GroupOps:
    """The native kernels' view of a ``ProcessGroup``: ``rank``, ``world_size``,
    ``all_gather_bytes`` and ``all_reduce``."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        nccl = dist.get_backend(group) == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data``, in rank order."""
        out: list = [None] * self.world_size
        dist.all_gather_object(out, data, group=self.group)
        return out

    def all_reduce(self, data: bytes, dtype: str, op: str) -> bytes:
        """``data`` (an array of ``dtype``) reduced over the group by ``op``."""
        t = torch.frombuffer(bytearray(data), dtype=_DTYPES[dtype]).to(self.device)
        dist.all_reduce(t, op=_OPS[op], group=self.group)
        return t.cpu().numpy().tobytes()


def register(group: Optional[dist.ProcessGroup]) -> str:
    """The name under which ``group`` is found by :func:`ops` ("" for no group)."""
    if group is None:
        return ""
    if not isinstance(group, dist.ProcessGroup):
        raise ValueError(
            f"argument `vocab_parallel_group`: expected a torch.distributed.ProcessGroup, got {type(group).__name__}"
        )
    name = group.group_name
    if name not in _GROUPS:
        _GROUPS[name] = GroupOps(group)
    return name


def ops(name: str) -> Optional[GroupOps]:
    """The group registered as ``name`` (None for "")."""
    return _GROUPS[name] if name else None


def agreed(name: str, check: Callable[[], T]) -> T:
    """``check()``, its ``ValueError`` raised on every rank of group ``name`` when it
    fails on any (the lowest failing rank's message, prefixed by its rank)."""
    group = ops(name)
    if group is None:
        return check()
    error, result = None, None
    try:
        result = check()
    except ValueError as e:
        error = str(e)
    first = _first_error(name, error)
    if first is not None:
        raise ValueError(first)
    return result  # type: ignore[return-value]


@torch.compiler.disable  # a collective on Python objects: run eagerly (a graph break under torch.compile)
def _first_error(name: str, error: Optional[str]) -> Optional[str]:
    """The lowest failing rank's error of group ``name``, prefixed by its rank."""
    errors = ops(name).all_gather_bytes(b"" if error is None else error.encode())
    for rank, e in enumerate(errors):
        if e:
            return f"rank {rank}: {e.decode()}"
    return None
