"""JAX operations over flashloss's fused kernels, on two paths chosen by platform.

``linear_grpo_loss``, ``linear_cross_entropy`` and ``linear_logprobs`` compute TRL's GRPO
loss, the cross-entropy and per-token log-probs/entropy straight from the hidden states
and the LM head, never holding the ``[tokens x vocab]`` logits; ``grpo_loss`` is the
logits-level GRPO loss. Argument names and defaults are TRL's, as in
:mod:`flashloss.torch`. Every function takes:

- ``impl``: ``"ffi"`` runs flashloss's XLA FFI handlers (CPU; CUDA where built, not yet
  run on a GPU): one fused kernel call gives the loss and the gradients together.
  ``"pallas"`` runs Pallas TPU (Mosaic) kernels (:mod:`flashloss.jax.pallas`) for the
  head's per-row statistics and their backward, with the loss above them in plain JAX
  that JAX differentiates. ``"auto"`` (default) picks per lowering platform with
  ``jax.lax.platform_dependent``: Pallas on TPU, the FFI handlers elsewhere, so a step
  exported for TPU from a CPU host takes the Pallas path. The Pallas path has never run on
  a TPU: it is checked in TPU interpret mode and by the Mosaic lowering (``docs/jax.md``).
- ``interpret``: run the Pallas kernels in interpret mode (``True``, or
  ``pltpu.InterpretParams()`` for TPU semantics) on any backend; with ``impl="auto"`` it
  selects the Pallas path.
- ``weight_layout``: ``"vh"`` for a head ``[V, H]`` (PyTorch, tied embeddings), ``"hv"``
  for a Flax kernel ``[H, V]`` (``'BTD,DV->BTV'``); no path makes a transposed copy.

They work under ``jax.jit``, ``jax.grad`` / ``value_and_grad``, ``jax.vmap`` and
``jax.shard_map`` (``token_axis``, ``vocab_axis``), in float32, bfloat16 and float16
(float16 widened to float32 on the Pallas path). The
per-token outputs (``logp``, ``entropy``, ``kl``) and the metrics carry no gradient.

Errors known at trace time (shapes, dtypes, the loss config) are ``ValueError`` naming
the argument, on both paths; those only the data tell (ids out of range, values beyond
f32) are raised by JAX as ``JaxRuntimeError`` with flashloss's message.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from .._config import DEFAULT_BUDGET_MIB, ce_config, sampler_filters
from . import _ffi, _logprobs, _ops, _policy, _support, _support_vocab, _vocab
from ._logprobs import LogprobOutputs
from .pallas import checks as _checks
from .pallas import losses as _pallas

__all__ = ["GRPOOutputs", "LogprobOutputs", "grpo_loss", "linear_cross_entropy", "linear_grpo_loss", "linear_logprobs"]

_ops.register()

_METRICS = _policy.METRICS
_IMPLS = ("auto", "ffi", "pallas")
_LAYOUTS = ("vh", "hv")


@jax.tree_util.register_dataclass
@dataclass
class GRPOOutputs:
    """What a GRPO call returns besides the loss (no gradient flows through it)."""

    #: Per-token log-probabilities of ``completion_ids`` ``[B, T]`` (float32).
    logp: jax.Array
    #: Per-token entropy ``[B, T]`` (float32).
    entropy: jax.Array
    #: Per-token KL as it enters the loss ``[B, T]`` (zero without a reference or at beta=0).
    kl: jax.Array
    #: TRL's logged metrics (scalars): kl, entropy, clip_ratio/{low,high,region}_mean.
    metrics: dict
    #: Under ``top_k``/``top_p``/``min_p``: whether each token's target is outside the
    #: sampler's truncated support ``[B, T]`` (such tokens were masked); else None.
    outside_support: Optional[jax.Array] = None


def _on_path(impl: str, interpret: Any, pallas: Callable, ffi: Callable, *operands):
    """``pallas(*operands)`` or ``ffi(*operands)`` as ``impl`` says (``auto``: by the
    lowering platform, or Pallas in interpret mode)."""
    if impl not in _IMPLS:
        raise ValueError(f"argument `impl`: expected one of {', '.join(_IMPLS)}, got {impl!r}")
    if impl == "pallas" or (impl == "auto" and interpret):
        return pallas(*operands)
    if impl == "ffi":
        return ffi(*operands)
    return jax.lax.platform_dependent(*operands, tpu=pallas, default=ffi)


def _floats(arg: str, x) -> jax.Array:
    x = jnp.asarray(x)
    if x.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise ValueError(f"argument `{arg}`: expected dtype float32, bfloat16 or float16, got {x.dtype}")
    return x


def _wide(*xs):
    """float16 widened to float32 (exact) for the Pallas kernels, which take float32 and
    bfloat16 (TPUs have no float16 arithmetic); JAX casts the gradients back."""
    return [x.astype(jnp.float32) if x is not None and x.dtype == jnp.float16 else x for x in xs]


def _head(hidden, weight, bias, layout: str):
    """One float dtype for the head (mixed dtypes become bfloat16, as autocast would);
    ``weight`` ``[V, H]`` (layout ``vh``) or ``[H, V]`` (``hv``)."""
    if layout not in _LAYOUTS:
        raise ValueError(f"argument `weight_layout`: expected 'vh' ([V, H]) or 'hv' ([H, V]), got {layout!r}")
    hidden, weight = _floats("hidden", hidden), _floats("weight", weight)
    bias = None if bias is None else _floats("bias", bias)
    if weight.ndim != 2:
        expected = "[V, H]" if layout == "vh" else "[H, V]"
        raise ValueError(f"argument `weight`: expected shape {expected}, got {list(weight.shape)}")
    v, h = weight.shape if layout == "vh" else weight.shape[::-1]
    if hidden.shape[-1] != h:
        raise ValueError(f"argument `hidden`: expected shape [..., H={h}], got {list(hidden.shape)}")
    if bias is not None and bias.shape != (v,):
        raise ValueError(f"argument `bias`: expected shape [V={v}], got {list(bias.shape)}")
    dtypes = {x.dtype for x in (hidden, weight, bias) if x is not None}
    # One dtype as it is; float32 with one half dtype: that one (as autocast); both halves: float32.
    halves = [d for d in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) if d in dtypes]
    dtype = halves[0] if len(halves) == 1 else jnp.float32
    cast = [None if x is None else x.astype(dtype) for x in (hidden, weight, bias)]
    return cast


def _axis_size(arg: str, name: str) -> int:
    """The size of mesh axis ``name``; an error naming ``arg`` outside a ``shard_map``
    over it."""
    try:
        return jax.lax.axis_size(name)
    except NameError as e:
        raise ValueError(f"argument `{arg}`: no mesh axis {name!r} here (call inside jax.shard_map over it)") from e


def _ids(arg: str, x) -> jax.Array:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"argument `{arg}`: expected an integer dtype, got {x.dtype}")
    return x.astype(jnp.int64 if x.dtype == jnp.int64 else jnp.int32)


def _grpo_args(loss_type, beta, epsilon_low, epsilon_high, delta, importance_sampling_level, temperature,
               use_bias_correction_kl, entropy_coef, num_items_in_batch, max_completion_length,
               sapo_temperature_pos, sapo_temperature_neg, vespo_k_pos, vespo_lambda_pos, vespo_k_neg,
               vespo_lambda_neg) -> _policy.GrpoArgs:  # fmt: skip
    """TRL's arguments, checked now (a ``ValueError`` naming the bad one, on either path)."""
    args = _policy.GrpoArgs(
        loss_type=loss_type, beta=float(beta), epsilon_low=float(epsilon_low),
        epsilon_high=None if epsilon_high is None else float(epsilon_high),
        delta=None if delta is None else float(delta), importance_sampling_level=importance_sampling_level,
        temperature=float(temperature), use_bias_correction_kl=bool(use_bias_correction_kl),
        entropy_coef=float(entropy_coef),
        num_items_in_batch=None if num_items_in_batch is None else float(num_items_in_batch),
        max_completion_length=None if max_completion_length is None else int(max_completion_length),
        sapo_temperature_pos=float(sapo_temperature_pos), sapo_temperature_neg=float(sapo_temperature_neg),
        vespo_k_pos=float(vespo_k_pos), vespo_lambda_pos=float(vespo_lambda_pos), vespo_k_neg=float(vespo_k_neg),
        vespo_lambda_neg=float(vespo_lambda_neg),
    )  # fmt: skip
    _policy.validate_grpo(args)
    return args


