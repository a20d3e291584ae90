"""flashloss.jax's ``policy_mask`` and ``entropy_mask`` (TRL's off-policy and top-entropy
masks) on ``linear_grpo_loss``, on the FFI and Pallas (interpret mode) paths, against
the torch binding, whose kernel takes them natively: the loss, the metrics, every
gradient, and the sampler's filters on top."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
torch = pytest.importorskip("torch")
fj = pytest.importorskip("flashloss.jax")
ft = pytest.importorskip("flashloss.torch")

jax.config.update("jax_enable_x64", False)


def _batch(seed, b=3, t=5, h=16, v=37):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, h, generator=g)
    weight = torch.randn(v, h, generator=g) / h**0.5
    bias = torch.randn(v, generator=g) * 0.1
    ids = torch.randint(0, v, (b, t), generator=g)
    mask = torch.rand(b, t, generator=g) > 0.2
    mask[0] = True
    adv = torch.randn(b, generator=g)
    old = -3.0 + 0.3 * torch.randn(b, t, generator=g)
    ref = old - 0.05
    policy_mask = torch.rand(b, t, generator=g) > 0.3
    entropy_mask = torch.rand(b, t, generator=g) > 0.4
    return hidden, weight, bias, ids, mask, adv, old, ref, policy_mask, entropy_mask


def _torch(d, kw):
    hidden, weight, bias, ids, mask, adv, old, ref, pm, em = d
    h, w, b = (x.clone().requires_grad_() for x in (hidden, weight, bias))
    loss, out = ft.linear_grpo_loss(h, w, ids, mask, adv, bias=b, old_per_token_logps=old, ref_per_token_logps=ref,
                                    policy_mask=pm, entropy_mask=em, **kw)  # fmt: skip
    loss.backward()
    return loss.item(), {k: float(v) for k, v in out.metrics.items()}, [x.grad.numpy() for x in (h, w, b)]


def _jax(d, kw, impl):
    hidden, weight, bias, ids, mask, adv, old, ref, pm, em = (jnp.asarray(x.numpy()) for x in d)

    def f(h, w, b):
        return fj.linear_grpo_loss(h, w, ids, mask, adv, bias=b, old_per_token_logps=old, ref_per_token_logps=ref,
                                   policy_mask=pm, entropy_mask=em, impl=impl,
                                   interpret=impl == "pallas", **kw)  # fmt: skip

    (loss, out), grads = jax.value_and_grad(f, (0, 1, 2), has_aux=True)(hidden, weight, bias)
    return float(loss), {k: float(v) for k, v in out.metrics.items()}, [np.asarray(g) for g in grads], out


CASES = [
    dict(loss_type="dapo", beta=0.04, entropy_coef=0.01),
    dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.04),
    dict(loss_type="bnpo", entropy_coef=0.02, use_bias_correction_kl=False),
    dict(loss_type="vespo"),
    dict(loss_type="dapo", top_k=7, entropy_coef=0.01),
]


@pytest.mark.parametrize("impl", ("ffi", "pallas"))
@pytest.mark.parametrize("kw", CASES, ids=[str(i) for i in range(len(CASES))])
def test_masks_match_the_torch_kernel(impl, kw):
    d = _batch(len(str(kw)))
    want_loss, want_metrics, want_grads = _torch(d, kw)
    loss, metrics, grads, out = _jax(d, kw, impl)
    assert abs(loss - want_loss) <= 1e-5 * max(1.0, abs(want_loss)), (loss, want_loss)
    for k, v in want_metrics.items():
        assert abs(metrics[k] - v) <= 1e-5, (k, metrics[k], v)
    for name, got, want in zip(("hidden", "weight", "bias"), grads, want_grads):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6 * np.abs(want).max(), err_msg=name)
    assert (out.outside_support is None) == ("top_k" not in kw)


def test_masks_change_the_loss():
    """A policy mask that drops tokens changes the loss (the masks are not ignored)."""
    hidden, weight, bias, ids, mask, adv, old, ref, pm, em = (jnp.asarray(x.numpy()) for x in _batch(3))
    kw = dict(bias=bias, old_per_token_logps=old, impl="ffi")
    plain = fj.linear_grpo_loss(hidden, weight, ids, mask, adv, **kw)[0]
    masked = fj.linear_grpo_loss(hidden, weight, ids, mask, adv, policy_mask=pm, **kw)[0]
    everything = fj.linear_grpo_loss(hidden, weight, ids, mask, adv, policy_mask=jnp.ones_like(pm), **kw)[0]
    assert float(masked) != float(plain)
    np.testing.assert_allclose(float(everything), float(plain), rtol=1e-6)
