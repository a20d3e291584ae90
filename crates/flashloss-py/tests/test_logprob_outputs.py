"""``linear_logprobs``' further outputs (issue 33): ``lse``, the max logit, ``Σp²`` and the
log-probs of candidate ids ``gather_ids`` ``[..., K]``, against float64 autograd on
materialized logits: values, and gradients of hidden, weight and bias through ``logp``,
entropy, ``lse`` and the candidates (f32 and bf16, odd V, masked rows, repeats, K = 1,
a frozen head); the plain call's return is unchanged; ``opcheck``, ``torch.compile``;
bad ``gather_ids`` and support filters are ``ValueError`` naming the argument."""

import flashloss.torch as fl
import pytest
import torch
from flashloss.torch import _ops as ops

N_B, N_T, H, V = 3, 5, 20, 2111  # V: a ragged last vocabulary tile (2048 + 63)


def _data(seed=0, k=4, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N_B, N_T, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) * 2.0 / H**0.5).to(dtype)
    bias = (torch.randn(V, generator=g) * 0.1).to(dtype)
    ids = torch.randint(0, V, (N_B, N_T), generator=g)
    mask = torch.rand(N_B, N_T, generator=g) > 0.25
    mask[0, 0] = True
    gather = torch.randint(0, V, (N_B, N_T, k), generator=g)
    gather[..., 0] = ids  # the target itself
    if k > 2:
        gather[..., 2] = gather[..., 1]  # a repeat
        gather[0, 0, 1:3] = torch.tensor([2047, 2048])  # either side of the tile edge
    gather[~mask] = -5  # never read on masked rows
    up = torch.randn(4, N_B, N_T, generator=g)
    up_k = torch.randn(N_B, N_T, k, generator=g)
    return hidden, weight, bias, ids, mask, gather, up, up_k


def _reference(hidden, weight, bias, ids, mask, gather, temperature, up, up_k):
    """float64 autograd on materialized logits: every output and the gradients of
    ``Σ up0·logp + up1·entropy + up2·lse + Σ_k up_k·gathered`` (masked rows: zero)."""
    h, w, b = (x.detach().double().requires_grad_() for x in (hidden, weight, bias))
    s = (h @ w.T + b) / temperature
    logq = torch.log_softmax(s, -1)
    m = mask.double()
    logp = logq.gather(-1, ids[..., None])[..., 0] * m
    entropy = -(logq.exp() * logq).sum(-1) * m
    lse = torch.logsumexp(s, -1) * m
    mx = s.max(-1).values * m
    p2 = (logq.exp() ** 2).sum(-1) * m
    gathered = logq.gather(-1, gather.clamp(min=0)) * m[..., None]
    total = (logp * up[0]).sum() + (entropy * up[1]).sum() + (lse * up[2]).sum() + (gathered * up_k).sum()
    total.backward()
    outs = [t.detach() for t in (logp, entropy, lse, mx, p2, gathered)]
    return outs, (h.grad, w.grad, b.grad)


def _close(name, got, want, rtol):
    err = (got.double() - want).abs().max().item()
    scale = want.abs().max().item()
    assert err <= rtol * scale + 1e-7, f"{name}: error {err:.3g}, scale {scale:.3g}"


def _rel(name, got, want, rtol):
    """``|got - want| ≤ rtol·max(|want|, 1)`` entry by entry (the logp gate)."""
    err = ((got.double() - want).abs() / want.abs().clamp(min=1.0)).max().item()
    assert err <= rtol, f"{name}: relative error {err:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize("k", [1, 4])
def test_outputs_and_gradients_match_float64(dtype, frozen, k):
    hidden, weight, bias, ids, mask, gather, up, up_k = _data(1, k, dtype)
    want, grads = _reference(hidden, weight, bias, ids, mask, gather, 0.8, up, up_k)
    h = hidden.clone().requires_grad_()
    w, b = (x.clone().requires_grad_(not frozen) for x in (weight, bias))
    out = fl.linear_logprobs(
        h,
        w,
        ids,
        temperature=0.8,
        return_entropy=True,
        bias=b,
        mask=mask,
        return_lse=True,
        return_max=True,
        return_sum_p2=True,
        gather_ids=gather,
    )
    assert isinstance(out, fl.LogprobOutputs)
    assert out.gathered_logp.shape == gather.shape and out.gathered_logp.dtype == torch.float32
    names = ("logp", "entropy", "lse", "max_logit", "sum_p2", "gathered_logp")
    for name, got, ref in zip(names, out, want):
        # f32 logits of bf16 inputs are the same up to the order of the sums.
        _rel(name, got, ref, 1e-5)
    assert not out.max_logit.requires_grad and not out.sum_p2.requires_grad
    # An id equal to the target gives the target's logp exactly.
    torch.testing.assert_close(out.gathered_logp[..., 0], out.logp, rtol=0, atol=0)
    total = (out.logp * up[0]).sum() + (out.entropy * up[1]).sum() + (out.lse * up[2]).sum()
    (total + (out.gathered_logp * up_k).sum()).backward()
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    _close("dhidden", h.grad, grads[0], tol)
    if frozen:
        assert w.grad is None and b.grad is None
    else:
        _close("dweight", w.grad, grads[1], tol)
        _close("dbias", b.grad, grads[2], tol)
        assert w.grad.dtype == dtype


