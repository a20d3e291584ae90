"""TRL's GRPO loss (and the cross-entropy) above the per-row statistics, in plain JAX.

A kernel that yields each row's ``logp`` and entropy (``lse``, mean logit for the
cross-entropy) under a ``jax.custom_vjp`` leaves the loss to this module: JAX
differentiates it, as TRL 1.14+ computes its loss, and the statistics' VJP carries
``∂L/∂logp`` and ``∂L/∂H`` back into the head. It is the Rust policy stage
(``crates/flashloss/src/policy.rs``, the FFI handler ``flashloss_grpo_policy``) written
in ``jnp``, in the spec's shape (``docs/spec/losses.md``):

- :func:`token_loss`: the per-token loss ``ℓ_tot,i = ℓ_i + β·kl_i``, elementwise only (no
  reduction, gather or sort), so a Pallas kernel can run it per row;
- :func:`reduction_weights` ``w_i = ∂L/∂ℓ_tot,i`` and :func:`entropy_weights`
  ``∂L/∂H_i``, which depend only on the mask and the arguments;
- :func:`grpo_policy_loss`: ``L = Σ_i w_i·ℓ_tot,i + Σ_i e_i·H_i``, where sequence-level
  ratios and vespo's weight (per-sequence reductions) are formed first and handed to
  :func:`token_loss`.

It computes in the inputs' float dtype (float32; float64 under ``jax_enable_x64``), where the Rust
stage computes in f64. Exponentials saturate at ``e^88`` (their value only; the gradient is
the exponential's at the saturated point), so an input beyond f32's range (where the Rust
stage raises ``OutOfRange``) gives a large or infinite loss, never a NaN.

Arguments are :mod:`flashloss._spec`'s ``GrpoArgs`` and ``CeArgs``, checked at trace time by
their ``validate()`` (the native module's own config check), so a bad argument raises
``ValueError`` with the message the FFI handlers raise at run time.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from .._spec import CeArgs, GrpoArgs

__all__ = [
    "ce_loss_from_stats",
    "clip_flags",
    "clips_per_sequence",
    "entropy_weights",
    "grpo_policy_loss",
    "per_token_losses",
    "is_token_local",
    "reduction_weights",
    "sampler_ratio",
    "token_kl",
    "token_loss",
    "vespo_log_weight",
]

#: Largest argument of an exponential here: ``e^88 ≈ 1.65e38`` is finite in f32.
_LOG_MAX = 88.0
#: vespo's clamp of ``log w_b``: ``[ln 1e-8, 20]``; each token's log-ratio is clamped to ±20 first.
_VESPO_LOG_LO = math.log(1e-8)
_VESPO_LOG_HI = 20.0


def is_token_local(args: GrpoArgs) -> bool:
    """True when every token's loss depends on its own statistics only (token-level ratios,
    any loss type but vespo): then ``L = Σ_i w_i·token_loss_i + Σ_i e_i·H_i`` with no
    per-sequence reduction before the loss."""
    return args.importance_sampling_level == "token" and args.loss_type != "vespo"


def _rust_float(x: float) -> str:
    """``x`` as Rust's ``Display`` writes an f64 (``1`` for 1.0, no exponent)."""
    return np.format_float_positional(float(x), trim="-")


def _exp(x: jax.Array) -> jax.Array:
    """``exp(x)`` with ``x`` saturated at ``_LOG_MAX`` in value (straight through: the
    gradient is the exponential's at the saturated point), so never ``inf``."""
    return jnp.exp(x - jax.lax.stop_gradient(jnp.maximum(x - _LOG_MAX, 0.0)))


def _old(logp: jax.Array, old: Optional[jax.Array]) -> jax.Array:
    """The old policy's logp; on-policy (None): ``stopgrad(logp)``, so the ratio is 1 with
    the gradient of ``exp(logp - stopgrad(logp))``."""
    return jax.lax.stop_gradient(logp) if old is None else old


