"""CUDA tensors (a build with the `cuda` feature, on a machine with a GPU): the GPU
kernels on PyTorch's current stream give what the CPU kernels give, within the spec's
tolerances, and the gradients stay on the device. Skipped without a GPU or without
the cuda build."""

import pytest
import torch

import flashloss
import flashloss.torch as fl
from flashloss import _native

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and _native.cuda_build), reason="needs a GPU and the cuda build"
)


def data(seed, b=4, t=33, h=64, v=5003, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return dict(
        hidden=torch.randn(b, t, h, generator=g).to(dtype),
        weight=(torch.randn(v, h, generator=g) / h**0.5).to(dtype),
        bias=torch.randn(v, generator=g) * 0.1,
        ids=torch.randint(0, v, (b, t), generator=g),
        mask=torch.rand(b, t, generator=g) > 0.2,
        adv=torch.randn(b, generator=g),
        old=-torch.rand(b, t, generator=g) * 8,
        ref=-torch.rand(b, t, generator=g) * 8,
    )


def run(d, device, **kw):
    leaves = [x.to(device).clone().requires_grad_() for x in (d["hidden"], d["weight"], d["bias"])]
    loss, out = fl.linear_grpo_loss(
        leaves[0], leaves[1], d["ids"].to(device), d["mask"].to(device), d["adv"].to(device),
        bias=leaves[2].to(d["hidden"].dtype), old_per_token_logps=d["old"].to(device),
        ref_per_token_logps=d["ref"].to(device), beta=0.04, **kw,
    )  # fmt: skip
    loss.backward()
    return loss, out, [x.grad for x in leaves]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "cispo"])
def test_grpo_matches_the_cpu(dtype, tol, loss_type):
    d = data(1, dtype=dtype)
    cpu_loss, cpu_out, cpu_grads = run(d, "cpu", loss_type=loss_type)
    loss, out, grads = run(d, "cuda", loss_type=loss_type)
    assert loss.device.type == "cuda" and out.logp.device.type == "cuda"
    assert abs(loss.item() - cpu_loss.item()) <= tol * max(1.0, abs(cpu_loss.item()))
    for g, c in zip(grads, cpu_grads):
        assert g.device.type == "cuda" and g.dtype == c.dtype
        assert (g.cpu().double() - c.double()).abs().max() <= tol * c.double().abs().max() + 1e-6


def test_cross_entropy_matches_the_cpu():
    d = data(2)
    targets = d["ids"].reshape(-1)
    h = d["hidden"].reshape(-1, d["hidden"].shape[-1])
    cpu = fl.linear_cross_entropy(h, d["weight"], targets, label_smoothing=0.1)
    gpu = fl.linear_cross_entropy(h.cuda(), d["weight"].cuda(), targets.cuda(), label_smoothing=0.1)
    assert abs(gpu.item() - cpu.item()) <= 1e-4 * abs(cpu.item())


def test_runs_on_the_current_stream():
    d = data(3)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        loss, _, grads = run(d, "cuda", loss_type="bnpo")
    stream.synchronize()
    cpu_loss, _, _ = run(d, "cpu", loss_type="bnpo")
    assert abs(loss.item() - cpu_loss.item()) <= 1e-4 * max(1.0, abs(cpu_loss.item()))
    assert flashloss.__version__