def _grpo_batch(completion_ids, completion_mask, advantages, old_per_token_logps, ref_per_token_logps):
    ids = _ids("completion_ids", completion_ids)
    if ids.ndim != 2:
        raise ValueError(f"argument `completion_ids`: expected shape [B, T], got {list(ids.shape)}")
    b, t = ids.shape
    mask = jnp.ones((b, t), bool) if completion_mask is None else jnp.asarray(completion_mask) != 0
    if mask.shape != (b, t):
        raise ValueError(f"argument `completion_mask`: expected shape [B, T] = {[b, t]}, got {list(mask.shape)}")
    adv = jnp.asarray(advantages, jnp.float32)
    if adv.ndim == 2 and adv.shape[1] == 1:
        adv = adv[:, 0]  # TRL's unsqueezed [B, 1]
    old = None if old_per_token_logps is None else jnp.asarray(old_per_token_logps, jnp.float32)
    ref = None if ref_per_token_logps is None else jnp.asarray(ref_per_token_logps, jnp.float32)
    return ids, mask, adv, old, ref


def _vocab_size(weight, layout: str, vocab_axis: Optional[str]) -> int:
    """The whole vocabulary: this device's block times the devices of ``vocab_axis``."""
    v = weight.shape[0] if layout == "vh" else weight.shape[1]
    return v if vocab_axis is None else v * _axis_size("vocab_axis", vocab_axis)


