"""flashloss.torch.linear_grpo_loss against TRL's formulas in float64 (trl_reference.py):
loss, per-token logp and entropy, and the gradients of hidden, weight and bias, at the
spec's tolerances (f32: loss 1e-5 relative, gradients 1e-4 of the largest entry; bf16:
1e-3 and 1e-2 against the reference on the same rounded inputs)."""

import itertools

import pytest
import torch

import flashloss.torch as fl
from flashloss import liger
from trl_reference import grpo_reference

LOSS_LEVELS = [
    (lt, lvl)
    for lt in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
    for lvl in ("token", "sequence")
    if not (lt == "vespo" and lvl == "sequence")
]


def make_batch(seed, b=3, t=5, h=16, v=37, dtype=torch.float32, bias=True, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(b, t, h, generator=g) * scale).to(dtype)
    weight = (torch.randn(v, h, generator=g) / h**0.5).to(dtype)
    bvec = (torch.randn(v, generator=g) * 0.1).to(dtype) if bias else None
    ids = torch.randint(0, v, (b, t), generator=g)
    mask = torch.rand(b, t, generator=g) > 0.25
    mask[0] = True
    mask[-1] = False  # a fully masked sequence
    adv = torch.randn(b, generator=g)
    return dict(hidden=hidden, weight=weight, bias=bvec, ids=ids, mask=mask, adv=adv, g=g)


def policy_logps(d, temperature, noise, g):
    """Old/reference log-probs near the current policy's (so ratios straddle the clips)."""
    with torch.no_grad():
        _, logp, _ = grpo_reference(
            d["hidden"].double(), d["weight"].double(), None if d["bias"] is None else d["bias"].double(),
            d["ids"], d["mask"], d["adv"], temperature=temperature,
        )  # fmt: skip
    return (logp + noise * torch.randn(logp.shape, generator=g, dtype=torch.float64)).float()


def check(d, tol_loss=1e-5, tol_grad=1e-4, **kw):
    leaves = [
        x.detach().double().requires_grad_() if x is not None else None for x in (d["hidden"], d["weight"], d["bias"])
    ]
    ref_kw = {k: v for k, v in kw.items() if k not in ("budget_mib", "mode")}
    extra = dict(
        old=kw.pop("old_per_token_logps", None),
        ref=kw.pop("ref_per_token_logps", None),
        rho=kw.pop("importance_sampling_ratio", None),
    )
    for k in ("old_per_token_logps", "ref_per_token_logps", "importance_sampling_ratio"):
        ref_kw.pop(k, None)
    masks = {k: kw.pop(k) for k in ("policy_mask", "entropy_mask") if k in kw}
    ref_loss, ref_logp, ref_ent = grpo_reference(*leaves, d["ids"], d["mask"], d["adv"], **extra, **ref_kw)
    ref_loss.backward()

    inputs = [
        x.detach().clone().requires_grad_() if x is not None else None for x in (d["hidden"], d["weight"], d["bias"])
    ]
    loss, out = fl.linear_grpo_loss(
        inputs[0], inputs[1], d["ids"], d["mask"], d["adv"], bias=inputs[2],
        old_per_token_logps=extra["old"], ref_per_token_logps=extra["ref"],
        importance_sampling_ratio=extra["rho"], **masks, **kw,
    )  # fmt: skip
    loss.backward()
    assert torch.isfinite(loss)
    assert abs(loss.item() - ref_loss.item()) <= tol_loss * max(1.0, abs(ref_loss.item())), (
        loss.item(),
        ref_loss.item(),
    )
    m = d["mask"]
    assert torch.allclose(out.logp[m].double(), ref_logp[m], rtol=tol_loss * 10, atol=tol_loss * 10)
    assert torch.allclose(out.entropy[m].double(), ref_ent[m], rtol=tol_loss * 10, atol=tol_loss * 10)
    for name, ours, leaf in zip(("hidden", "weight", "bias"), inputs, leaves):
        if leaf is None:
            continue
        assert ours.grad is not None and ours.grad.dtype == ours.dtype, name
        scale = leaf.grad.abs().max().item()
        err = (ours.grad.double() - leaf.grad).abs().max().item()
        assert err <= tol_grad * scale + 1e-6, (name, err, scale)
    return loss, out


