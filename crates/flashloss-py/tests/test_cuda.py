"""CUDA tensors (a build with the `cuda` feature, on a machine with a GPU): the GPU
kernels on PyTorch's current stream give what the CPU kernels give, within the spec's
tolerances, and the gradients stay on the device; so do torch.compile, a one-rank NCCL
group, flashloss.verl, FlashlossGRPOTrainer and the JAX CUDA FFI handlers. Skipped without a GPU or without the cuda
build (and each part without its framework)."""

import os

import numpy as np
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


@pytest.mark.parametrize("budget_mib", [None, 32.2])
def test_bf16_chunk_matches_the_cpu_within_bf16_logits(budget_mib):
    """``mode="compact"`` on a bf16 head: the logits GEMM writes a bf16 chunk that the row kernel
    overwrites with dZ (one block, and blocks of 20 rows at 32.2 MiB). Its logits carry bf16's
    rounding, so logp is compared within 5e-2 of max(|logp|, 1) and the gradients within 2e-2."""
    d = data(7, dtype=torch.bfloat16)
    kw = {} if budget_mib is None else {"budget_mib": budget_mib}
    cpu_loss, cpu_out, cpu_grads = run(d, "cpu")
    loss, out, grads = run(d, "cuda", mode="compact", **kw)
    assert abs(loss.item() - cpu_loss.item()) <= 1e-2 * max(1.0, abs(cpu_loss.item()))
    m = d["mask"]
    lp, cpu_lp = out.logp.float().cpu()[m], cpu_out.logp.float()[m]
    assert ((lp - cpu_lp).abs() / cpu_lp.abs().clamp(min=1)).max() <= 5e-2
    for g, c in zip(grads, cpu_grads):
        assert g.device.type == "cuda" and torch.isfinite(g).all()
        assert (g.cpu().double() - c.double()).abs().max() <= 2e-2 * c.double().abs().max() + 1e-6


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


def test_torch_compile_fullgraph_matches_eager():
    d = data(4)

    def step(h, w, ids, mask, adv, old):
        loss, out = fl.linear_grpo_loss(h, w, ids, mask, adv, old_per_token_logps=old, loss_type="dapo")
        return loss + 0.01 * fl.linear_cross_entropy(h.reshape(-1, h.shape[-1]), w, ids.reshape(-1)), out.entropy

    results = []
    for fn in (step, torch.compile(step, fullgraph=True)):
        h, w = (d[k].cuda().requires_grad_() for k in ("hidden", "weight"))
        loss, entropy = fn(h, w, *(d[k].cuda() for k in ("ids", "mask", "adv", "old")))
        loss.backward()
        results.append((loss.detach(), entropy, h.grad, w.grad))
    for eager, compiled in zip(*results):
        assert compiled.device.type == "cuda"
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)


def test_nccl_group_of_one_matches_no_group(tmp_path):
    dist = torch.distributed
    if not dist.is_nccl_available():
        pytest.skip("torch has no NCCL")
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        d = data(5)
        loss, out, grads = run(d, "cuda", loss_type="dapo", vocab_parallel_group=dist.group.WORLD)
        want_loss, want_out, want_grads = run(d, "cuda", loss_type="dapo")
    finally:
        dist.destroy_process_group()
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(out.logp, want_out.logp, rtol=1e-6, atol=1e-7)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)


def logprobs_on(d, gather, device, **kw):
    """``linear_logprobs`` with every output but the support's on ``device``, and the
    gradients of a sum of all the differentiable ones."""
    leaves = [d[k].to(device).clone().requires_grad_() for k in ("hidden", "weight", "bias")]
    out = fl.linear_logprobs(
        leaves[0],
        leaves[1],
        d["ids"].to(device),
        temperature=0.8,
        return_entropy=True,
        bias=leaves[2].to(d["hidden"].dtype),
        mask=d["mask"].to(device),
        return_lse=True,
        return_max=True,
        return_sum_p2=True,
        gather_ids=gather.to(device),
        **kw,
    )
    loss = out.logp.sum() + 0.1 * out.entropy.sum() + 0.01 * out.lse.sum() + 0.05 * out.gathered_logp.sum()
    loss.backward()
    return out, [x.grad for x in leaves]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("mode", ["auto", "two_pass", "single_pass"])
