"""Packed (padding-free) GRPO batches, written once for both bindings: the rule that reads
a batch's sequences from ``cu_seqlens`` (flash-attention's and TRL's padding-free
collator's ``[B + 1]`` offsets) or from ``position_ids`` restarting at 0, its checks
(each a ``ValueError`` naming the argument), and where each packed row lies in the padded
``[B, T_max]`` batch it equals.

A packed batch holds its ``total_tokens`` rows back to back: sequence ``b`` is rows
``cu_seqlens[b] .. cu_seqlens[b+1]``. The kernels work on rows, so the hidden states
(or logits) stay ``[total_tokens, ...]``; only the per-token statistics (``logp``,
entropy, a few floats a row) are placed at ``(b, t)`` for the per-sequence reductions
(sequence-level ratios, vespo's ``log w_b``, each loss type's normalizer), which are
then those of the padded call exactly. Host values (NumPy): the bindings pass their
arrays' concrete values."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np


def _ints(arg: str, x) -> np.ndarray:
    a = np.asarray(x)
    if not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"argument `{arg}`: expected an integer dtype, got {a.dtype}")
    return a.astype(np.int64)


@dataclass(frozen=True)
class Segments:
    """The sequences of a packed batch: ``offsets`` ``[B + 1]`` (``cu_seqlens``: 0, then
    each sequence's end), with ``B``, ``total`` rows and ``max_len`` (``T_max``)."""

    offsets: np.ndarray

    @property
    def batch(self) -> int:
        return len(self.offsets) - 1

    @property
    def total(self) -> int:
        return int(self.offsets[-1])

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def max_len(self) -> int:
        return int(self.lengths.max())

    def padded_index(self) -> np.ndarray:
        """``b·T_max + t`` of each packed row ``[total]`` (int64): where it lies in the
        flattened ``[B, T_max]`` batch."""
        seq = np.repeat(np.arange(self.batch, dtype=np.int64), self.lengths)
        pos = np.arange(self.total, dtype=np.int64) - self.offsets[:-1][seq]
        return seq * self.max_len + pos

    @classmethod
    def of(cls, cu_seqlens=None, position_ids=None, *, total_tokens: int) -> "Segments":
        """The sequences given by exactly one of ``cu_seqlens`` (``[B + 1]``, from 0, strictly
        increasing, ending at ``total_tokens``: every sequence has a row) and
        ``position_ids`` (``[total_tokens]`` or ``[1, total_tokens]``, 0 at each
        sequence's first row and one more than the row before elsewhere)."""
        one_of(cu_seqlens, position_ids)
        if cu_seqlens is not None:
            cu = _ints("cu_seqlens", cu_seqlens)
            if cu.ndim != 1 or cu.shape[0] < 2:
                raise ValueError(f"argument `cu_seqlens`: expected shape [B + 1] with B >= 1, got {list(cu.shape)}")
            if cu[0] != 0:
                raise ValueError(f"argument `cu_seqlens`: must start at 0, got {int(cu[0])}")
            steps = np.diff(cu)
            if (steps <= 0).any():
                b = int(np.argmax(steps <= 0))
                raise ValueError(
                    f"argument `cu_seqlens`: must be strictly increasing (every sequence has a token), "
                    f"got {int(cu[b])} then {int(cu[b + 1])} at index {b}"
                )
            if cu[-1] != total_tokens:
                raise ValueError(
                    f"argument `cu_seqlens`: must end at total_tokens = {total_tokens} (the packed rows), "
                    f"got {int(cu[-1])}"
                )
            return cls(cu)
        pos = _ints("position_ids", position_ids)
        if pos.ndim == 2 and pos.shape[0] == 1:
            pos = pos[0]
        if pos.shape != (total_tokens,):
            raise ValueError(
                f"argument `position_ids`: expected shape [total_tokens={total_tokens}] or [1, total_tokens], "
                f"got {list(np.shape(position_ids))}"
            )
        if total_tokens == 0 or pos[0] != 0:
            first = None if total_tokens == 0 else int(pos[0])
            raise ValueError(f"argument `position_ids`: must start at 0 (a sequence's first row), got {first}")
        bad = (pos[1:] != 0) & (pos[1:] != pos[:-1] + 1)
        if bad.any():
            i = int(np.argmax(bad)) + 1
            raise ValueError(
                f"argument `position_ids`: must restart at 0 or count up by 1, got {int(pos[i - 1])} then "
                f"{int(pos[i])} at index {i}"
            )
        starts = np.flatnonzero(pos == 0)
        return cls(np.concatenate([starts, [total_tokens]]).astype(np.int64))


def one_of(cu_seqlens, position_ids) -> None:
    """Exactly one of the two ways to give the sequences."""
    if cu_seqlens is not None and position_ids is not None:
        raise ValueError("argument `position_ids`: give `cu_seqlens` or `position_ids`, not both")
    if cu_seqlens is None and position_ids is None:
        raise ValueError("argument `cu_seqlens`: a packed batch needs `cu_seqlens` or `position_ids`")


def per_sequence(arg: str, shape: tuple, batch: int) -> None:
    """``arg`` (the advantages) given once per packed sequence: ``[B]`` or ``[B, 1]``."""
    if tuple(shape) not in ((batch,), (batch, 1)):
        raise ValueError(
            f"argument `{arg}`: expected shape [B={batch}] or [B, 1] (one per sequence), got {list(shape)}"
        )


def per_row(arg: str, shape: tuple, total: int) -> None:
    """``arg`` given once per packed row: ``[total_tokens]`` or ``[1, total_tokens]``."""
    if tuple(shape) not in ((total,), (1, total)):
        raise ValueError(
            f"argument `{arg}`: expected shape [total_tokens={total}] or [1, total_tokens] (a packed batch), "
            f"got {list(shape)}"
        )


def sampler_ratio_kind(shape: tuple, segments: Segments) -> str:
    """``"sequence"`` for an ``importance_sampling_ratio`` ``[B]`` or ``[B, 1]``, ``"token"`` for
    ``[total_tokens]`` or ``[1, total_tokens]`` (either, when both read the same)."""
    b, n = segments.batch, segments.total
    if tuple(shape) in ((b,), (b, 1)):
        return "sequence"
    if tuple(shape) in ((n,), (1, n)):
        return "token"
    raise ValueError(
        f"argument `importance_sampling_ratio`: expected shape [B={b}], [B, 1] or [total_tokens={n}] "
        f"(a packed batch), got {list(shape)}"
    )


def rows_of(arg: str, shape: tuple, total: int, width: Optional[int] = None) -> None:
    """``arg`` (``hidden`` ``[..., H]`` or ``logits`` ``[..., V]``) holds ``total`` rows:
    ``[total_tokens, X]`` or ``[1, total_tokens, X]``."""
    rows = tuple(shape[:-1])
    if rows not in ((total,), (1, total)):
        x = "X" if width is None else str(width)
        raise ValueError(
            f"argument `{arg}`: a packed batch takes [total_tokens={total}, {x}] or [1, total_tokens, {x}], "
            f"got {list(shape)}"
        )
