"""The losses on the Pallas path: the head's per-row statistics from the kernels
(:func:`.stats.row_stats`, a ``custom_vjp``), and above them the loss in plain JAX
(:mod:`flashloss.jax._policy`: TRL's GRPO, the cross-entropy), which JAX
differentiates, as TRL 1.14+ does. Arguments arrive checked and shaped by
:mod:`flashloss.jax`; what only the data can tell is checked here (:mod:`.checks`)."""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp

from .. import _policy
from .. import _checks as checks
from . import _chips, logits, single_pass, support
from .head import Transform, vocab_size
from .single_pass import Plan
from .stats import HeadSpec, RowStats, row_stats


def logprob_stats(x, weight, bias, ids, live, spec: HeadSpec, seq_len: int, ids_arg: str = "ids") -> RowStats:
    """:class:`.stats.RowStats` ``[N]`` of rows ``x`` ``[N, H]`` at ``ids`` (0 where not
    ``live``), checked, with ``logp_k`` and ``outside`` under ``spec.support``
    (:mod:`.support`); ``ids_arg`` names ``ids`` in errors."""
    checks.ids_in_range(ids_arg, ids, live, spec.vocab, seq_len, spec.interpret)
    stats_fn = row_stats if spec.support is None else support.row_stats
    stats = stats_fn(x, weight, bias, jnp.where(live, ids, 0).astype(jnp.int32), live, spec)
    checks.row_stats_finite(stats.lse, stats.logp, live, seq_len, spec.interpret)
    return stats


def _check_batch(adv, old, ref, ratio, mask, interpret) -> None:
    """The GRPO batch's values: finite advantages, old and ref logp (where live), a
    finite non-negative sampler ratio."""
    for name, values in (("advantages", adv), ("old_per_token_logps", old), ("ref_per_token_logps", ref)):
        checks.finite(name, values, None if name == "advantages" else mask, interpret)
    checks.sampler_ratio(ratio, mask, interpret)


def single_pass_plan(mode: str, budget_mib: Optional[float], x, weight, spec: HeadSpec, args) -> Optional[Plan]:
    """The single-pass plan (:func:`.single_pass.choose`), or None for the two kernels'.
    ``mode`` as the FFI path's: ``two_pass`` never; ``single_pass`` (and ``compact``)
    whenever the step allows it; ``auto`` (and ``auto_f32``) where a plan fits the budget
    and its roofline estimate is the lower. ``budget_mib`` None: the chip's default
    (:func:`.single_pass.default_budget_bytes`). The step allows it when token-local, on
    one device, with no sampler support."""
    allowed = _policy.is_token_local(args) and spec.support is None and spec.vocab_axis is None
    if mode == "two_pass" or not allowed or spec.transform.softcap is not None:
        return None
    n, hidden = x.shape
    v = vocab_size(weight, spec.layout)
    target, e = _chips.chip(spec.chip), jnp.dtype(weight.dtype).itemsize
    copy = v * hidden * 2 if weight.dtype == jnp.bfloat16 and target.name in _chips.RELAYOUTS_BF16_HEAD else 0
    budget = single_pass.default_budget_bytes(n, v, hidden, e, target) if budget_mib is None else budget_mib * 2**20
    return single_pass.choose(mode, budget, n, v, hidden, e, target, copy)


