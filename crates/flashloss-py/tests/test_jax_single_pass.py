"""The Pallas path's single-pass plan of a token-local GRPO step (``pallas/single_pass.py``,
in interpret mode on the CPU): every token-local loss type, with KL, the entropy bonus,
the sampler's ratio, a bias, both layouts, f32 and bf16, and several blocks of rows with
a ragged last one and masked rows, against the f64 reference and the two-pass plan; which
plan ``mode`` and ``budget_mib`` pick; its FLOPs (6NHV) in the compiled step."""

import dataclasses

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
fj = pytest.importorskip("flashloss.jax")

from flashloss.jax import gradcheck  # noqa: E402
from flashloss.jax.pallas import _chips, single_pass, target_chip  # noqa: E402
from test_jax_pallas import _grpo_inputs, _rel  # noqa: E402

TOKEN_LOCAL = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo")


def _inputs(seed, b=3, t=70, h=16, v=1003, dtype=jnp.float32):
    """``B·T = 210`` rows: two blocks of 128, the last ragged; sequences of random length."""
    return _grpo_inputs(seed, b=b, t=t, h=h, v=v, dtype=dtype)


def _f64(hidden, weight, ids, mask, adv, old, ref, cfg, entropy_coef=0.0):
    """The f64 reference's loss and gradients (plus ``entropy_coef`` times the masked mean
    entropy, TRL's bonus)."""
    with jax.enable_x64(True):
        h64, w64 = jnp.asarray(np.asarray(hidden, np.float64)), jnp.asarray(np.asarray(weight, np.float64))
        f64 = [jnp.asarray(np.asarray(a, np.float64)) for a in (adv, old, ref)]
        m = jnp.asarray(mask)

        def ref_fn(x, wt):
            z = (x.reshape(-1, x.shape[-1]) @ wt.T).reshape(*ids.shape, -1)
            loss = gradcheck.reference_loss(jnp, jax, z, jnp.asarray(ids), m, *f64, cfg)
            lp = jax.nn.log_softmax(z / cfg["temperature"], axis=-1)
            ent = -(jnp.exp(lp) * lp).sum(-1)
            return loss - entropy_coef * jnp.where(m, ent, 0.0).sum() / jnp.maximum(m.sum(), 1)

        loss, (dh, dw) = jax.value_and_grad(ref_fn, (0, 1))(h64, w64)
        return float(loss), np.asarray(dh), np.asarray(dw)


def _budget(weight) -> float:
    """A budget of two blocks of 128 rows at N = 210, V = 1003 (the second ragged): f32 0.75
    MiB (128·V·4 ≈ 0.51 MB, 210 rows 0.84 MB), bf16 1.5 MiB (every dZ stored: N·V·2 +
    128·V·6 ≈ 1.19 MB, 210 rows 1.68 MB)."""
    return 0.75 if weight.dtype == jnp.float32 else 1.5


def _run(hidden, weight, ids, mask, adv, mode, budget_mib=None, **kw):
    budget_mib = _budget(weight) if budget_mib is None else budget_mib

    def f(x, w):
        return fj.linear_grpo_loss(x, w, ids, mask, adv, impl="pallas", interpret=True, mode=mode,
                                   budget_mib=budget_mib, **kw)  # fmt: skip

    return jax.value_and_grad(f, (0, 1), has_aux=True)(hidden, weight)