def linear_grpo_loss(
    hidden,
    weight,
    completion_ids,
    completion_mask,
    advantages,
    *,
    bias=None,
    old_per_token_logps=None,
    ref_per_token_logps=None,
    importance_sampling_ratio=None,
    loss_type: str = "dapo",
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: Optional[float] = None,
    delta: Optional[float] = None,
    importance_sampling_level: str = "token",
    temperature: float = 1.0,
    use_bias_correction_kl: bool = True,
    entropy_coef: float = 0.0,
    num_items_in_batch: Optional[float] = None,
    max_completion_length: Optional[int] = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    min_p: Optional[float] = None,
    mode: str = "auto",
    budget_mib: Optional[float] = None,
    token_axis: Optional[str] = None,
    vocab_axis: Optional[str] = None,
    impl: str = "auto",
    interpret: Any = False,
    weight_layout: str = "vh",
):
    """TRL's GRPO loss from ``hidden`` ``[B, T, H]`` (or ``[B·T, H]``) and the LM head
    ``weight`` (``[V, H]``, or ``[H, V]`` with ``weight_layout="hv"``; + ``bias`` ``[V]``)
    at ``completion_ids`` ``[B, T]``.

    Returns ``(loss, GRPOOutputs)``, differentiable in ``hidden``, ``weight`` and
    ``bias``. ``epsilon_high=None`` means ``epsilon_low``; ``old_per_token_logps=None``
    means on-policy (ratio 1); ``num_items_in_batch`` must be a Python number (it is part
    of the compiled call). ``importance_sampling_ratio``: TRL's vLLM importance-sampling
    correction ``ρ`` ``[B]``, ``[B, 1]`` or ``[B, T]`` (finite, ``>= 0``, detached), which
    multiplies each token's policy loss (``ℓ·ρ + β·kl``; for vespo it enters ``log w_b``).
    ``mode`` and ``budget_mib`` are the kernels' plan: on the Pallas path a token-local
    step (token-level ratios, not vespo) on one device without a sampler support runs in
    one pass over blocks of rows (6NHV, ``pallas/single_pass.py``) where ``mode`` is
    ``single_pass`` or a block fits ``budget_mib`` under ``auto``; otherwise two passes.

    ``token_axis``: inside ``jax.shard_map``, the mesh axis over which the sequences are
    split (each device passes its own sequences and the whole head): the loss's
    normalizers (the token count of dapo/bnpo, the sequence count of grpo/dr_grpo/luspo)
    and the metrics are summed over it, so every device gets the one-device loss, its
    ``hidden`` gradient, and the head's gradient summed over the axis. A
    ``num_items_in_batch`` given is taken as already global, as TRL passes it.

    ``vocab_axis``: inside ``jax.shard_map``, the mesh axis over which the head's
    vocabulary is split in equal contiguous blocks, in axis order (a tensor-parallel LM
    head); every device passes all the rows. The partial row statistics merge over the
    axis, every device gets the loss and ``hidden``'s whole gradient, and its own block's
    ``weight`` / ``bias`` gradients.

    Both (a 2-D mesh): each device holds its sequences and its block of the head; the
    statistics merge over ``vocab_axis``, the normalizers and ``weight``'s gradient sum
    over ``token_axis``. ``impl``, ``interpret``, ``weight_layout``: see the module.

    ``top_k``, ``top_p``, ``min_p``: the sampler's truncation (vLLM V1's filters in its
    order; ``None``, ``top_k=0``, ``top_p=1``, ``min_p=0`` unset, as in TRL): every term
    uses the log-prob under the truncated support, a token whose target is outside it is
    masked (loss, normalizers, metrics) and flagged in ``GRPOOutputs.outside_support``
    (its ``logp`` is ``-inf``); the entropy stays the full softmax's. On the Pallas path,
    and with ``vocab_axis`` on both (``_support_vocab``), the support is plain JAX over
    blocks of rows, not streamed."""
    hidden, weight, bias = _head(hidden, weight, bias, weight_layout)
    ids, mask, adv, old, ref = _grpo_batch(
        completion_ids, completion_mask, advantages, old_per_token_logps, ref_per_token_logps
    )
    b, t = ids.shape
    if hidden.size // hidden.shape[-1] != b * t:
        raise ValueError(
            f"argument `hidden`: has {hidden.size // hidden.shape[-1]} rows but completion_ids has B·T = {b * t}"
        )
    rho = _policy.sampler_ratio(importance_sampling_ratio, b, t)
    args = _grpo_args(
        loss_type, beta, epsilon_low, epsilon_high, delta, importance_sampling_level, temperature,
        use_bias_correction_kl, entropy_coef, num_items_in_batch, max_completion_length,
        sapo_temperature_pos, sapo_temperature_neg, vespo_k_pos, vespo_lambda_pos, vespo_k_neg,
        vespo_lambda_neg,
    )  # fmt: skip
    vocab = _vocab_size(weight, weight_layout, vocab_axis)
    set_filters = sampler_filters(top_k, top_p, min_p)
    truncated = any(x is not None for x in set_filters)
    support = _support.filters(*set_filters, vocab)
    if _support.active(support) is None:
        support = None
    else:
        args = dataclasses.replace(args, top_k=support.top_k, top_p=support.top_p, min_p=support.min_p)
    config = args.config_json()
    budget = DEFAULT_BUDGET_MIB if budget_mib is None else float(budget_mib)
    if token_axis is not None:
        _axis_size("token_axis", token_axis)
        if entropy_coef and loss_type not in ("dapo", "bnpo", "cispo", "vespo"):
            raise ValueError(
                f"argument `token_axis`: an entropy bonus with loss_type {loss_type!r} has a normalizer of its own; "
                "not supported across devices yet"
            )
        weight = jax.lax.pcast(weight, token_axis, to="varying")
        bias = None if bias is None else jax.lax.pcast(bias, token_axis, to="varying")
    if vocab_axis is not None:
        hidden = jax.lax.pcast(hidden, vocab_axis, to="varying")
    spec = _pallas.spec_for(weight_layout, temperature, None, vocab_axis, vocab, interpret)

    k_spec = (support, weight_layout, spec.transform)

    def ffi(hidden, weight, bias, ids, mask, adv, old, ref, rho):
        if vocab_axis is None:
            return _ffi.grpo(hidden, weight, bias, ids, mask, adv, old, ref, rho, config, mode, budget, weight_layout)
        if support is not None:  # the policy handler takes no support: the loss in JAX
            stats = (vocab_axis, float(temperature), budget, mode, weight_layout)
            return _support_vocab.grpo(hidden, weight, bias, ids, mask, adv, old, ref, rho, args, k_spec, stats)
        return _vocab.grpo(
            hidden, weight, bias, ids, mask, adv, old, ref, config, vocab_axis, float(temperature), int(vocab),
            mode, budget, weight_layout, ratio=rho,
        )  # fmt: skip

    def pallas(hidden, weight, bias, ids, mask, adv, old, ref, rho):
        hidden, weight, bias = _wide(hidden, weight, bias)

        head = dataclasses.replace(spec, support=support)
        plan = (mode, budget) if token_axis is None else ("two_pass", budget)
        return _pallas.grpo(hidden, weight, bias, ids, mask, adv, old, ref, rho, args, head, *plan)

    loss, (logp, entropy, kl, metrics) = _on_path(impl, interpret, pallas, ffi, hidden, weight, bias, ids, mask,
                                                  adv, old, ref, rho)  # fmt: skip
    outside = mask & jnp.isneginf(logp) if truncated else None
    if token_axis is not None:
        per_seq = _policy.clips_per_sequence(args, adv)
        kept = mask if outside is None else mask & ~outside
        loss, metrics = _over_tokens(loss, metrics, kept, token_axis, loss_type, num_items_in_batch, per_seq)
    aux = jax.lax.stop_gradient((logp, entropy, kl, metrics))
    return loss, GRPOOutputs(aux[0], aux[1], aux[2], dict(zip(_METRICS, aux[3])), outside)