def _has_kl(ref: Optional[jax.Array], args: GrpoArgs) -> bool:
    """The KL term is formed only with a reference and ``β ≠ 0`` (flashloss addition 1)."""
    return ref is not None and args.beta != 0.0


def vespo_log_weight(log_ratio: jax.Array, mask: jax.Array, ratio: Optional[jax.Array] = None) -> jax.Array:
    """vespo's ``log w_b = clamp(Σ_t m·clamp(log r_t, ±20) + log ρ, ln 1e-8, 20)`` ``[B, 1]``
    (no gradient) from the token log-ratios ``[B, T]``, where the sampler ratio ``ratio``
    adds ``Σ_t m·clamp(log ρ_t, ln 1e-8, 20)`` (per token, ``[B, T]``) or
    ``clamp(log ρ_b, ln 1e-8, 20)`` once (per sequence, ``[B, 1]``)."""
    per_token = jnp.where(mask, jnp.clip(log_ratio, -_VESPO_LOG_HI, _VESPO_LOG_HI), 0.0)
    total = jnp.sum(per_token, axis=-1, keepdims=True)
    if ratio is not None:
        log_rho = jnp.clip(jnp.log(ratio), _VESPO_LOG_LO, _VESPO_LOG_HI)
        if ratio.ndim == 1 or ratio.shape[-1] == 1:  # per sequence (as Rust reads [B, 1], T = 1 included)
            total = total + log_rho.reshape(-1, 1)
        else:
            total = total + jnp.sum(jnp.where(mask, log_rho, 0.0), axis=-1, keepdims=True)
    return jax.lax.stop_gradient(jnp.clip(total, _VESPO_LOG_LO, _VESPO_LOG_HI))


def _vespo_phi(log_w: jax.Array, adv: jax.Array, args: GrpoArgs) -> jax.Array:
    """``φ = exp(λ + k·log w - λ·w)`` with (k, λ) of the advantage's sign (no gradient)."""
    pos = adv >= 0
    k = jnp.where(pos, args.vespo_k_pos, args.vespo_k_neg)
    lam = jnp.where(pos, args.vespo_lambda_pos, args.vespo_lambda_neg)
    return jax.lax.stop_gradient(jnp.exp(lam + k * log_w - lam * jnp.exp(log_w)))


def _log_ratio(logp: jax.Array, old: Optional[jax.Array], log_ratio: Optional[jax.Array]) -> jax.Array:
    return logp - _old(logp, old) if log_ratio is None else log_ratio


def token_kl(
    logp: jax.Array,
    old: Optional[jax.Array],
    ref: Optional[jax.Array],
    args: GrpoArgs,
    *,
    log_ratio: Optional[jax.Array] = None,
) -> jax.Array:
    """The per-token KL as it enters the loss (before ``β``), elementwise: k3
    ``exp(d) - d - 1`` with ``d = ref - logp``, times the ratio with bias correction,
    written ``exp(d + log r) - (d + 1)·r`` (flashloss addition 2). Zero without ``ref`` or
    at ``β = 0``. ``log_ratio``: the ratio's log where it is not the token's own
    (sequence level: the sequence's mean log-ratio, broadcast)."""
    if not _has_kl(ref, args):
        return jnp.zeros_like(logp)
    d = ref - logp
    if not args.use_bias_correction_kl:
        return _exp(d) - d - 1.0
    if log_ratio is None:
        # d + log r = ref - old, formed once (its gradient in logp is 0 either way).
        old_ = _old(logp, old)
        u, log_r = ref - old_, logp - old_
    else:
        u, log_r = d + log_ratio, log_ratio
    r = _exp(log_r)
    kl = _exp(u) - (d + 1.0) * r
    # Beyond f32 (an exponential saturated, or (d + 1)·r overflowed) the difference is no
    # longer kl·r ≥ 0: take the product of the two saturated factors there, without a
    # gradient (the Rust stage raises OutOfRange in that regime).
    beyond = (u > _LOG_MAX) | (log_r > _LOG_MAX) | ~jnp.isfinite(kl)
    k3 = _exp(d) - d - 1.0
    return jnp.where(beyond, jax.lax.stop_gradient(jnp.maximum(r * k3, 0.0)), kl)


