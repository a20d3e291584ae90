"""The single-pass plan of a token-local GRPO step on the head: 6NHV FLOPs, as the
materialized-logits step, holding one block of rows' logits at a time.

Token-local (:func:`flashloss.jax._policy.is_token_local`: token-level ratios, not vespo,
and here no sampler support, no mesh axis, no soft-cap): the loss is
``L = Σ_i w_i·ℓ_tot,i + Σ_i e_i·H_i`` with weights ``w`` and ``e`` known from the mask
alone (:func:`~flashloss.jax._policy.reduction_weights`, ``entropy_weights``), so each
row's gradient is known as soon as its statistics are. For each block of ``R`` rows
(a ``lax.scan``):

    Z_b  = X_b·Wᵀ (+ c)                        XLA's dot, in f32 (as the two kernels' tiles) 2·R·H·V
    (ℓ_b, logp_b, H_b, dZ_b) = logits_fused(Z_b)  one Pallas kernel: one read of Z_b, one write of dZ_b
    dX_b = dZ_b·W                              XLA's dot, dZ in the head's dtype           2·R·H·V
    dW  += dZ_bᵀ·X_b,  dc += Σ_rows dZ_b       XLA's dot into an f32 carry                 2·R·H·V

so ``6·N·H·V`` FLOPs in all (XLA's cost analysis counts the loop's body once: times the
blocks; unrolled, the step compiled for v6e counts 6NHV, but XLA then holds every block's
logits at once) against the two-pass kernels' ``10·N·H·V`` (forward, then dH
and dW each recomputing the logits). That is the **carry** plan. The **stored** plan keeps
every block's ``dZ_b`` (``N·V·e``) instead of the carry and forms ``dX = dZ·W`` and
``dW = dZᵀ·X`` once after the scan: no f32 carry read and written per block, the head not
re-read per block for ``dX`` (on chips whose XLA copies a bf16 head for its dots, the head's
products are Pallas kernels, :mod:`.products`, and ``dX`` is formed per block). Bytes held:
:func:`footprint_bytes`; the plan is chosen by its counted roofline estimate within the
budget (:func:`choose`; :func:`default_budget_bytes` without one; the counts:
docs/results/tpu_default_plan.md). The gradients are formed in the forward and
scaled by the loss's cotangent in the backward (a ``jax.custom_vjp``), as the logits
level's fused kernel does; only the gradients asked for are formed (a frozen head runs no
dW product), and without a gradient the pass runs no product but the logits'.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from ..._config import DEFAULT_BUDGET_MIB
from .. import _policy
from .._head import vocab_size
from . import _chips, logits
from . import products as head_products

#: Rows per block tried, largest first (multiples of 128 rows: the MXU's tile).
BLOCK_ROWS = (4096, 2048, 1024, 512, 256, 128)


@dataclass(frozen=True)
class Plan:
    """A single pass over blocks of ``rows`` rows. ``stored``: every block's ``dZ`` kept (in
    the head's dtype) and ``dX = dZ·W``, ``dW = dZᵀ·X`` formed once after the scan; else
    ``dX`` per block and ``dW`` in an f32 carry. ``flops``, ``bytes``, ``temp``: counted at
    the plan's shape (:func:`plans`), an estimate."""

    rows: int
    stored: bool
    flops: float
    bytes: float
    temp: int
    #: The products over the head as Pallas kernels (:mod:`.products`): the stored plan on
    #: a chip whose XLA copies a bf16 head for its dots (no copy then).
    pallas_products: bool = False

    def seconds(self, target: _chips.Chip) -> float:
        """The roofline estimate on ``target``: ``max(FLOPs / bf16 rate, bytes / HBM rate)``."""
        return max(self.flops / target.bf16_flops_per_s, self.bytes / target.hbm_bytes_per_s)


def footprint_bytes(rows: int, v: int, hidden: int, itemsize: int = 4, n: int = 0, head_copy_bytes: int = 0) -> int:
    """Bytes the plan holds beyond its inputs and outputs: a block's f32 logits and its
    ``dZ`` in the head's dtype (``rows·V·(4 + itemsize)``; in f32 ``dZ`` is written over the
    logits: ``rows·V·4``), the copy of the head the chip's
    compiler makes for its dots (``_chips.RELAYOUTS_BF16_HEAD``), and either every row's
    ``dZ`` (``n·V·itemsize``, ``n > 0``: the stored plan) or the f32 ``dW`` and ``dc``
    carries (``V·H·4 + V·4``; with an f32 head XLA aliases the dW carry to the dW output:
    ``V·4``)."""
    kept = n * v * itemsize if n else (v * hidden * 4 if itemsize != 4 else 0) + v * 4
    return rows * v * (4 + (itemsize if itemsize != 4 else 0)) + kept + head_copy_bytes


