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
:mod:`flashloss.torch._dist` ("" for none).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import _native
from .._spec.names import native
from . import _dist
from .._spec.native import call_spec

# The logits-level ops (re-exported for flashloss.torch) and the helpers every op shares.
from ._logits_ops import grpo_logits, grpo_logits_rows, grpo_logits_rows_backward  # noqa: F401
from ._op_utils import (
    METRICS,
    METRICS_DTYPE,
    _f32,
    _fake_grads,
    _grad_buffers,
    _head_dtypes,
    _head_wanted,
    _native_grads,
    _only_the_loss_differentiable,
    _scale,
    _stream,
    _with_items,
    metrics_tensor,
    scalar_on,
    to_device,
)


def _ce_call(hidden, weight, bias, targets, grad_rows, config, mode, budget_mib, group, head_grad):
    """The native CE call: ``(result dict, per-row losses, dhidden, dweight, dbias)``,
    gradients times ``grad_rows`` where given."""
    dh, dw, db = _grad_buffers(hidden, weight, bias, head_grad)
    rows = torch.empty(targets.shape, dtype=torch.float32)
    out = native("ce", _native.ce_linear, 
        (hidden, weight, bias), targets, (grad_rows, None), (dh, *_native_grads(dw, db, bias, head_grad)),
        (rows, None), call_spec(config, mode=mode, budget_mib=budget_mib), _stream(hidden.device), _dist.ops(group),
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
    budget_mib: Optional[float],
    group: str,
    head_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(loss, dhidden, dweight, dbias, logp, entropy, kl, metrics)`` (``dweight``,
    ``dbias`` ``[0]`` for a frozen head: ``head_grad`` False)."""
    device = hidden.device
    dh, dw, db = _grad_buffers(hidden, weight, bias, head_grad)
    logp, entropy, kl = (torch.empty(completion_ids.shape, dtype=torch.float32) for _ in range(3))
    batch = (
        completion_ids,
        completion_mask,
        advantages,
        old_per_token_logps,
        ref_per_token_logps,
        importance_sampling_ratio,
        policy_mask,
        entropy_mask,
    )
    out = native("grpo", _native.grpo_linear, 
        (hidden, weight, bias), batch, (dh, *_native_grads(dw, db, bias, head_grad)), (logp, entropy, kl),
        call_spec(_with_items(config, num_items), mode=mode, budget_mib=budget_mib), _stream(device),
        _dist.ops(group),
    )  # fmt: skip
    loss = scalar_on(out["loss"], device)
    metrics = metrics_tensor(out, device)
    return loss, dh, dw, db, to_device(logp, device), to_device(entropy, device), to_device(kl, device), metrics


@grpo_linear.register_fake
def _(hidden, weight, bias, completion_ids, *args):
    per_token = tuple(hidden.new_empty(completion_ids.shape, dtype=torch.float32) for _ in range(3))
    loss, metrics = hidden.new_empty((), dtype=torch.float32), hidden.new_empty((len(METRICS),), dtype=METRICS_DTYPE)
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
    budget_mib: Optional[float],
    group: str,
    head_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(loss, dhidden, dweight, dbias)`` of reduction ``mean`` or ``sum`` (``dweight``,
    ``dbias`` ``[0]`` for a frozen head)."""
    out, _, dh, dw, db = _ce_call(hidden, weight, bias, targets, None, config, mode, budget_mib, group, head_grad)
    return scalar_on(out["loss"], hidden.device), dh, dw, db


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
    budget_mib: Optional[float],
    group: str,
    head_grad: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """``Σ_i grad_rows_i · ∂loss_i/∂(hidden, weight, bias)`` (f32; ``[0]`` for the head's
    when frozen)."""
    return _ce_call(hidden, weight, bias, targets, _f32(grad_rows), config, mode, budget_mib, group, head_grad)[2:]


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
    budget_mib: Optional[float],
    group: str,
) -> Tensor:
    """Each row's loss (reduction ``none``), f32 ``[N]``: on the CPU one statistics pass
    (no gradient buffers); on a GPU or a vocab-parallel group, the fused call with zero
    row gradients."""
    if hidden.device.type == "cpu" and not group:
        rows = torch.empty(targets.shape, dtype=torch.float32)
        native(
            "ce",
            _native.ce_rows,
            (hidden, weight, bias),
            targets,
            (rows, None),
            call_spec(config, budget_mib=budget_mib),
        )
        return rows
    zero = torch.zeros(targets.shape, dtype=torch.float32)
    rows = _ce_call(hidden, weight, bias, targets, zero, config, mode, budget_mib, group, False)[1]
    return to_device(rows, hidden.device)


@ce_linear_rows.register_fake
def _(hidden, weight, bias, targets, *args):
    return hidden.new_empty(targets.shape, dtype=torch.float32)


