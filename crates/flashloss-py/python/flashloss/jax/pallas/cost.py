"""The HBM bytes a Pallas kernel moves, from its grid and block specs: what every head and
logits kernel declares in its ``pl.CostEstimate`` (XLA's cost analysis takes a kernel's
bytes from there, and the roofline estimates of :mod:`flashloss.jax.tpu_compile` from
XLA's).

Pallas's TPU pipeline copies an operand's block into VMEM at the first grid step and at
every step whose block index differs from the step before's, and an output's block back
to HBM each time its index changes (and after the last step). The grid is walked in its
order (the last dimension fastest); a block at the array's edge moves only the part inside
the array. ``tests/test_jax_pallas_cost.py`` checks each kernel's declared bytes against
the same count made from the ``pallas_call``'s own block mappings in its jaxpr.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
from jax.experimental import pallas as pl


def moved_bytes(grid: Sequence[int], blocks: Sequence[tuple[Sequence[int], Callable, Sequence[int], int]]) -> int:
    """The bytes moved for ``blocks``, each ``(block_shape, index_map, array_shape,
    itemsize)`` (``index_map(*grid_indices)`` the block index), over ``grid``."""
    total = 0
    for shape, index_map, array, itemsize in blocks:
        last = None
        for step in itertools.product(*(range(g) for g in grid)):
            index = tuple(int(i) for i in index_map(*step))
            if index != last:
                total += itemsize * math.prod(min(b, a - i * b) for b, a, i in zip(shape, array, index))
                last = index
    return total


def _blocks(specs: Sequence[pl.BlockSpec], arrays: Sequence[Any]) -> list:
    """Each spec's block with its array (an array, or a ``(shape, dtype)`` pair)."""
    pairs = [(a.shape, a.dtype) if hasattr(a, "shape") else a for a in arrays]
    return [
        (spec.block_shape, spec.index_map, shape, jnp.dtype(dtype).itemsize)
        for spec, (shape, dtype) in zip(specs, pairs)
    ]


def estimate(
    flops: float, transcendentals: float, grid: Sequence[int], in_specs: Sequence[pl.BlockSpec], inputs: Sequence[Any],
    out_specs: Sequence[pl.BlockSpec], outputs: Sequence[Any],
) -> pl.CostEstimate:  # fmt: skip
    """``pl.CostEstimate`` with ``bytes_accessed`` counted from the specs (:func:`moved_bytes`):
    ``inputs`` the kernel's operands, ``outputs`` its results (arrays, structs or
    ``(shape, dtype)`` pairs)."""
    moved = moved_bytes(grid, _blocks(in_specs, inputs) + _blocks(out_specs, outputs))
    return pl.CostEstimate(flops=int(flops), transcendentals=int(transcendentals), bytes_accessed=moved)
