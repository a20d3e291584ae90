"""``flashloss.torch.linear_grpo_loss`` under the sampler's truncated support (``top_k``,
``top_p``, ``min_p``; docs/spec/losses.md, flashloss addition 13) against TRL's loss in
float64 with vLLM's filters materialized (``trl_reference``): loss, ``logp^K``, the
targets outside the support (masked, flagged), and the gradients, on heads of exact
logits so that both sides decide the same support, ties included."""

from __future__ import annotations

import pytest
import torch

import flashloss.torch as fl
from trl_reference import grpo_reference, truncated_support

FILTERS = [(7, None, None), (None, 0.8, None), (None, None, 0.05), (20, 0.5, None), (4, 0.9, 0.02)]


def exact_batch(seed: int, b: int = 3, t: int = 4, h: int = 12, v: int = 301, ties: bool = True):
    """A head whose logits are exact in f32 (multiples of 1/32); every other target is its
    row's argmax (inside any support), the others random ids (often outside)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randint(-4, 5, (b, t, h), generator=g).double() / 4
    weight = torch.randint(-4, 5, (v, h), generator=g).double() / 8
    bias = torch.randint(-8, 9, (v,), generator=g).double() / 16
    if ties:
        weight[64:] = weight[torch.arange(64, v) % 3]
    z = hidden @ weight.T + bias
    ids = torch.randint(0, v, (b, t), generator=g)
    ids.view(-1)[::2] = z.reshape(-1, v).argmax(-1)[::2]
    mask = torch.rand(b, t, generator=g) > 0.2
    adv = torch.randn(b, generator=g)
    old = (torch.log_softmax(z, -1).gather(-1, ids[..., None])[..., 0] + 0.1).float()
    ref = (old - 0.05).float()
    return dict(
        hidden=hidden.float(), weight=weight.float(), bias=bias.float(), ids=ids, mask=mask, adv=adv, old=old, ref=ref
    )


def run(d, support, entropy_mask=None, **kw):
    leaves = [d[k].double().requires_grad_() for k in ("hidden", "weight", "bias")]
    common = dict(loss_type=kw.get("loss_type", "dapo"), beta=0.04, temperature=0.9, entropy_coef=0.01)
    level = kw.get("importance_sampling_level", "token")
    ref_loss, ref_logp, _ = grpo_reference(
        *leaves, d["ids"], d["mask"], d["adv"], old=d["old"], ref=d["ref"], support=support,
        importance_sampling_level=level, entropy_mask=entropy_mask, **common,
    )  # fmt: skip
    ref_loss.backward()
    inputs = [d[k].clone().requires_grad_() for k in ("hidden", "weight", "bias")]
    top_k, top_p, min_p = support
    loss, out = fl.linear_grpo_loss(
        inputs[0], inputs[1], d["ids"], d["mask"], d["adv"], bias=inputs[2],
        old_per_token_logps=d["old"], ref_per_token_logps=d["ref"], top_k=top_k, top_p=top_p, min_p=min_p,
        importance_sampling_level=level, entropy_mask=entropy_mask, **common,
    )  # fmt: skip
    loss.backward()
    return (ref_loss, ref_logp, leaves), (loss, out, inputs)


@pytest.mark.parametrize("support", FILTERS)
@pytest.mark.parametrize(
    "loss_type,level", [("dapo", "token"), ("grpo", "sequence"), ("bnpo", "token"), ("cispo", "token")]
)
def test_loss_logp_and_gradients_match_trl_under_the_support(support, loss_type, level):
    d = exact_batch(3)
    (ref_loss, ref_logp, leaves), (loss, out, inputs) = run(
        d, support, loss_type=loss_type, importance_sampling_level=level
    )
    z = d["hidden"].double() @ d["weight"].double().T + d["bias"].double()
    keep = truncated_support(z, 0.9, *support)
    outside = ~keep.gather(-1, d["ids"][..., None])[..., 0] & d["mask"]
    assert torch.equal(out.outside_support, outside)
    assert torch.isfinite(loss)
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * max(1.0, abs(ref_loss.item()))
    inside = d["mask"] & ~outside
    assert torch.allclose(out.logp[inside].double(), ref_logp[inside], rtol=1e-5, atol=1e-5)
    assert torch.isneginf(out.logp[outside]).all()
    for name, ours, leaf in zip(("hidden", "weight", "bias"), inputs, leaves):
        scale = leaf.grad.abs().max().item()
        err = (ours.grad.double() - leaf.grad).abs().max().item()
        assert err <= 1e-4 * scale + 1e-7, (name, err, scale)


def test_some_targets_are_outside_and_unset_filters_are_the_plain_loss():
    d = exact_batch(5)
    _, (_, out, _) = run(d, (7, None, None))
    assert out.outside_support.any(), "the masking went untested"
    _, (plain, plain_out, _) = run(d, (None, None, None))
    _, (unset, unset_out, _) = run(d, (0, 1.0, 0.0))
    assert plain_out.outside_support is None
    assert unset.item() == plain.item() and unset_out.outside_support is None
    # One rule (vLLM's, TRL's): top_k -1 is "no top-k" too.
    _, (unset, unset_out, _) = run(d, (-1, None, None))
    assert unset.item() == plain.item() and unset_out.outside_support is None


@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(top_k=-2), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(min_p=2.0), "min_p"),
    ],
)
def test_bad_filters_name_the_argument(kwargs, name):
    d = exact_batch(1)
    with pytest.raises(ValueError, match=name):
        fl.linear_grpo_loss(d["hidden"], d["weight"], d["ids"], d["mask"], d["adv"], **kwargs)


def test_compile_under_a_support():
    d = exact_batch(7)

    def step(hidden, weight, bias):
        loss, out = fl.linear_grpo_loss(
            hidden, weight, d["ids"], d["mask"], d["adv"], bias=bias, old_per_token_logps=d["old"], top_k=7, top_p=0.9
        )
        return loss, out.outside_support

    inputs = [d[k].clone().requires_grad_() for k in ("hidden", "weight", "bias")]
    eager, eager_out = step(*inputs)
    compiled, compiled_out = torch.compile(step, fullgraph=True)(*inputs)
    assert torch.equal(eager, compiled) and torch.equal(eager_out, compiled_out) and eager_out.any()


@pytest.mark.parametrize("support", [(7, None, None), (None, 0.8, 0.02)])
def test_entropy_mask_under_the_support(support):
    """The entropy bonus's mean over ``m' * entropy_mask`` (``m'`` without the tokens
    outside the support), against TRL's float64 loss."""
    d = exact_batch(9)
    entropy_mask = torch.arange(d["mask"].numel()).reshape(d["mask"].shape) % 3 != 1
    (ref_loss, _, leaves), (loss, out, inputs) = run(d, support, entropy_mask=entropy_mask)
    assert out.outside_support.any()
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * max(1.0, abs(ref_loss.item()))
    for name, ours, leaf in zip(("hidden", "weight", "bias"), inputs, leaves):
        err = (ours.grad.double() - leaf.grad).abs().max().item()
        assert err <= 1e-4 * leaf.grad.abs().max().item() + 1e-7, name
