"""``flashloss.torch.linear_logprobs`` under vLLM V1's truncated support (``top_k``,
``top_p``, ``min_p``): ``logp`` is the log-prob under the support (``-inf`` where the
target is outside it, flagged in ``outside_support``), against a float64 materialized
reference of vLLM's filters in vLLM's order (min-p, top-k, top-p; ties in top-p broken by
a stable ascending sort, the lower index dropped first), values and gradients. Exact
inputs (small integers scaled by powers of two) make every logit exact, so ties reproduce
and the kernel and the reference decide on the same values."""

from __future__ import annotations

from typing import Optional

import pytest
import torch

import flashloss.torch as ft
from trl_reference import truncated_support


def exact_head(n: int, h: int, v: int, dtype: torch.dtype, seed: int, ties: bool):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randint(-4, 5, (n, h), generator=g).double() / 4
    weight = torch.randint(-4, 5, (v, h), generator=g).double() / 8
    bias = torch.randint(-8, 9, (v,), generator=g).double() / 16
    if ties:
        # Vocabulary rows from 64 on repeat three patterns; the last row's logits are the bias.
        weight[64:] = weight[torch.arange(64, v) % 3]
        hidden[-1] = 0
    return hidden.to(dtype), weight.to(dtype), bias.to(dtype)


def reference(hidden, weight, bias, ids, temperature, top_k, top_p, min_p):
    """``logp^K`` (float64, differentiable in the head with the support fixed) and the
    outside flags, vLLM's filters materialized on the f32 scaled logits."""
    z = hidden.double() @ weight.double().T + bias.double()
    keep = truncated_support(z, temperature, top_k, top_p, min_p)
    scaled = z / temperature
    lse = torch.logsumexp(scaled.masked_fill(~keep, float("-inf")), -1)
    inside = keep.gather(-1, ids[:, None])[:, 0]
    logp = scaled.gather(-1, ids[:, None])[:, 0] - lse
    return torch.where(inside, logp, torch.full_like(logp, float("-inf"))), ~inside


FILTERS = [
    (5, None, None),
    (None, 0.6, None),
    (None, None, 0.2),
    (40, 0.8, 0.01),
    (None, 0.9, None),
    (3000, None, None),
]


@pytest.mark.parametrize("top_k,top_p,min_p", FILTERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_and_gradients_match_the_float64_reference(top_k, top_p, min_p, dtype):
    n, h, v = 6, 12, 2077
    hidden, weight, bias = exact_head(n, h, v, dtype, 3, ties=True)
    # Even rows: the largest (value, index), always in the support; odd rows: anywhere.
    z = hidden.double() @ weight.double().T + bias.double()
    largest = torch.sort(z, stable=True, dim=-1).indices[:, -1]
    ids = torch.where(torch.arange(n) % 2 == 0, largest, (torch.arange(n) * 331 + 64) % v)
    mask = torch.ones(n, dtype=torch.bool)
    mask[1] = False
    temperature = 0.5
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    bias.requires_grad_(True)
    out = ft.linear_logprobs(
        hidden,
        weight,
        ids,
        temperature=temperature,
        bias=bias,
        mask=mask,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
    )
    assert isinstance(out, ft.LogprobOutputs)
    hr, wr, br = (t.detach().double().requires_grad_(True) for t in (hidden, weight, bias))
    want, outside = reference(hr, wr, br, ids, temperature, top_k, top_p, min_p)
    live = mask
    assert torch.equal(out.outside_support[live], outside[live])
    assert not out.outside_support[~live].any()
    got = out.logp.double()
    assert torch.equal(torch.isinf(got[live]), torch.isinf(want[live]))
    finite = live & torch.isfinite(want)
    assert finite.any()
    torch.testing.assert_close(got[finite], want[finite].detach(), rtol=1e-5, atol=1e-5)
    assert (got[~live] == 0).all()
    # Upstream gradients on the finite log-probs only (a -inf one is a constant).
    g = torch.linspace(0.5, -0.75, n, dtype=torch.float64) * finite
    (out.logp.double().masked_fill(~finite, 0.0) * g).sum().backward()
    (want.masked_fill(~finite, 0.0) * g).sum().backward()
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    for name, a, b in (
        ("hidden", hidden, hr),
        ("weight", weight, wr),
        ("bias", bias, br),
    ):
        scale = b.grad.abs().max().item()
        err = (a.grad.double() - b.grad).abs().max().item()
        assert err <= tol * scale + 1e-7, f"{name}: {err} vs max {scale}"


def test_unset_filters_are_the_plain_call():
    hidden, weight, bias = exact_head(5, 8, 999, torch.float32, 5, ties=False)
    ids = torch.arange(5) * 97 % 999
    plain = ft.linear_logprobs(hidden, weight, ids, bias=bias).logp
    out = ft.linear_logprobs(hidden, weight, ids, bias=bias, top_k=999, top_p=1.0, min_p=0.0)
    assert torch.equal(out.logp, plain)
    assert not out.outside_support.any()
    # One rule (vLLM's, TRL's): top_k 0 and -1 are "no top-k".
    for top_k in (0, -1):
        out = ft.linear_logprobs(hidden, weight, ids, bias=bias, top_k=top_k)
        assert torch.equal(out.logp, plain)
        assert not out.outside_support.any()


def test_targets_outside_the_support_are_minus_inf_without_nan_gradients():
    n, h, v = 4, 8, 500
    hidden, weight, bias = exact_head(n, h, v, torch.float32, 7, ties=False)
    z = hidden @ weight.T + bias
    ids = z.argmin(-1)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    out = ft.linear_logprobs(hidden, weight, ids, bias=bias, top_k=10)
    assert out.outside_support.all()
    assert torch.isinf(out.logp).all() and (out.logp < 0).all()
    out.logp.masked_fill(out.outside_support, 0.0).sum().backward()
    assert torch.isfinite(hidden.grad).all() and (hidden.grad == 0).all()
    assert (weight.grad == 0).all()


@pytest.mark.parametrize(
    "kwargs,arg",
    [
        (dict(top_k=-2), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(min_p=-0.1), "min_p"),
        (dict(min_p=1.1), "min_p"),
    ],
)
def test_bad_filters_name_the_argument(kwargs: dict, arg: Optional[str]):
    hidden, weight, bias = exact_head(2, 4, 50, torch.float32, 1, ties=False)
    with pytest.raises(ValueError, match=arg):
        ft.linear_logprobs(hidden, weight, torch.tensor([1, 2]), bias=bias, **kwargs)


def test_opcheck_and_compile_with_a_support():
    from flashloss.torch import _ops as ops

    hidden, weight, bias = exact_head(6, 8, 301, torch.float32, 11, ties=True)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    ids = torch.arange(6) * 41 % 301
    tests = ("test_schema", "test_faketensor", "test_autograd_registration")
    args = (hidden, weight, bias, ids, None, 0.5, 160.0, "", None, False, 20, 0.9, None)
    torch.library.opcheck(ops.logp_linear, args, test_utils=tests)

    def step(hidden, weight):
        out = ft.linear_logprobs(hidden, weight, ids, temperature=0.5, bias=bias, top_k=20, top_p=0.9)
        return out.logp.masked_fill(out.outside_support, 0.0).sum()

    eager = step(hidden, weight)
    compiled = torch.compile(step, fullgraph=True)(hidden, weight)
    assert torch.equal(eager, compiled)