def _ce_rows_setup(ctx, inputs, output):
    hidden, weight, bias, targets, config, mode, budget_mib, group = inputs
    ctx.save_for_backward(hidden, weight, bias, targets)
    ctx.args = (config, mode, budget_mib, group)


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
    budget_mib: Optional[float],
    group: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """The f32 gradients of ``grad_output·L + Σ_i grad_lse_i·lse_i`` (``L`` with
    ``grad_rows`` for reduction ``none``)."""
    dh, dw, db = _grad_buffers(hidden, weight, bias, True)  # the lse ops train the head
    out_rows = torch.empty(targets.shape, dtype=torch.float32)
    native("ce", _native.ce_linear, 
        (hidden, weight, bias), targets, (_f32(grad_rows), _f32(grad_lse)), (dh, dw, None if bias is None else db),
        (out_rows, None), call_spec(config, mode=mode, budget_mib=budget_mib, grad_output=grad_output),
        _stream(hidden.device), _dist.ops(group),
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
    budget_mib: Optional[float],
    group: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(loss, lse, dhidden, dweight, dbias)``: reduction ``mean``/``sum``'s loss and
    its gradients, with each row's log-sum-exp ``[N]`` (0 where ignored)."""
    dh, dw, db = _grad_buffers(hidden, weight, bias, True)  # the lse ops train the head
    rows, lse = (torch.empty(targets.shape, dtype=torch.float32) for _ in range(2))
    out = native("ce", _native.ce_linear, 
        (hidden, weight, bias), targets, (None, None), (dh, dw, None if bias is None else db), (rows, lse),
        call_spec(config, mode=mode, budget_mib=budget_mib), _stream(hidden.device), _dist.ops(group),
    )  # fmt: skip
    loss = scalar_on(out["loss"], hidden.device)
    return loss, to_device(lse, hidden.device), dh, dw, db


@ce_linear_lse.register_fake
def _(hidden, weight, bias, targets, *args):
    f32 = dict(dtype=torch.float32)
    return (
        hidden.new_empty((), **f32),
        hidden.new_empty(targets.shape, **f32),
        *_fake_grads(hidden, weight, bias, True),
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
    budget_mib: Optional[float],
    group: str,
) -> tuple[Tensor, Tensor]:
    """Reduction ``none``: each row's loss and log-sum-exp ``[N]`` (f32, 0 where ignored)."""
    rows, lse = (torch.empty(targets.shape, dtype=torch.float32) for _ in range(2))
    if hidden.device.type == "cpu" and not group:
        native(
            "ce",
            _native.ce_rows,
            (hidden, weight, bias),
            targets,
            (rows, lse),
            call_spec(config, budget_mib=budget_mib),
        )
        return rows, lse
    dh, dw, db = _grad_buffers(hidden, weight, bias, True)  # the lse ops train the head
    native("ce", _native.ce_linear, 
        (hidden, weight, bias), targets, (torch.zeros_like(rows), None), (dh, dw, None if bias is None else db),
        (rows, lse), call_spec(config, mode=mode, budget_mib=budget_mib), _stream(hidden.device), _dist.ops(group),
    )  # fmt: skip
    return to_device(rows, hidden.device), to_device(lse, hidden.device)


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


def _logp_outputs(ids: Tensor, gather_ids: Optional[Tensor], sum_p2: bool, support: bool, new) -> tuple:
    """``(logp, entropy, lse, max_logit, sum_p2, gathered, outside)`` buffers from
    ``new(shape)``: ``ids``' shape each, ``sum_p2`` ``[0]`` unless asked, ``gathered``
    ``gather_ids``' shape (``[0]`` without), ``outside`` ``[0]`` without a support."""
    return (
        *(new(ids.shape) for _ in range(4)),
        new(ids.shape if sum_p2 else (0,)),
        new((0,) if gather_ids is None else gather_ids.shape),
        new(ids.shape if support else (0,)),
    )


def _has_support(top_k, top_p, min_p) -> bool:
    return any(x is not None for x in (top_k, top_p, min_p))


@torch.library.custom_op("flashloss::logp_linear", mutates_args=())
def logp_linear(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    ids: Tensor,
    mask: Optional[Tensor],
    temperature: float,
    budget_mib: Optional[float],
    group: str,
    gather_ids: Optional[Tensor] = None,
    sum_p2: bool = False,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    min_p: Optional[float] = None,
    mode: str = "auto",
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(logp, entropy, lse, max_logit, sum_p2, gathered, outside)`` f32: ``ids``' shape
    each (zero where ``mask`` is false), ``sum_p2`` ``[0]`` unless asked, ``gathered`` the
    log-probs of ``gather_ids`` ``[..., K]`` (``[0]`` without); with ``top_k``/``top_p``/
    ``min_p``, ``logp`` under the truncated support (``-inf`` outside it) and ``outside``
    1.0 where the target is outside (``[0]`` without a support). ``mode``: the backward's
    plan (the forward is one statistics pass)."""
    support = _has_support(top_k, top_p, min_p)
    out = _logp_outputs(ids, gather_ids, sum_p2, support, lambda shape: torch.empty(shape, dtype=torch.float32))
    logp, entropy, lse, max_logit, p2, gathered, outside = out
    h = hidden.reshape(-1, hidden.shape[-1])
    outs = (
        logp,
        entropy,
        lse,
        max_logit,
        p2 if sum_p2 else None,
        None if gather_ids is None else gathered,
        outside if support else None,
    )
    spec = call_spec(temperature=temperature, budget_mib=budget_mib, top_k=top_k, top_p=top_p, min_p=min_p)
    native(
        "logprobs",
        _native.logp_linear,
        (h, weight, bias),
        (ids, mask),
        outs,
        gather_ids,
        spec,
        _stream(hidden.device),
        _dist.ops(group),
    )
    return tuple(to_device(t, hidden.device) for t in out)


@logp_linear.register_fake
def _(
    hidden, weight, bias, ids, mask, temperature, budget_mib, group, gather_ids=None, sum_p2=False,
    top_k=None, top_p=None, min_p=None, mode="auto",
):  # fmt: skip
    support = _has_support(top_k, top_p, min_p)
    return _logp_outputs(ids, gather_ids, sum_p2, support, lambda shape: hidden.new_empty(shape, dtype=torch.float32))


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
    budget_mib: Optional[float],
    group: str,
    head_grad: bool,
    grad_lse: Optional[Tensor] = None,
    gather_ids: Optional[Tensor] = None,
    grad_gathered: Optional[Tensor] = None,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    min_p: Optional[float] = None,
    mode: str = "auto",
) -> tuple[Tensor, Tensor, Tensor]:
    """``∂(Σ grad_logp·logp + grad_entropy·entropy + grad_lse·lse + Σ grad_gathered·gathered)
    /∂(hidden, weight, bias)`` (f32; ``[0]`` for the head's when frozen: ``head_grad``
    False)."""
    dh, dw, db = _grad_buffers(hidden, weight, bias, head_grad)
    g_logp = _f32(grad_logp)
    if g_logp is None:
        g_logp = torch.zeros(ids.shape, dtype=torch.float32)
    gathered = _f32(grad_gathered)
    h = hidden.reshape(-1, hidden.shape[-1])
    spec = call_spec(
        temperature=temperature, mode=mode, budget_mib=budget_mib, top_k=top_k, top_p=top_p, min_p=min_p,
    )  # fmt: skip
    native("logprobs", _native.logp_linear_grads, 
        (h, weight, bias), (ids, mask), (g_logp, _f32(grad_entropy), _f32(grad_lse), gathered),
        (dh.view(h.shape), *_native_grads(dw, db, bias, head_grad)), None if gathered is None else gather_ids,
        spec, _stream(hidden.device), _dist.ops(group),
    )  # fmt: skip
    return dh, dw, db


@logp_linear_backward.register_fake
def _(hidden, weight, bias, ids, mask, grad_logp, grad_entropy, temperature, budget_mib, group, head_grad, *_):
    return _fake_grads(hidden, weight, bias, head_grad)


def _logp_setup(ctx, inputs, output):
    hidden, weight, bias, ids, mask, temperature, budget_mib, group, gather_ids, _, *support, mode = inputs
    ctx.save_for_backward(hidden, weight, bias, ids, mask, gather_ids)
    ctx.args = (temperature, budget_mib, group)
    ctx.support = tuple(support)  # top_k, top_p, min_p
    ctx.mode = mode
    ctx.mark_non_differentiable(output[3], output[4], output[6])  # max logit, Σp², outside
    ctx.set_materialize_grads(False)


def _logp_backward(ctx, grad_logp, grad_entropy, grad_lse, _max, _sum_p2, grad_gathered, _outside):
    hidden, weight, bias, ids, mask, gather_ids = ctx.saved_tensors
    head_grad = _head_wanted(ctx)
    if all(g is None for g in (grad_logp, grad_entropy, grad_lse, grad_gathered)):
        return (None,) * 14
    up = (grad_logp, grad_entropy, *ctx.args, head_grad, grad_lse, gather_ids, grad_gathered, *ctx.support, ctx.mode)
    grads = logp_linear_backward(hidden, weight, bias, ids, mask, *up)
    dtypes = _head_dtypes(hidden, weight, bias, head_grad)
    out = [None if dt is None else g.to(dt) for g, dt in zip(grads, dtypes)]
    return (*out, *(None,) * 11)


logp_linear.register_autograd(_logp_backward, setup_context=_logp_setup)
