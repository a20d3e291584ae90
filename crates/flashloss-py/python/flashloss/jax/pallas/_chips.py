"""TPU chips and the blocks of the head kernels: VMEM each kernel needs for its blocks,
and the blocks chosen for a chip.

A chip cannot be asked on a CPU host (``pltpu.get_tpu_info()`` fails there), so the
table is JAX's own per-chip record (``pltpu.get_tpu_info_for_chip``: VMEM capacity, HBM
bandwidth, bf16 rate): the chip named by :func:`target_chip`, else the attached TPU's,
else :data:`DEFAULT_CHIP`. Every kernel requests ``vmem_limit_bytes = 3/4`` of the chip's
VMEM (96 MiB on v5e and v6e, 48 MiB on v5p and v7x; Mosaic's default scoped limit, 16-32
MiB, is what broke large vocabulary tiles for others) and takes the largest blocks whose
footprint, counted below from the block shapes, stays within 80% of that request.

Footprint of a kernel, bytes (``e``: the input dtype's size, ``bn`` rows, ``bv``
vocabulary entries, ``h`` hidden; Pallas double-buffers every pipelined block; ``σ`` =
:data:`F32_SPLIT_BYTES` for f32 inputs, 0 for bf16):

- forward: ``2·bn·h·e + 2·bv·h·e + 4·bn·bv·4 + σ·bn·h + rows``
- dH: forward's + ``2·bn·h·e`` (the dH block) + ``bn·h·4`` (its f32 accumulator) + ``σ·bv·h``
- dW: forward's + ``2·bv·h·e`` (the dW block) + ``bv·h·4`` (its f32 accumulator) + ``σ·bv·h``

where ``4·bn·bv·4`` bounds the f32 temporaries of a logits tile (the tile, its
exponentials, the gradient tile and one product), ``σ·…`` the bf16 pieces Mosaic splits an
f32 operand into for a product at HIGHEST precision (six bf16 passes), and ``rows`` the
per-row vectors. This is an upper bound, not Mosaic's allocation: the check is the
compile itself (:mod:`flashloss.jax.tpu_compile`, in CI for v5e, v6e, v5p and v7x).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Optional

from jax.experimental.pallas import tpu as pltpu

#: Chips the table covers (``pltpu.ChipVersion`` values), each compiled for in CI.
CHIPS = ("v5e", "v6e", "v5p", "7x")
#: The chip assumed when lowering for TPU from a host without one and no
#: :func:`target_chip`: the one with the least VMEM (v7x, 64 MiB), so that a step exported
#: from a CPU host fits every chip.
DEFAULT_CHIP = "7x"
_TARGET: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("flashloss_tpu_chip", default=None)


@contextlib.contextmanager
def target_chip(name: str) -> Iterator[None]:
    """Within the block, the Pallas kernels choose their blocks and VMEM request for the
    TPU chip ``name`` (``v5e``, ``v6e``, ``v5p``, ``7x``): for compiling ahead of time on a
    host that has no TPU, or another one. The chip is read when a step is traced."""
    chip(name)  # a clear error for an unknown name, here
    token = _TARGET.set(name)
    try:
        yield
    finally:
        _TARGET.reset(token)


#: Block sizes tried, largest first: multiples of 256 (v6e and v7x's MXU is 256 wide).
_ROW_BLOCKS = (1024, 768, 512, 256, 128)
_VOCAB_BLOCKS = (2048, 1024, 768, 512, 256, 128)
#: VMEM per element of an f32 operand of a product at HIGHEST precision: Mosaic splits it
#: into bf16 pieces (measured with libtpu 0.0.42 on v6e: 10-15 bytes per element of the
#: row block of the forward kernel; 16 bounds it).
F32_SPLIT_BYTES = 16

#: Chips whose XLA copies a bfloat16 head argument (tiled ``T(8,128)(2,1)``) into its own
#: tiling (``T(16,128)(2,1)``) before an XLA dot over it: seen in the single pass's HLO
#: compiled for v7x (a 1.16 GiB copy of a ``[151936, 4096]`` head, none on v5e, v6e, v5p).
#: The single pass's footprint counts the copy there.
RELAYOUTS_BF16_HEAD = ("7x",)


@dataclass(frozen=True)
class Chip:
    """What the kernels need of a chip (from JAX's record of it)."""

    name: str
    vmem_bytes: int
    hbm_bytes_per_s: float
    bf16_flops_per_s: float
    hbm_bytes: int

    @property
    def vmem_limit_bytes(self) -> int:
        """What every head kernel requests: 3/4 of the chip's VMEM."""
        return self.vmem_bytes * 3 // 4

    @property
    def block_budget_bytes(self) -> int:
        """The most a kernel's blocks may take: 80% of the request (the rest is Mosaic's)."""
        return self.vmem_limit_bytes * 4 // 5


def chip(name: Optional[str] = None) -> Chip:
    """The chip ``name`` (``v5e``, ``v6e``, ``7x``, ...), else :func:`target_chip`'s, else
    the attached TPU's, else :data:`DEFAULT_CHIP` on a host without one."""
    name = name if name is not None else _TARGET.get()
    if name is None:
        try:
            info = pltpu.get_tpu_info()
        except Exception:  # no TPU attached: a CPU host lowering for TPU, or interpret mode
            info = pltpu.get_tpu_info_for_chip(pltpu.ChipVersion(DEFAULT_CHIP), 1)
    else:
        try:
            version = pltpu.ChipVersion(name)
        except ValueError as e:
            known = ", ".join(c.value for c in pltpu.ChipVersion)
            raise ValueError(f"argument `chip`: unknown TPU chip {name!r} (known: {known})") from e
        info = pltpu.get_tpu_info_for_chip(version, 1)
    return Chip(
        name=info.chip_version.value,
        vmem_bytes=int(info.vmem_capacity_bytes),
        hbm_bytes_per_s=float(info.mem_bw_bytes_per_second),
        bf16_flops_per_s=float(info.bf16_ops_per_second),
        hbm_bytes=int(info.hbm_capacity_bytes),
    )


@dataclass(frozen=True)
class Blocks:
    """Rows and vocabulary entries of one grid step."""

    rows: int
    vocab: int


def _rows_bytes(bn: int, vectors: int) -> int:
    """Per-row ``(bn, 128)`` f32/int32 blocks (the value along the lanes), double-buffered."""
    return vectors * 2 * 4 * 128 * (-(-bn // 8) * 8)


def vmem_bytes(kernel: str, blocks: Blocks, hidden: int, itemsize: int) -> int:
    """The VMEM footprint of ``kernel`` (``forward``, ``dh``, ``dw``) at ``blocks``: an
    upper bound of Mosaic's scoped allocation (the module's formula, checked by compiling
    every kernel with libtpu for each chip, :mod:`flashloss.jax.tpu_compile`)."""
    bn, bv, h, e = blocks.rows, blocks.vocab, hidden, itemsize
    split = F32_SPLIT_BYTES if e == 4 else 0
    base = 2 * bn * h * e + 2 * bv * h * e + 4 * bn * bv * 4 + 2 * 8 * bv * 4 + split * bn * h
    if kernel == "forward":
        return base + _rows_bytes(bn, 6)
    if kernel == "dh":
        return base + 2 * bn * h * e + bn * h * 4 + split * bv * h + _rows_bytes(bn, 7)
    if kernel == "dw":
        return base + 2 * bv * h * e + bv * h * 4 + 2 * 8 * bv * 4 + split * bv * h + _rows_bytes(bn, 7)
    raise ValueError(f"argument `kernel`: expected forward, dh or dw, got {kernel!r}")


def _fit(size: int, prefs: tuple[int, ...], cap: Optional[int]) -> tuple[int, ...]:
    """The block sizes allowed along a dimension of ``size``, largest first: the whole
    dimension when it is no larger than a block (a block may equal the array's
    dimension), then the multiples of 128 tried; none above ``cap``."""
    if cap is not None:
        if cap < 128 or cap % 128:
            raise ValueError(f"argument `block_rows`/`block_vocab`: expected a multiple of 128, got {cap}")
        prefs = tuple(b for b in prefs if b <= cap) or (cap,)
    small = [b for b in prefs if b < size]
    return tuple([size] if size <= prefs[0] else []) + tuple(small)


def choose(
    kernel: str,
    n: int,
    v: int,
    hidden: int,
    itemsize: int,
    target: Chip,
    max_rows: Optional[int] = None,
    max_vocab: Optional[int] = None,
) -> Blocks:
    """The blocks of ``kernel`` for ``n`` rows and ``v`` vocabulary entries on ``target``:
    the forward and dH kernels stream the head once per row block, so they take the
    most rows first (the head's HBM traffic is ``n/bn·V·H·e``); the dW kernel streams
    the hidden states once per vocabulary block, so it takes the widest vocabulary
    block first. ``max_rows``, ``max_vocab``: caps (multiples of 128)."""
    rows, vocab = _fit(n, _ROW_BLOCKS, max_rows), _fit(v, _VOCAB_BLOCKS, max_vocab)
    pairs = [(r, c) for r in rows for c in vocab] if kernel != "dw" else [(r, c) for c in vocab for r in rows]
    for r, c in pairs:
        blocks = Blocks(r, c)
        if vmem_bytes(kernel, blocks, hidden, itemsize) <= target.block_budget_bytes:
            return blocks
    raise ValueError(
        f"argument `hidden`: H={hidden} leaves no block of rows and vocabulary entries within "
        f"{target.block_budget_bytes >> 20} MiB of VMEM on TPU {target.name}"
    )


def compiler_params(target: Chip, semantics: tuple[str, ...]) -> pltpu.CompilerParams:
    """Mosaic's parameters of a head kernel: grid semantics and the VMEM request."""
    return pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=target.vmem_limit_bytes)