def _over_tokens(loss, metrics, mask, axis, loss_type, num_items_in_batch, clips_per_sequence):
    """The one-device loss and metrics from each device's: the loss is a sum of row terms
    over a normalizer, so `L = Σ_d L_d · n_d / Σ_d n_d` (`n_d` the device's normalizer);
    the metrics are token means, so they are weighted by the devices' token counts (the
    clip metrics by their sequence counts where they are sequence means)."""
    tokens = mask.sum().astype(jnp.float32)
    clips = jnp.float32(mask.shape[0]) if clips_per_sequence else tokens
    weights = jnp.stack([tokens, tokens, clips, clips, clips])
    metrics = jax.lax.psum(metrics * weights, axis) / jnp.maximum(jax.lax.psum(weights, axis), 1.0)
    if loss_type in ("dapo", "cispo", "vespo") and num_items_in_batch is not None:
        norm = jnp.float32(1.0)  # already global: the device's losses add up
        share = norm
    else:
        norm = tokens if loss_type in ("dapo", "bnpo", "cispo", "vespo") else jnp.float32(mask.shape[0])
        share = norm / jax.lax.psum(norm, axis)
    loss = jax.lax.psum(jax.lax.stop_gradient(share) * loss, axis)
    return loss, metrics


def linear_cross_entropy(
    hidden,
    weight,
    targets,
    *,
    bias=None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: Optional[float] = None,
    reduction: str = "mean",
    temperature: float = 1.0,
    return_lse: bool = False,
    mode: str = "auto",
    budget_mib: Optional[float] = None,
    vocab_axis: Optional[str] = None,
    impl: str = "auto",
    interpret: Any = False,
    weight_layout: str = "vh",
):
    """Cross-entropy of ``hidden @ weight.T + bias`` at ``targets`` (Cut Cross-Entropy's
    call): ``hidden`` ``[..., H]``, ``targets`` ``[...]``; reduction ``mean``, ``sum`` or
    ``none`` (``[...]``). ``return_lse`` returns ``(loss, lse)`` as Cut Cross-Entropy does:
    ``lse`` ``[...]`` float32, each row's log-sum-exp of the logits as the loss sees them
    (soft-capped, divided by the temperature), 0 where ``targets`` is ``ignore_index``,
    differentiable (``∂lse/∂s_j = p_j``; on the FFI path a cotangent on it runs the kernel
    once more, or joins reduction none's backward pass). ``vocab_axis``: inside
    ``jax.shard_map``, the mesh axis over which the head's vocabulary is split in equal
    contiguous blocks, as in :func:`linear_grpo_loss`; every device passes all the rows
    and gets the loss, the whole ``hidden`` gradient and its block's gradients. ``impl``,
    ``interpret``, ``weight_layout``: see the module."""
    config = ce_config(ignore_index, label_smoothing, z_loss, softcap, reduction, temperature)
    _policy.validate_ce(
        label_smoothing, z_loss, reduction, ignore_index=ignore_index, softcap=softcap, temperature=temperature
    )
    hidden, weight, bias = _head(hidden, weight, bias, weight_layout)
    targets = _ids("targets", targets)
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(
            f"argument `targets`: shape {list(targets.shape)} does not match hidden's rows {list(hidden.shape[:-1])}"
        )
    h2, t1 = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    budget = DEFAULT_BUDGET_MIB if budget_mib is None else float(budget_mib)
    vocab = _vocab_size(weight, weight_layout, vocab_axis)
    if vocab_axis is not None:
        h2 = jax.lax.pcast(h2, vocab_axis, to="varying")
    spec = _pallas.spec_for(weight_layout, temperature, softcap, vocab_axis, vocab, interpret)

    def ffi(h2, weight, bias, t1):
        if vocab_axis is not None:
            args = (vocab_axis, config, float(temperature), int(ignore_index), int(vocab), reduction, budget, mode)
            return _vocab.cross_entropy(h2, weight, bias, t1, *args, weight_layout)
        if reduction == "none":
            return _ffi.cross_entropy_rows(h2, weight, bias, t1, config, mode, budget, weight_layout)
        return _ffi.cross_entropy(h2, weight, bias, t1, config, mode, budget, weight_layout)

    def pallas(h2, weight, bias, t1):
        out, lse = _pallas.cross_entropy(
            *_wide(h2, weight, bias), t1, spec, ignore_index=int(ignore_index), label_smoothing=float(label_smoothing),
            z_loss=float(z_loss), reduction=reduction,
        )  # fmt: skip
        return out, lse

    out, lse = _on_path(impl, interpret, pallas, ffi, h2, weight, bias, t1)
    out = out.reshape(targets.shape) if reduction == "none" else out
    return (out, lse.reshape(targets.shape)) if return_lse else out


