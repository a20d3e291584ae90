"""Differentiable ``linear_logprobs`` and the frozen head in PyTorch.

``linear_logprobs``: gradients of hidden, weight and bias through logp and entropy equal
float64 autograd on materialized logits (f32 and bf16, temperature, mask, both outputs
or one); ``opcheck`` of its ops; ``torch.compile(fullgraph=True)`` and ``torch.export``.
A frozen head (``weight``/``bias`` without ``requires_grad``): every op gives the
trainable head's loss and hidden gradient, no weight gradient, and no ``[V, H]`` buffer
(the op's ``dweight`` output is ``[0]``), eager and compiled."""

import pytest
import torch

import flashloss.torch as fl
from flashloss.torch import _ops as ops
from flashloss._spec import CeArgs, GrpoArgs

N_B, N_T, H, V = 3, 7, 24, 301

GRPO_CONFIG = GrpoArgs(loss_type="dapo", beta=0.04, epsilon_low=0.2, epsilon_high=0.28, temperature=0.9).config_json()


def _data(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N_B, N_T, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) / H**0.5).to(dtype)
    bias = (torch.randn(V, generator=g) * 0.1).to(dtype)
    ids = torch.randint(0, V, (N_B, N_T), generator=g)
    mask = torch.rand(N_B, N_T, generator=g) > 0.3
    up = torch.randn(2, N_B, N_T, generator=g)
    return hidden, weight, bias, ids, mask, up


def _leaves(*xs, frozen=()):
    out = [x.detach().clone().requires_grad_() for x in xs]
    for k in frozen:
        out[k].requires_grad_(False)
    return out


def _reference(hidden, weight, bias, ids, mask, temperature, up):
    """float64 autograd on materialized logits: logp, entropy and their gradients for
    the upstream ``up`` (rows where ``mask`` is false: zero)."""
    h, w, b = _leaves(*(x.double() for x in (hidden, weight, bias)))
    z = (h @ w.T + b) / temperature
    logq = torch.log_softmax(z, -1)
    logp = logq.gather(-1, ids[..., None])[..., 0] * mask
    entropy = -(logq.exp() * logq).sum(-1) * mask
    ((logp * up[0]).sum() + (entropy * up[1]).sum()).backward()
    return logp.detach(), entropy.detach(), h.grad, w.grad, b.grad


def _close(name, got, want, rtol):
    err = (got.double() - want).abs().max().item()
    scale = want.abs().max().item()
    assert err <= rtol * scale + 1e-7, f"{name}: error {err:.3g}, scale {scale:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("frozen", [False, True])
def test_logprobs_gradients_match_float64_autograd(dtype, frozen):
    hidden, weight, bias, ids, mask, up = _data(1, dtype)
    want = _reference(hidden, weight, bias, ids, mask, 0.8, up)
    h, w, b = _leaves(hidden, weight, bias, frozen=(1, 2) if frozen else ())
    logp, entropy = fl.linear_logprobs(h, w, ids, temperature=0.8, return_entropy=True, bias=b, mask=mask)[:2]
    ((logp * up[0]).sum() + (entropy * up[1]).sum()).backward()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    _close("logp", logp, want[0], 1e-5 if dtype == torch.float32 else 1e-2)
    _close("entropy", entropy, want[1], 1e-5 if dtype == torch.float32 else 1e-2)
    assert h.grad.dtype == dtype
    _close("dhidden", h.grad, want[2], tol)
    if frozen:
        assert w.grad is None and b.grad is None
    else:
        _close("dweight", w.grad, want[3], tol)
        _close("dbias", b.grad, want[4], tol)


def test_logprobs_one_output_and_no_grad():
    hidden, weight, bias, ids, mask, up = _data(2)
    want = _reference(hidden, weight, bias, ids, mask, 1.0, torch.stack([up[0], torch.zeros_like(up[0])]))
    h, w = _leaves(hidden, weight)
    logp = fl.linear_logprobs(h, w, ids, bias=bias, mask=mask).logp
    (logp * up[0]).sum().backward()
    _close("dhidden (logp only)", h.grad, want[2], 1e-4)
    _close("dweight (logp only)", w.grad, want[3], 1e-4)
    with torch.no_grad():
        assert fl.linear_logprobs(h, w, ids, bias=bias).logp.grad_fn is None