@pytest.mark.parametrize("loss_type", TOKEN_LOCAL)
def test_single_pass_matches_f64_and_two_pass(loss_type):
    hidden, weight, ids, mask, adv, old, ref = _inputs(21)
    cfg = dict(loss_type=loss_type, importance_sampling_level="token", beta=0.04, temperature=0.9,
               use_bias_correction_kl=True)  # fmt: skip
    kw = dict(cfg, epsilon_high=1.2 if loss_type == "cispo" else 0.2, max_completion_length=70,
              old_per_token_logps=old, ref_per_token_logps=ref)  # fmt: skip
    # two blocks of 128 rows, the second ragged
    assert single_pass.choose("single_pass", _budget(weight) * 2**20, 210, 1003, 16, 4, _chips.chip("v6e")).rows == 128
    (loss, aux), (dh, dw) = _run(hidden, weight, ids, mask, adv, "single_pass", **kw)
    want, dh64, dw64 = _f64(hidden, weight, ids, mask, adv, old, ref, cfg)
    assert abs(float(loss) - want) <= 1e-5 * max(1.0, abs(want))
    assert _rel(dh, dh64) <= 1e-4 and _rel(dw, dw64) <= 1e-4
    assert np.all(np.asarray(dh)[~np.asarray(mask)] == 0)  # masked rows take no gradient
    (loss2, aux2), (dh2, dw2) = _run(hidden, weight, ids, mask, adv, "two_pass", **kw)
    assert abs(float(loss) - float(loss2)) <= 1e-5 * max(1.0, abs(want))
    assert _rel(dh, dh2) <= 1e-4 and _rel(dw, dw2) <= 1e-4
    for a, b in ((aux.logp, aux2.logp), (aux.entropy, aux2.entropy), (aux.kl, aux2.kl)):
        assert _rel(a, b) <= 1e-5
    for k in aux.metrics:
        assert abs(float(aux.metrics[k]) - float(aux2.metrics[k])) <= 1e-5, k


@pytest.mark.parametrize("layout", ["vh", "hv"])
def test_single_pass_bias_entropy_bonus_and_sampler_ratio(layout):
    """A bias (its gradient too), the entropy bonus, a per-token sampler ratio, the ``[H, V]``
    layout: the single pass equals the two-pass plan."""
    hidden, weight, ids, mask, adv, old, ref = _inputs(22)
    rng = np.random.default_rng(5)
    bias = jnp.asarray(rng.standard_normal(weight.shape[0]) * 0.1, jnp.float32)
    rho = jnp.asarray(rng.uniform(0.5, 1.5, mask.shape), jnp.float32)
    w_in = weight if layout == "vh" else weight.T

    def run(mode):
        def f(x, w, c):
            return fj.linear_grpo_loss(x, w, ids, mask, adv, bias=c, old_per_token_logps=old, ref_per_token_logps=ref,
                                       beta=0.04, entropy_coef=0.01, importance_sampling_ratio=rho, impl="pallas",
                                       interpret=True, mode=mode, budget_mib=_budget(weight),
                                       weight_layout=layout)[0]  # fmt: skip

        return jax.value_and_grad(f, (0, 1, 2))(hidden, w_in, bias)

    loss, grads = run("single_pass")
    loss2, grads2 = run("two_pass")
    assert abs(float(loss) - float(loss2)) <= 1e-5 * max(1.0, abs(float(loss2)))
    for g, g2 in zip(grads, grads2):
        assert g.shape == g2.shape and _rel(g, g2) <= 1e-4


def test_single_pass_entropy_bonus_matches_f64():
    hidden, weight, ids, mask, adv, old, ref = _inputs(23)
    cfg = dict(loss_type="dapo", importance_sampling_level="token", beta=0.0, temperature=1.0,
               use_bias_correction_kl=True)  # fmt: skip
    (loss, _), (dh, dw) = _run(hidden, weight, ids, mask, adv, "single_pass", old_per_token_logps=old,
                               entropy_coef=0.05)  # fmt: skip
    want, dh64, dw64 = _f64(hidden, weight, ids, mask, adv, old, ref, cfg, entropy_coef=0.05)
    assert abs(float(loss) - want) <= 1e-5 * max(1.0, abs(want))
    assert _rel(dh, dh64) <= 1e-4 and _rel(dw, dw64) <= 1e-4


def test_single_pass_bf16():
    hidden, weight, ids, mask, adv, old, ref = _inputs(24, dtype=jnp.bfloat16)
    cfg = dict(loss_type="dapo", importance_sampling_level="token", beta=0.04, temperature=1.0,
               use_bias_correction_kl=True)  # fmt: skip
    (loss, _), (dh, dw) = _run(hidden, weight, ids, mask, adv, "single_pass", old_per_token_logps=old,
                               ref_per_token_logps=ref, beta=0.04)  # fmt: skip
    assert dh.dtype == jnp.bfloat16 and dw.dtype == jnp.bfloat16
    want, dh64, dw64 = _f64(hidden, weight, ids, mask, adv, old, ref, cfg)
    assert abs(float(loss) - want) <= 1e-3 * max(1.0, abs(want))  # f32 logits, bf16 products: as two-pass
    assert _rel(dh, dh64) <= 1e-2 and _rel(dw, dw64) <= 1e-2