def _policy_term(
    logp: jax.Array, log_ratio: jax.Array, adv: jax.Array, args: GrpoArgs, vespo_log_w: Optional[jax.Array]
) -> jax.Array:
    """``ℓ_i`` of the spec's table, elementwise; the gradient follows the Rust stage's
    branches (ties of the clipped family's min go to the unclipped side)."""
    r = _exp(log_ratio)
    lt = args.loss_type
    if lt == "cispo":
        return -jax.lax.stop_gradient(jnp.minimum(r, args.eps_high)) * adv * logp
    if lt == "vespo":
        if vespo_log_w is None:
            raise ValueError("vespo's loss needs the sequence weight: pass `vespo_log_w` (see vespo_log_weight)")
        return -_vespo_phi(vespo_log_w, adv, args) * adv * logp
    if lt == "sapo":
        tau = jnp.where(adv > 0, args.sapo_temperature_pos, args.sapo_temperature_neg)
        return -adv * (4.0 / tau) * jax.nn.sigmoid(tau * (r - 1.0))
    lo, hi = 1.0 - args.epsilon_low, 1.0 + args.eps_high
    # Gradient inside [lo, hi] (inclusive), none outside: Rust's `(lo..=hi).contains(&r)`.
    clipped = jnp.where((r >= lo) & (r <= hi), r, jnp.clip(jax.lax.stop_gradient(r), lo, hi))
    capped = r if args.delta is None else jnp.where(r <= args.delta, r, jnp.asarray(args.delta, r.dtype))
    return -jnp.where(capped * adv <= clipped * adv, capped, clipped) * adv


def token_loss(
    logp: jax.Array,
    entropy: Optional[jax.Array],
    old: Optional[jax.Array],
    ref: Optional[jax.Array],
    adv: jax.Array,
    args: GrpoArgs,
    *,
    log_ratio: Optional[jax.Array] = None,
    vespo_log_w: Optional[jax.Array] = None,
    ratio: Optional[jax.Array] = None,
    policy_weight: Optional[jax.Array] = None,
) -> jax.Array:
    """The per-token loss ``ℓ_tot,i = ℓ_i·ρ_i + β·kl_i`` (spec: "GRPO per-token policy loss",
    "KL penalty"), elementwise over broadcastable shapes (``adv`` per token or broadcast
    from ``[B, 1]``; ``old`` None: on-policy). No reduction, gather or sort, so a kernel can
    evaluate it per row; ``L = Σ_i w_i·ℓ_tot,i + Σ_i e_i·H_i`` with
    :func:`reduction_weights` and :func:`entropy_weights`.

    ``entropy`` takes no part in ``ℓ_tot`` (the bonus is linear in ``H`` with its own
    weights, :func:`entropy_weights`); it is in the signature so that a kernel calls every
    per-row function on the same statistics.

    For the token-local configs (:func:`is_token_local`) that is all. Otherwise the
    per-sequence reductions come first: ``log_ratio`` the sequence's mean log-ratio
    (sequence level, broadcast to its tokens), ``vespo_log_w`` vespo's ``log w_b``
    (:func:`vespo_log_weight`).

    ``ratio``: the sampler's importance ratio ``ρ`` (TRL's ``importance_sampling_ratio``,
    detached; None: 1), broadcastable to ``logp``. For vespo it enters ``vespo_log_w``
    instead, so it is not a factor here. ``policy_weight``: ``e_i`` (0 or 1, TRL's policy
    and entropy masks together; None: 1), a factor of ``ℓ_i`` only."""
    del entropy
    if args.sequence_level and log_ratio is None:
        raise ValueError("importance_sampling_level 'sequence' needs the sequence's mean log-ratio: pass `log_ratio`")
    lr = _log_ratio(logp, old, log_ratio)
    ell = _policy_term(logp, lr, adv, args, vespo_log_w)
    if ratio is not None and args.loss_type != "vespo":
        ell = ell * jax.lax.stop_gradient(ratio)
    if policy_weight is not None:
        ell = ell * policy_weight
    if _has_kl(ref, args):
        ell = ell + args.beta * token_kl(logp, old, ref, args, log_ratio=log_ratio)
    return ell