@pytest.mark.parametrize("loss_type,level", LOSS_LEVELS)
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_every_loss_type_and_level(loss_type, level, beta):
    d = make_batch(hash((loss_type, level, beta)) % 1000)
    temperature = 0.7
    kw = dict(
        loss_type=loss_type,
        importance_sampling_level=level,
        beta=beta,
        temperature=temperature,
        old_per_token_logps=policy_logps(d, temperature, 0.3, d["g"]),
        max_completion_length=8,
        epsilon_high=5.0 if loss_type == "cispo" else 0.28,
    )
    if beta:
        kw["ref_per_token_logps"] = policy_logps(d, temperature, 0.2, d["g"])
    check(d, **kw)


@pytest.mark.parametrize("bias_correction", [False, True])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_kl_with_and_without_bias_correction(bias_correction, level):
    d = make_batch(11)
    check(
        d,
        loss_type="grpo",
        importance_sampling_level=level,
        beta=0.1,
        use_bias_correction_kl=bias_correction,
        old_per_token_logps=policy_logps(d, 1.0, 0.3, d["g"]),
        ref_per_token_logps=policy_logps(d, 1.0, 0.3, d["g"]),
    )


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "cispo", "luspo"])
def test_entropy_bonus_is_a_token_mean(loss_type):
    d = make_batch(12)
    check(d, loss_type=loss_type, entropy_coef=0.05, importance_sampling_level="token")


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "cispo", "sapo"])
def test_delta_sampler_ratio_and_num_items(loss_type):
    d = make_batch(13)
    rho = torch.rand(d["ids"].shape, generator=d["g"]) + 0.5
    kw = dict(
        loss_type=loss_type,
        old_per_token_logps=policy_logps(d, 1.0, 0.4, d["g"]),
        importance_sampling_ratio=rho,
        num_items_in_batch=17.0,
    )
    if loss_type in ("grpo", "bnpo", "dapo"):
        kw["delta"] = 1.1
    check(d, **kw)


def test_vespo_folds_the_sampler_ratio_into_phi():
    d = make_batch(14)
    rho = torch.rand(d["ids"].shape, generator=d["g"]) + 0.5
    check(d, loss_type="vespo", old_per_token_logps=policy_logps(d, 1.0, 0.2, d["g"]), importance_sampling_ratio=rho)


@pytest.mark.parametrize("mode,budget", [("auto", 64.0), ("two_pass", 6.01), ("single_pass", 6.01)])
def test_modes_and_small_budgets_agree(mode, budget):
    d = make_batch(15, b=4, t=9, h=24, v=301)
    check(d, loss_type="bnpo", mode=mode, budget_mib=budget, old_per_token_logps=policy_logps(d, 1.0, 0.3, d["g"]))


def test_bf16_inputs():
    d = make_batch(16, dtype=torch.bfloat16)
    check(d, tol_loss=1e-3, tol_grad=1e-2, loss_type="grpo", beta=0.04,
          ref_per_token_logps=policy_logps(d, 1.0, 0.2, d["g"]))  # fmt: skip


def _has_avx512_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "avx512_bf16" in f.read().split()
    except OSError:
        return False


def test_bf16_products_chosen_by_the_environment(monkeypatch):
    """``FLASHLOSS_BF16_PRODUCTS`` picks the CPU's products on a bf16 head: ``widened``
    and ``avx512bf16`` (on a CPU with AVX512-BF16) both pass the bf16 check and give
    different gradients (``dZ`` rounded to bf16 or not); another value is a ValueError
    naming the variable."""
    d = make_batch(16, dtype=torch.bfloat16, t=9, v=301)
    grads = {}
    choices = ["widened"] + (["avx512bf16"] if _has_avx512_bf16() else [])
    for choice in choices:
        monkeypatch.setenv("FLASHLOSS_BF16_PRODUCTS", choice)
        check(d, tol_loss=1e-3, tol_grad=1e-2, loss_type="grpo", beta=0.04,
              ref_per_token_logps=policy_logps(d, 1.0, 0.2, d["g"]))  # fmt: skip
        hidden = d["hidden"].detach().clone().requires_grad_()
        fl.linear_grpo_loss(hidden, d["weight"], d["ids"], d["mask"], d["adv"])[0].backward()
        grads[choice] = hidden.grad
    if len(grads) == 2:
        assert not torch.equal(grads["widened"], grads["avx512bf16"])
    else:
        print("skipped: bf16 products on avx512bf16 (this CPU has no AVX512-BF16)")
    monkeypatch.setenv("FLASHLOSS_BF16_PRODUCTS", "amx")
    with pytest.raises(ValueError, match="FLASHLOSS_BF16_PRODUCTS"):
        fl.linear_grpo_loss(d["hidden"], d["weight"], d["ids"], d["mask"], d["adv"])


