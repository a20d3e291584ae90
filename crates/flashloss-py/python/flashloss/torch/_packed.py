"""Packed (padding-free) GRPO batches in :mod:`flashloss.torch`: ``hidden`` (or the
logits) ``[total_tokens, ...]`` with the sequences given by ``cu_seqlens`` or
``position_ids`` (the rule: :mod:`flashloss._spec.packed`).

The head runs on the packed rows (:func:`linear_logprobs`: one statistics pass forward,
the head again in its backward, no ``[B, T_max, H]`` copy); each row's ``logp`` and
entropy are then placed at ``(b, t)`` of the padded ``[B, T_max]`` batch (these O(B·T)
floats only) and the native policy stage (``flashloss::grpo_policy``, the crate's
``policy_stage``: the one place the per-sequence reductions are written) gives the loss,
the metrics and ``∂L/∂logp``, ``∂L/∂H``, which autograd carries back through the head."""

from __future__ import annotations

from dataclasses import asdict
from typing import Optional

import torch
from torch import Tensor

from .. import _native
from .._spec.names import native
from .._spec import METRICS, GRPOOutputs
from .._spec import packed as P
from .._spec.native import call_spec
from ._args import check_tensor
from ._losses import linear_logprobs
from ._op_utils import METRICS_DTYPE, _f32, _with_items, metrics_tensor

# --- the policy stage alone, from per-token statistics -----------------------------------