def test_logprob_options_match_the_cpu(dtype, tol, mode):
    """Issue 41: Σp² (S₂ in row_states), lse, the max logit and candidate sets
    (gather_logits.cu, their one-hot gradient terms by sparse_grads.cu) on CUDA tensors
    give the CPU kernels' values and gradients, in pass A + pass B and in a single pass."""
    d = data(8, dtype=dtype)
    g = torch.Generator().manual_seed(80)
    gather = torch.randint(0, d["weight"].shape[0], (*d["ids"].shape, 5), generator=g)
    gather[..., 0] = d["ids"]  # a candidate that is the target
    gather[..., 1] = gather[..., 2]  # a repeat
    cpu_out, cpu_grads = logprobs_on(d, gather, "cpu", mode=mode)
    out, grads = logprobs_on(d, gather, "cuda", mode=mode)
    for name in ("logp", "entropy", "lse", "max_logit", "sum_p2", "gathered_logp"):
        got, want = getattr(out, name), getattr(cpu_out, name)
        assert got.device.type == "cuda" and got.shape == want.shape, name
        err = (got.cpu().double() - want.double()).abs().max().item()
        assert err <= tol * max(1.0, want.double().abs().max().item()), (name, err)
    for got, want in zip(grads, cpu_grads):
        assert got.device.type == "cuda" and got.dtype == want.dtype
        assert (got.cpu().double() - want.double()).abs().max() <= tol * want.double().abs().max() + 1e-6


def exact_data(seed, b=3, t=17, h=64, v=5003, dtype=torch.float32):
    """``data`` on a grid where every f32 logit is exact in any summation order (hidden in
    eighths, weight in 64ths, bias in 512ths; bf16 holds them exactly): the CPU and the GPU
    decide the same truncated support."""
    g = torch.Generator().manual_seed(seed)

    def grid(shape, den):
        return torch.randint(-8, 9, shape, generator=g).float() / den

    d = data(seed, b=b, t=t, h=h, v=v)
    d.update(hidden=grid((b, t, h), 8).to(dtype), weight=grid((v, h), 64).to(dtype), bias=grid((v,), 512))
    return d


def support_on(d, device, **kw):
    """``linear_logprobs`` under a truncated support on ``device``, and the gradients of
    a sum of its outputs (the targets outside the support left out)."""
    leaves = [d[k].to(device).clone().requires_grad_() for k in ("hidden", "weight", "bias")]
    out = fl.linear_logprobs(
        leaves[0],
        leaves[1],
        d["ids"].to(device),
        temperature=0.7,
        return_entropy=True,
        bias=leaves[2].to(d["hidden"].dtype),
        mask=d["mask"].to(device),
        return_lse=True,
        **kw,
    )
    inside = torch.isfinite(out.logp)
    loss = torch.where(inside, out.logp, 0.0).sum() + 0.1 * out.entropy.sum() + 0.01 * out.lse.sum()
    loss.backward()
    return out, [x.grad for x in leaves]


FILTERS = [
    dict(top_k=50),
    dict(top_p=0.9),
    dict(min_p=0.05),
    dict(top_k=400, top_p=0.9, min_p=0.02),
    dict(top_k=4500, top_p=0.97),
]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("filters", FILTERS, ids=lambda f: "-".join(f"{k}{v}" for k, v in f.items()))
def test_truncated_support_matches_the_cpu(dtype, tol, filters):
    """Issue 41: the sampler's truncated support on CUDA tensors (pass A's top keys by
    top_keys.cu, the rows its buffer cannot decide searched over extra passes on the host,
    the support term in row_grad) gives the CPU's supports, log-probs and gradients: top-k
    within the buffer, top-p on flat rows (extra passes), min-p, the three together, a
    top-k beyond the largest buffer."""
    d = exact_data(10, dtype=dtype)
    cpu_out, cpu_grads = support_on(d, "cpu", **filters)
    out, grads = support_on(d, "cuda", **filters)
    assert out.outside_support.device.type == "cuda"
    assert torch.equal(out.outside_support.cpu(), cpu_out.outside_support)
    assert cpu_out.outside_support.any() and not cpu_out.outside_support.all()
    for name in ("logp", "entropy", "lse"):
        got, want = getattr(out, name).cpu().double(), getattr(cpu_out, name).double()
        assert torch.equal(torch.isfinite(got), torch.isfinite(want)), name
        fin = torch.isfinite(want)
        err = (got[fin] - want[fin]).abs().max().item()
        assert err <= tol * max(1.0, want[fin].abs().max().item()), (name, err)
    for got, want in zip(grads, cpu_grads):
        assert got.device.type == "cuda" and got.dtype == want.dtype
        assert (got.cpu().double() - want.double()).abs().max() <= tol * want.double().abs().max() + 1e-6


