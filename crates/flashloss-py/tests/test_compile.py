"""flashloss's losses as torch.library custom ops: ``torch.library.opcheck`` on each op,
``torch.compile(fullgraph=True)`` of a training step through them (no graph break, the
eager numbers), and ``torch.export`` of a module that calls them."""

import pytest
import torch

import flashloss.torch as fl
from flashloss import liger
from flashloss.torch import _ops as ops
from flashloss._spec import CeArgs, GrpoArgs
from test_grpo import make_batch

GRPO_CONFIG = GrpoArgs(loss_type="dapo", beta=0.04, epsilon_low=0.2, epsilon_high=0.28, temperature=0.9).config_json()


def _inputs(seed=0, bias=True, dtype=torch.float32):
    d = make_batch(seed, bias=bias, dtype=dtype)
    old = torch.randn(d["ids"].shape, generator=d["g"]) * 0.1 - 3.0
    return d, old


@pytest.mark.parametrize("bias", [True, False])
def test_opcheck_grpo_linear(bias):
    d, old = _inputs(bias=bias)
    h = d["hidden"].requires_grad_()
    w = d["weight"].requires_grad_()
    b = None if d["bias"] is None else d["bias"].requires_grad_()
    args = (h, w, b, d["ids"], d["mask"], d["adv"], old, old - 0.05, None, None, None, None,
            GRPO_CONFIG, "auto", 160.0, "", True)  # fmt: skip
    # The gradients are formed in the forward (the op's outputs); gradcheck of the op's
    # formula is test_grpo's job (against float64 TRL), so opcheck checks the rest.
    tests = ("test_schema", "test_faketensor", "test_autograd_registration")
    torch.library.opcheck(ops.grpo_linear, args, test_utils=tests)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_opcheck_ce_ops(reduction):
    d, _ = _inputs()
    h, w, b = (d[k].requires_grad_() for k in ("hidden", "weight", "bias"))
    h2 = h.reshape(-1, h.shape[-1])
    tgt = d["ids"].reshape(-1)
    config = CeArgs(label_smoothing=0.1, z_loss=1e-4, reduction=reduction).config_json()
    tests = ("test_schema", "test_faketensor", "test_autograd_registration")
    if reduction == "none":
        torch.library.opcheck(ops.ce_linear_rows, (h2, w, b, tgt, config, "auto", 160.0, ""), test_utils=tests)
        grad_rows = torch.randn(tgt.shape)
        torch.library.opcheck(
            ops.ce_linear_rows_backward, (h2, w, b, tgt, grad_rows, config, "auto", 160.0, "", True), test_utils=tests
        )
    else:
        torch.library.opcheck(ops.ce_linear, (h2, w, b, tgt, config, "auto", 160.0, "", True), test_utils=tests)
    lse_op = ops.ce_linear_rows_lse if reduction == "none" else ops.ce_linear_lse
    torch.library.opcheck(lse_op, (h2, w, b, tgt, config, "auto", 160.0, ""), test_utils=tests)
    rows = torch.randn(tgt.shape) if reduction == "none" else None
    args = (h2, w, b, tgt, rows, torch.randn(tgt.shape), 1.0, config, "auto", 160.0, "")
    torch.library.opcheck(ops.ce_linear_lse_backward, args, test_utils=tests)


def test_opcheck_logp_and_logits_ops():
    d, old = _inputs()
    ids = d["ids"]
    tests = ("test_schema", "test_faketensor", "test_autograd_registration")
    torch.library.opcheck(
        ops.logp_linear, (d["hidden"], d["weight"], d["bias"], ids, d["mask"], 0.9, 160.0, ""), test_utils=tests
    )
    logits = torch.randn(ids.shape[0], ids.shape[1] + 1, 37, requires_grad=True)
    args = (logits, ids, d["mask"], d["adv"], old, old - 0.05, None, None, GRPO_CONFIG)
    torch.library.opcheck(ops.grpo_logits, args, test_utils=tests)
    torch.library.opcheck(ops.grpo_logits_rows, args[:7] + (GRPO_CONFIG,), test_utils=tests)
    grad_rows = torch.randn(ids.shape)
    torch.library.opcheck(ops.grpo_logits_rows_backward, args[:7] + (GRPO_CONFIG, grad_rows), test_utils=tests)


def _grpo_step(hidden, weight, bias, ids, mask, adv, old):
    loss, out = fl.linear_grpo_loss(
        hidden, weight, ids, mask, adv, bias=bias, old_per_token_logps=old, ref_per_token_logps=old - 0.05,
        beta=0.04, epsilon_high=0.28, temperature=0.9,
    )  # fmt: skip
    return loss * 2.0 + out.entropy.mean() * 0.0, out.metrics["kl"]


def test_compile_fullgraph_grpo_step_matches_eager():
    d, old = _inputs(seed=3)
    results = []
    for fn in (_grpo_step, torch.compile(_grpo_step, fullgraph=True, backend="aot_eager")):
        h, w, b = (d[k].clone().requires_grad_() for k in ("hidden", "weight", "bias"))
        loss, kl = fn(h, w, b, d["ids"], d["mask"], d["adv"], old)
        loss.backward()
        results.append((loss.detach(), kl.detach(), h.grad, w.grad, b.grad))
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


def test_compile_fullgraph_cross_entropy_and_logits_level():
    d, old = _inputs(seed=4)
    ids = d["ids"]

    def ce_step(h, w, t):
        return (
            fl.linear_cross_entropy(h, w, t, label_smoothing=0.1)
            + fl.linear_cross_entropy(h, w, t, reduction="none").sum() * 0.5
        )

    def logits_step(z):
        return liger.triton_grpo_loss(z, old, None, ids, d["adv"], d["mask"], beta=0.0)[0]

    for fn, make in (
        (ce_step, lambda: (d["hidden"].clone().requires_grad_(), d["weight"].clone().requires_grad_(), ids)),
        (logits_step, lambda: (torch.randn(3, 6, 37, generator=torch.Generator().manual_seed(1)).requires_grad_(),)),
    ):
        grads = []
        for f in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
            args = make()
            loss = f(*args)
            loss.backward()
            grads.append([loss.detach()] + [a.grad for a in args if isinstance(a, torch.Tensor) and a.requires_grad])
        for eager, compiled in zip(*grads):
            torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-7)


def test_compile_num_items_in_batch_tensor():
    """TRL passes num_items_in_batch as a tensor: read inside the op, no graph break."""
    d, old = _inputs(seed=5)

    def step(h, w, n):
        loss, _ = fl.linear_grpo_loss(h, w, d["ids"], d["mask"], d["adv"], loss_type="dapo", num_items_in_batch=n)
        return loss

    n = torch.tensor(40.0)
    eager = step(d["hidden"], d["weight"], n)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(d["hidden"], d["weight"], n)
    as_float = step(d["hidden"], d["weight"], 40.0)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    torch.testing.assert_close(eager, as_float, rtol=0, atol=0)


def test_export_module_calling_the_loss():
    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = torch.nn.Linear(16, 37, bias=False)

        def forward(self, hidden, targets):
            return fl.linear_cross_entropy(hidden, self.lm_head.weight, targets)

    torch.manual_seed(0)
    m = Head()
    hidden, targets = torch.randn(12, 16), torch.randint(0, 37, (12,))
    ep = torch.export.export(m, (hidden, targets))
    assert any("flashloss.ce_linear" in str(n.target) for n in ep.graph.nodes)
    torch.testing.assert_close(ep.module()(hidden, targets), m(hidden, targets), rtol=0, atol=0)