def test_opcheck_logprobs_ops():
    hidden, weight, bias, ids, mask, up = _data(3)
    tests = ("test_schema", "test_faketensor", "test_autograd_registration")
    h, w, b = _leaves(hidden, weight, bias)
    torch.library.opcheck(ops.logp_linear, (h, w, b, ids, mask, 0.9, 160.0, ""), test_utils=tests)
    for head_grad in (True, False):
        args = (h, w, b, ids, mask, up[0], up[1], 0.9, 160.0, "", head_grad)
        torch.library.opcheck(ops.logp_linear_backward, args, test_utils=tests)
    dh, dw, db = ops.logp_linear_backward(hidden, weight, bias, ids, mask, up[0], None, 0.9, 160.0, "", False)
    assert dh.shape == hidden.shape and dw.numel() == 0 and db.numel() == 0


def _logprob_loss(hidden, weight, bias, ids, mask, old, adv):
    """A clipped policy loss written in PyTorch on ``linear_logprobs`` (how TRL, verl and
    Tunix build theirs), with an entropy bonus."""
    logp, entropy = fl.linear_logprobs(hidden, weight, ids, temperature=0.9, return_entropy=True, bias=bias, mask=mask)[
        :2
    ]
    ratio = torch.exp(logp - old)
    per_token = -torch.min(ratio * adv[:, None], ratio.clamp(0.8, 1.28) * adv[:, None]) - 0.01 * entropy
    return (per_token * mask).sum() / mask.sum()