def test_cpu_bf16_products_says_which_path_runs(monkeypatch):
    """``flashloss.cpu_bf16_products()`` names the path ``auto`` runs and why: measured
    once per process (the same answer twice, the 1.1x rule on its own rates), the
    environment variable where set, an explicit setting as asked; a bf16 head under
    ``auto`` gives the gradients of the path it names, bitwise."""
    import flashloss

    monkeypatch.delenv("FLASHLOSS_BF16_PRODUCTS", raising=False)
    auto = flashloss.cpu_bf16_products()
    assert auto == flashloss.cpu_bf16_products()
    if _has_avx512_bf16():
        assert auto["by"] == "measured", auto
        r = auto["rates"]
        assert r["widened"] > 0 and r["avx512bf16"] > 0, auto
        assert auto["runs"] == ("avx512bf16" if r["avx512bf16"] >= 1.1 * r["widened"] else "widened")
    else:
        assert auto == {"runs": "widened", "by": "no_avx512bf16", "rates": None}
    assert flashloss.cpu_bf16_products("widened") == {"runs": "widened", "by": "option", "rates": None}
    d = make_batch(5, dtype=torch.bfloat16, t=7, v=97)

    def dhidden():
        hidden = d["hidden"].detach().clone().requires_grad_()
        fl.linear_grpo_loss(hidden, d["weight"], d["ids"], d["mask"], d["adv"])[0].backward()
        return hidden.grad

    under_auto = dhidden()
    monkeypatch.setenv("FLASHLOSS_BF16_PRODUCTS", auto["runs"])
    assert flashloss.cpu_bf16_products() == {"runs": auto["runs"], "by": "environment", "rates": None}
    assert torch.equal(under_auto, dhidden())
    with pytest.raises(ValueError, match="bf16_products"):
        flashloss.cpu_bf16_products("amx")
    monkeypatch.setenv("FLASHLOSS_BF16_PRODUCTS", "amx")
    with pytest.raises(ValueError, match="FLASHLOSS_BF16_PRODUCTS"):
        flashloss.cpu_bf16_products()


def test_hidden_as_rows_and_token_advantages():
    d = make_batch(17, bias=False)
    d["adv"] = torch.randn(d["ids"].shape, generator=d["g"])
    check(d, loss_type="dr_grpo", max_completion_length=5)
    b, t, h = d["hidden"].shape
    loss, _ = fl.linear_grpo_loss(d["hidden"].reshape(b * t, h), d["weight"], d["ids"], d["mask"], d["adv"],
                                  loss_type="dr_grpo", max_completion_length=5)  # fmt: skip
    loss2, _ = fl.linear_grpo_loss(d["hidden"], d["weight"], d["ids"], d["mask"], d["adv"],
                                   loss_type="dr_grpo", max_completion_length=5)  # fmt: skip
    assert loss.item() == loss2.item()


def test_upstream_gradient_scales_the_gradients():
    d = make_batch(18)
    w1 = d["weight"].clone().requires_grad_()
    fl.linear_grpo_loss(d["hidden"], w1, d["ids"], d["mask"], d["adv"])[0].backward()
    w3 = d["weight"].clone().requires_grad_()
    (3.0 * fl.linear_grpo_loss(d["hidden"], w3, d["ids"], d["mask"], d["adv"])[0]).backward()
    assert torch.allclose(w3.grad, 3.0 * w1.grad, rtol=1e-6, atol=0)
    assert w1.grad.abs().max() > 0


