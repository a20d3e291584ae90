"""Bad inputs raise ValueError naming the argument (never a panic, a NaN or a hang)."""

import pytest
import torch

import flashloss.torch as fl
from flashloss import liger


def batch(b=2, t=3, h=8, v=11):
    g = torch.Generator().manual_seed(0)
    return dict(
        hidden=torch.randn(b, t, h, generator=g),
        weight=torch.randn(v, h, generator=g),
        ids=torch.randint(0, v, (b, t), generator=g),
        mask=torch.ones(b, t, dtype=torch.bool),
        adv=torch.randn(b, generator=g),
    )


def grpo(d, **kw):
    return fl.linear_grpo_loss(d["hidden"], d["weight"], d["ids"], d["mask"], d["adv"], **kw)


def test_shape_mismatch_names_the_argument():
    d = batch()
    d["weight"] = torch.randn(11, 7)
    with pytest.raises(ValueError, match="`hidden`"):
        grpo(d)
    d = batch()
    d["adv"] = torch.randn(5)
    with pytest.raises(ValueError, match="`advantages`"):
        grpo(d)
    d = batch()
    with pytest.raises(ValueError, match="`completion_mask`"):
        fl.linear_grpo_loss(d["hidden"], d["weight"], d["ids"], d["mask"][:, :2], d["adv"])


def test_token_id_out_of_range():
    d = batch()
    d["ids"][1, 2] = 11
    with pytest.raises(ValueError, match="`completion_ids`: id 11"):
        grpo(d)


def test_nan_hidden_state():
    d = batch()
    d["hidden"][0, 1, 3] = float("nan")
    with pytest.raises(ValueError, match="`hidden`.*NaN"):
        grpo(d)


def test_wrong_dtypes():
    d = batch()
    d["hidden"] = d["hidden"].double()
    with pytest.raises(ValueError, match="`hidden`.*float64"):
        grpo(d)
    d = batch()
    with pytest.raises(ValueError, match="`completion_ids`.*integer"):
        fl.linear_grpo_loss(d["hidden"], d["weight"], d["ids"].float(), d["mask"], d["adv"])


def test_not_a_tensor_and_bad_options():
    d = batch()
    with pytest.raises(ValueError, match="`advantages`"):
        fl.linear_grpo_loss(d["hidden"], d["weight"], d["ids"], d["mask"], [1.0, 2.0])
    with pytest.raises(ValueError, match="loss_type"):
        grpo(d, loss_type="ppo")
    with pytest.raises(ValueError, match="`ref_per_token_logps`: required"):
        grpo(d, beta=0.1)
    with pytest.raises(ValueError, match="max_completion_length"):
        grpo(d, loss_type="dr_grpo")
    with pytest.raises(ValueError, match="budget_mib"):
        grpo(d, budget_mib=-1.0)
    with pytest.raises(ValueError, match="reduction"):
        fl.linear_cross_entropy(d["hidden"], d["weight"], d["ids"], reduction="avg")


def test_non_contiguous_inputs_are_made_contiguous():
    d = batch()
    wide = torch.randn(2, 3, 16)
    hidden = wide[:, :, ::2]
    assert not hidden.is_contiguous()
    a, _ = fl.linear_grpo_loss(hidden, d["weight"], d["ids"], d["mask"], d["adv"])
    b, _ = fl.linear_grpo_loss(hidden.contiguous(), d["weight"], d["ids"], d["mask"], d["adv"])
    assert a.item() == b.item()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cpu_and_cuda_mix():
    d = batch()
    with pytest.raises(ValueError, match="`weight` is on cuda"):
        fl.linear_grpo_loss(d["hidden"], d["weight"].cuda(), d["ids"], d["mask"], d["adv"])


def test_a_gradient_sum_beyond_f32_is_an_error_not_inf():
    # Every logit's gradient is in range (logits ±30, probabilities), but dH = dZ·W sums
    # two terms of 3e38 of the same sign: beyond f32. CE and GRPO both say so by row.
    # (hidden is a normal f32: at a subnormal 1e-38 the test failed when test_jax_policy.py
    # had run earlier in the same process, and passed alone; not traced further.)
    hidden = torch.full((1, 1, 1), 1e-37)
    weight = torch.tensor([[-3e38], [3e38]])
    ids = torch.zeros(1, 1, dtype=torch.long)
    hidden.requires_grad_(True)
    with pytest.raises(ValueError, match="dhidden"):
        fl.linear_cross_entropy(hidden, weight, ids).backward()
    with pytest.raises(ValueError, match="dhidden"):
        fl.linear_grpo_loss(hidden, weight, ids, torch.ones(1, 1, dtype=torch.bool), torch.tensor([-1.0]))[0].backward()


def test_only_the_loss_types_parameters_are_validated():
    """A loss type's unused parameters are not checked (Liger's tests pass
    sapo_temperature_neg=False to bnpo); the error names the argument that is wrong."""
    h, w, ids, mask, adv = (torch.randn(2, 3, 4), torch.randn(5, 4), torch.zeros(2, 3, dtype=torch.long),
                            torch.ones(2, 3), torch.ones(2))  # fmt: skip
    loss, _ = fl.linear_grpo_loss(h, w, ids, mask, adv, loss_type="bnpo", sapo_temperature_neg=False,
                                  vespo_lambda_neg=-1.0)  # fmt: skip
    assert torch.isfinite(loss)
    liger.triton_grpo_loss(torch.randn(2, 4, 5), None, None, ids, adv, mask, beta=0.0, loss_type="cispo", eps_low=3.0)
    for kw, name in ((dict(sapo_temperature_neg=0.0), "sapo_temperature_neg"),
                     (dict(sapo_temperature_pos=-1.0), "sapo_temperature_pos")):  # fmt: skip
        with pytest.raises(ValueError, match=f"`{name}`: must be > 0"):
            fl.linear_grpo_loss(h, w, ids, mask, adv, loss_type="sapo", **kw)