@pytest.mark.parametrize("frozen", [False, True])
def test_compile_fullgraph_logprob_loss_matches_eager(frozen):
    hidden, weight, bias, ids, mask, up = _data(4)
    old, adv = up[0] * 0.1 - 4.0, up[1][:, 0]
    frozen_args = (1, 2) if frozen else ()
    runs = []
    for fn in (_logprob_loss, torch.compile(_logprob_loss, fullgraph=True)):
        h, w, b = _leaves(hidden, weight, bias, frozen=frozen_args)
        loss = fn(h, w, b, ids, mask, old, adv)
        loss.backward()
        runs.append((loss.detach(), h.grad, w.grad, b.grad))
    (l0, dh0, dw0, db0), (l1, dh1, dw1, db1) = runs
    torch.testing.assert_close(l1, l0, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(dh1, dh0, rtol=1e-5, atol=1e-7)
    if frozen:
        assert dw0 is None and dw1 is None and db1 is None
    else:
        torch.testing.assert_close(dw1, dw0, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(db1, db0, rtol=1e-5, atol=1e-7)


def test_export_logprobs_module():
    hidden, weight, bias, ids, mask, _ = _data(5)

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = torch.nn.Linear(H, V)
            with torch.no_grad():
                self.lm_head.weight.copy_(weight)
                self.lm_head.bias.copy_(bias)

        def forward(self, x, ids, mask):
            return fl.linear_logprobs(
                x, self.lm_head.weight, ids, temperature=1.0, return_entropy=True, bias=self.lm_head.bias, mask=mask
            )[:2]

    module = Head()
    exported = torch.export.export(module, (hidden, ids, mask))
    names = [str(n.target) for n in exported.graph.nodes if n.op == "call_function"]
    assert any("flashloss.logp_linear" in n for n in names), names
    got = exported.module()(hidden, ids, mask)
    want = module(hidden, ids, mask)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


def _grpo(h, w, b, ids, mask, adv, old):
    loss, _ = fl.linear_grpo_loss(
        h, w, ids, mask, adv, bias=b, old_per_token_logps=old, ref_per_token_logps=old - 0.05, beta=0.04,
        epsilon_high=0.28, temperature=0.9, mode="two_pass",
    )  # fmt: skip
    return loss


def _ce(h, w, b, ids, mask, adv, old):
    return fl.linear_cross_entropy(h, w, ids.masked_fill(~mask, -100), bias=b, label_smoothing=0.1)


def _ce_rows(h, w, b, ids, mask, adv, old):
    return (fl.linear_cross_entropy(h, w, ids, bias=b, reduction="none") * adv[:, None]).sum()


class _NativeSpy:
    """``flashloss._native`` recording, per call that forms gradients, whether it was
    given a ``grad_weight`` buffer (None: a frozen head, no dW formed): the second of its
    ``(grad_hidden, grad_weight, grad_bias)`` argument."""

    GRADS_ARG = {"grpo_linear": 2, "ce_linear": 3, "logp_linear_grads": 3}

    def __init__(self, native):
        self.native, self.calls = native, []

    def __getattr__(self, name):
        fn = getattr(self.native, name)
        if name not in self.GRADS_ARG:
            return fn

        def spied(*args, **kw):
            self.calls.append(args[self.GRADS_ARG[name]][1] is not None)
            return fn(*args, **kw)

        return spied


def _logprobs_sum(h, w, b, ids, mask, adv, old):
    logp, entropy = fl.linear_logprobs(h, w, ids, temperature=0.9, return_entropy=True, bias=b, mask=mask)[:2]
    return (logp * adv[:, None]).sum() + entropy.sum()


@pytest.mark.parametrize("loss_fn", [_grpo, _ce, _ce_rows, _logprobs_sum], ids=["grpo", "ce", "ce_rows", "logprobs"])
@pytest.mark.parametrize("compiled", [False, True])
def test_frozen_head_gives_the_trainable_loss_and_dhidden(loss_fn, compiled, monkeypatch):
    hidden, weight, bias, ids, mask, up = _data(6)
    old, adv = up[0] * 0.1 - 4.0, up[1][:, 0]
    spy = _NativeSpy(ops._native)
    monkeypatch.setattr(ops, "_native", spy)
    fn = torch.compile(loss_fn, fullgraph=True) if compiled else loss_fn
    runs, formed_dweight = {}, {}
    for case, frozen in (("full", ()), ("frozen", (1, 2)), ("bias only", (1,))):
        h, w, b = _leaves(hidden, weight, bias, frozen=frozen)
        spy.calls.clear()
        loss = fn(h, w, b, ids, mask, adv, old)
        loss.backward()
        runs[case] = (loss.detach(), h.grad, w.grad, b.grad)
        formed_dweight[case] = list(spy.calls)
    # What `ctx.needs_input_grad` (or the wrapper's requires_grad) gave the native call,
    # eager and compiled: a buffer for the trainable head and the bias, none when frozen.
    assert formed_dweight == {"full": [True], "frozen": [False], "bias only": [True]}
    full, frozen, bias_only = runs["full"], runs["frozen"], runs["bias only"]
    assert frozen[0].item() == full[0].item()
    torch.testing.assert_close(frozen[1], full[1], rtol=1e-6, atol=1e-8)
    assert frozen[2] is None and frozen[3] is None
    # A trainable bias on a frozen weight: the bias's gradient, none for the weight.
    assert bias_only[2] is None
    torch.testing.assert_close(bias_only[3], full[3], rtol=1e-6, atol=1e-8)


def test_fused_ops_allocate_no_weight_gradient_when_frozen():
    hidden, weight, bias, ids, mask, up = _data(7)
    h2 = hidden.reshape(-1, H)
    mask_i = mask.reshape(-1)
    old = (up[0] * 0.1 - 4.0).contiguous()
    args = (hidden, weight, bias, ids, mask, up[1][:, 0].contiguous(), old, old - 0.05, None, None, None, None)
    out = ops.grpo_linear(*args, GRPO_CONFIG, "auto", 160.0, "", False)
    assert out[2].numel() == 0 and out[3].numel() == 0
    config = CeArgs().config_json()
    ce = ops.ce_linear(h2, weight, bias, ids.reshape(-1).masked_fill(~mask_i, -100), config, "auto", 160.0, "", False)
    assert ce[2].numel() == 0 and ce[3].numel() == 0
    tests = ("test_schema", "test_faketensor", "test_autograd_registration")
    h = hidden.clone().requires_grad_()
    frozen_args = (h, weight, bias, *args[3:], GRPO_CONFIG, "auto", 160.0, "", False)
    torch.library.opcheck(ops.grpo_linear, frozen_args, test_utils=tests)


def test_head_grad_false_with_a_trainable_weight_is_refused():
    hidden, weight, bias, ids, mask, up = _data(8)
    h, w = _leaves(hidden, weight)
    old = (up[0] * 0.1 - 4.0).contiguous()
    args = (h, w, None, ids, mask, up[1][:, 0].contiguous(), old, old - 0.05, None, None, None, None)
    with pytest.raises(ValueError, match="head_grad"):
        ops.grpo_linear(*args, GRPO_CONFIG, "auto", 160.0, "", False)