def test_grpo_under_a_support_matches_the_cpu():
    """GRPO under a truncated support (logp^K in every term, targets outside masked) on
    CUDA tensors gives the CPU's loss and gradients."""
    d = exact_data(11)
    cpu_loss, _, cpu_grads = run(d, "cpu", loss_type="dapo", top_k=400, top_p=0.9, min_p=0.02)
    loss, _, grads = run(d, "cuda", loss_type="dapo", top_k=400, top_p=0.9, min_p=0.02)
    assert abs(loss.item() - cpu_loss.item()) <= 1e-4 * max(1.0, abs(cpu_loss.item()))
    for g, c in zip(grads, cpu_grads):
        assert g.device.type == "cuda"
        assert (g.cpu().double() - c.double()).abs().max() <= 1e-4 * c.double().abs().max() + 1e-6


def test_verl_entry_points_on_cuda_tensors():
    import flashloss.verl as fverl

    d = data(6)
    h = d["hidden"].reshape(-1, d["hidden"].shape[-1]).cuda().requires_grad_()
    w, ids = d["weight"].cuda(), d["ids"].reshape(-1).cuda()
    logp, entropy = fverl.linear_cross_entropy(h, w, ids, 0.9)
    lp = torch.log_softmax((h.double() @ w.double().T) / 0.9, -1)
    torch.testing.assert_close(logp.double(), lp.gather(-1, ids[:, None])[:, 0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(entropy.double(), -(lp.exp() * lp).sum(-1), rtol=1e-4, atol=1e-5)
    logp, _ = fverl.fused_linear_for_ppo_forward(None, h, w, ids, 0.9)
    logp.sum().backward()
    assert h.grad.device.type == "cuda"


@pytest.mark.parametrize("cfg", [dict(loss_type="dapo"), dict(loss_type="grpo", beta=0.04)])
def test_flashloss_grpo_trainer_on_cuda_matches_trl(tmp_path, cfg):
    for name in ("trl", "transformers", "datasets"):
        pytest.importorskip(name)
    import test_trl_trainer as t
    from flashloss.trl import FlashlossGRPOTrainer

    stock = t.trainer(t.trl.GRPOTrainer, tmp_path, use_cpu=False, bf16=False, **cfg)
    ours = t.trainer(FlashlossGRPOTrainer, tmp_path, use_cpu=False, bf16=False, **cfg)
    assert next(ours.model.parameters()).device.type == "cuda"
    stock.model.train()
    ours.model.train()
    torch.manual_seed(1)
    inputs = stock._generate_and_score_completions([{"prompt": p} for p in t.dataset()["prompt"][:4]])
    trl_loss, trl_grads = t.loss_and_grads(stock, inputs)
    loss, grads = t.loss_and_grads(ours, inputs)
    assert loss == pytest.approx(trl_loss, rel=1e-4, abs=1e-6)
    assert grads.keys() == trl_grads.keys()
    for name, g in trl_grads.items():
        assert (grads[name] - g).abs().max().item() <= 1e-3 * g.abs().max().item() + 1e-7, name


def jax_on_cuda():
    """jax and its CUDA device (its memory allocated on demand, beside torch's)."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    jax = pytest.importorskip("jax")
    try:
        return jax, jax.devices("cuda")[0]
    except RuntimeError:
        pytest.skip("jax has no CUDA backend")


@pytest.mark.parametrize("layout", ["vh", "hv"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_jax_ffi_on_cuda_under_jit_grad_and_donation(dtype, layout):
    """The CUDA FFI handlers (jit, value_and_grad, donated inputs) give the CPU handlers'
    step, within the spec's tolerances, with a `[V, H]` weight and a Flax-style `[H, V]` one
    (its gradient `[H, V]` too)."""
    jax, gpu = jax_on_cuda()
    import flashloss.jax as fj

    d = data(7, b=2, t=9, v=1001)
    weight = d["weight"] if layout == "vh" else d["weight"].T.contiguous()
    args = [jax.numpy.asarray(x.float().numpy(), dtype) for x in (d["hidden"], weight)]
    args.append(jax.numpy.asarray(d["bias"].numpy(), dtype))
    ids, mask, adv, old, ref = (jax.numpy.asarray(d[k].numpy()) for k in ("ids", "mask", "adv", "old", "ref"))

    def step(h, w, b):
        def loss(h, w, b):
            out = fj.linear_grpo_loss(h, w, ids, mask, adv, bias=b, old_per_token_logps=old,
                                      ref_per_token_logps=ref, beta=0.04, weight_layout=layout)  # fmt: skip
            return out[0] + fj.linear_cross_entropy(h, w, ids, bias=b, weight_layout=layout)

        value, grads = jax.value_and_grad(loss, (0, 1, 2))(h, w, b)
        return value, tuple(x - 0.1 * g.astype(x.dtype) for x, g in zip((h, w, b), grads))

    cpu = jax.devices("cpu")[0]
    want = jax.jit(step)(*(jax.device_put(x, cpu) for x in args))
    on_gpu = tuple(jax.device_put(x, gpu) for x in args)
    got = jax.jit(step, donate_argnums=(0, 1, 2))(*on_gpu)
    assert all(x.is_deleted() for x in on_gpu)  # XLA took the buffers
    tol = 1e-4 if dtype == "float32" else 2e-2
    for a, b_ in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert a.devices() == {gpu} and a.dtype == b_.dtype
        a, b_ = np.asarray(a, np.float64), np.asarray(b_, np.float64)
        assert np.abs(a - b_).max() <= tol * max(np.abs(b_).max(), 1.0)


def ce_call(n, mode, budget_mib, seed=12, h=64, v=5003):
    """One fused cross-entropy call (loss and gradients) on ``n`` rows, and the native
    stats of that call alone (``reset`` before it: the host's waits counted from zero)."""
    g = torch.Generator().manual_seed(seed)
    dev = torch.device("cuda", torch.cuda.current_device())
    hid = torch.randn(n, h, generator=g).to(dev).requires_grad_()
    w = (torch.randn(v, h, generator=g) / h**0.5).to(dev).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g).to(dev)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    before = _native.cuda_stats(dev.index, reset=True)
    loss = fl.linear_cross_entropy(hid, w, t, mode=mode, budget_mib=budget_mib)
    torch.cuda.synchronize()
    after = _native.cuda_stats(dev.index)
    return loss.detach(), torch.cuda.max_memory_allocated(dev) - base, before, after


def test_host_waits_of_a_two_pass_call_do_not_grow_with_its_row_blocks():
    """Issue 41: a two-pass call waits for the stream a fixed number of times (the finite
    scans, pass A's statistics, the end of the call: docs/design.md's table), however many
    row blocks it runs (a budget of 33 MiB leaves 1 MiB of tiles: 52 rows of V = 5003 f32,
    3 blocks at N = 128, 10 at N = 512); a single pass waits once more per block (each
    block's statistics go to the host's per-row stage)."""
    waits = {}
    for mode in ("two_pass", "single_pass"):
        for n in (128, 512):
            after = ce_call(n, mode, 33.0)[3]
            waits[mode, n] = after["stream_syncs"] + after["copies_to_host"]
    assert 1 <= waits["two_pass", 128] == waits["two_pass", 512] <= 10, waits
    assert waits["single_pass", 512] > waits["single_pass", 128], waits


def test_the_call_buffers_come_from_torchs_caching_allocator(monkeypatch):
    """Issue 41: with PyTorch's tensors, the call's buffers (states, coefficients, the
    fused tiles) are lent by PyTorch's caching allocator under FLASHLOSS_CUDA_BUFFERS=torch:
    torch's peak grows by what the backend allocates itself under the default (backend), the
    backend allocates nothing during the call and keeps no tile after it, and the loss is the
    same."""
    ce_call(512, "two_pass", 40.0)  # the first call makes the cuBLAS workspace (kept)
    monkeypatch.setenv("FLASHLOSS_CUDA_BUFFERS", "backend")
    own_loss, own_peak, own_before, own_after = ce_call(512, "two_pass", 40.0)
    monkeypatch.setenv("FLASHLOSS_CUDA_BUFFERS", "torch")
    own_bytes = own_after["peak_bytes"] - own_before["in_use_bytes"]
    assert own_bytes > 4 << 20 and own_after["workspace_bytes"] > 4 << 20, own_after  # the tiles, kept
    loss, peak, before, after = ce_call(512, "two_pass", 40.0)
    assert after["peak_bytes"] == before["in_use_bytes"], (before, after)  # nothing of its own
    assert after["workspace_bytes"] == 0, after
    assert after["in_use_bytes"] == own_before["in_use_bytes"], (own_before, after)  # the cuBLAS workspace
    assert 0.9 * own_bytes <= peak - own_peak <= own_bytes + (1 << 20), (peak, own_peak, own_bytes)
    torch.testing.assert_close(loss, own_loss, rtol=1e-6, atol=0)