def linear_logprobs(
    hidden,
    weight,
    ids,
    temperature: float = 1.0,
    return_entropy: bool = False,
    *,
    bias=None,
    mask=None,
    return_lse: bool = False,
    return_max: bool = False,
    return_sum_p2: bool = False,
    gather_ids=None,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    min_p: Optional[float] = None,
    budget_mib=None,
    mode: str = "auto",
    vocab_axis: Optional[str] = None,
    impl: str = "auto",
    interpret: Any = False,
    weight_layout: str = "vh",
):
    """Per-token log-probabilities of ``ids`` ``[...]`` under ``(hidden @ weight.T + bias) /
    temperature`` (``hidden`` ``[..., H]``); ``(logp, entropy)`` when ``return_entropy``.
    Rows where ``mask`` is false are zero. Differentiable in ``hidden``, ``weight`` and
    ``bias`` through both (the forward keeps each row's ``max``, ``log Σexp`` and entropy;
    the backward is one more pass over the head, and no dW pass for a head that needs no
    gradient on the Pallas path); ``vocab_axis`` as in :func:`linear_grpo_loss`.
    ``impl``, ``interpret``, ``weight_layout``: see the module.

    More per-row outputs (``docs/spec/losses.md``, all of the scaled logits ``s``):
    ``return_lse`` (``log Σ_j e^{s_j}``, differentiable), ``return_max`` (``max_j s_j``),
    ``return_sum_p2`` (``Σ_j p_j²``; neither takes a gradient) and ``gather_ids``
    ``[..., K]`` (candidate ids per row, repeats allowed: ``log p`` of each,
    ``s_{ik} - lse``, differentiable). ``top_k``, ``top_p``, ``min_p``: vLLM V1's truncated
    support (its filters in its order, ties by ``(s_j, j)``): ``logp`` is then ``logp^K``
    under the support, ``-inf`` where the target is outside it (``outside_support``), and
    its gradient holds the support fixed; the other outputs stay the full softmax's. On the
    Pallas path, and with ``vocab_axis`` on both, plain JAX over blocks of rows, not
    streamed (``_support``, ``_support_vocab``). When any is asked the return is a
    :class:`LogprobOutputs` (None where not asked), else as above."""
    hidden, weight, bias = _head(hidden, weight, bias, weight_layout)
    ids = _ids("ids", ids)
    if hidden.shape[:-1] != ids.shape:
        raise ValueError(
            f"argument `ids`: shape {list(ids.shape)} does not match hidden's rows {list(hidden.shape[:-1])}"
        )
    m = jnp.ones(ids.shape, bool) if mask is None else jnp.asarray(mask) != 0
    if m.shape != ids.shape:
        raise ValueError(f"argument `mask`: expected shape {list(ids.shape)}, got {list(m.shape)}")
    candidates = None if gather_ids is None else _logprobs.gather_ids(gather_ids, ids.shape)
    budget = DEFAULT_BUDGET_MIB if budget_mib is None else float(budget_mib)
    x = hidden.reshape(-1, hidden.shape[-1])
    vocab = _vocab_size(weight, weight_layout, vocab_axis)
    support = _support.filters(top_k, top_p, min_p, vocab)
    if vocab_axis is not None:
        x = jax.lax.pcast(x, vocab_axis, to="varying")
    spec = _pallas.spec_for(weight_layout, temperature, None, vocab_axis, vocab, interpret)
    spec = dataclasses.replace(spec, sum_p2=bool(return_sum_p2))
    filtered = _support.active(support) is not None
    seq_len = ids.shape[-1] if ids.ndim else 1
    gather_kw = dict(layout=weight_layout, transform=spec.transform, vocab_axis=vocab_axis)

    def gathered(x, weight, bias, live, lse, cand, check: bool):
        if cand is None:
            return None
        if check:
            _logprobs.check_gather_ids(cand, live, vocab)
        return _logprobs.gathered_logp(x, weight, bias, cand, live, lse, **gather_kw)

    def outside(flat_mask):  # where the support is asked but keeps everything
        return None if support is None else jnp.zeros(flat_mask.shape, bool)

    def truncated(x, weight, bias, flat_ids, flat_mask):
        k_spec = (support, weight_layout, spec.transform)
        return _support_vocab.truncated(x, weight, bias, flat_ids, flat_mask, k_spec, vocab_axis)

    def ffi(x, weight, bias, flat_ids, flat_mask, cand):
        stats_args = (float(temperature), budget, mode, weight_layout)
        if filtered and vocab_axis is None:
            *out, out_k = _support.ffi_logprobs(x, weight, bias, flat_ids, flat_mask, support, *stats_args)
        else:
            out = _vocab.logprobs(x, weight, bias, flat_ids, flat_mask, vocab_axis, *stats_args)
            out_k = outside(flat_mask)
            if filtered:  # vocab-parallel: logp^K in plain JAX, the rest the full softmax's
                logp_k, out_k = truncated(x, weight, bias, flat_ids, flat_mask)
                out = (logp_k, *out[1:])
        logp, entropy, lse, top, p2 = out
        p2 = p2 if return_sum_p2 else None
        return logp, entropy, lse, top, p2, gathered(x, weight, bias, flat_mask, lse, cand, True), out_k

    def pallas(x, weight, bias, flat_ids, flat_mask, cand):
        x, weight, bias = _wide(x, weight, bias)
        head = dataclasses.replace(spec, support=support if filtered else None)
        st = _pallas.logprob_stats(x, weight, bias, flat_ids, flat_mask, head, seq_len)
        p2 = st.sum_p2 if return_sum_p2 else None
        g = gathered(x, weight, bias, flat_mask, st.lse, cand, _checks.runs_here(interpret))
        logp, out_k = st.logp, outside(flat_mask)
        if filtered:
            logp, out_k = st.logp_k, st.outside
        return logp, st.entropy, st.lse, st.max, p2, g, out_k

    out = _on_path(impl, interpret, pallas, ffi, x, weight, bias, ids.reshape(-1), m.reshape(-1), candidates)
    logp, entropy, lse, top, p2, g, out_k = (None if y is None else y.reshape(ids.shape + y.shape[1:]) for y in out)
    if not (return_lse or return_max or return_sum_p2 or gather_ids is not None or support is not None):
        return (logp, entropy) if return_entropy else logp
    return LogprobOutputs(
        logp=logp,
        entropy=entropy if return_entropy else None,
        lse=lse if return_lse else None,
        max_logit=jax.lax.stop_gradient(top) if return_max else None,
        sum_p2=None if p2 is None else jax.lax.stop_gradient(p2),
        gathered_logp=g,
        outside_support=out_k,
    )