def test_backward_through_a_kept_graph_adds_the_gradients_each_time():
    """At ``grad == 1`` the op hands autograd its saved gradients without a copy; through a
    kept graph every backward must still add them once more (never alias ``.grad``)."""
    d = make_batch(21)
    w = d["weight"].clone().requires_grad_()
    loss, _ = fl.linear_grpo_loss(d["hidden"], w, d["ids"], d["mask"], d["adv"])
    loss.backward(retain_graph=True)
    once = w.grad.clone()
    loss.backward(retain_graph=True)
    loss.backward()
    assert once.abs().max() > 0
    assert torch.allclose(w.grad, 3 * once, rtol=1e-6, atol=0)


def test_metrics_are_trl_masked_means():
    d = make_batch(19)
    old = policy_logps(d, 1.0, 0.5, d["g"])
    loss, out = fl.linear_grpo_loss(d["hidden"], d["weight"], d["ids"], d["mask"], d["adv"],
                                    old_per_token_logps=old, loss_type="grpo")  # fmt: skip
    m = d["mask"]
    ratio = torch.exp(out.logp.double() - old.double())
    adv = d["adv"].double().unsqueeze(1).expand_as(ratio)
    low = ((ratio < 0.8) & (adv < 0))[m].double().mean().item()
    high = ((ratio > 1.2) & (adv > 0))[m].double().mean().item()
    assert out.metrics["clip_ratio/low_mean"] == pytest.approx(low, abs=1e-12)
    assert out.metrics["clip_ratio/high_mean"] == pytest.approx(high, abs=1e-12)
    assert out.metrics["entropy"] == pytest.approx(out.entropy[m].double().mean().item(), rel=1e-5)
    assert low + high > 0  # the noise is large enough that some tokens clip


def test_liger_drop_in_module():
    d = make_batch(20)
    old = policy_logps(d, 1.0, 0.3, d["g"])
    ref = policy_logps(d, 1.0, 0.3, d["g"])
    module = liger.LigerFusedLinearGRPOLoss(beta=0.04, loss_type="bnpo", use_bias_correction_kl=False)
    b, t, h = d["hidden"].shape
    loss, metrics = module(d["hidden"].reshape(b * t, h), d["weight"], d["ids"], d["mask"].long(), d["adv"],
                           ref_per_token_logps=ref, old_per_token_logps=old)  # fmt: skip
    ref_loss, _, _ = grpo_reference(d["hidden"], d["weight"], None, d["ids"], d["mask"], d["adv"], old=old, ref=ref,
                                    loss_type="bnpo", beta=0.04, use_bias_correction_kl=False)  # fmt: skip
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
    assert len(metrics) == 2 and all(torch.isfinite(x) for x in metrics)


def test_float64_gradcheck_of_the_f32_kernel_on_a_tiny_shape():
    """Central differences of the float64 reference agree with the kernel's gradient (old
    log-probs are a fixed tensor here, so the ratio moves with the input)."""
    d = make_batch(21, b=2, t=3, h=4, v=5)
    hidden = d["hidden"].double()
    old = policy_logps(d, 1.0, 0.1, d["g"])
    loss, _ = fl.linear_grpo_loss(d["hidden"].requires_grad_(), d["weight"], d["ids"], d["mask"], d["adv"],
                                  old_per_token_logps=old, loss_type="grpo", entropy_coef=0.1)  # fmt: skip
    loss.backward()
    eps = 1e-6
    checked = []
    for idx in itertools.islice(itertools.product(range(2), range(3), range(4)), 0, None, 5):
        plus, minus = hidden.clone(), hidden.clone()
        plus[idx] += eps
        minus[idx] -= eps
        f = lambda x: grpo_reference(x, d["weight"], None, d["ids"], d["mask"], d["adv"], old=old,  # noqa: E731
                                     loss_type="grpo", entropy_coef=0.1)[0].item()  # fmt: skip
        fd = (f(plus) - f(minus)) / (2 * eps)
        assert abs(d["hidden"].grad[idx].item() - fd) <= 1e-4 * max(0.1, abs(fd)), (idx, fd)
        checked.append(abs(fd))
    assert max(checked) > 1e-3  # the differences see a real gradient