@torch.library.custom_op("flashloss::grpo_policy", mutates_args=())
def grpo_policy(
    logp: Tensor,
    entropy: Tensor,
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
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(loss, dlogp, dentropy, kl, metrics)`` of ``logp``, ``entropy`` ``[B, T]``."""
    dlogp, dentropy, kl = (torch.empty(completion_ids.shape, dtype=torch.float32) for _ in range(3))
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
    out = native("grpo", _native.grpo_policy, 
        _f32(logp), _f32(entropy), batch, (dlogp, dentropy, kl), call_spec(_with_items(config, num_items)),
    )  # fmt: skip
    return torch.tensor(out["loss"], dtype=torch.float32), dlogp, dentropy, kl, metrics_tensor(out)


@grpo_policy.register_fake
def _(logp, *args):
    f32 = dict(dtype=torch.float32)
    per_token = tuple(logp.new_empty(logp.shape, **f32) for _ in range(3))
    return (logp.new_empty((), **f32), *per_token, logp.new_empty((len(METRICS),), dtype=METRICS_DTYPE))


def _policy_setup(ctx, inputs, output):
    ctx.save_for_backward(output[1], output[2])
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)


def _policy_backward(ctx, grad, *_):
    dlogp, dentropy = ctx.saved_tensors
    if grad is None:
        return (None,) * 12
    return (grad * dlogp, grad * dentropy, *([None] * 10))


grpo_policy.register_autograd(_policy_backward, setup_context=_policy_setup)


# --- a packed batch ------------------------------------------------------------------------


def _host(x):
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else x


class Packed:
    """A packed call's sequences (:class:`flashloss._spec.packed.Segments`) and its per-row
    inputs, checked: ``ids`` ``[N]`` int64, ``mask`` ``[N]`` bool, the advantages ``[B]``."""

    def __init__(self, cu_seqlens, position_ids, completion_ids, completion_mask, advantages):
        check_tensor("completion_ids", completion_ids)
        if completion_ids.dtype.is_floating_point or completion_ids.dtype == torch.bool:
            raise ValueError(f"argument `completion_ids`: expected an integer dtype, got {completion_ids.dtype}")
        n = completion_ids.shape[-1] if completion_ids.dim() else 0
        P.per_row("completion_ids", tuple(completion_ids.shape), n)
        self.seg = P.Segments.of(_host(cu_seqlens), _host(position_ids), total_tokens=n)
        self.n, self.shape = n, (self.seg.batch, self.seg.max_len)
        self.index = torch.from_numpy(self.seg.padded_index())
        self.ids = completion_ids.reshape(n).to(device="cpu", dtype=torch.int64).contiguous()
        self.mask = self.token_mask("completion_mask", completion_mask)
        if self.mask is None:
            self.mask = torch.ones(n, dtype=torch.bool)
        check_tensor("advantages", advantages)
        P.per_sequence("advantages", tuple(advantages.shape), self.seg.batch)
        self.advantages = _f32(advantages.reshape(self.seg.batch))

    def check(self, per_token: dict) -> "Packed":
        """Checks the shapes of ``per_token`` (``hidden``, ``old``, ``ref``, ``ratio``,
        ``policy_mask``, ``entropy_mask``) before any kernel runs."""
        names = dict(old="old_per_token_logps", ref="ref_per_token_logps")
        for key, x in per_token.items():
            if key == "hidden":
                check_tensor("hidden", x)
                P.rows_of("hidden", tuple(x.shape), self.n)
            elif key == "ratio":
                if x is not None:
                    check_tensor("importance_sampling_ratio", x)
                    P.sampler_ratio_kind(tuple(x.shape), self.seg)
            else:
                self.rows(names.get(key, key), x)
        return self

    def rows(self, arg: str, x: Optional[Tensor]) -> Optional[Tensor]:
        """A per-row input ``[N]`` or ``[1, N]`` as ``[N]`` (None as None)."""
        if x is None:
            return None
        check_tensor(arg, x)
        P.per_row(arg, tuple(x.shape), self.n)
        return x.reshape(self.n)

    def token_mask(self, arg: str, x: Optional[Tensor]) -> Optional[Tensor]:
        x = self.rows(arg, x)
        return None if x is None else (x != 0).cpu()

    def padded(self, x: Optional[Tensor], fill=0) -> Optional[Tensor]:
        """Per-row values ``[N]`` placed in the padded ``[B, T_max]`` batch (``fill`` elsewhere)."""
        if x is None:
            return None
        out = torch.full((self.shape[0] * self.shape[1],), fill, dtype=x.dtype, device=x.device)
        return out.index_put((self.index.to(x.device),), x).reshape(self.shape)

    def packed(self, x: Tensor) -> Tensor:
        """A padded ``[B, T_max]`` tensor's values at the packed rows ``[N]``."""
        return x.reshape(-1)[self.index.to(x.device)]

    def sampler_ratio(self, ratio: Optional[Tensor]) -> Optional[Tensor]:
        if ratio is None:
            return None
        check_tensor("importance_sampling_ratio", ratio)
        if P.sampler_ratio_kind(tuple(ratio.shape), self.seg) == "sequence":
            return _f32(ratio.reshape(self.seg.batch))
        return self.padded(_f32(ratio.reshape(self.n)), 1.0)

    def loss(self, logp, entropy, outside, old, ref, ratio, policy_mask, entropy_mask, items, config):
        """``(loss, GRPOOutputs)`` from the rows' ``logp`` and ``entropy`` ``[N]``
        (differentiable), ``outside`` ``[N]`` (bool: masked out) or None; per-row inputs
        checked here."""
        kept = self.mask if outside is None else self.mask & ~outside.cpu()
        lp = torch.where(kept.to(logp.device), logp, torch.zeros((), dtype=logp.dtype, device=logp.device))
        old, ref = (_f32(self.rows(a, x)) for a, x in (("old_per_token_logps", old), ("ref_per_token_logps", ref)))
        masks = (self.token_mask("policy_mask", policy_mask), self.token_mask("entropy_mask", entropy_mask))
        loss, _, _, kl, metrics = grpo_policy(
            self.padded(lp), self.padded(entropy), torch.zeros(self.shape, dtype=torch.int64),
            self.padded(kept, False), self.advantages, self.padded(old), self.padded(ref), self.sampler_ratio(ratio),
            *(self.padded(m, False) for m in masks), items, config,
        )  # fmt: skip
        device = logp.device
        named = {k: metrics[i].to(device) for i, k in enumerate(METRICS)}
        kl = self.packed(kl).to(device)
        return loss.to(device), GRPOOutputs(logp=logp.detach(), entropy=entropy.detach(), kl=kl, metrics=named,
                                            outside_support=outside)  # fmt: skip


def linear_grpo(packed: Packed, head: dict, args, per_token: dict, items, config, plan: dict):
    """The packed ``linear_grpo_loss``: ``head`` = (hidden, weight, bias), ``args`` the
    call's :class:`GrpoArgs`, ``per_token`` the old/ref/ratio/masks as given."""
    hidden, weight, bias = head["hidden"], head["weight"], head["bias"]
    check_tensor("hidden", hidden)
    P.rows_of("hidden", tuple(hidden.shape), packed.n)
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
        **plan,
    )
    outside = out.outside_support if f.truncates else None
    return packed.loss(out.logp, out.entropy, outside, **per_token, items=items, config=config)


def logits_grpo(packed: Packed, logits: Tensor, args, per_token: dict, items, config):
    """The packed ``grpo_loss`` on ``logits`` ``[N, V]``: each live row's log-softmax is
    formed in PyTorch (float32, ``[live rows, V]``; the padded call's fused kernel forms
    none)."""
    check_tensor("logits", logits)
    P.rows_of("logits", tuple(logits.shape), packed.n)
    z = logits.reshape(packed.n, logits.shape[-1])
    live = packed.mask.nonzero()[:, 0].to(z.device)
    rows = z.index_select(0, live).float() / args.temperature
    logsm = torch.log_softmax(rows, dim=-1)
    ids = packed.ids.to(z.device).index_select(0, live)
    if ((ids < 0) | (ids >= z.shape[-1])).any():
        raise ValueError(f"argument `completion_ids`: ids must be in [0, {z.shape[-1]}) where the mask is set")
    zeros = torch.zeros(packed.n, dtype=torch.float32, device=z.device)
    logp = zeros.index_put((live,), logsm.gather(-1, ids[:, None])[:, 0])
    entropy = zeros.index_put((live,), -(logsm.exp() * logsm).sum(-1))
    return packed.loss(logp, entropy, None, **per_token, items=items, config=config)
