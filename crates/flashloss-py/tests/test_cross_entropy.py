"""flashloss.torch.linear_cross_entropy against torch.nn.functional.cross_entropy on
materialized float64 logits, for every option of the spec (ignore_index, label
smoothing, z-loss, soft-cap, temperature, reductions)."""

import pytest
import torch
import torch.nn.functional as F

import flashloss.torch as fl


def reference(hidden, weight, bias, targets, ignore_index, label_smoothing, z_loss, softcap, reduction, temperature):
    z = hidden.double() @ weight.double().T
    if bias is not None:
        z = z + bias.double()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    s = z / temperature
    rows = F.cross_entropy(s, targets, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction="none")
    keep = targets != ignore_index
    if z_loss:
        rows = rows + z_loss * torch.logsumexp(s, -1) ** 2 * keep
    if reduction == "none":
        return rows
    if reduction == "sum":
        return rows.sum()
    return rows.sum() / keep.sum().clamp(min=1)


def data(seed, n=23, h=12, v=41, dtype=torch.float32, bias=True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) / h**0.5).to(dtype)
    b = (torch.randn(v, generator=g) * 0.1).to(dtype) if bias else None
    targets = torch.randint(0, v, (n,), generator=g)
    targets[::5] = -100
    return hidden, weight, b, targets


OPTIONS = [
    dict(),
    dict(label_smoothing=0.1),
    dict(z_loss=1e-3),
    dict(softcap=3.0),
    dict(temperature=0.7),
    dict(label_smoothing=0.05, z_loss=1e-4, softcap=5.0, temperature=1.3),
]


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_matches_torch_cross_entropy(options, reduction):
    hidden, weight, bias, targets = data(len(str(options)) + len(reduction))
    kw = dict(ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None, temperature=1.0) | options
    leaves = [x.double().requires_grad_() for x in (hidden, weight, bias)]
    ref = reference(*leaves, targets, reduction=reduction, **kw)
    ours_in = [x.clone().requires_grad_() for x in (hidden, weight, bias)]
    ours = fl.linear_cross_entropy(*ours_in[:2], targets, bias=ours_in[2], reduction=reduction, **kw)
    assert ours.shape == ref.shape
    assert torch.allclose(ours.double(), ref, rtol=1e-5, atol=1e-6)
    upstream = torch.linspace(0.5, 1.5, targets.numel(), dtype=torch.float64) if reduction == "none" else None
    (ref * upstream).sum().backward() if upstream is not None else ref.backward()
    (ours * upstream.float()).sum().backward() if upstream is not None else ours.backward()
    for name, a, b in zip(("hidden", "weight", "bias"), ours_in, leaves):
        scale = b.grad.abs().max().item()
        assert (a.grad.double() - b.grad).abs().max().item() <= 1e-4 * scale + 1e-7, name


def test_bf16_and_batched_shapes():
    hidden, weight, bias, targets = data(3, n=24, dtype=torch.bfloat16)
    h3, t3 = hidden.reshape(2, 12, -1).requires_grad_(), targets.reshape(2, 12)
    loss = fl.linear_cross_entropy(h3, weight, t3, bias=bias)
    ref = reference(hidden.double(), weight.double(), bias.double(), targets, -100, 0.0, 0.0, None, "mean", 1.0)
    assert abs(loss.item() - ref.item()) <= 1e-3 * abs(ref.item())
    loss.backward()
    assert h3.grad.dtype == torch.bfloat16 and h3.grad.shape == h3.shape


def test_every_row_ignored_gives_zero():
    hidden, weight, _, targets = data(4, bias=False)
    w = weight.clone().requires_grad_()
    loss = fl.linear_cross_entropy(hidden, w, torch.full_like(targets, -100))
    loss.backward()
    assert loss.item() == 0.0 and torch.count_nonzero(w.grad) == 0


