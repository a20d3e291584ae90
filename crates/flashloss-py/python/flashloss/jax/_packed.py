"""Packed (padding-free) GRPO batches in :mod:`flashloss.jax`: ``hidden`` (or the logits)
``[total_tokens, ...]`` with the sequences given by ``cu_seqlens`` or ``position_ids``
(the rule: :mod:`flashloss._spec.packed`).

The head runs on the packed rows (:func:`linear_logprobs`, differentiable in ``logp``
and the entropy; no ``[B, T_max, H]`` copy); each row's statistics are then placed at
``(b, t)`` of a padded ``[B, T]`` batch (these O(B·T) floats only) and the loss is
``_policy.grpo_policy_loss``'s, the padded call's. With concrete sequences (NumPy or
concrete arrays) ``T = T_max`` and a bad one is a ``ValueError`` at trace time; traced
ones (under ``jax.jit``) take ``T = total_tokens`` and the same rule runs in a host
callback (a ``JaxRuntimeError`` carrying the same message)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from .._spec import GrpoArgs
from .._spec import packed as P
from . import _args as A
from . import _policy
from ._collectives import over_tokens
from ._losses import linear_logprobs
from . import _checks


def _concrete(x) -> Optional[np.ndarray]:
    """``x``'s values on the host, or None for a tracer (None stays None)."""
    if x is None:
        return None
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


class Packed:
    """A packed call's sequences and per-row inputs, checked: ``ids`` ``[N]``, ``mask``
    ``[N]`` bool, ``advantages`` ``[B]``, and ``index`` ``[N]``, each row's ``b·T + t``."""

    def __init__(self, cu_seqlens, position_ids, completion_ids, completion_mask, advantages):
        ids = A.int_ids("completion_ids", completion_ids)
        n = ids.shape[-1] if ids.ndim else 0
        P.per_row("completion_ids", ids.shape, n)
        adv = jnp.asarray(advantages, jnp.float32)
        self.n = n
        cu, pos = _concrete(cu_seqlens), _concrete(position_ids)
        if (cu_seqlens is None or cu is not None) and (position_ids is None or pos is not None):
            seg = P.Segments.of(cu, pos, total_tokens=n)
            P.per_sequence("advantages", adv.shape, seg.batch)
            self.shape = (seg.batch, seg.max_len)
            self.index = jnp.asarray(seg.padded_index(), jnp.int32)
        else:  # traced: T = N, the rule checked on the host when the program runs
            self.shape, self.index = self._traced(cu_seqlens, position_ids, adv.shape, n)
        self.ids = ids.reshape(n)
        self.mask = jnp.ones(n, bool) if completion_mask is None else self.rows("completion_mask", completion_mask) != 0
        self.advantages = adv.reshape(self.shape[0])

    @staticmethod
    def _traced(cu_seqlens, position_ids, adv_shape, n):
        rows = jnp.arange(n, dtype=jnp.int32)
        P.one_of(cu_seqlens, position_ids)
        if cu_seqlens is not None:
            cu = A.int_ids("cu_seqlens", cu_seqlens)
            if cu.ndim != 1 or cu.shape[0] < 2:
                raise ValueError(f"argument `cu_seqlens`: expected shape [B + 1] with B >= 1, got {list(cu.shape)}")
            b = cu.shape[0] - 1
            P.per_sequence("advantages", adv_shape, b)
            seq = jnp.clip(jnp.searchsorted(cu, rows, side="right") - 1, 0, b - 1).astype(jnp.int32)
            pos = rows - cu[seq].astype(jnp.int32)
            jax.debug.callback(lambda c: P.Segments.of(c, None, total_tokens=n), cu)
        else:
            p = A.int_ids("position_ids", position_ids)
            P.per_row("position_ids", p.shape, n)
            b = adv_shape[0] if len(adv_shape) else 0
            p = p.reshape(n).astype(jnp.int32)
            seq = jnp.clip(jnp.cumsum(p == 0) - 1, 0, max(b - 1, 0)).astype(jnp.int32)
            pos = p

            def check(p):
                P.per_sequence("advantages", adv_shape, P.Segments.of(None, p, total_tokens=n).batch)

            jax.debug.callback(check, p)
        return (b, n), seq * n + jnp.clip(pos, 0, n - 1)

    def rows(self, arg: str, x):
        """A per-row input ``[N]`` or ``[1, N]`` as ``[N]`` (None as None)."""
        if x is None:
            return None
        x = jnp.asarray(x)
        P.per_row(arg, x.shape, self.n)
        return x.reshape(self.n)

    def padded(self, x, fill=0):
        """Per-row values ``[N]`` placed in the padded ``[B, T]`` batch (``fill`` elsewhere)."""
        if x is None:
            return None
        out = jnp.full(self.shape[0] * self.shape[1], fill, x.dtype)
        return out.at[self.index].set(x, mode="drop").reshape(self.shape)

    def packed(self, x):
        """A padded ``[B, T]`` array's values at the packed rows ``[N]``."""
        return x.reshape(-1)[self.index]

    def sampler_ratio(self, ratio):
        if ratio is None:
            return None
        rho = jnp.asarray(ratio, jnp.float32)
        b = self.shape[0]
        if rho.shape in ((b,), (b, 1)):
            return rho.reshape(b, 1)
        if rho.shape in ((self.n,), (1, self.n)):
            return self.padded(rho.reshape(self.n), 1.0)
        raise ValueError(
            f"argument `importance_sampling_ratio`: expected shape [B={b}], [B, 1] or [total_tokens={self.n}] "
            f"(a packed batch), got {list(rho.shape)}"
        )

    def loss(self, logp, entropy, outside, per_token: dict, args: GrpoArgs, token_axis=None):
        """``(loss, (logp, entropy, kl, metrics))`` from the rows' ``logp`` and ``entropy``
        ``[N]`` (differentiable); ``outside`` ``[N]`` (masked out) or None."""
        kept = self.mask if outside is None else self.mask & ~outside
        old, ref = (self.rows(a, per_token[a]) for a in ("old_per_token_logps", "ref_per_token_logps"))
        old, ref = (None if x is None else x.astype(jnp.float32) for x in (old, ref))
        masks = [self.rows(a, per_token[a]) for a in ("policy_mask", "entropy_mask")]
        masks = [None if m is None else self.padded(m != 0, False) for m in masks]
        rho = self.sampler_ratio(per_token["importance_sampling_ratio"])
        for name, values in (("advantages", self.advantages), ("old_per_token_logps", old),
                             ("ref_per_token_logps", ref)):  # fmt: skip
            _checks.finite(name, values, None if name == "advantages" else kept, True)
        kept_p = self.padded(kept, False)
        if rho is not None:
            _checks.sampler_ratio(rho, kept_p, True)
        loss, kl, metrics = _policy.grpo_policy_loss(
            self.padded(jnp.where(kept, logp, 0.0)), self.padded(entropy), kept_p, self.advantages,
            self.padded(old), self.padded(ref), args, rho, policy_mask=masks[0], entropy_mask=masks[1],
        )  # fmt: skip
        if token_axis is not None:
            per_seq = _policy.clips_per_sequence(args, self.advantages)
            loss, metrics = over_tokens(loss, metrics, kept_p, token_axis, args, per_seq)
        return loss, (logp, entropy, self.packed(kl), metrics)


