"""flashloss.jax's ``importance_sampling_ratio`` (TRL's vLLM importance-sampling
correction ρ, ``[B]``, ``[B, 1]`` or ``[B, T]``) on ``linear_grpo_loss`` and the
logits-level ``grpo_loss``, on the FFI path and the Pallas path (interpret mode, small
shapes), against TRL's formulas in float64 (``trl_reference.grpo_reference``): the loss
and the gradients for every loss type and level (ρ multiplies ℓ; for vespo it enters
``log w_b``), Liger's per-token losses, and the torch binding's messages for a bad
shape (trace time) and a negative or non-finite value (run time)."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
torch = pytest.importorskip("torch")
fj = pytest.importorskip("flashloss.jax")

from trl_reference import grpo_reference  # noqa: E402

LOSS_LEVELS = [
    (lt, lvl)
    for lt in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
    for lvl in ("token", "sequence")
    if not (lt == "vespo" and lvl == "sequence")
]
SHAPES = ("b", "b1", "bt")


def _batch(seed, shape, b=3, t=5, h=16, v=37):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) / h**0.5
    bias = torch.randn(v, generator=g, dtype=torch.float64) * 0.1
    ids = torch.randint(0, v, (b, t), generator=g)
    mask = torch.rand(b, t, generator=g) > 0.25
    mask[0] = True
    mask[-1, 1:] = False
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    with torch.no_grad():
        _, logp, _ = grpo_reference(hidden, weight, bias, ids, mask, adv)
    old = (logp + 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64)).float().double()
    rho = {"b": (b,), "b1": (b, 1), "bt": (b, t)}[shape]
    rho = (torch.rand(rho, generator=g, dtype=torch.float64) * 1.5 + 0.1).float().double()
    if shape == "bt":
        rho[-1, -1] = float("nan")  # a masked token's ratio is never read
    return dict(hidden=hidden.float().double(), weight=weight.float().double(), bias=bias.float().double(), ids=ids,
                mask=mask, adv=adv.float().double(), old=old, rho=rho)  # fmt: skip


def _kw(loss_type, level):
    kw = dict(loss_type=loss_type, importance_sampling_level=level, beta=0.04, temperature=0.9)
    kw.update(max_completion_length=6 if loss_type == "dr_grpo" else None)
    kw.update(epsilon_high=5.0 if loss_type == "cispo" else 0.28)
    return kw


def _reference(d, kw):
    leaves = [d[k].clone().requires_grad_() for k in ("hidden", "weight", "bias")]
    ref_logp = d["old"] - 0.05
    ref_kw = {k: (0.2 if v is None and k == "epsilon_high" else v) for k, v in kw.items()}
    rho = d["rho"] if d["rho"].shape != d["mask"].shape else torch.where(d["mask"], d["rho"], 1.0)  # no NaN·0
    loss, _, _ = grpo_reference(*leaves, d["ids"], d["mask"], d["adv"], old=d["old"], ref=ref_logp, rho=rho, **ref_kw)
    loss.backward()
    return loss.item(), [x.grad.numpy() for x in leaves]


def _j(t, dtype=jnp.float32):
    return jnp.asarray(t.numpy(), dtype)


def _rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-6))


def _check(loss, grads, want_loss, want_grads):
    assert abs(float(loss) - want_loss) <= 1e-5 * max(1.0, abs(want_loss)), (float(loss), want_loss)
    for name, got, want in zip(("hidden", "weight", "bias"), grads, want_grads):
        assert _rel(got, want) <= 1e-4, name


def _linear(d, kw, impl):
    def f(x, w, b):
        return fj.linear_grpo_loss(
            x, w, _j(d["ids"], jnp.int32), _j(d["mask"], bool), _j(d["adv"]), bias=b, old_per_token_logps=_j(d["old"]),
            ref_per_token_logps=_j(d["old"] - 0.05), importance_sampling_ratio=_j(d["rho"]), impl=impl,
            interpret=impl == "pallas", **kw,
        )[0]  # fmt: skip

    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(_j(d["hidden"]), _j(d["weight"]), _j(d["bias"]))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("loss_type,level", LOSS_LEVELS)
def test_linear_grpo_ffi_matches_f64_reference(loss_type, level, shape):
    d, kw = _batch(7, shape), _kw(loss_type, level)
    _check(*_linear(d, kw, "ffi"), *_reference(d, kw))


@pytest.mark.parametrize("loss_type,level", LOSS_LEVELS)
def test_linear_grpo_pallas_matches_f64_reference(loss_type, level):
    shape = SHAPES[LOSS_LEVELS.index((loss_type, level)) % 3]
    d, kw = _batch(8, shape), _kw(loss_type, level)
    _check(*_linear(d, kw, "pallas"), *_reference(d, kw))


@pytest.mark.parametrize("impl", ["ffi", "pallas"])
@pytest.mark.parametrize("loss_type,level,shape", [("dapo", "token", "bt"), ("grpo", "sequence", "b1"),
                                                   ("cispo", "token", "b"), ("vespo", "token", "bt")])  # fmt: skip
def test_logits_level_matches_f64_reference(impl, loss_type, level, shape):
    d, kw = _batch(9, shape), _kw(loss_type, level)
    w = _j(d["weight"])
    kw.pop("epsilon_high") if loss_type != "cispo" else None

    def f(x):
        z = jnp.einsum("bth,vh->btv", x, w, precision="highest") + _j(d["bias"])
        return fj.grpo_loss(z, _j(d["ids"], jnp.int32), _j(d["mask"], bool), _j(d["adv"]),
                            old_per_token_logps=_j(d["old"]), ref_per_token_logps=_j(d["old"] - 0.05),
                            importance_sampling_ratio=_j(d["rho"]), impl=impl,
                            interpret=impl == "pallas", **kw)[0]  # fmt: skip

    loss, dx = jax.jit(jax.value_and_grad(f))(_j(d["hidden"]))
    want_loss, want_grads = _reference(d, kw)
    assert abs(float(loss) - want_loss) <= 1e-5 * max(1.0, abs(want_loss))
    assert _rel(dx, want_grads[0]) <= 1e-4


@pytest.mark.parametrize("impl", ["ffi", "pallas"])
def test_per_token_losses_carry_the_ratio(impl):
    d = _batch(10, "bt")
    z = jnp.einsum("bth,vh->btv", _j(d["hidden"]), _j(d["weight"]), precision="highest")
    args = (z, _j(d["ids"], jnp.int32), _j(d["mask"], bool), _j(d["adv"]))
    common = dict(old_per_token_logps=_j(d["old"]), impl=impl, interpret=impl == "pallas", loss_type="dapo")
    loss, _ = fj.grpo_loss(*args, importance_sampling_ratio=_j(d["rho"]), **common)
    rows, _, _ = fj.grpo_loss(*args, importance_sampling_ratio=_j(d["rho"]), reduce=False, **common)
    plain, _, _ = fj.grpo_loss(*args, reduce=False, **common)
    m = np.asarray(d["mask"])
    rho = np.where(m, d["rho"].numpy(), 0.0)
    np.testing.assert_allclose(np.asarray(rows), np.asarray(plain) * rho, rtol=1e-6, atol=1e-7)
    assert abs(float(rows.sum()) / m.sum() - float(loss)) <= 1e-6 * max(1.0, abs(float(loss)))


@pytest.mark.parametrize("impl", ["ffi", "pallas"])
def test_bad_ratio_names_it(impl):
    d = _batch(11, "b")
    args = (_j(d["hidden"]), _j(d["weight"]), _j(d["ids"], jnp.int32), _j(d["mask"], bool), _j(d["adv"]))
    kw = dict(impl=impl, interpret=impl == "pallas")
    with pytest.raises(ValueError, match=r"argument `importance_sampling_ratio`: expected shape \[B=3\], \[B, 1\] or "
                                         r"\[B, T\] with B·T = 15, got \[3, 2\]"):  # fmt: skip
        fj.linear_grpo_loss(*args, importance_sampling_ratio=jnp.ones((3, 2)), **kw)
    for value, why in ((-1.0, "is negative"), (float("nan"), "is not finite")):
        rho = jnp.ones(3).at[1].set(value)
        with pytest.raises(Exception, match=f"argument `importance_sampling_ratio`: value .* at index 1 {why}"):
            jax.block_until_ready(fj.linear_grpo_loss(*args, importance_sampling_ratio=rho, **kw)[0])
    z = jnp.zeros((3, 5, 37))
    with pytest.raises(Exception, match="argument `importance_sampling_ratio`: value .* at index 1 is negative"):
        jax.block_until_ready(
            fj.grpo_loss(z, *args[2:], importance_sampling_ratio=jnp.ones(3).at[1].set(-2.0), **kw)[0]
        )