@pytest.mark.parametrize(
    "loss_type,level", [("grpo", "token"), ("dapo", "sequence"), ("sapo", "token"), ("vespo", "token")]
)
def test_policy_and_entropy_masks(loss_type, level):
    """TRL's off-policy mask and top-entropy mask multiply the policy loss (not the KL);
    the entropy bonus is the mean over completion_mask * entropy_mask."""
    d = make_batch(22)
    policy_mask = torch.rand(d["ids"].shape, generator=d["g"]) > 0.3
    entropy_mask = torch.rand(d["ids"].shape, generator=d["g"]) > 0.4
    entropy_mask[0] = False  # a sequence whose tokens all leave the entropy bonus
    check(
        d,
        loss_type=loss_type,
        importance_sampling_level=level,
        beta=0.04,
        entropy_coef=0.03,
        old_per_token_logps=policy_logps(d, 1.0, 0.3, d["g"]),
        ref_per_token_logps=policy_logps(d, 1.0, 0.3, d["g"]),
        policy_mask=policy_mask,
        entropy_mask=entropy_mask,
    )


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "vespo"])
@pytest.mark.parametrize("shape", ["b", "b1", "bt"])
def test_sampler_ratio_shapes(loss_type, shape):
    """TRL's vLLM importance-sampling ratio is [B, T] (token_* modes) or [B, 1]
    (sequence_* modes); [B] is accepted too (issue 33)."""
    d = make_batch(23)
    b, t = d["ids"].shape
    rho = {"b": torch.rand(b, generator=d["g"]) + 0.5, "b1": torch.rand(b, 1, generator=d["g"]) + 0.5,
           "bt": torch.rand(b, t, generator=d["g"]) + 0.5}[shape]  # fmt: skip
    old = policy_logps(d, 1.0, 0.3, d["g"])
    check(d, loss_type=loss_type, old_per_token_logps=old, importance_sampling_ratio=rho)


def test_sampler_ratio_of_another_shape_names_it():
    d = make_batch(24)
    with pytest.raises(ValueError, match="argument `importance_sampling_ratio`: expected shape"):
        fl.linear_grpo_loss(d["hidden"], d["weight"], d["ids"], d["mask"], d["adv"],
                            importance_sampling_ratio=torch.ones(3, 2))  # fmt: skip


@pytest.mark.parametrize("per_token_advantages", [False, True])
def test_sequence_level_clip_metrics_are_trl_global_masked_means(per_token_advantages):
    """TRL 1.16's global_masked_mean: at sequence level with per-sequence advantages the
    clip flags are [B, 1] and averaged over the B sequences (a fully masked sequence has
    ratio 1); with [B, T] advantages they are token means (issue 33)."""
    d = make_batch(25, b=6, t=7)
    d["mask"][1, 2:] = False  # sequences of different lengths: token and sequence means differ
    old = policy_logps(d, 1.0, 0.1, d["g"]) - torch.linspace(-0.6, 0.6, 6)[:, None]
    adv = d["adv"].unsqueeze(1).expand(-1, 7).contiguous() if per_token_advantages else d["adv"]
    _, out = fl.linear_grpo_loss(d["hidden"], d["weight"], d["ids"], d["mask"], adv, old_per_token_logps=old,
                                 loss_type="grpo", importance_sampling_level="sequence")  # fmt: skip
    m = d["mask"].double()
    log_ratio = ((out.logp.double() - old.double()) * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)
    coef = torch.exp(log_ratio)  # [B, 1]
    a = adv.double() if per_token_advantages else adv.double().unsqueeze(1)
    low, high = (coef < 0.8) & (a < 0), (coef > 1.2) & (a > 0)
    region = (low | high).double().expand(-1, 7)
    token_mean = ((region * m).sum() / m.sum()).item()
    for name, flags in (("low", low), ("high", high), ("region", low | high)):
        x = flags.double()
        want = (x.expand(-1, 7) * m).sum() / m.sum() if per_token_advantages else x.sum() / x.shape[0]
        assert out.metrics[f"clip_ratio/{name}_mean"].item() == pytest.approx(want.item(), abs=1e-7), name  # float32
    assert 0 < token_mean < 1  # some sequences clip, some not
    if not per_token_advantages:
        assert out.metrics["clip_ratio/region_mean"].item() != pytest.approx(token_mean, abs=1e-3)