def linear_grpo(packed: Packed, hidden, weight, bias, per_token: dict, args: GrpoArgs, head: dict, token_axis):
    """The packed ``linear_grpo_loss``; ``head``: ``linear_logprobs``' plan and path
    arguments."""
    P.rows_of("hidden", hidden.shape, packed.n)
    f = args.filters
    out = linear_logprobs(
        hidden.reshape(packed.n, hidden.shape[-1]),
        weight,
        packed.ids,
        temperature=args.temperature,
        return_entropy=True,
        bias=bias,
        mask=packed.mask,
        **asdict(f),
        **head,
    )
    outside = None if out.outside_support is None or not f.truncates else out.outside_support
    loss, aux = packed.loss(out.logp, out.entropy, outside, per_token, args, token_axis)
    return loss, aux, (None if outside is None else packed.mask & outside)


def logits_grpo(packed: Packed, logits, per_token: dict, args: GrpoArgs):
    """The packed ``grpo_loss`` on ``logits`` ``[N, V]``: each row's log-softmax in JAX
    (float32)."""
    logits = A.floats("logits", logits)
    P.rows_of("logits", logits.shape, packed.n)
    z = logits.reshape(packed.n, logits.shape[-1]).astype(jnp.float32) / args.temperature
    z = jnp.where(packed.mask[:, None], z, 0.0)
    _checks.ids_in_range("completion_ids", packed.ids, packed.mask, z.shape[-1], packed.n, True)
    logsm = jax.nn.log_softmax(z, axis=-1)
    ids = jnp.clip(packed.ids, 0, z.shape[-1] - 1)
    logp = jnp.where(packed.mask, jnp.take_along_axis(logsm, ids[:, None], axis=-1)[:, 0], 0.0)
    entropy = jnp.where(packed.mask, -jnp.sum(jnp.exp(logsm) * logsm, axis=-1), 0.0)
    return packed.loss(logp, entropy, None, per_token, args)
