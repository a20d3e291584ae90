"""flashloss.torch.grpo_loss (logits-level, Liger's triton_grpo_loss call shape) against
TRL's formulas in float64, on [B, T+1, V] logits, in place and not."""

import pytest
import torch

import flashloss.torch as fl
from trl_reference import grpo_reference


def setup(seed, b=3, t=4, v=29):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, t + 1, v, generator=g) * 2
    ids = torch.randint(0, v, (b, t), generator=g)
    mask = torch.rand(b, t, generator=g) > 0.2
    mask[-1] = False
    adv = torch.randn(b, generator=g)
    noise = lambda s: (torch.log_softmax(logits[:, :t].double() / 0.9, -1).gather(-1, ids[..., None])[..., 0]  # noqa: E731
                       + s * torch.randn(b, t, generator=g, dtype=torch.float64)).float()  # fmt: skip
    return logits, ids, mask, adv, noise(0.3), noise(0.3)


def reference(logits, ids, mask, adv, old, ref, **kw):
    b, t = ids.shape
    v = logits.shape[-1]
    z = logits[:, :t].double().detach().requires_grad_()
    eye = torch.eye(v, dtype=torch.float64)
    loss, _, _ = grpo_reference(z, eye, None, ids, mask, adv, old=old, ref=ref, **kw)
    loss.backward()
    return loss.item(), z.grad


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "sapo"])
def test_matches_trl(inplace, loss_type):
    logits, ids, mask, adv, old, ref = setup(len(loss_type) + inplace)
    ref_loss, ref_grad = reference(logits, ids, mask, adv, old, ref, loss_type=loss_type, beta=0.04,
                                   epsilon_high=0.4, temperature=0.9, use_bias_correction_kl=False)  # fmt: skip
    z = logits.clone().requires_grad_()
    leaf = z
    if inplace:
        z = z * 1.0  # a non-leaf the kernel may overwrite
    loss, metrics = fl.grpo_loss(z, old, ref, ids, adv, mask, loss_type=loss_type, inplace=inplace)
    loss.backward()
    assert abs(loss.item() - ref_loss) <= 1e-5 * max(1.0, abs(ref_loss))
    t = ids.shape[1]
    scale = ref_grad.abs().max().item()
    assert (leaf.grad[:, :t].double() - ref_grad).abs().max().item() <= 1e-4 * scale
    assert torch.count_nonzero(leaf.grad[:, t:]) == 0
    assert len(metrics) == 2


def test_reduce_false_is_refused():
    logits, ids, mask, adv, old, ref = setup(0)
    with pytest.raises(ValueError, match="`reduce`"):
        fl.grpo_loss(logits, old, ref, ids, adv, mask, reduce=False)
