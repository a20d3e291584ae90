"""flashloss's losses as PyTorch custom operators (``torch.library.custom_op``), so that
``torch.compile(fullgraph=True)`` and ``torch.export`` trace through them: each op has a
fake (meta) implementation giving its outputs' shapes, and the differentiable ones an
autograd formula (``register_autograd``).

The fused ops form their gradients in the forward, while each block of logits is on
hand: ``grpo_linear`` and ``ce_linear`` return the loss and ``∂loss/∂(hidden, weight,
bias)`` in f32; their backward is ``grad_loss · ∂loss/∂x`` in ``x``'s dtype. Reduction
``none`` (``ce_linear_rows``) runs the head again in its backward
(``ce_linear_rows_backward``) with each row's upstream gradient, and so does
``logp_linear`` (``logp_linear_backward``, with the upstream gradients of ``logp`` and
the entropy). ``grpo_logits`` returns ``∂loss/∂logits`` (zero at positions it does not
read).

A frozen head (``weight`` and ``bias`` need no gradient) gets no ``[V, H]`` buffer and no
dW/dbias product: the fused ops, which form the gradients in their forward, take
``head_grad`` (False: frozen; :mod:`flashloss.torch` passes whether autograd will want
them, and ``setup_context`` checks that against ``ctx.needs_input_grad``) and return
``[0]``-shaped ``dweight``/``dbias``; the ops whose backward runs the head again read
``ctx.needs_input_grad`` there. Inputs arrive checked and
converted by :mod:`flashloss.torch`: per-token tensors on the CPU, the head in one
dtype, contiguous. ``group`` names a vocab-parallel group registered in
:mod:`flashloss._dist` ("" for none).
"""

from __future__ import annotations

import json
from typing import Optional

import torch
from torch import Tensor

from . import _dist, _native

#: The metrics tensor's entries, in order (TRL's names).
METRICS = ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


def _stream(device: torch.device) -> int:
    """PyTorch's current stream on ``device`` (0 on the CPU): the kernels run on it."""
    return 0 if device.type == "cpu" else torch.cuda.current_stream(device).cuda_stream