def test_plan_choice():
    """``auto`` takes the single pass where a plan fits the budget and its roofline estimate
    is below the two kernels', else two passes; no budget: the chip's default (half the
    materialized step's peak at the original shape); ``two_pass`` never; sequence level,
    vespo and a sampler support never (docs/results/tpu_default_plan.md)."""
    from flashloss.jax import _policy
    from flashloss.jax.ffi import support as _support
    from flashloss.jax.pallas import losses

    x, w = jax.ShapeDtypeStruct((8192, 4096), jnp.bfloat16), jax.ShapeDtypeStruct((151936, 4096), jnp.bfloat16)
    x32, w32 = (jax.ShapeDtypeStruct(a.shape, jnp.float32) for a in (x, w))
    args = _policy.GrpoArgs(loss_type="dapo")
    specs = {}
    for chip in ("v5e", "v6e", "v5p", "7x"):
        with target_chip(chip):
            specs[chip] = losses.spec_for("vh", 1.0, None, None, 151936, False)
    spec = losses.spec_for("vh", 1.0, None, None, 151936, False)
    assert spec.chip == "7x"  # without a TPU or target_chip
    # at 160 MiB neither the f32 dW carry (2.49 GB) nor the stored dZ (N·V·2 = 2.49 GB) fits
    assert losses.single_pass_plan("auto", 160.0, x, w, specs["v6e"], args) is None
    # the default budget (3497 MiB in bf16): every block's dZ stored, 1024 rows (3264 MiB);
    # on v7x, whose XLA copies a bf16 head for its dots (+ V·H·2), the products in Pallas
    for chip in ("v5e", "v6e", "v5p", "7x"):
        plan = losses.single_pass_plan("auto", None, x, w, specs[chip], args)
        assert (plan.rows, plan.stored, plan.temp >> 20, plan.pallas_products) == (1024, True, 3264, chip == "7x")
    # the carry plan keeps XLA's dots: on v7x it counts the copy (1187 MiB)
    carry = [p for p in single_pass.plans(8192, 151936, 4096, 2, 151936 * 4096 * 2) if not p.stored]
    assert min(p.temp for p in carry) >> 20 == 128 * 151936 * 6 // 2**20 + 2374 + 1187
    # f32 (2246 MiB): the carry (aliased to dW), dZ over the logits, a block of 2048 rows
    plan = losses.single_pass_plan("auto", None, x32, w32, specs["v6e"], args)
    assert (plan.rows, plan.stored, plan.temp >> 20) == (2048, False, 1187)
    assert losses.single_pass_plan("auto", 4096.0, x32, w32, spec, args).rows == 4096
    assert losses.single_pass_plan("two_pass", 4096.0, x, w, spec, args) is None
    assert losses.single_pass_plan("single_pass", 160.0, x, w, spec, args).rows == 128
    seq = dataclasses.replace(args, importance_sampling_level="sequence")
    assert losses.single_pass_plan("single_pass", 4096.0, x, w, spec, seq) is None
    vespo = dataclasses.replace(args, loss_type="vespo")
    assert losses.single_pass_plan("single_pass", 4096.0, x, w, spec, vespo) is None
    supported = dataclasses.replace(spec, support=_support.Filters(top_k=50, top_p=None, min_p=None))
    assert losses.single_pass_plan("single_pass", 4096.0, x, w, supported, args) is None


