"""The packed GRPO batch of test_packed.py and test_jax_packed.py (NumPy only): ragged
sequences with a length-1 one and a fully masked one, packed and padded."""

import numpy as np

from flashloss._spec import LOSS_TYPES

LENGTHS = [3, 1, 5, 2, 4]  # a length-1 sequence; sequence 3 is fully masked below
V, H = 13, 6
LEVELS = [(lt, lvl) for lt in LOSS_TYPES for lvl in ("token", "sequence") if (lt, lvl) != ("vespo", "sequence")]


def batch(seed=0, lengths=LENGTHS):
    """A packed batch and the same batch padded: dicts of numpy arrays."""
    rng = np.random.default_rng(seed)
    b, n, t = len(lengths), sum(lengths), max(lengths)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    seq = np.repeat(np.arange(b), lengths)
    pos = np.arange(n) - cu[:-1][seq]
    mask = rng.random(n) > 0.2
    mask[seq == 3] = False  # a fully masked sequence
    mask[seq == 1] = True
    packed = dict(
        hidden=rng.standard_normal((n, H)).astype(np.float32),
        ids=rng.integers(0, V, n),
        mask=mask,
        old=(-np.log(V) + 0.4 * rng.standard_normal(n)).astype(np.float32),
        ref=(-np.log(V) + 0.4 * rng.standard_normal(n)).astype(np.float32),
        rho_token=rng.uniform(0.5, 1.5, n).astype(np.float32),
        policy_mask=rng.random(n) > 0.3,
        entropy_mask=rng.random(n) > 0.3,
    )
    padded = {}
    for k, x in packed.items():
        fill = 1.0 if k == "rho_token" else 0
        out = np.full((b, t) + x.shape[1:], fill, x.dtype)
        out[seq, pos] = x
        padded[k] = out
    shared = dict(
        adv=rng.standard_normal(b).astype(np.float32),
        rho_seq=rng.uniform(0.5, 1.5, b).astype(np.float32),
        weight=(0.5 * rng.standard_normal((V, H))).astype(np.float32),
        bias=(0.1 * rng.standard_normal(V)).astype(np.float32),
        cu=cu,
        position_ids=pos.astype(np.int64),
        seq=seq,
        pos=pos,
    )
    return packed, padded, shared