def clip_flags(
    logp: jax.Array,
    old: Optional[jax.Array],
    adv: jax.Array,
    args: GrpoArgs,
    *,
    log_ratio: Optional[jax.Array] = None,
) -> Tuple[jax.Array, jax.Array]:
    """``(low, high)`` per token (bool, elementwise): ``r < 1-ε_low`` with ``A < 0``,
    ``r > 1+ε_high`` with ``A > 0``; cispo ``(False, r > ε_high & A > 0)``; sapo and vespo
    never. ``log_ratio`` as in :func:`token_loss`."""
    r = jax.lax.stop_gradient(_exp(_log_ratio(logp, old, log_ratio)))
    adv = jax.lax.stop_gradient(adv)
    no = jnp.zeros(jnp.broadcast_shapes(r.shape, adv.shape), bool)
    if args.loss_type in ("sapo", "vespo"):
        return no, no
    if args.loss_type == "cispo":
        return no, (r > args.eps_high) & (adv > 0)
    return (r < 1.0 - args.epsilon_low) & (adv < 0), (r > 1.0 + args.eps_high) & (adv > 0)


def clips_per_sequence(args: GrpoArgs, advantages) -> bool:
    """True when TRL 1.16's clip metrics are means over the B sequences: a sequence-level
    ratio with per-sequence advantages (``[B]`` or ``[B, 1]``) makes its clip flags
    ``[B, 1]``, which its ``global_masked_mean`` divides by B (else by the live tokens)."""
    shape = jnp.shape(advantages)
    return args.sequence_level and (len(shape) == 1 or shape[1:] == (1,))


def _counts(mask: jax.Array, dtype=jnp.float32) -> Tuple[jax.Array, jax.Array]:
    """``(L_b [B, 1], Σ m)`` as floats."""
    m = mask.astype(dtype)
    return jnp.sum(m, axis=-1, keepdims=True), jnp.sum(m)


def reduction_weights(
    mask: jax.Array,
    args: GrpoArgs,
    *,
    batch_size: Optional[float] = None,
    token_count: Optional[jax.Array] = None,
    dtype=jnp.float32,
) -> jax.Array:
    """``w_bt = ∂L/∂ℓ_tot,bt`` ``[B, T]`` (0 where masked; spec "Reduction
    weights" with TRL 1.16's luspo): grpo, sapo ``1/(B·L_b)``; bnpo ``1/max(1, Σm)``;
    dr_grpo ``1/(B·max_completion_length)``; dapo, cispo, vespo ``1/num_items_in_batch``
    (unset: ``1/max(1, Σm)``); luspo ``1/B``. ``batch_size`` (B) and ``token_count`` (Σm)
    default to this batch's; a sharded caller passes the global ones. In ``dtype``."""
    mask = jnp.asarray(mask) != 0
    b = float(mask.shape[0]) if batch_size is None else batch_size
    len_b, tokens = _counts(mask, dtype)
    tokens = tokens if token_count is None else jnp.asarray(token_count, dtype)
    lt = args.loss_type
    if lt in ("grpo", "sapo"):
        per = 1.0 / (b * jnp.maximum(len_b, 1.0))
    elif lt == "bnpo":
        per = 1.0 / jnp.maximum(tokens, 1.0)
    elif lt == "dr_grpo":
        per = jnp.asarray(1.0 / (b * (args.max_completion_length or 1)), dtype)
    elif lt in ("dapo", "cispo", "vespo"):
        n = jnp.maximum(tokens, 1.0) if args.num_items_in_batch is None else jnp.asarray(args.num_items_in_batch, dtype)
        per = 1.0 / n
    elif lt == "luspo":
        per = jnp.asarray(1.0 / b, dtype)
    else:
        raise ValueError(f"argument `loss_type`: unknown {lt!r}")
    return jnp.where(mask, per, 0.0).astype(dtype)