def _zeros_f32(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else torch.zeros(t.shape, dtype=torch.float32, device=t.device)


def _grad_buffers(
    hidden: Tensor, weight: Tensor, bias: Optional[Tensor], head_grad: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """The head's zeroed f32 gradient buffers; ``dweight`` and ``dbias`` are empty (an op
    returns tensors) for a frozen head (``head_grad`` False), ``dbias`` without a bias."""

    def empty():  # one tensor per output: an op's outputs may not alias each other
        return hidden.new_empty((0,), dtype=torch.float32)

    dw = _zeros_f32(weight) if head_grad else empty()
    db = _zeros_f32(bias) if head_grad and bias is not None else empty()
    return _zeros_f32(hidden), dw, db


def _native_grads(dw: Tensor, db: Tensor, bias: Optional[Tensor], head_grad: bool) -> tuple:
    """``(grad_weight, grad_bias)`` as the native calls take them: None for a frozen head
    (no dW, no dbias formed) and for an absent bias."""
    if not head_grad:
        return None, None
    return dw, None if bias is None else db


def metrics_tensor(out: dict, device=None) -> Tensor:
    """TRL's metrics of a native GRPO call's result, in :data:`METRICS` order (float64)."""
    return torch.tensor([out[k] for k in METRICS], dtype=torch.float64, device=device)


def _with_items(config: str, num_items: Optional[Tensor]) -> str:
    """``config`` with ``num_items_in_batch`` read from a tensor (TRL passes one)."""
    if num_items is None:
        return config
    c = json.loads(config)
    c["num_items_in_batch"] = float(num_items)
    return json.dumps(c)


def _scale(grad: Tensor, grads: tuple, dtypes: tuple) -> list:
    """``grad · g`` in each input's dtype (None where the input is absent). Eager on the
    CPU with ``grad == 1`` (``loss.backward()``) the saved gradients are returned as they
    are (cast where the input's dtype differs): autograd then takes them as ``.grad``
    without a copy, where ``grad * g`` would write a fresh ``[V, H]`` tensor (0.27 s at
    V=151936, H=1024 on 2 cores, docs/bench/cpu.md)."""
    unit = grad.device.type == "cpu" and not torch.compiler.is_compiling() and grad.item() == 1.0
    return [None if dt is None else (g if unit else grad * g).to(dt) for g, dt in zip(grads, dtypes)]


def _only_the_loss_differentiable(ctx, output) -> None:
    """Marks every output but the loss (output 0) non-differentiable, and has autograd
    pass ``None`` for their gradients instead of zero tensors of their shapes (the
    gradient outputs' zeros took 0.13 s a backward at V=151936, H=1024)."""
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)


def _fake_grads(
    hidden: Tensor, weight: Tensor, bias: Optional[Tensor], head_grad: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """The fake (meta) gradient buffers of a head (as :func:`_grad_buffers` shapes them)."""
    f32 = dict(dtype=torch.float32)
    dw = hidden.new_empty(weight.shape if head_grad else (0,), **f32)
    db = hidden.new_empty(bias.shape if head_grad and bias is not None else (0,), **f32)
    return hidden.new_empty(hidden.shape, **f32), dw, db


def _head_dtypes(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], head_grad: bool) -> tuple:
    """The dtypes the gradients go back in; None where no gradient is returned."""
    return (
        hidden.dtype,
        weight.dtype if head_grad else None,
        bias.dtype if head_grad and bias is not None else None,
    )


def _ce_call(hidden, weight, bias, targets, grad_rows, config, mode, budget_mib, group, head_grad):
    """The native CE call: ``(result dict, per-row losses, dhidden, dweight, dbias)``,
    gradients times ``grad_rows`` where given."""
    dh, dw, db = _grad_buffers(hidden, weight, bias, head_grad)
    rows = torch.empty(targets.shape, dtype=torch.float32)
    out = _native.ce_linear(
        hidden, weight, bias, targets, config, mode, budget_mib, grad_rows, dh,
        *_native_grads(dw, db, bias, head_grad), rows, _stream(hidden.device), _dist.ops(group),
    )  # fmt: skip
    return out, rows, dh, dw, db


def _head_setup(ctx, inputs, output) -> None:
    """Saves the head's gradients (outputs 1-3; output 0 is the loss) for the backward;
    the op's last input is ``head_grad``, which must cover what autograd wants."""
    hidden, weight, bias = inputs[:3]
    head_grad = inputs[-1]
    if not head_grad and (ctx.needs_input_grad[1] or ctx.needs_input_grad[2]):
        raise ValueError("argument `head_grad`: False, but autograd wants the gradient of `weight` or `bias`")
    ctx.save_for_backward(*output[1:4])
    ctx.dtypes = _head_dtypes(hidden, weight, bias, head_grad)
    _only_the_loss_differentiable(ctx, output)


# --- GRPO from hidden states -----------------------------------------------------------


@torch.library.custom_op("flashloss::grpo_linear", mutates_args=())
def grpo_linear(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    completion_ids: Tensor,
    completion_mask: Tensor,
    advantages: Tensor,
    old_per_token_logps: Optional[Tensor],
    ref_per_token_logps: Optional[Tensor],
    importance_sampling_ratio: Optional[Tensor],
    policy_mask: Optional[Tensor],
    entropy_mask: Optional[Tensor],
    num_items: Optional[Tensor],
    config: str,
    mode: str,
    budget_mib: float,
    group: str,
    head_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(loss, dhidden, dweight, dbias, logp, entropy, kl, metrics)`` (``dweight``,
    ``dbias`` ``[0]`` for a frozen head: ``head_grad`` False)."""
    device = hidden.device
    dh, dw, db = _grad_buffers(hidden, weight, bias, head_grad)
    logp, entropy, kl = (torch.empty(completion_ids.shape, dtype=torch.float32) for _ in range(3))
    out = _native.grpo_linear(
        hidden, weight, bias, completion_ids, completion_mask, advantages, old_per_token_logps,
        ref_per_token_logps, importance_sampling_ratio, policy_mask, entropy_mask,
        _with_items(config, num_items), mode, budget_mib, dh, *_native_grads(dw, db, bias, head_grad),
        logp, entropy, kl, _stream(device), _dist.ops(group),
    )  # fmt: skip
    loss = torch.tensor(out["loss"], dtype=torch.float32, device=device)
    metrics = metrics_tensor(out, device)
    return loss, dh, dw, db, logp.to(device), entropy.to(device), kl.to(device), metrics


@grpo_linear.register_fake
def _(hidden, weight, bias, completion_ids, *args):
    per_token = tuple(hidden.new_empty(completion_ids.shape, dtype=torch.float32) for _ in range(3))
    loss, metrics = hidden.new_empty((), dtype=torch.float32), hidden.new_empty((len(METRICS),), dtype=torch.float64)
    return (loss, *_fake_grads(hidden, weight, bias, args[-1]), *per_token, metrics)


def _grpo_linear_backward(ctx, grad, *_):
    return (*_scale(grad, ctx.saved_tensors, ctx.dtypes), *([None] * 14))


grpo_linear.register_autograd(_grpo_linear_backward, setup_context=_head_setup)


# --- Cross-entropy from hidden states --------------------------------------------------


@torch.library.custom_op("flashloss::ce_linear", mutates_args=())
def ce_linear(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    targets: Tensor,
    config: str,
    mode: str,
    budget_mib: float,
    group: str,
    head_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(loss, dhidden, dweight, dbias)`` of reduction ``mean`` or ``sum`` (``dweight``,
    ``dbias`` ``[0]`` for a frozen head)."""
    out, _, dh, dw, db = _ce_call(hidden, weight, bias, targets, None, config, mode, budget_mib, group, head_grad)
    return torch.tensor(out["loss"], dtype=torch.float32, device=hidden.device), dh, dw, db


@ce_linear.register_fake
def _(hidden, weight, bias, *args):
    return (hidden.new_empty((), dtype=torch.float32), *_fake_grads(hidden, weight, bias, args[-1]))


def _ce_linear_backward(ctx, grad, *_):
    return (*_scale(grad, ctx.saved_tensors, ctx.dtypes), *([None] * 6))


ce_linear.register_autograd(_ce_linear_backward, setup_context=_head_setup)


@torch.library.custom_op("flashloss::ce_linear_rows_backward", mutates_args=())
def ce_linear_rows_backward(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    targets: Tensor,
    grad_rows: Tensor,
    config: str,
    mode: str,
    budget_mib: float,
    group: str,
    head_grad: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """``Σ_i grad_rows_i · ∂loss_i/∂(hidden, weight, bias)`` (f32; ``[0]`` for the head's
    when frozen)."""
    g = grad_rows.detach().to(device="cpu", dtype=torch.float32).contiguous()
    return _ce_call(hidden, weight, bias, targets, g, config, mode, budget_mib, group, head_grad)[2:]


@ce_linear_rows_backward.register_fake
def _(hidden, weight, bias, *args):
    return _fake_grads(hidden, weight, bias, args[-1])


@torch.library.custom_op("flashloss::ce_linear_rows", mutates_args=())
def ce_linear_rows(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    targets: Tensor,
    config: str,
    mode: str,
    budget_mib: float,
    group: str,
) -> Tensor:
    """Each row's loss (reduction ``none``), f32 ``[N]``: on the CPU one statistics pass
    (no gradient buffers); on a GPU or a vocab-parallel group, the fused call with zero
    row gradients."""
    if hidden.device.type == "cpu" and not group:
        rows = torch.empty(targets.shape, dtype=torch.float32)
        _native.ce_rows(hidden, weight, bias, targets, config, budget_mib, rows)
        return rows
    zero = torch.zeros(targets.shape, dtype=torch.float32)
    rows = _ce_call(hidden, weight, bias, targets, zero, config, mode, budget_mib, group, False)[1]
    return rows.to(hidden.device)


@ce_linear_rows.register_fake
def _(hidden, weight, bias, targets, *args):
    return hidden.new_empty(targets.shape, dtype=torch.float32)


def _ce_rows_setup(ctx, inputs, output):
    hidden, weight, bias, targets, config, mode, budget_mib, group = inputs
    ctx.save_for_backward(hidden, weight, bias, targets)
    ctx.args = (config, mode, budget_mib, group)


def _head_wanted(ctx) -> bool:
    """Whether autograd wants the gradient of ``weight`` or ``bias`` (inputs 1, 2)."""
    return bool(ctx.needs_input_grad[1] or ctx.needs_input_grad[2])


def _ce_rows_backward(ctx, grad_rows):
    hidden, weight, bias, targets = ctx.saved_tensors
    head_grad = _head_wanted(ctx)
    grads = ce_linear_rows_backward(hidden, weight, bias, targets, grad_rows, *ctx.args, head_grad)
    dtypes = _head_dtypes(hidden, weight, bias, head_grad)
    out = [None if dt is None else g.to(dt) for g, dt in zip(grads, dtypes)]
    return (*out, None, None, None, None, None)


ce_linear_rows.register_autograd(_ce_rows_backward, setup_context=_ce_rows_setup)


# --- Cross-entropy with each row's log-sum-exp (Cut Cross-Entropy's return_lse) ---------


@torch.library.custom_op("flashloss::ce_linear_lse_backward", mutates_args=())
def ce_linear_lse_backward(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    targets: Tensor,
    grad_rows: Optional[Tensor],
    grad_lse: Tensor,
    grad_output: float,
    config: str,
    mode: str,
    budget_mib: float,
    group: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """The f32 gradients of ``grad_output·L + Σ_i grad_lse_i·lse_i`` (``L`` with
    ``grad_rows`` for reduction ``none``)."""
    f32 = dict(device="cpu", dtype=torch.float32)
    rows = None if grad_rows is None else grad_rows.detach().to(**f32).contiguous()
    dh, dw, db = _grad_buffers(hidden, weight, bias, True)  # the lse ops train the head
    out_rows = torch.empty(targets.shape, dtype=torch.float32)
    _native.ce_linear(
        hidden, weight, bias, targets, config, mode, budget_mib, rows, dh, dw, None if bias is None else db,
        out_rows, _stream(hidden.device), _dist.ops(group), grad_lse.detach().to(**f32).contiguous(), grad_output,
    )  # fmt: skip
    return dh, dw, db


@ce_linear_lse_backward.register_fake
def _(hidden, weight, bias, *args):
    return _fake_grads(hidden, weight, bias, True)


@torch.library.custom_op("flashloss::ce_linear_lse", mutates_args=())
def ce_linear_lse(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    targets: Tensor,
    config: str,
    mode: str,
    budget_mib: float,
    group: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(loss, lse, dhidden, dweight, dbias)``: reduction ``mean``/``sum``'s loss and
    its gradients, with each row's log-sum-exp ``[N]`` (0 where ignored)."""
    dh, dw, db = _grad_buffers(hidden, weight, bias, True)  # the lse ops train the head
    rows, lse = (torch.empty(targets.shape, dtype=torch.float32) for _ in range(2))
    out = _native.ce_linear(
        hidden, weight, bias, targets, config, mode, budget_mib, None, dh, dw, None if bias is None else db,
        rows, _stream(hidden.device), _dist.ops(group), None, 1.0, lse,
    )  # fmt: skip
    loss = torch.tensor(out["loss"], dtype=torch.float32, device=hidden.device)
    return loss, lse.to(hidden.device), dh, dw, db


@ce_linear_lse.register_fake
def _(hidden, weight, bias, targets, *args):
    f32 = dict(dtype=torch.float32)
    return (
        hidden.new_empty((), **f32), hidden.new_empty(targets.shape, **f32), *_fake_grads(hidden, weight, bias, True)
    )


def _ce_lse_setup(ctx, inputs, output):
    hidden, weight, bias, targets, config, mode, budget_mib, group = inputs
    ctx.save_for_backward(hidden, weight, bias, targets, *output[2:])
    ctx.args = (config, mode, budget_mib, group)
    ctx.mark_non_differentiable(*output[2:])
    ctx.set_materialize_grads(False)


def _ce_lse_backward(ctx, grad, grad_lse, *_):
    hidden, weight, bias, targets, *grads = ctx.saved_tensors
    dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
    out = [None, None, None] if grad is None else _scale(grad, grads, dtypes)
    if grad_lse is not None:
        extra = ce_linear_lse_backward(hidden, weight, bias, targets, None, grad_lse, 0.0, *ctx.args)
        out = [None if dt is None else (e if o is None else o + e).to(dt) for o, e, dt in zip(out, extra, dtypes)]
    return (*out, None, None, None, None, None)


ce_linear_lse.register_autograd(_ce_lse_backward, setup_context=_ce_lse_setup)


@torch.library.custom_op("flashloss::ce_linear_rows_lse", mutates_args=())
def ce_linear_rows_lse(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    targets: Tensor,
    config: str,
    mode: str,
    budget_mib: float,
    group: str,
) -> tuple[Tensor, Tensor]:
    """Reduction ``none``: each row's loss and log-sum-exp ``[N]`` (f32, 0 where ignored)."""
    rows, lse = (torch.empty(targets.shape, dtype=torch.float32) for _ in range(2))
    if hidden.device.type == "cpu" and not group:
        _native.ce_rows(hidden, weight, bias, targets, config, budget_mib, rows, lse)
        return rows, lse
    dh, dw, db = _grad_buffers(hidden, weight, bias, True)  # the lse ops train the head
    _native.ce_linear(
        hidden, weight, bias, targets, config, mode, budget_mib, torch.zeros_like(rows), dh, dw,
        None if bias is None else db, rows, _stream(hidden.device), _dist.ops(group), None, 1.0, lse,
    )  # fmt: skip
    return rows.to(hidden.device), lse.to(hidden.device)


@ce_linear_rows_lse.register_fake
def _(hidden, weight, bias, targets, *args):
    return tuple(hidden.new_empty(targets.shape, dtype=torch.float32) for _ in range(2))


def _ce_rows_lse_backward(ctx, grad_rows, grad_lse):
    hidden, weight, bias, targets = ctx.saved_tensors
    dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
    if grad_lse is None:
        grads = ce_linear_rows_backward(hidden, weight, bias, targets, grad_rows, *ctx.args, True)
    else:
        rows = torch.zeros_like(grad_lse) if grad_rows is None else grad_rows
        grads = ce_linear_lse_backward(hidden, weight, bias, targets, rows, grad_lse, 1.0, *ctx.args)
    out = [None if dt is None else g.to(dt) for g, dt in zip(grads, dtypes)]
    return (*out, None, None, None, None, None)


def _ce_rows_lse_setup(ctx, inputs, output):
    _ce_rows_setup(ctx, inputs, output)
    ctx.set_materialize_grads(False)


ce_linear_rows_lse.register_autograd(_ce_rows_lse_backward, setup_context=_ce_rows_lse_setup)


# --- Log-probabilities -----------------------------------------------------------------


@torch.library.custom_op("flashloss::logp_linear", mutates_args=())
def logp_linear(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    ids: Tensor,
    mask: Optional[Tensor],
    temperature: float,
    budget_mib: float,
    group: str,
) -> tuple[Tensor, Tensor]:
    """``(logp, entropy)`` f32 of ``ids``' shape, zero where ``mask`` is false."""
    logp = torch.empty(ids.shape, dtype=torch.float32)
    entropy = torch.empty(ids.shape, dtype=torch.float32)
    h = hidden.reshape(-1, hidden.shape[-1])
    _native.logp_linear(h, weight, bias, ids, mask, temperature, budget_mib, logp, entropy, _dist.ops(group))
    return logp.to(hidden.device), entropy.to(hidden.device)


@logp_linear.register_fake
def _(hidden, weight, bias, ids, *args):
    return tuple(hidden.new_empty(ids.shape, dtype=torch.float32) for _ in range(2))


@torch.library.custom_op("flashloss::logp_linear_backward", mutates_args=())
def logp_linear_backward(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    ids: Tensor,
    mask: Optional[Tensor],
    grad_logp: Optional[Tensor],
    grad_entropy: Optional[Tensor],
    temperature: float,
    budget_mib: float,
    group: str,
    head_grad: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """``∂(Σ grad_logp·logp + grad_entropy·entropy)/∂(hidden, weight, bias)`` (f32;
    ``[0]`` for the head's when frozen: ``head_grad`` False)."""
    dh, dw, db = _grad_buffers(hidden, weight, bias, head_grad)

    def upstream(g):
        return None if g is None else g.detach().to(device="cpu", dtype=torch.float32).contiguous()

    g_logp = upstream(grad_logp)
    if g_logp is None:
        g_logp = torch.zeros(ids.shape, dtype=torch.float32)
    h = hidden.reshape(-1, hidden.shape[-1])
    _native.logp_linear_grads(
        h, weight, bias, ids, mask, g_logp, upstream(grad_entropy), temperature, "auto", budget_mib,
        dh.view(h.shape), *_native_grads(dw, db, bias, head_grad), _dist.ops(group),
    )  # fmt: skip
    return dh, dw, db


@logp_linear_backward.register_fake
def _(hidden, weight, bias, *args):
    return _fake_grads(hidden, weight, bias, args[-1])


def _logp_setup(ctx, inputs, output):
    hidden, weight, bias, ids, mask, temperature, budget_mib, group = inputs
    ctx.save_for_backward(hidden, weight, bias, ids, mask)
    ctx.args = (temperature, budget_mib, group)
    ctx.set_materialize_grads(False)


def _logp_backward(ctx, grad_logp, grad_entropy):
    hidden, weight, bias, ids, mask = ctx.saved_tensors
    head_grad = _head_wanted(ctx)
    if grad_logp is None and grad_entropy is None:
        return None, None, None, None, None, None, None, None
    grads = logp_linear_backward(hidden, weight, bias, ids, mask, grad_logp, grad_entropy, *ctx.args, head_grad)
    dtypes = _head_dtypes(hidden, weight, bias, head_grad)
    out = [None if dt is None else g.to(dt) for g, dt in zip(grads, dtypes)]
    return (*out, None, None, None, None, None)


logp_linear.register_autograd(_logp_backward, setup_context=_logp_setup)


# --- GRPO on materialized logits -------------------------------------------------------


@torch.library.custom_op("flashloss::grpo_logits", mutates_args=())
def grpo_logits(
    logits: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    advantages: Tensor,
    old_per_token_logps: Optional[Tensor],
    ref_per_token_logps: Optional[Tensor],
    importance_sampling_ratio: Optional[Tensor],
    num_items: Optional[Tensor],
    config: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(loss, dlogits, logp, entropy, kl, metrics)``; ``dlogits`` has ``logits``' shape
    and dtype (zero at positions ``t ≥ T``)."""
    b, t = completion_ids.shape
    dlogits = torch.empty((b, t, logits.shape[-1]), dtype=logits.dtype)
    logp, entropy, kl = (torch.empty((b, t), dtype=torch.float32) for _ in range(3))
    out = _native.grpo_logits(
        logits.contiguous(), completion_ids, completion_mask, advantages, old_per_token_logps,
        ref_per_token_logps, importance_sampling_ratio, _with_items(config, num_items), dlogits,
        logp, entropy, kl,
    )  # fmt: skip
    if logits.shape[1] != t:
        dlogits = torch.nn.functional.pad(dlogits, (0, 0, 0, logits.shape[1] - t))
    loss = torch.tensor(out["loss"], dtype=torch.float32)
    metrics = metrics_tensor(out)
    return loss, dlogits, logp, entropy, kl, metrics


@grpo_logits.register_fake
def _(logits, completion_ids, *args):
    f32 = dict(dtype=torch.float32)
    per_token = tuple(logits.new_empty(completion_ids.shape, **f32) for _ in range(3))
    metrics = logits.new_empty((len(METRICS),), dtype=torch.float64)
    return (logits.new_empty((), **f32), logits.new_empty(logits.shape), *per_token, metrics)


def _grpo_logits_setup(ctx, inputs, output):
    ctx.save_for_backward(output[1])
    _only_the_loss_differentiable(ctx, output)


def _grpo_logits_backward(ctx, grad, *_):
    (dlogits,) = ctx.saved_tensors
    return (*_scale(grad, (dlogits,), (dlogits.dtype,)), *([None] * 8))


grpo_logits.register_autograd(_grpo_logits_backward, setup_context=_grpo_logits_setup)


# --- Per-token GRPO losses on materialized logits (reduce=False) ------------------------


def _per_token_call(logits, ids, mask, adv, old, ref, ratio, config, grad_rows, dlogits):
    """The native per-token call: ``(token_loss, kl, clipped)`` ``[B, T]`` f32."""
    outs = [torch.empty(ids.shape, dtype=torch.float32) for _ in range(5)]
    _native.grpo_logits_per_token(
        logits.contiguous(), ids, mask, adv, old, ref, ratio, config, grad_rows, dlogits, *outs
    )
    token_loss, _, _, kl, clipped = outs
    return token_loss, kl, clipped


@torch.library.custom_op("flashloss::grpo_logits_rows", mutates_args=())
def grpo_logits_rows(
    logits: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    advantages: Tensor,
    old_per_token_logps: Optional[Tensor],
    ref_per_token_logps: Optional[Tensor],
    importance_sampling_ratio: Optional[Tensor],
    config: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """Each token's loss ``ℓ_tot = ℓ·ρ + β·kl`` unreduced, its KL and its clip flag (0/1),
    ``[B, T]`` f32, 0 where masked (Liger's ``reduce=False``)."""
    return _per_token_call(
        logits, completion_ids, completion_mask, advantages, old_per_token_logps, ref_per_token_logps,
        importance_sampling_ratio, config, None, None,
    )  # fmt: skip


@grpo_logits_rows.register_fake
def _(logits, completion_ids, *args):
    return tuple(logits.new_empty(completion_ids.shape, dtype=torch.float32) for _ in range(3))


@torch.library.custom_op("flashloss::grpo_logits_rows_backward", mutates_args=())
def grpo_logits_rows_backward(
    logits: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    advantages: Tensor,
    old_per_token_logps: Optional[Tensor],
    ref_per_token_logps: Optional[Tensor],
    importance_sampling_ratio: Optional[Tensor],
    config: str,
    grad_rows: Tensor,
) -> Tensor:
    """``∂(Σ_i grad_rows_i·ℓ_tot,i)/∂logits`` in ``logits``' shape and dtype (zero at
    positions ``t ≥ T``)."""
    b, t = completion_ids.shape
    dlogits = torch.empty((b, t, logits.shape[-1]), dtype=logits.dtype)
    g = grad_rows.detach().to(device="cpu", dtype=torch.float32).contiguous()
    _per_token_call(
        logits, completion_ids, completion_mask, advantages, old_per_token_logps, ref_per_token_logps,
        importance_sampling_ratio, config, g, dlogits,
    )  # fmt: skip
    if logits.shape[1] != t:
        dlogits = torch.nn.functional.pad(dlogits, (0, 0, 0, logits.shape[1] - t))
    return dlogits


@grpo_logits_rows_backward.register_fake
def _(logits, *args):
    return logits.new_empty(logits.shape)


def _grpo_rows_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:7])
    ctx.config = inputs[7]
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)


def _grpo_rows_backward(ctx, grad_rows, *_):
    if grad_rows is None:
        return (None,) * 8
    dlogits = grpo_logits_rows_backward(*ctx.saved_tensors, ctx.config, grad_rows)
    return (dlogits, *([None] * 7))


grpo_logits_rows.register_autograd(_grpo_rows_backward, setup_context=_grpo_rows_setup)