def grpo(
    hidden, weight, bias, ids, mask, adv, old, ref, ratio, args: _policy.GrpoArgs, spec: HeadSpec,
    mode: str = "two_pass", budget_mib: Optional[float] = 0.0,
):  # fmt: skip
    """``(loss, (logp, entropy, kl, metrics))`` of TRL's GRPO loss at ``ids`` ``[B, T]``
    (``ratio``: the sampler's importance ratio ``[B, 1]``, ``[B, T]`` or None). Under the
    sampler's truncated support (``spec.support``) the loss takes ``logp^K`` and masks the
    tokens outside (docs/spec/losses.md, flashloss addition 13), and ``logp`` is ``-inf``
    there. ``mode``, ``budget_mib``: the plan (:func:`single_pass_rows`)."""
    b, t = ids.shape
    _check_batch(adv, old, ref, ratio, mask, spec.interpret)
    x = hidden.reshape(b * t, hidden.shape[-1])
    plan = single_pass_plan(mode, budget_mib, x, weight, spec, args)
    if plan is not None:
        checks.ids_in_range("completion_ids", ids, mask, spec.vocab, t, spec.interpret)
        ids0 = jnp.where(mask, ids, 0).astype(jnp.int32)
        loss, (logp, entropy) = single_pass.grpo(
            x, weight, bias, ids0, mask, adv, old, ref, ratio, args, spec.layout, plan, spec.interpret
        )
        # the entropy is finite exactly where the row's logits are (lse's place in the check)
        checks.row_stats_finite(entropy, logp, mask, t, spec.interpret)
        logp, entropy = jax.lax.stop_gradient((logp, entropy))
        _, kl, metrics = _policy.grpo_policy_loss(logp, entropy, mask, adv, old, ref, args, ratio)
        return loss, (logp, entropy, kl, metrics)
    st = logprob_stats(x, weight, bias, ids.reshape(-1), mask.reshape(-1), spec, t, "completion_ids")
    logp, entropy = st.logp.reshape(b, t), st.entropy.reshape(b, t)
    if spec.support is None:
        loss, kl, metrics = _policy.grpo_policy_loss(logp, entropy, mask, adv, old, ref, args, ratio)
        return loss, (logp, entropy, kl, metrics)
    logp_k, outside = st.logp_k.reshape(b, t), st.outside.reshape(b, t)
    kept = mask & ~outside
    loss, kl, metrics = _policy.grpo_policy_loss(
        jnp.where(kept, logp_k, 0.0), entropy, kept, adv, old, ref, args, ratio
    )
    return loss, (logp_k, entropy, kl, metrics)


def cross_entropy(
    x,
    weight,
    bias,
    targets,
    spec: HeadSpec,
    *,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    reduction: str,
) -> jax.Array:
    """``(loss, lse)``: the cross-entropy of rows ``x`` ``[N, H]`` at ``targets`` ``[N]``, a
    scalar (mean over rows whose target is not ``ignore_index``, or sum) or ``[N]``
    (none), and each row's log-sum-exp ``[N]`` (0 where ignored), both differentiable."""
    live = targets != ignore_index
    checks.ids_in_range("targets", targets, live, spec.vocab, targets.shape[0], spec.interpret)
    stats = row_stats(x, weight, bias, jnp.where(live, targets, 0).astype(jnp.int32), live, spec)
    checks.row_stats_finite(stats.lse, stats.logp, live, targets.shape[0], spec.interpret)
    loss = _policy.ce_loss_from_stats(
        stats.lse, stats.logp, stats.mean, live, label_smoothing=label_smoothing, z_loss=z_loss, reduction=reduction
    )
    return loss, stats.lse