def test_liger_module_reference_head_and_kl_metric():
    """As Liger's LigerFusedLinearGRPOLoss: ref_weight without ref_input is ignored; a
    reference head (ref_input, ref_weight, ref_bias) gives the reference log-probs; with
    beta != 0 and no reference model the KL metric is still returned (0) (issue 33)."""
    d = make_batch(26)
    old = policy_logps(d, 1.0, 0.3, d["g"])
    ref = policy_logps(d, 1.0, 0.3, d["g"])
    args = (d["hidden"], d["weight"], d["ids"], d["mask"], d["adv"])
    module = liger.LigerFusedLinearGRPOLoss(beta=0.04, loss_type="grpo")
    base, _ = module(*args, ref_per_token_logps=ref, old_per_token_logps=old)
    ignored, metrics = module(*args, ref_per_token_logps=ref, old_per_token_logps=old, ref_weight=d["weight"] * 2)
    assert ignored.item() == base.item() and len(metrics) == 2

    ref_hidden = d["hidden"] + 0.1 * torch.randn(d["hidden"].shape, generator=d["g"])
    ref_bias = torch.randn(d["weight"].shape[0], generator=d["g"]) * 0.1
    head, _ = module(*args, old_per_token_logps=old, ref_input=ref_hidden, ref_weight=d["weight"], ref_bias=ref_bias)
    _, ref_logp, _ = grpo_reference(ref_hidden, d["weight"], ref_bias, d["ids"], d["mask"], d["adv"])
    want, _, _ = grpo_reference(d["hidden"], d["weight"], None, d["ids"], d["mask"], d["adv"], old=old,
                                ref=ref_logp, loss_type="grpo", beta=0.04, use_bias_correction_kl=False)  # fmt: skip
    assert head.item() == pytest.approx(want.item(), rel=1e-5)

    no_ref = liger.LigerFusedLinearGRPOLoss(beta=0.04, use_ref_model=False, loss_type="grpo")
    loss, metrics = no_ref(*args, old_per_token_logps=old, ref_per_token_logps=ref)
    unregularized, _ = liger.LigerFusedLinearGRPOLoss(beta=0.0, loss_type="grpo")(*args, old_per_token_logps=old)
    assert len(metrics) == 2 and metrics[0].item() == 0.0
    assert loss.item() == unregularized.item()


@pytest.mark.parametrize("loss_type,level", [("grpo", "token"), ("dapo", "sequence"), ("vespo", "token")])
def test_f16_inputs(loss_type, level):
    """float16 heads (V100/T4; issue 33) are widened exactly as bf16 ones: f32 statistics
    on the f16 values, so the loss keeps the f32 bound; gradients come back in float16."""
    d = make_batch(27, dtype=torch.float16)
    check(d, tol_loss=1e-5, tol_grad=2e-3, loss_type=loss_type, importance_sampling_level=level, beta=0.04,
          old_per_token_logps=policy_logps(d, 1.0, 0.3, d["g"]),
          ref_per_token_logps=policy_logps(d, 1.0, 0.2, d["g"]))  # fmt: skip


def test_f16_hidden_with_an_f32_head_is_cast_as_autocast_would():
    d = make_batch(28)
    h = d["hidden"].half().requires_grad_()
    w = d["weight"].clone().requires_grad_()
    loss, _ = fl.linear_grpo_loss(h, w, d["ids"], d["mask"], d["adv"], loss_type="grpo")
    loss.backward()
    assert h.grad.dtype == torch.float16 and w.grad.dtype == torch.float32
    want, _, _ = grpo_reference(h.detach(), w.detach().half(), None, d["ids"], d["mask"], d["adv"], loss_type="grpo")
    assert loss.item() == pytest.approx(want.item(), rel=1e-5, abs=1e-7)