def entropy_weights(
    mask: jax.Array, args: GrpoArgs, *, entropy_count: Optional[jax.Array] = None, dtype=jnp.float32
) -> jax.Array:
    """``∂L/∂H_bt = -entropy_coef·m_bt / max(1, Σm)`` ``[B, T]`` (TRL 1.16: the bonus is a
    token mean whatever the loss type); ``entropy_count`` defaults to this batch's ``Σm``."""
    mask = jnp.asarray(mask) != 0
    count = _counts(mask, dtype)[1] if entropy_count is None else jnp.asarray(entropy_count, dtype)
    return jnp.where(mask, -args.entropy_coef / jnp.maximum(count, 1.0), 0.0).astype(dtype)


def sampler_ratio(ratio, batch: int, seq_len: int, dtype=jnp.float32) -> Optional[jax.Array]:
    """TRL's ``importance_sampling_ratio`` shaped for the loss: ``[B]`` or ``[B, 1]`` (per
    sequence) as ``[B, 1]``, ``[B, T]`` (per token) as it is, None as None; another shape
    raises ``ValueError`` with the FFI handlers' (and the torch binding's) message."""
    if ratio is None:
        return None
    rho = jnp.asarray(ratio, dtype)
    if rho.shape in ((batch,), (batch, 1)):
        return rho.reshape(batch, 1)
    if rho.shape == (batch, seq_len):
        return rho
    raise ValueError(
        f"argument `importance_sampling_ratio`: expected shape [B={batch}], [B, 1] or [B, T] with "
        f"B·T = {batch * seq_len}, got {list(rho.shape)}"
    )


def _prepared(logp, entropy, mask, advantages, old, ref, args: GrpoArgs, ratio=None, policy_weight=None) -> dict:
    """The checked per-token inputs of :func:`grpo_policy_loss` (masked tokens zeroed, so
    that neither a value nor a gradient reads them), the sequence-level reductions and each
    token's ``ℓ_tot``."""
    args.validate()
    logp, entropy = jnp.asarray(logp), jnp.asarray(entropy)
    if logp.ndim != 2:
        raise ValueError(f"argument `logp`: expected shape [B, T], got {list(logp.shape)}")
    shape = logp.shape
    dtype = logp.dtype if jnp.issubdtype(logp.dtype, jnp.floating) else jnp.float32
    for name, x in (("entropy", entropy), ("completion_mask", mask), ("old_per_token_logps", old),
                    ("ref_per_token_logps", ref)):  # fmt: skip
        if x is not None and tuple(jnp.shape(x)) != tuple(shape):
            raise ValueError(f"argument `{name}`: expected shape {list(shape)}, got {list(jnp.shape(x))}")
    if args.beta > 0.0 and ref is None:
        raise ValueError(f"argument `ref_per_token_logps`: required when beta > 0 (beta = {_rust_float(args.beta)})")
    mask = jnp.asarray(mask) != 0
    adv = jnp.asarray(advantages, dtype)
    if adv.ndim == 1 or adv.shape == (shape[0], 1):
        adv = adv.reshape(shape[0], 1)
    elif adv.shape != shape:
        raise ValueError(f"argument `advantages`: expected shape [B={shape[0]}] or [B, T], got {list(adv.shape)}")

    # Masked tokens: zeros in place of their inputs, so that neither a value nor a gradient
    # (where's other branch) reads them.
    def live(x: Optional[jax.Array]) -> Optional[jax.Array]:
        return None if x is None else jnp.where(mask, jnp.asarray(x, dtype), 0.0)

    lp, ent, adv_t = (live(logp.astype(dtype)), live(entropy), live(jnp.broadcast_to(adv, shape)))
    rho = sampler_ratio(ratio, shape[0], shape[1], dtype)
    if rho is not None and rho.shape == shape:
        rho = jnp.where(mask, rho, 1.0)
    old_, ref_ = _old(lp, live(old)), live(ref)
    len_b, _ = _counts(mask, dtype)
    log_ratio = None
    if args.sequence_level:
        log_ratio = jnp.sum(jnp.where(mask, lp - old_, 0.0), -1, keepdims=True) / jnp.maximum(len_b, 1.0)
        log_ratio = jnp.broadcast_to(log_ratio, shape)
    vespo_log_w = vespo_log_weight(lp - old_, mask, rho) if args.loss_type == "vespo" else None

    e = None if policy_weight is None else jnp.asarray(policy_weight, dtype)
    ell = token_loss(lp, ent, old_, ref_, adv_t, args, log_ratio=log_ratio, vespo_log_w=vespo_log_w, ratio=rho,
                     policy_weight=e)  # fmt: skip
    return dict(mask=mask, dtype=dtype, shape=shape, lp=lp, ent=ent, old=old_, ref=ref_, adv=adv, adv_t=adv_t,
                log_ratio=log_ratio, ell=ell)  # fmt: skip