def grpo_loss(
    logits,
    completion_ids,
    completion_mask,
    advantages,
    *,
    old_per_token_logps=None,
    ref_per_token_logps=None,
    importance_sampling_ratio=None,
    loss_type: str = "dapo",
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: Optional[float] = None,
    delta: Optional[float] = None,
    importance_sampling_level: str = "token",
    temperature: float = 1.0,
    use_bias_correction_kl: bool = True,
    num_items_in_batch: Optional[float] = None,
    max_completion_length: Optional[int] = None,
    reduce: bool = True,
    impl: str = "auto",
    interpret: Any = False,
):
    """TRL's GRPO loss on materialized ``logits`` ``[B, T, V]`` (float32, bfloat16 or float16):
    the loss and ``dlogits`` in one pass (the place of the original Pallas kernel), the
    gradient in the logits' dtype with no float32 copy of bfloat16 logits. Returns
    ``(loss, GRPOOutputs)``, differentiable in ``logits``. ``importance_sampling_ratio``
    as in :func:`linear_grpo_loss`. ``impl``, ``interpret``: see the module.

    ``reduce=False`` returns Liger's ``(per_token_loss, per_token_kl, is_clipped)``
    ``[B, T]`` float32, 0 where masked (``per_token_kl`` None when ``beta == 0``):
    ``per_token_loss = ℓ·ρ + β·kl`` before the loss type's reduction, differentiable in
    ``logits`` (at sequence level through ``R_b``); its backward reads the logits again."""
    logits = _floats("logits", logits)
    ids, mask, adv, old, ref = _grpo_batch(
        completion_ids, completion_mask, advantages, old_per_token_logps, ref_per_token_logps
    )
    if logits.ndim != 3 or logits.shape[:2] != ids.shape:
        raise ValueError(
            f"argument `logits`: expected shape [B, T, V] with [B, T] = {list(ids.shape)}, got {list(logits.shape)}"
        )
    args = _grpo_args(
        loss_type, beta, epsilon_low, epsilon_high, delta, importance_sampling_level, temperature,
        use_bias_correction_kl, 0.0, num_items_in_batch, max_completion_length,
        1.0, 1.05, 2.0, 3.0, 3.0, 2.0,
    )  # fmt: skip
    config = args.config_json()
    rho = _policy.sampler_ratio(importance_sampling_ratio, *ids.shape)
    if not reduce:
        rows, (kl, clipped) = _on_path(
            impl, interpret,
            lambda *xs: _pallas.grpo_logits_rows(*_wide(xs[0]), *xs[1:], args, interpret),
            lambda *xs: _ffi.grpo_logits_rows(*xs, config),
            logits, ids, mask, adv, old, ref, rho,
        )  # fmt: skip
        return rows, (jax.lax.stop_gradient(kl) if beta != 0.0 else None), jax.lax.stop_gradient(clipped)

    def ffi(logits, ids, mask, adv, old, ref, rho):
        return _ffi.grpo_logits(logits, ids, mask, adv, old, ref, rho, config)

    def pallas(logits, ids, mask, adv, old, ref, rho):
        return _pallas.grpo_logits(*_wide(logits), ids, mask, adv, old, ref, rho, args, interpret)

    loss, aux = _on_path(impl, interpret, pallas, ffi, logits, ids, mask, adv, old, ref, rho)
    aux = jax.lax.stop_gradient(aux)
    return loss, GRPOOutputs(aux[0], aux[1], aux[2], dict(zip(_METRICS, aux[3])))