def test_each_output_alone_and_the_plain_return():
    hidden, weight, bias, ids, mask, gather, up, up_k = _data(2)
    want, _ = _reference(hidden, weight, bias, ids, mask, gather, 1.3, up, up_k)
    # One return type (was a tensor, or a pair with the entropy): a LogprobOutputs.
    plain = fl.linear_logprobs(hidden, weight, ids, temperature=1.3, bias=bias, mask=mask)
    assert isinstance(plain, fl.LogprobOutputs) and plain.entropy is None and plain.lse is None
    pair = fl.linear_logprobs(hidden, weight, ids, temperature=1.3, return_entropy=True, bias=bias, mask=mask)
    assert isinstance(pair, fl.LogprobOutputs) and pair.entropy is not None and pair.gathered_logp is None
    only_lse = fl.linear_logprobs(hidden, weight, ids, temperature=1.3, bias=bias, mask=mask, return_lse=True)
    assert only_lse.entropy is None and only_lse.sum_p2 is None and only_lse.gathered_logp is None
    _rel("lse", only_lse.lse, want[2], 1e-5)
    only_p2 = fl.linear_logprobs(hidden, weight, ids, temperature=1.3, bias=bias, mask=mask, return_sum_p2=True)
    _rel("sum_p2", only_p2.sum_p2, want[4], 1e-5)
    assert only_p2.lse is None and only_p2.max_logit is None
    # Masked rows are zero in every output, and the gathered ids there are never read.
    out = fl.linear_logprobs(
        hidden, weight, ids, temperature=1.3, bias=bias, mask=mask, gather_ids=gather, return_max=True
    )
    assert (out.gathered_logp[~mask] == 0).all() and (out.max_logit[~mask] == 0).all()


def test_gradient_through_lse_and_gathered_alone():
    hidden, weight, bias, ids, mask, gather, up, up_k = _data(3)
    zero = torch.zeros_like(up)
    _, grads = _reference(hidden, weight, bias, ids, mask, gather, 0.9, zero, up_k)
    h, w, b = (x.clone().requires_grad_() for x in (hidden, weight, bias))
    out = fl.linear_logprobs(h, w, ids, temperature=0.9, bias=b, mask=mask, gather_ids=gather)
    (out.gathered_logp * up_k).sum().backward()
    for name, got, ref in zip(("dhidden", "dweight", "dbias"), (h.grad, w.grad, b.grad), grads):
        _close(name, got, ref, 1e-4)
    up_lse = torch.stack([zero[0], zero[1], up[2], zero[3]])
    _, grads = _reference(hidden, weight, bias, ids, mask, gather, 0.9, up_lse, torch.zeros_like(up_k))
    h, w, b = (x.clone().requires_grad_() for x in (hidden, weight, bias))
    out = fl.linear_logprobs(h, w, ids, temperature=0.9, bias=b, mask=mask, return_lse=True)
    (out.lse * up[2]).sum().backward()
    for name, got, ref in zip(("dhidden", "dweight", "dbias"), (h.grad, w.grad, b.grad), grads):
        _close(f"{name} (lse)", got, ref, 1e-4)


def test_opcheck_and_compile():
    hidden, weight, bias, ids, mask, gather, up, up_k = _data(4)
    h, w, b = (x.clone().requires_grad_() for x in (hidden, weight, bias))
    tests = ("test_schema", "test_faketensor", "test_autograd_registration")
    args = (h, w, b, ids, mask, 0.9, 160.0, "", gather, True, None, None, None)
    torch.library.opcheck(ops.logp_linear, args, test_utils=tests)

    def step(h, w, b):
        out = fl.linear_logprobs(
            h, w, ids, temperature=0.9, return_entropy=True, bias=b, mask=mask, return_lse=True, gather_ids=gather
        )
        return (out.logp * up[0]).sum() + (out.lse * up[2]).sum() + (out.gathered_logp * up_k).sum()

    results = []
    for fn in (step, torch.compile(step, fullgraph=True, backend="aot_eager")):
        h, w, b = (x.clone().requires_grad_() for x in (hidden, weight, bias))
        loss = fn(h, w, b)
        loss.backward()
        results.append((loss.detach(), h.grad, w.grad, b.grad))
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


def test_bad_arguments_name_themselves():
    hidden, weight, bias, ids, mask, gather, *_ = _data(5)

    def call(**kw):
        return fl.linear_logprobs(hidden, weight, ids, bias=bias, mask=mask, **kw)

    for bad in (gather[..., 0], gather.float(), gather[:1], torch.zeros(N_B, N_T, 0, dtype=torch.int64)):
        with pytest.raises(ValueError, match="gather_ids"):
            call(gather_ids=bad)
    out_of_range = gather.clone()
    out_of_range[0, 0, 1] = V
    with pytest.raises(ValueError, match="gather_ids"):
        call(gather_ids=out_of_range)
    with pytest.raises(ValueError, match="top_k"):
        call(top_k=-2)
    with pytest.raises(ValueError, match="top_p"):
        call(top_p=1.5)
    with pytest.raises(ValueError, match="min_p"):
        call(min_p=-0.2)