def per_token_losses(logp, entropy, mask, advantages, old, ref, args: GrpoArgs, ratio=None):
    """Liger's ``reduce=False`` outputs: ``(ℓ_tot·m, kl·m, clipped)`` ``[B, T]`` (spec,
    flashloss addition 7), differentiable in ``logp`` through ``ℓ_tot`` (at sequence level
    through ``R_b``); the entropy bonus is no token's loss. ``ratio``: as in
    :func:`grpo_policy_loss`."""
    p = _prepared(logp, entropy, mask, advantages, old, ref, args, ratio)
    mask = p["mask"]
    kl = jnp.where(mask, token_kl(p["lp"], p["old"], p["ref"], args, log_ratio=p["log_ratio"]), 0.0)
    low, high = clip_flags(p["lp"], p["old"], p["adv_t"], args, log_ratio=p["log_ratio"])
    clipped = jnp.where(mask, (low | high).astype(p["dtype"]), 0.0)
    return jnp.where(mask, p["ell"], 0.0), jax.lax.stop_gradient(kl), clipped


def grpo_policy_loss(
    logp: jax.Array,
    entropy: jax.Array,
    mask: jax.Array,
    advantages: jax.Array,
    old: Optional[jax.Array],
    ref: Optional[jax.Array],
    args: GrpoArgs,
    ratio: Optional[jax.Array] = None,
    *,
    policy_mask: Optional[jax.Array] = None,
    entropy_mask: Optional[jax.Array] = None,
) -> Tuple[jax.Array, jax.Array, jax.Array]:
    """TRL's GRPO loss from the per-token statistics: ``(loss, kl, metrics)``.

    ``logp``, ``entropy`` ``[B, T]`` (differentiable), ``mask`` ``[B, T]`` (bool or 0/1),
    ``advantages`` ``[B]``, ``[B, 1]`` or ``[B, T]``, ``old`` / ``ref`` ``[B, T]`` or None
    (``old`` None: on-policy; ``ref`` is required when ``β > 0``), ``ratio`` the sampler's
    importance ratio ``ρ`` ``[B]``, ``[B, 1]`` or ``[B, T]`` (TRL's
    ``importance_sampling_ratio``, detached; None: 1): ``ℓ_tot = ℓ·ρ + β·kl``, for vespo
    inside ``log w_b`` (:func:`vespo_log_weight`). Returns the scalar loss,
    the per-token KL ``[B, T]`` as it enters the loss (0 where masked) and TRL's metrics
    ``[5]`` in the order of ``flashloss._spec.METRICS`` (no gradient): the values of the FFI handler
    ``flashloss_grpo_policy``. Masked tokens take no part (their inputs are never read
    into a value or a gradient); a fully masked batch gives 0.

    ``policy_mask`` (TRL's off-policy mask) and ``entropy_mask`` (its top-entropy mask)
    ``[B, T]`` (bool; None: all set) multiply each token's policy term ``ℓ_i`` (not the
    KL); the entropy bonus is the mean over ``mask & entropy_mask``."""
    weight = None
    for m in (policy_mask, entropy_mask):
        if m is not None:
            weight = (m != 0) if weight is None else weight & (m != 0)
    p = _prepared(logp, entropy, mask, advantages, old, ref, args, ratio, weight)
    mask, dtype, shape, ent, ell = p["mask"], p["dtype"], p["shape"], p["ent"], p["ell"]
    lp, old_, ref_, adv, adv_t, log_ratio = (p[k] for k in ("lp", "old", "ref", "adv", "adv_t", "log_ratio"))
    w = reduction_weights(mask, args, dtype=dtype)
    e = entropy_weights(mask if entropy_mask is None else mask & (entropy_mask != 0), args, dtype=dtype)
    loss = jnp.sum(jnp.where(mask, w * ell, 0.0))
    if args.entropy_coef != 0.0:
        loss = loss + jnp.sum(e * ent)

    kl = jnp.where(mask, token_kl(lp, old_, ref_, args, log_ratio=log_ratio), 0.0)
    count = jnp.maximum(jnp.sum(mask.astype(dtype)), 1.0)

    def mean(x: jax.Array) -> jax.Array:
        return jnp.sum(jnp.where(mask, x.astype(dtype), 0.0)) / count

    if clips_per_sequence(args, adv):
        # TRL's `[B, 1]` flags, averaged over the B sequences (a sequence with no live
        # token has R_b = 1 and keeps its advantage).
        low, high = (f[:, 0] for f in clip_flags(lp, old_, adv, args, log_ratio=log_ratio))

        def clip_mean(x: jax.Array) -> jax.Array:
            return jnp.sum(x.astype(dtype)) / max(shape[0], 1)
    else:
        low, high = clip_flags(lp, old_, adv_t, args, log_ratio=log_ratio)
        clip_mean = mean
    metrics = jnp.stack([mean(kl), mean(ent), clip_mean(low), clip_mean(high), clip_mean(low | high)])
    return loss, kl, jax.lax.stop_gradient(metrics)