def test_default_budget_is_half_the_materialized_peak():
    """``default_budget_bytes``: ``n·V·4 − (n + V)·H·e`` (temp + arguments + outputs at half
    the step with f32 logits and their gradient), within a quarter of the chip's HBM, never
    below the CPU default."""
    v6e = _chips.chip("v6e")
    assert single_pass.default_budget_bytes(8192, 151936, 4096, 2, v6e) >> 20 == 3497
    assert single_pass.default_budget_bytes(8192, 151936, 4096, 4, v6e) >> 20 == 2246
    assert single_pass.default_budget_bytes(64, 100, 16, 4, v6e) == 160 * 2**20
    big = single_pass.default_budget_bytes(65536, 151936, 4096, 2, _chips.chip("v5e"))
    assert big == _chips.chip("v5e").hbm_bytes // 4


def test_single_pass_flops_are_six_nhv():
    """XLA's cost analysis of the compiled step (CPU, interpret mode: the kernel's work is
    elementwise there): the products are 6·N·H·V FLOPs under ``single_pass``, against
    10·N·H·V for the two kernels' plan, which recomputes the logits twice."""
    n, h, v = 256, 64, 2048
    hidden, weight, ids, mask, adv, old, ref = _inputs(25, b=2, t=n // 2, h=h, v=v)

    def flops(mode):
        def f(x, w):
            return fj.linear_grpo_loss(x, w, ids, mask, adv, impl="pallas", interpret=True, mode=mode,
                                       budget_mib=64.0)[0]  # fmt: skip

        cost = jax.jit(jax.value_and_grad(f, (0, 1))).lower(hidden, weight).compile().cost_analysis()
        return float((cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"])

    products = 6 * n * h * v
    assert products <= flops("single_pass") <= 1.3 * products


def test_single_pass_frozen_head_runs_no_dw_product():
    """A head that needs no gradient: no dW product (nor an f32 ``[V, H]`` carry) in the
    step, and dH as with a trained head."""
    hidden, weight, ids, mask, adv, old, ref = _inputs(26, dtype=jnp.bfloat16)  # an f32 [V, H] is then dW's

    def f(x, w):
        return fj.linear_grpo_loss(x, w, ids, mask, adv, impl="pallas", interpret=True, mode="single_pass",
                                   budget_mib=1.5)[0]  # fmt: skip

    frozen = jax.make_jaxpr(jax.grad(lambda x: f(x, jax.lax.stop_gradient(weight))))(hidden)
    trained = jax.make_jaxpr(jax.grad(f, (0, 1)))(hidden, weight)
    v, h = weight.shape
    assert f"f32[{v},{h}]" in str(trained) and f"f32[{v},{h}]" not in str(frozen)
    dh = jax.grad(lambda x: f(x, jax.lax.stop_gradient(weight)))(hidden)
    dh2, _ = jax.grad(f, (0, 1))(hidden, weight)
    assert _rel(dh, dh2) == 0.0


@pytest.mark.parametrize("layout", ["vh", "hv"])
def test_head_products_match_the_dots(layout):
    """``pallas/products.py`` (the stored plan's products on v7x): ``Z = X·Wᵀ`` and
    ``dX = dZ·W`` against XLA's dots, bf16 products with f32 accumulation, a ragged last
    vocabulary tile (V = 2500: tiles of 2048) and a ragged last row block (600 = 512 + 88)."""
    from flashloss.jax.pallas import products

    key = jax.random.split(jax.random.PRNGKey(7), 3)
    x = jax.random.normal(key[0], (200, 64)).astype(jnp.bfloat16)
    w = (jax.random.normal(key[1], (2500, 64)) * 0.3).astype(jnp.bfloat16)
    dz = (jax.random.normal(key[2], (600, 2500)) * 0.1).astype(jnp.bfloat16)
    head = w if layout == "vh" else w.T
    with target_chip("7x"):
        z = products.logits(x, head, layout, interpret=True)
        dx = products.hidden_grad(dz, head, layout, jnp.float32, interpret=True)
    want_z = jnp.dot(x, w.T, preferred_element_type=jnp.float32)
    want_dx = jnp.dot(dz, w, preferred_element_type=jnp.float32)
    assert z.dtype == jnp.float32 and z.shape == (200, 2500)
    assert _rel(z, want_z) <= 1e-6 and _rel(dx, want_dx) <= 1e-6