def plans(n: int, v: int, hidden: int, itemsize: int, head_copy_bytes: int = 0) -> list[Plan]:
    """Every single-pass plan of ``n`` rows (blocks of :data:`BLOCK_ROWS`, or ``n`` when
    smaller; ``stored`` for a head narrower than f32), its FLOPs (6NHV) and HBM bytes
    counted (``W = V·H·e``): a block reads ``W`` for ``Z_b``, writes ``Z_b`` f32 and the
    kernel reads it and writes ``dZ_b``; the carry plan reads ``W`` again for ``dX_b`` and
    reads and writes the f32 carry per block, the stored plan reads every ``dZ`` twice and
    ``W``, ``X`` once after the scan (docs/results/tpu_default_plan.md)."""
    w, x, out = v * hidden * itemsize, n * hidden * itemsize, []
    for rows in sorted({min(r, n) for r in BLOCK_ROWS}, reverse=True):
        blocks = -(-n // rows)
        z, dz = rows * v * 4, rows * v * itemsize
        carry = blocks * (2 * w + 2 * z + 3 * dz + 2 * v * hidden * 4 + 2 * rows * hidden * itemsize)
        kinds = [(False, carry)]
        if itemsize < 4:
            after = 2 * n * v * itemsize + 2 * (w + x)  # dZ read by both products, W and X once, dX and dW written
            if head_copy_bytes:  # dX per block in Pallas (:mod:`.products`): the head once per 512 rows
                after -= n * v * itemsize + w
                after += blocks * (-(-rows // 512) * w + dz)
            kinds.append((True, blocks * (w + 2 * z + dz + rows * hidden * itemsize) + after))
        for stored, traffic in kinds:
            copy = 0 if stored else head_copy_bytes
            temp = footprint_bytes(rows, v, hidden, itemsize, n if stored else 0, copy)
            out.append(Plan(rows, stored, 6.0 * n * hidden * v, float(traffic), temp, stored and head_copy_bytes > 0))
    return out


def two_pass_seconds(n: int, v: int, hidden: int, itemsize: int, target: _chips.Chip) -> float:
    """The two kernels' roofline estimate on ``target``: 10NHV, the head read by the forward
    and the dH kernel once per row block and the rows by the dW kernel once per vocabulary
    tile, in the blocks :func:`._chips.choose` takes there."""
    w, x = v * hidden * itemsize, n * hidden * itemsize
    fwd, dh, dw = (_chips.choose(k, n, v, hidden, itemsize, target) for k in ("forward", "dh", "dw"))
    traffic = (-(-n // fwd.rows) + -(-n // dh.rows)) * w + -(-v // dw.vocab) * x + 2 * w
    return max(10.0 * n * hidden * v / target.bf16_flops_per_s, traffic / target.hbm_bytes_per_s)


def default_budget_bytes(n: int, v: int, hidden: int, itemsize: int, target: _chips.Chip) -> int:
    """The budget of a call with no ``budget_mib`` on ``target``: half the peak of the step
    that materializes the f32 logits and their gradient (``2·n·V·4`` of temp beside the
    arguments and outputs ``2·(n + V)·H·e``) less this step's own arguments and outputs,
    ``n·V·4 − (n + V)·H·e``, within a quarter of the chip's HBM; never below the CPU
    default (:data:`flashloss._config.DEFAULT_BUDGET_MIB`)."""
    half = n * v * 4 - (n + v) * hidden * itemsize
    return max(int(DEFAULT_BUDGET_MIB * 2**20), min(half, target.hbm_bytes // 4))


def choose(mode: str, budget_bytes: float, n: int, v: int, hidden: int, itemsize: int, target: _chips.Chip,
           head_copy_bytes: int = 0) -> Optional[Plan]:  # fmt: skip
    """The plan with the lowest roofline estimate on ``target`` (then the fewest bytes)
    whose temp fits ``budget_bytes``; ``auto``: None (the two kernels) where none fits or
    the two kernels' estimate is lower; ``single_pass``: the smallest carry block where none
    fits."""
    found = plans(n, v, hidden, itemsize, head_copy_bytes)
    fits = sorted((p for p in found if p.temp <= budget_bytes), key=lambda p: (p.seconds(target), p.bytes, p.temp))
    if mode in ("single_pass", "compact"):
        return fits[0] if fits else min((p for p in found if not p.stored), key=lambda p: p.rows)
    if fits and fits[0].seconds(target) <= two_pass_seconds(n, v, hidden, itemsize, target):
        return fits[0]
    return None


def _dot(a, b, contract: tuple[int, int], dtype) -> jax.Array:
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(
        a, b, ((contract[:1], contract[1:]), ((), ())), precision=precision, preferred_element_type=jnp.float32
    ).astype(dtype)


def _row_inputs(mask, adv, old, ref, ratio, args: _policy.GrpoArgs) -> tuple[list, callable]:
    """The per-row ``[N]`` f32 inputs of the fused kernel and its row function
    ``w·ℓ_tot + e·H`` (``logits.logits_fused``'s ``row_fn``)."""
    b, t = mask.shape
    has_old, has_kl, has_rho = old is not None, ref is not None and args.beta != 0.0, ratio is not None
    columns = [jnp.broadcast_to(adv[:, None], (b, t)), _policy.reduction_weights(mask, args)]
    columns.append(_policy.entropy_weights(mask, args))
    columns += ([old] if has_old else []) + ([ref] if has_kl else [])
    columns += [jnp.broadcast_to(jnp.where(mask, ratio, 1.0), (b, t))] if has_rho else []

    def row_fn(logp, entropy, adv, w, e, *rest):
        rest = list(rest)
        rho_row = rest.pop() if has_rho else None
        old_row = rest[0] if has_old else None
        ref_row = rest[-1] if has_kl else None
        return w * _policy.token_loss(logp, entropy, old_row, ref_row, adv, args, ratio=rho_row) + e * entropy

    return [c.reshape(-1).astype(jnp.float32) for c in columns], row_fn


def _pieces(x, weight, bias, ids, mask, adv, old, ref, ratio, args, layout, plan, interpret, wants):
    """``(block, zero, xs, finish)`` of the single pass (see :func:`_step`): the scan's body,
    its initial carry, its blocked inputs, and ``finish(carry, ys) -> (loss, (logp,
    entropy), (dX, dW, dc))``."""
    n, hidden = x.shape
    v = vocab_size(weight, layout)
    rows = plan.rows
    want_dx, want_dw, want_dc = wants[0], wants[1], wants[2] and bias is not None
    stored = plan.stored and (want_dx or want_dw or want_dc)
    columns, row_fn = _row_inputs(mask, adv, old, ref, ratio, args)
    live = mask.reshape(-1)
    pad = -n % rows

    def blocks(a):
        return jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)).reshape(-1, rows, *a.shape[1:])

    w_contract = 1 if layout == "vh" else 0  # Z = X·Wᵀ over H

    def products(dz, xb, with_dx=want_dx):
        """``(dX_b, dWᵀ_b or dW_b, dc_b)`` of rows ``xb`` with ``dz`` (the head's dtype)."""
        dx = None
        if with_dx and plan.pallas_products:
            dx = head_products.hidden_grad(dz, weight, layout, x.dtype, interpret=interpret)
        elif with_dx:
            dx = _dot(dz, weight, (1, 1 - w_contract), x.dtype)
        dw = None
        if want_dw:
            dw = _dot(dz, xb, (0, 0), jnp.float32) if layout == "vh" else _dot(xb, dz, (0, 0), jnp.float32)
        dc = jnp.sum(dz.astype(jnp.float32), axis=0) if want_dc else None
        return dx, dw, dc

    def block(carry, xs):
        dw, dc = carry
        xb, yb, lb, *cb = xs
        if plan.pallas_products:
            z = head_products.logits(xb, weight, layout, interpret=interpret)
        else:
            z = _dot(xb, weight, (1, w_contract), jnp.float32)
        if bias is not None:
            z = z + bias.astype(jnp.float32)
        # the products on the head's dtype, as the two kernels' are
        row_loss, logp, entropy, dz = logits.logits_fused(
            z, yb, cb, row_fn, mask=lb, temperature=args.temperature, interpret=interpret, dz_dtype=weight.dtype,
            in_place=True,
        )  # fmt: skip
        if stored:
            # with Pallas products dX per block (XLA would copy the stacked dZ into the kernel's
            # tiling); the barriers: XLA would fuse a kernel into the stacking's update, at its
            # own VMEM limit (32 MiB)
            barrier = jax.lax.optimization_barrier
            dx = products(dz, xb)[0] if plan.pallas_products else None
            dx = None if dx is None else barrier(dx)
            kept = barrier(dz) if want_dw or want_dc or not plan.pallas_products else None
            return carry, (row_loss, logp, entropy, dx, kept)
        dx, dw_b, dc_b = products(dz, xb)
        dw = dw if dw_b is None else dw + dw_b
        dc = dc if dc_b is None else dc + dc_b
        return (dw, dc), (row_loss, logp, entropy, dx, None)

    zero = (
        jnp.zeros(weight.shape, jnp.float32) if want_dw and not stored else None,
        jnp.zeros((v,), jnp.float32) if want_dc and not stored else None,
    )
    xs = (blocks(x), blocks(ids.reshape(-1).astype(jnp.int32)), blocks(live), *(blocks(c) for c in columns))

    def finish(carry, ys):
        (dw, dc), (row_loss, logp, entropy, dx, dz) = carry, ys
        if stored and dz is not None:  # every block's dZ: the products once, over all (padded) rows
            late = want_dx and not plan.pallas_products
            dx_late, dw, dc = products(dz.reshape(-1, v), xs[0].reshape(-1, hidden), late)
            dx = dx_late if late else dx
        logp, entropy = (y.reshape(-1)[:n].reshape(mask.shape) for y in (logp, entropy))
        dx = None if dx is None else dx.reshape(-1, hidden)[:n]
        return jnp.sum(row_loss), (logp, entropy), (dx, dw, dc)

    return block, zero, xs, finish


def _step(x, weight, bias, ids, mask, adv, old, ref, ratio, args, layout, plan, interpret, wants=(False,) * 3):
    """``(loss, (logp, entropy), (dX, dW, dc))`` of the single pass (see the module) in
    ``plan``'s blocks: of the gradients only those ``wants`` asks for (of ``x``, ``weight``,
    ``bias``; None for the others); none: no product but the logits'."""
    block, zero, xs, finish = _pieces(x, weight, bias, ids, mask, adv, old, ref, ratio, args, layout, plan, interpret,
                                      wants)  # fmt: skip
    return finish(*jax.lax.scan(block, zero, xs))


def one_block(args: _policy.GrpoArgs, layout: str, plan: Plan, wants=(True, True, False)) -> Callable:
    """``f(x, weight, bias, ids, mask, adv, old, ref, ratio, carry) -> (carry, ys)``: the
    scan's body on its first block, as the step traces it (``carry``: the f32 ``(dW, dc)``
    of the carry plan, or ``(None, None)``). XLA's cost analysis counts a loop's body once;
    compiling this gives one trip's FLOPs and bytes (:mod:`flashloss.jax.tpu_compile`)."""

    def f(x, weight, bias, ids, mask, adv, old, ref, ratio, carry):
        block, _, xs, _ = _pieces(x, weight, bias, ids, mask, adv, old, ref, ratio, args, layout, plan, False, wants)
        return block(carry, tuple(a[0] for a in xs))

    return f


@functools.partial(jax.custom_vjp, nondiff_argnums=(9, 10, 11, 12))
def _grpo(x, weight, bias, ids, mask, adv, old, ref, ratio, args, layout, plan, interpret):
    loss, stats, _ = _step(x, weight, bias, ids, mask, adv, old, ref, ratio, args, layout, plan, interpret)
    return loss, stats


def _value(a):
    """``(value, perturbed)`` of a primal under symbolic zeros (``None`` stays ``None``)."""
    return (None, False) if a is None else (a.value, a.perturbed)


def _fwd(x, weight, bias, ids, mask, adv, old, ref, ratio, args, layout, plan, interpret):
    (x, want_dx), (weight, want_dw), (bias, want_db) = _value(x), _value(weight), _value(bias)
    ids, mask, adv, old, ref, ratio = (_value(a)[0] for a in (ids, mask, adv, old, ref, ratio))
    wants = (want_dx, want_dw, want_db)
    loss, stats, grads = _step(x, weight, bias, ids, mask, adv, old, ref, ratio, args, layout, plan, interpret, wants)
    dtypes = tuple(None if a is None else jnp.zeros((), a.dtype) for a in (weight, bias))  # scalars of each dtype
    return (loss, stats), (grads, dtypes)


def _bwd(args, layout, plan, interpret, res, cts):
    (dx, dw, dc), (w_dtype, b_dtype) = res
    g = cts[0]  # the statistics carry no gradient (the caller stops it)
    dx = None if dx is None else (g * dx).astype(dx.dtype)
    dw = None if dw is None else (g * dw).astype(w_dtype.dtype)
    dc = None if dc is None else (g * dc).astype(b_dtype.dtype)
    return (dx, dw, dc, None, None, None, None, None, None)


_grpo.defvjp(_fwd, _bwd, symbolic_zeros=True)


def grpo(
    x, weight, bias, ids, mask, adv, old, ref, ratio, args: _policy.GrpoArgs, layout: str, plan: Plan, interpret: Any
):
    """``(loss, (logp, entropy))`` of a token-local GRPO step on rows ``x`` ``[N, H]``
    (``ids``, ``mask``, ``old``, ``ref`` ``[B, T]`` with ``B·T = N``; ``adv`` ``[B]``;
    ``ratio`` ``[B, 1]``, ``[B, T]`` or None) in one pass over ``plan``'s blocks;
    differentiable in ``x``, ``weight`` and ``bias``."""
    return _grpo(x, weight, bias, ids, mask, adv, old, ref, ratio, args, layout, plan, interpret)