def ce_loss_from_stats(
    lse: jax.Array,
    logp: jax.Array,
    mean_logit: jax.Array,
    live: jax.Array,
    *,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    reduction: str = "mean",
) -> jax.Array:
    """The cross-entropy from each row's statistics (spec "Cross-entropy"): ``lse``, the
    target's ``logp`` and ``mean_logit = mean_j s_j`` ``[N]`` (of the scaled, soft-capped
    logits ``s``), ``live`` ``[N]`` (target ≠ ignore_index):
    ``ℓ = (1-ε)·(-logp) + ε·(lse - mean_logit) + λ_z·lse²``. Reduction ``mean`` (over live
    rows; 0 when none is live), ``sum``, or ``none`` (``[N]``, 0 on ignored rows), as the
    Rust cross-entropy. Differentiable in the statistics; ignored rows' are never read."""
    CeArgs(label_smoothing=label_smoothing, z_loss=z_loss, reduction=reduction).validate()
    live = jnp.asarray(live) != 0
    dtype = jnp.asarray(logp).dtype
    dtype = dtype if jnp.issubdtype(dtype, jnp.floating) else jnp.float32

    def rows(x: jax.Array) -> jax.Array:
        return jnp.where(live, jnp.asarray(x, dtype), 0.0)

    lse_, logp_ = rows(lse), rows(logp)
    ell = -logp_ if label_smoothing == 0.0 else (1.0 - label_smoothing) * (-logp_)
    if label_smoothing != 0.0:
        ell = ell + label_smoothing * (lse_ - rows(mean_logit))
    if z_loss != 0.0:
        ell = ell + z_loss * lse_ * lse_
    ell = jnp.where(live, ell, 0.0)
    if reduction == "none":
        return ell
    total = jnp.sum(ell)
    if reduction == "sum":
        return total
    return total / jnp.maximum(jnp.sum(live.astype(dtype)), 1.0)
