"""The logits-level GRPO loss against TRL's formulas in float64, on [B, T+1, V] logits:
Liger's call shape, in place and not (flashloss.liger.triton_grpo_loss), and the
TRL-shaped flashloss.torch.grpo_loss, which returns GRPOOutputs."""

import pytest
import torch

import flashloss.torch as fl
from flashloss import liger
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
    loss, metrics = liger.triton_grpo_loss(z, old, ref, ids, adv, mask, loss_type=loss_type, inplace=inplace)
    loss.backward()
    assert abs(loss.item() - ref_loss) <= 1e-5 * max(1.0, abs(ref_loss))
    t = ids.shape[1]
    scale = ref_grad.abs().max().item()
    assert (leaf.grad[:, :t].double() - ref_grad).abs().max().item() <= 1e-4 * scale
    assert torch.count_nonzero(leaf.grad[:, t:]) == 0
    assert len(metrics) == 2


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "sapo", "vespo"])
def test_trl_shaped_grpo_loss_matches_trl(loss_type):
    """``flashloss.torch.grpo_loss``: TRL's names (keyword-only after the batch), TRL's
    defaults, ``(loss, GRPOOutputs)``; the same loss and gradient as TRL's formulas."""
    logits, ids, mask, adv, old, ref = setup(7 + len(loss_type))
    kw = dict(loss_type=loss_type, beta=0.04, epsilon_high=0.4, temperature=0.9, use_bias_correction_kl=False)
    ref_loss, ref_grad = reference(logits, ids, mask, adv, old, ref, **kw)
    leaf = logits.clone().requires_grad_()
    loss, out = fl.grpo_loss(leaf, ids, mask, adv, old_per_token_logps=old, ref_per_token_logps=ref, **kw)
    loss.backward()
    assert abs(loss.item() - ref_loss) <= 1e-5 * max(1.0, abs(ref_loss))
    t = ids.shape[1]
    assert (leaf.grad[:, :t].double() - ref_grad).abs().max().item() <= 1e-4 * ref_grad.abs().max().item()
    assert isinstance(out, fl.GRPOOutputs) and out.logp.shape == ids.shape and set(out.metrics) >= {"kl", "entropy"}
    liger_loss, liger_metrics = liger.triton_grpo_loss(
        logits.clone(), old, ref, ids, adv, mask, eps_high=0.4, loss_type=loss_type, inplace=False
    )
    assert liger_loss.item() == loss.item()
    assert float(liger_metrics[-1]) == float(out.metrics["clip_ratio/region_mean"])


@pytest.mark.parametrize(
    "loss_type,level,rho_shape",
    [("grpo", "token", None), ("dapo", "sequence", "b1"), ("sapo", "token", "bt"), ("cispo", "token", "b"),
     ("bnpo", "sequence", None), ("vespo", "token", "bt")],
)  # fmt: skip
def test_reduce_false_per_token_losses(loss_type, level, rho_shape):
    """Liger's ``reduce=False``: ``(ℓ·ρ + β·kl)·m`` per token, its KL and clip flags, and
    the gradient of ``Σ g·ℓ_tot`` for an upstream ``g`` (sequence level: through R_b)."""
    logits, ids, mask, adv, old, ref = setup(7 + len(loss_type))
    b, t = ids.shape
    g = torch.Generator().manual_seed(3)
    rho = {None: None, "b": torch.rand(b, generator=g) + 0.5, "b1": torch.rand(b, 1, generator=g) + 0.5,
           "bt": torch.rand(b, t, generator=g) + 0.5}[rho_shape]  # fmt: skip
    kw = dict(loss_type=loss_type, beta=0.04, epsilon_high=0.4, temperature=0.9, use_bias_correction_kl=True,
              importance_sampling_level=level)  # fmt: skip
    z = logits[:, :t].double().detach().requires_grad_()
    eye = torch.eye(logits.shape[-1], dtype=torch.float64)
    want, _, _ = grpo_reference(z, eye, None, ids, mask, adv, old=old, ref=ref, rho=rho, per_token=True, **kw)
    upstream = torch.randn(b, t, generator=g)
    (want * upstream.double()).sum().backward()

    leaf = logits.clone().requires_grad_()
    kw.pop("epsilon_high")
    per_token, kl, clipped = liger.triton_grpo_loss(leaf, old, ref, ids, adv, mask, eps_high=0.4, vllm_is_ratio=rho,
                                          reduce=False, **kw)  # fmt: skip
    assert per_token.shape == kl.shape == clipped.shape == (b, t) and per_token.dtype == torch.float32
    assert (per_token - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())
    assert torch.count_nonzero(per_token[~mask]) == 0 and torch.count_nonzero(kl[~mask]) == 0
    assert set(clipped.unique().tolist()) <= {0.0, 1.0} and torch.count_nonzero(clipped[~mask]) == 0
    (per_token * upstream).sum().backward()
    scale = z.grad.abs().max().item()
    assert (leaf.grad[:, :t].double() - z.grad).abs().max().item() <= 1e-4 * scale
    assert torch.count_nonzero(leaf.grad[:, t:]) == 0


def test_reduce_false_without_beta_has_no_kl_and_compiles():
    logits, ids, mask, adv, old, ref = setup(1)
    per_token, kl, clipped = liger.triton_grpo_loss(logits, old, None, ids, adv, mask, beta=0.0, reduce=False)
    assert kl is None
    # The sum of the per-token losses over the live tokens is bnpo's loss times their count.
    loss, _ = liger.triton_grpo_loss(logits.clone(), old, None, ids, adv, mask, beta=0.0, loss_type="bnpo")
    assert per_token.sum().item() == pytest.approx(loss.item() * mask.sum().item(), rel=1e-5)
    f = torch.compile(lambda z: liger.triton_grpo_loss(z, old, None, ids, adv, mask, beta=0.0, reduce=False)[0].sum(),
                      fullgraph=True)  # fmt: skip
    z = logits.clone().requires_grad_()
    f(z).backward()
    assert z.grad is not None and torch.isfinite(z.grad).all()


@pytest.mark.parametrize("inplace", [False, True])
def test_f16_logits(inplace):
    """float16 logits (issue 33): widened exactly, the gradient written in float16."""
    logits, ids, mask, adv, old, ref = setup(21)
    logits = logits.half()
    ref_loss, ref_grad = reference(logits, ids, mask, adv, old, ref, loss_type="grpo", beta=0.04, epsilon_high=0.4,
                                   temperature=0.9, use_bias_correction_kl=False)  # fmt: skip
    leaf = logits.clone().requires_grad_()
    loss, _ = liger.triton_grpo_loss(
        leaf * 1.0 if inplace else leaf, old, ref, ids, adv, mask, loss_type="grpo", inplace=inplace
    )
    loss.backward()
    assert leaf.grad.dtype == torch.float16
    assert abs(loss.item() - ref_loss) <= 1e-5 * max(1.0, abs(ref_loss))
    t = ids.shape[1]
    assert (leaf.grad[:, :t].double() - ref_grad).abs().max().item() <= 2e-3 * ref_grad.abs().max().item()