def test_logprobs_without_gradient():
    hidden, weight, bias, targets = data(5)
    targets = targets.clamp(min=0)
    logp, ent = fl.linear_logprobs(hidden, weight, targets, temperature=0.8, return_entropy=True, bias=bias)[:2]
    s = (hidden.double() @ weight.double().T + bias.double()) / 0.8
    lp = torch.log_softmax(s, -1)
    assert torch.allclose(logp.double(), lp.gather(-1, targets[:, None])[:, 0], rtol=1e-5, atol=1e-5)
    assert torch.allclose(ent.double(), -(lp.exp() * lp).sum(-1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("options", [dict(), dict(softcap=3.0, temperature=0.7, label_smoothing=0.1, z_loss=1e-3)])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_return_lse_as_cut_cross_entropy(options, reduction):
    """``return_lse=True`` returns ``(loss, lse)`` (Cut Cross-Entropy's convention): each
    row's log-sum-exp of the scaled logits, 0 at ignored rows, differentiable: the
    gradient of ``loss + mean(lse²)`` (a z-loss of the caller's own) matches float64
    autograd (issue 33)."""
    hidden, weight, bias, targets = data(31 + len(reduction))
    hidden, targets = hidden.reshape(23, 1, -1), targets.reshape(23, 1)  # [..., H] with two batch dims
    kw = dict(ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None, temperature=1.0) | options
    leaves = [x.double().requires_grad_() for x in (hidden, weight, bias)]
    ref = reference(leaves[0].reshape(23, -1), *leaves[1:], targets.reshape(-1), reduction=reduction, **kw)
    z = leaves[0].reshape(23, -1) @ leaves[1].T + leaves[2]
    if kw["softcap"] is not None:
        z = kw["softcap"] * torch.tanh(z / kw["softcap"])
    keep = targets.reshape(-1) != -100
    ref_lse = torch.where(keep, torch.logsumexp(z / kw["temperature"], -1), 0.0).reshape(23, 1)
    (ref.sum() + (ref_lse**2).mean()).backward()

    ours_in = [x.clone().requires_grad_() for x in (hidden, weight, bias)]
    loss, lse = fl.linear_cross_entropy(*ours_in[:2], targets, bias=ours_in[2], reduction=reduction,
                                        return_lse=True, **kw)  # fmt: skip
    assert lse.shape == targets.shape and lse.dtype == torch.float32
    assert loss.shape == (targets.shape if reduction == "none" else ())
    assert torch.allclose(loss.double().reshape(ref.shape), ref.detach(), rtol=1e-5, atol=1e-6)
    assert torch.allclose(lse.double(), ref_lse.detach(), rtol=1e-5, atol=1e-6)
    assert torch.count_nonzero(lse[~keep.reshape(23, 1)]) == 0
    (loss.sum() + (lse**2).mean()).backward()
    for name, ours, leaf in zip(("hidden", "weight", "bias"), ours_in, leaves):
        scale = leaf.grad.abs().max().item()
        assert (ours.grad.double() - leaf.grad).abs().max().item() <= 1e-4 * scale, name
    # lse alone (the loss unused) and the loss alone take their own gradients.
    for use_loss in (False, True):
        x = hidden.clone().requires_grad_()
        loss, lse = fl.linear_cross_entropy(x, weight, targets, bias=bias, reduction=reduction, return_lse=True, **kw)
        (loss.sum() if use_loss else lse.sum()).backward()
        y = hidden.clone().requires_grad_()
        if use_loss:
            fl.linear_cross_entropy(y, weight, targets, bias=bias, reduction=reduction, **kw).sum().backward()
        else:
            zz = y.reshape(23, -1).double() @ weight.double().T + bias.double()
            if kw["softcap"] is not None:
                zz = kw["softcap"] * torch.tanh(zz / kw["softcap"])
            torch.where(keep, torch.logsumexp(zz / kw["temperature"], -1), 0.0).sum().backward()
        assert torch.allclose(x.grad.double(), y.grad.double(), rtol=1e-4, atol=1e-5), use_loss


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_f16_inputs(reduction):
    """float16 heads (issue 33): widened exactly, the f32 bounds against float64 on the
    same float16 values; gradients in float16."""
    hidden, weight, bias, targets = data(41, dtype=torch.float16)
    kw = dict(ignore_index=-100, label_smoothing=0.1, z_loss=1e-3, softcap=4.0, temperature=0.9)
    leaves = [x.double().requires_grad_() for x in (hidden, weight, bias)]
    ref = reference(*leaves, targets, reduction=reduction, **kw)
    ours_in = [x.clone().requires_grad_() for x in (hidden, weight, bias)]
    ours = fl.linear_cross_entropy(*ours_in[:2], targets, bias=ours_in[2], reduction=reduction, **kw)
    assert torch.allclose(ours.double(), ref, rtol=1e-5, atol=1e-6)
    ref.sum().backward()
    ours.sum().backward()
    for name, a, b in zip(("hidden", "weight", "bias"), ours_in, leaves):
        assert a.grad.dtype == torch.float16, name
        assert (a.grad.double() - b.grad).abs().max().item() <= 2e-3 * b.grad.abs().max().item(), name