def _token_local_step(z, ids, mask, adv, old, ref, ratio, args: _policy.GrpoArgs, interpret):
    """One :func:`.logits.logits_fused` call: each live row's ``w_i·ℓ_i`` and its
    ``dlogits`` (``w`` the reduction weights, from the mask alone), then the KL and the
    metrics from the rows' statistics."""
    b, t, v = z.shape
    has_old, has_kl, has_rho = (old is not None, ref is not None and args.beta != 0.0, ratio is not None)
    inputs = [jnp.broadcast_to(adv[:, None], (b, t)), _policy.reduction_weights(mask, args)]
    inputs += ([old] if has_old else []) + ([ref] if has_kl else [])
    inputs += [jnp.broadcast_to(ratio, (b, t))] if has_rho else []

    def row_fn(logp, entropy, adv, w, *rest):
        rest = list(rest)
        rho_row = rest.pop() if has_rho else None
        old_row = rest[0] if has_old else None
        ref_row = rest[-1] if has_kl else None
        return w * _policy.token_loss(logp, entropy, old_row, ref_row, adv, args, ratio=rho_row)

    row_loss, logp, entropy, dz = logits.logits_fused(
        z.reshape(b * t, v), ids.reshape(-1), [x.reshape(-1).astype(jnp.float32) for x in inputs], row_fn,
        mask=mask.reshape(-1), temperature=args.temperature, interpret=interpret,
    )  # fmt: skip
    logp, entropy = logp.reshape(b, t), entropy.reshape(b, t)
    _, kl, metrics = _policy.grpo_policy_loss(logp, entropy, mask, adv, old, ref, args, ratio)
    return jnp.sum(row_loss), (logp, entropy, kl, metrics), dz.reshape(z.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _token_local(z, ids, mask, adv, old, ref, ratio, args, interpret):
    loss, aux, _ = _token_local_step(z, ids, mask, adv, old, ref, ratio, args, interpret)
    return loss, aux


def _token_local_fwd(z, ids, mask, adv, old, ref, ratio, args, interpret):
    loss, aux, dz = _token_local_step(z, ids, mask, adv, old, ref, ratio, args, interpret)
    return (loss, aux), dz


def _token_local_bwd(args, interpret, dz, cts):
    return ((cts[0] * dz).astype(dz.dtype), None, None, None, None, None, None)


_token_local.defvjp(_token_local_fwd, _token_local_bwd)


def grpo_logits(z, ids, mask, adv, old, ref, ratio, args: _policy.GrpoArgs, interpret: Any):
    """TRL's GRPO loss on logits ``z`` ``[B, T, V]``: ``(loss, (logp, entropy, kl,
    metrics))``. A token-local loss (token-level ratios, not vespo) runs one fused kernel,
    one read and one write of the logits; the others need every token of a sequence
    before any token's gradient, so they run the statistics kernel, the loss in JAX, and
    the gradient kernel (two reads, one write)."""
    b, t, v = z.shape
    checks.ids_in_range("completion_ids", ids, mask, v, t, interpret)
    _check_batch(adv, old, ref, ratio, mask, interpret)
    ids = jnp.where(mask, ids, 0).astype(jnp.int32)
    if _policy.is_token_local(args):
        if ratio is not None and ratio.shape == mask.shape:
            ratio = jnp.where(mask, ratio, 1.0)  # masked tokens' values are never read
        return _token_local(z, ids, mask, adv, old, ref, ratio, args, interpret)
    logp, entropy = logits.logits_logprobs(
        z.reshape(b * t, v), ids.reshape(-1), mask=mask.reshape(-1), temperature=args.temperature, interpret=interpret
    )
    logp, entropy = logp.reshape(b, t), entropy.reshape(b, t)
    loss, kl, metrics = _policy.grpo_policy_loss(logp, entropy, mask, adv, old, ref, args, ratio)
    return loss, (logp, entropy, kl, metrics)


def grpo_logits_rows(z, ids, mask, adv, old, ref, ratio, args: _policy.GrpoArgs, interpret: Any):
    """The per-token losses on logits ``z`` ``[B, T, V]`` (Liger's ``reduce=False``):
    ``(token_loss, (kl, clipped))`` ``[B, T]`` from the statistics kernel and the loss in
    JAX, which JAX differentiates (the gradient kernel then takes each token's cotangent)."""
    b, t, v = z.shape
    checks.ids_in_range("completion_ids", ids, mask, v, t, interpret)
    _check_batch(adv, old, ref, ratio, mask, interpret)
    ids = jnp.where(mask, ids, 0).astype(jnp.int32)
    logp, entropy = logits.logits_logprobs(
        z.reshape(b * t, v), ids.reshape(-1), mask=mask.reshape(-1), temperature=args.temperature, interpret=interpret
    )
    logp, entropy = logp.reshape(b, t), entropy.reshape(b, t)
    rows, kl, clipped = _policy.per_token_losses(logp, entropy, mask, adv, old, ref, args, ratio)
    return rows, (kl, clipped)


def spec_for(
    layout: str,
    temperature: float,
    softcap: Optional[float],
    vocab_axis: Optional[str],
    vocab: int,
    interpret,
) -> HeadSpec:
    """The kernels' static arguments from the API's, with the chip resolved now (a static
    argument of the jitted kernels, so that a step traced for another chip is retraced)."""
    return HeadSpec(
        layout=layout,
        chip=_chips.chip().name,
        transform=Transform(float(temperature), None if softcap is None else float(softcap)),
        vocab_axis=vocab_axis,
        vocab=int(vocab),
        interpret=interpret,
    )
