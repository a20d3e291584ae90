"""flashloss.jax._policy (TRL's GRPO loss and the cross-entropy above the per-row
statistics, in plain JAX) against the Rust policy stage (the FFI handler
``flashloss_grpo_policy``) and the fused cross-entropy: loss, ``jax.grad`` vs the
handler's dlogp / dentropy, KL, metrics, for every loss type, level, β, bias-corrected
KL, delta, entropy bonus and normalizer; the per-row pieces (token_loss, weights) add up
to the loss; extreme inputs give no NaN; bad arguments raise the FFI path's message at
trace time."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
fj = pytest.importorskip("flashloss.jax")

from jax.extend import core as jex_core  # noqa: E402

from flashloss._spec import LOSS_TYPES  # noqa: E402
from flashloss.jax import _policy as P  # noqa: E402
from flashloss.jax.ffi import vocab as _vocab  # noqa: E402

LEVELS = ("token", "sequence")
# (B, T, kind): kind "ragged" random lengths, "hole" sequence 0 fully masked, "none" every token masked out.
SHAPES = ((1, 1, "ragged"), (1, 7, "ragged"), (3, 5, "ragged"), (4, 9, "hole"), (2, 3, "none"), (5, 4, "hole"))


def _case(b, t, kind, seed, spread=0.3, per_token_adv=False, on_policy=False):
    rng = np.random.default_rng(seed)
    logp = -np.abs(rng.standard_normal((b, t))) * 2.0
    ent = np.abs(rng.standard_normal((b, t))) * 2.0
    mask = np.arange(t)[None, :] < rng.integers(1, t + 1, b)[:, None]
    if kind == "hole":
        mask[0] = False
    if kind == "none":
        mask[:] = False
    adv = rng.standard_normal((b, t) if per_token_adv else b)
    old = None if on_policy else logp + spread * rng.standard_normal((b, t))
    ref = logp + spread * rng.standard_normal((b, t))
    # Masked tokens hold values that must not matter.
    logp = np.where(mask, logp, -1e4)
    f32 = [None if x is None else jnp.asarray(x, jnp.float32) for x in (logp, ent, adv, old, ref)]
    return f32[0], f32[1], jnp.asarray(mask), f32[2], f32[3], f32[4]


def _args(loss_type, level="token", beta=0.0, bias_kl=True, **kw):
    eps_high = kw.pop("epsilon_high", 5.0 if loss_type == "cispo" else None)
    mcl = kw.pop("max_completion_length", 6)
    return P.GrpoArgs(loss_type=loss_type, importance_sampling_level=level, beta=beta, use_bias_correction_kl=bias_kl,
                      epsilon_high=eps_high, max_completion_length=mcl, **kw)  # fmt: skip


def _valid(args):
    try:
        args.validate()
    except ValueError:
        return False
    return True


def _ffi(case, args):
    logp, ent, mask, adv, old, ref = case
    ids = jnp.zeros(mask.shape, jnp.int32)
    loss, dlogp, dent, kl, metrics = _vocab._policy(logp, ent, ids, mask, adv, old, ref, args.config_json(), 8)
    return [np.asarray(x, np.float64) for x in (loss, dlogp, dent, kl, metrics)]


def _ours(case, args):
    logp, ent, mask, adv, old, ref = case

    def f(lp, en):
        loss, kl, metrics = P.grpo_policy_loss(lp, en, mask, adv, old, ref, args)
        return loss, (kl, metrics)

    (loss, (kl, metrics)), (dlogp, dent) = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(logp, ent)
    return [np.asarray(x, np.float64) for x in (loss, dlogp, dent, kl, metrics)]


def _close_grad(got, want, rel=1e-4, atol=1e-6):
    scale = float(np.abs(want).max()) if want.size else 0.0
    err = float(np.abs(got - want).max()) if want.size else 0.0
    return err <= rel * scale + atol, err, scale


def _check(got, want, what, loss_rel=1e-5, grad_rel=1e-4):
    loss, dlogp, dent, kl, metrics = got
    r_loss, r_dlogp, r_dent, r_kl, r_metrics = want
    assert np.isfinite([loss, *metrics]).all() and np.isfinite(dlogp).all() and np.isfinite(dent).all(), what
    assert abs(loss - r_loss) <= loss_rel * abs(r_loss) + 1e-6, (what, loss, r_loss)
    for name, g, w in (("dlogp", dlogp, r_dlogp), ("dentropy", dent, r_dent), ("kl", kl, r_kl)):
        ok, err, scale = _close_grad(g, w, grad_rel)
        assert ok, (what, name, err, scale)
    np.testing.assert_allclose(metrics, r_metrics, rtol=1e-5, atol=1e-6, err_msg=str(what))


def _configs():
    """Every loss type x level x β x bias-corrected KL the Rust config accepts, with the
    options (delta, entropy_coef, num_items_in_batch, max_completion_length) sampled."""
    out = []
    for i, (lt, level, beta, bias_kl) in enumerate(itertools.product(LOSS_TYPES, LEVELS, (0.0, 0.04), (True, False))):
        kw = {}
        if i % 3 == 0:
            kw["entropy_coef"] = 0.01
        if i % 4 == 1 and lt in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
            kw["delta"] = 1.5
        if i % 2 == 0 and lt in ("dapo", "cispo", "vespo"):
            kw["num_items_in_batch"] = 11.0
        if lt == "dr_grpo":
            kw["max_completion_length"] = 3 + i % 7
        args = _args(lt, level, beta, bias_kl, **kw)
        if _valid(args):
            out.append(args)
    return out


CONFIGS = _configs()


def test_every_loss_type_and_level_is_covered():
    seen = {(a.loss_type, a.importance_sampling_level, a.beta > 0, a.use_bias_correction_kl) for a in CONFIGS}
    assert len(seen) == 8 * 2 * 2 * 2 - 4  # vespo has no sequence level
    assert any(a.delta for a in CONFIGS) and any(a.entropy_coef for a in CONFIGS)
    assert any(a.num_items_in_batch for a in CONFIGS)


@pytest.mark.parametrize("k", range(len(CONFIGS)), ids=lambda k: "-".join(map(str, _cfg_id(CONFIGS[k]))))
def test_matches_the_rust_policy_stage(k):
    args = CONFIGS[k]
    for j in (k % len(SHAPES), (k + 3) % len(SHAPES)):
        b, t, kind = SHAPES[j]
        case = _case(b, t, kind, seed=100 * k + j, per_token_adv=(k % 5 == 2), on_policy=(k % 7 == 3))
        _check(_ours(case, args), _ffi(case, args), (args, SHAPES[j]))


def _cfg_id(a):
    return (a.loss_type, a.importance_sampling_level[:3], a.beta, int(a.use_bias_correction_kl))


def test_far_ratios_and_reference_within_f32_match_the_rust_stage():
    # Log-ratios and reference gaps of ±60 nats: every value stays inside f32, where the Rust
    # stage returns a result (beyond it raises OutOfRange).
    far = (_args("dapo", beta=0.04), _args("grpo", "sequence", beta=0.04), _args("sapo", beta=0.04),
           _args("cispo", beta=0.04, bias_kl=False), _args("vespo", beta=0.04), _args("bnpo", delta=2.0))  # fmt: skip
    for args in far:
        logp, ent, mask, adv, old, ref = _case(3, 6, "ragged", seed=7)
        rng = np.random.default_rng(8)
        old = logp - jnp.asarray(rng.choice([-60.0, -5.0, 0.0, 5.0, 60.0], (3, 6)), jnp.float32)
        ref = logp + jnp.asarray(rng.choice([-60.0, -5.0, 0.0, 5.0, 60.0], (3, 6)), jnp.float32)
        case = (logp, ent, mask, adv, old, ref)
        _check(_ours(case, args), _ffi(case, args), args)


def test_a_perturbed_loss_fails_the_comparison():
    """The gate can fail: cispo without its stop-gradient on the capped ratio, and the
    clipped loss with the ratio's gradient kept outside the clip range, are caught."""
    case = _case(3, 5, "ragged", seed=3, spread=1.0)
    args = _args("cispo")
    want = _ffi(case, args)
    logp, ent, mask, adv, old, ref = case
    w = P.reduction_weights(mask, args)

    def wrong(lp):
        r = jnp.exp(lp - old)
        return jnp.sum(w * -jnp.minimum(r, args.eps_high) * adv[:, None] * lp)

    g = np.asarray(jax.grad(wrong)(logp), np.float64)
    assert not _close_grad(g, want[1])[0]
    args = _args("dapo")
    want = _ffi(case, args)
    w = P.reduction_weights(mask, args)

    def unclipped(lp):
        r = jnp.exp(lp - old)
        return jnp.sum(w * -r * adv[:, None])

    g = np.asarray(jax.grad(unclipped)(logp), np.float64)
    assert not _close_grad(g, want[1])[0]


def test_token_loss_and_weights_add_up_to_the_loss():
    token_local = [a for a in CONFIGS if P.is_token_local(a)]
    assert {a.loss_type for a in token_local} == set(LOSS_TYPES) - {"vespo"}
    assert not any(P.is_token_local(a) for a in CONFIGS if a.loss_type == "vespo" or a.sequence_level)
    for k, args in list(enumerate(token_local))[::2]:
        b, t, kind = SHAPES[k % len(SHAPES)]
        logp, ent, mask, adv, old, ref = _case(b, t, kind, seed=k, on_policy=(k % 3 == 0))
        logp = jnp.where(mask, logp, -2.0)  # the pieces read every token: keep masked ones finite

        def whole(lp, en):
            return P.grpo_policy_loss(lp, en, mask, adv, old, ref, args)[0]

        def pieces(lp, en):
            ell = P.token_loss(lp, en, old, ref, adv[:, None], args)
            return jnp.sum(P.reduction_weights(mask, args) * ell) + jnp.sum(P.entropy_weights(mask, args) * en)

        both = jax.jit(lambda lp, en: [jax.value_and_grad(f, argnums=(0, 1))(lp, en) for f in (whole, pieces)])
        (l1, g1), (l2, g2) = both(logp, ent)
        assert abs(float(l1) - float(l2)) <= 1e-6 * max(1.0, abs(float(l1))), (args, l1, l2)
        for a, c in zip(g1, g2):
            np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-6, atol=1e-9, err_msg=str(args))


def test_the_sequence_and_vespo_paths_go_through_token_loss():
    # grpo_policy_loss = Σ w·token_loss(log_ratio=mean log-ratio / vespo_log_w) + bonus, also off token-local.
    for args in (_args("grpo", "sequence", beta=0.04), _args("vespo", beta=0.04, entropy_coef=0.01)):
        logp, ent, mask, adv, old, ref = _case(3, 5, "ragged", seed=5)
        m = mask.astype(jnp.float32)
        lr = jnp.sum((logp - old) * m, -1, keepdims=True) / jnp.maximum(m.sum(-1, keepdims=True), 1.0)
        kw = {"log_ratio": jnp.broadcast_to(lr, logp.shape)} if args.sequence_level else {}
        if args.loss_type == "vespo":
            kw["vespo_log_w"] = P.vespo_log_weight(logp - old, mask)
        ell = P.token_loss(logp, ent, old, ref, adv[:, None], args, **kw)
        got = jnp.sum(P.reduction_weights(mask, args) * ell) + jnp.sum(P.entropy_weights(mask, args) * ent)
        want = P.grpo_policy_loss(logp, ent, mask, adv, old, ref, args)[0]
        assert abs(float(got) - float(want)) <= 1e-6 * max(1.0, abs(float(want)))


_NOT_ELEMENTWISE = {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin", "gather", "scatter",
                    "scatter-add", "scatter_add", "sort", "cumsum", "cumprod", "cummax", "dot_general", "reduce_and",
                    "reduce_or", "transpose", "reshape", "dynamic_slice", "concatenate"}  # fmt: skip


def _primitives(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn.primitive.name
        for sub in jex_core.jaxprs_in_params(eqn.params):
            yield from _primitives(sub)


def test_token_loss_is_elementwise():
    for args in [a for a in CONFIGS if P.is_token_local(a)]:
        x = jnp.float32(-1.3)
        for f in (lambda lp, o, q, a: P.token_loss(lp, None, o, q, a, args),
                  lambda lp, o, q, a: jax.grad(lambda y: P.token_loss(y, None, o, q, a, args))(lp),
                  lambda lp, o, q, a: P.token_kl(lp, o, q, args),
                  lambda lp, o, q, a: P.clip_flags(lp, o, a, args)):  # fmt: skip
            prims = set(_primitives(jax.make_jaxpr(f)(x, x, x, x).jaxpr))
            assert not prims & _NOT_ELEMENTWISE, (args, prims & _NOT_ELEMENTWISE)
        # Scalars, rows and [B, T] blocks give the same per-token values.
        logp, ent, mask, adv, old, ref = _case(2, 3, "ragged", seed=1)
        block = P.token_loss(logp, ent, old, ref, adv[:, None], args)
        one = P.token_loss(logp[1, 2], ent[1, 2], old[1, 2], ref[1, 2], adv[1], args)
        np.testing.assert_allclose(float(one), float(block[1, 2]), rtol=1e-7)


def test_reduction_weights_are_the_normalizers():
    mask = jnp.asarray([[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 0]], bool)
    n, lens = 5.0, np.array([2.0, 1.0, 3.0])[:, None]
    m = np.asarray(mask, np.float64)
    want = {
        "grpo": m / (3 * lens),
        "sapo": m / (3 * lens),
        "bnpo": m / n,
        "dr_grpo": m / (3 * 6),
        "dapo": m / n,
        "cispo": m / n,
        "vespo": m / n,
        "luspo": m / 3,
    }
    for lt, w in want.items():
        np.testing.assert_allclose(np.asarray(P.reduction_weights(mask, _args(lt))), w, rtol=1e-7)
    np.testing.assert_allclose(np.asarray(P.reduction_weights(mask, _args("dapo", num_items_in_batch=4.0))), m / 4)
    np.testing.assert_allclose(np.asarray(P.entropy_weights(mask, _args("grpo", entropy_coef=0.5))), -0.5 * m / n)


def test_extreme_inputs_give_no_nan():
    # Log-ratios and reference gaps up to ±300 nats (beyond f32's exp), logp down to -1e4,
    # advantages of ±1e3 and 0, entropies of 1e4, fully masked sequences, in one batch.
    vals = np.array([-300.0, -100.0, -89.0, -80.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 80.0, 89.0, 100.0, 300.0])
    rng = np.random.default_rng(11)
    b, t = 12, 6
    # β = 0.5 (the KL's exponentials are the hard part), bias-corrected KL or not in turn.
    args_list = [_args(lt, lvl, 0.5, i % 4 in (0, 3), delta=3.0 if lt in ("grpo", "luspo") else None, entropy_coef=0.1)
                 for i, (lt, lvl) in enumerate(itertools.product(LOSS_TYPES, LEVELS))]  # fmt: skip
    for args in filter(_valid, args_list):
        f = jax.jit(jax.value_and_grad(lambda *x: P.grpo_policy_loss(*x, args)[0], argnums=(0, 1)))
        lp = -rng.choice([0.0, 1e-3, 5.0, 100.0, 1e4], (b, t))
        old, ref = lp - rng.choice(vals, (b, t)), lp + rng.choice(vals, (b, t))
        adv = rng.choice([-1e3, -1.0, 0.0, 1.0, 1e3], b)
        ent = rng.choice([0.0, 1e-3, 5.0, 1e4], (b, t))
        mask = rng.random((b, t)) < 0.7
        mask[0], mask[1] = False, True
        x = [jnp.asarray(v, jnp.float32) for v in (lp, ent)] + [jnp.asarray(mask)]
        x += [jnp.asarray(v, jnp.float32) for v in (adv, old, ref)]
        loss, (g_lp, g_ent) = f(*x)
        assert not np.isnan(float(loss)), args
        assert not np.isnan(np.asarray(g_lp)).any() and not np.isnan(np.asarray(g_ent)).any(), args
        assert (np.asarray(g_lp)[~mask] == 0).all() and (np.asarray(g_ent)[~mask] == 0).all()
        # All masked: zero.
        x[2] = jnp.zeros((b, t), bool)
        loss, (g_lp, g_ent) = f(*x)
        assert float(loss) == 0.0 and not np.asarray(g_lp).any() and not np.asarray(g_ent).any()


def test_the_unbiased_kl_stays_finite_where_the_ratio_underflows():
    # Flashloss addition 2: exp(d)·r with exp(d) beyond f32 and r = 0 in f32 is exp(d + log r), not inf·0.
    logp = jnp.asarray([[-1.0, -2.0]], jnp.float32)
    old = logp + 120.0  # log r = -120: r underflows
    ref = logp + 150.0  # d = 150: exp(d) overflows
    args = _args("dapo", beta=0.1)
    loss, kl, _ = P.grpo_policy_loss(logp, jnp.zeros_like(logp), jnp.ones((1, 2), bool), jnp.ones(1), old, ref, args)
    np.testing.assert_allclose(np.asarray(kl), np.exp(30.0) - 151.0 * np.exp(-120.0), rtol=1e-5)
    assert np.isfinite(float(loss))


_X64 = r"""
import sys, numpy as np, jax
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp
sys.path.insert(0, sys.argv[1])
import test_jax_policy as t
from flashloss.jax import _policy as P
worst = [0.0, 0.0]
for k, args in list(enumerate(t.CONFIGS))[::3]:
    b, s, kind = t.SHAPES[k % len(t.SHAPES)]
    case = t._case(b, s, kind, seed=k)
    want = t._ffi(case, args)
    c64 = [None if x is None else jnp.asarray(x, jnp.float64) for x in case]
    c64[2] = case[2]
    f = jax.jit(jax.value_and_grad(lambda lp, en, *x: P.grpo_policy_loss(lp, en, *x, args)[0], argnums=(0, 1)))
    loss, (g, ge) = f(c64[0], c64[1], c64[2], c64[3], c64[4], c64[5])
    worst[0] = max(worst[0], abs(float(loss) - want[0]) / max(abs(want[0]), 1e-6))
    worst[1] = max(worst[1], float(np.abs(np.asarray(g) - want[1]).max()) / max(float(np.abs(want[1]).max()), 1e-6))
print(worst[0], worst[1])
"""


def test_float64_matches_the_rust_stage_to_its_f32_rounding():
    # Under x64 (global, so in a subprocess) the same code is the f64 stage: the handler's
    # f32 outputs are its rounding (≤ 6e-8 relative), so the gate is two orders tighter.
    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run([sys.executable, "-c", _X64, here], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    loss_err, grad_err = map(float, out.stdout.split()[-2:])
    assert loss_err <= 1e-7 and grad_err <= 1e-6, (loss_err, grad_err)


# ---- validation --------------------------------------------------------------------------------------------------

BAD = [
    (dict(loss_type="ppo"), "loss_type"),
    (dict(importance_sampling_level="batch"), "importance_sampling_level"),
    (dict(loss_type="vespo", importance_sampling_level="sequence"), "importance_sampling_level"),
    (dict(epsilon_low=-0.1), "epsilon_low"),
    (dict(epsilon_low=1.0), "epsilon_low"),
    (dict(epsilon_high=-0.5), "epsilon_high"),
    (dict(loss_type="cispo", epsilon_high=0.0), "epsilon_high"),
    (dict(temperature=0.0), "temperature"),
    (dict(temperature=-1.0), "temperature"),
    (dict(beta=-0.1), "beta"),
    (dict(delta=0.9), "delta"),
    (dict(loss_type="sapo", delta=2.0), "delta"),
    (dict(loss_type="dr_grpo", max_completion_length=None), "max_completion_length"),
    (dict(loss_type="dapo", num_items_in_batch=0.0), "num_items_in_batch"),
    (dict(loss_type="sapo", sapo_temperature_neg=0.0), "sapo_temperature_neg"),  # named right (issue 33)
    (dict(entropy_coef=float("nan")), "entropy_coef"),
]


def _ffi_message(case, args):
    with pytest.raises(Exception) as e:  # JaxRuntimeError
        jax.block_until_ready(_ffi(case, args))
    return str(e.value)


@pytest.mark.parametrize("bad,field", BAD, ids=[f for _, f in BAD])
def test_bad_arguments_raise_the_ffi_message_at_trace_time(bad, field):
    kw = {"loss_type": "grpo", "max_completion_length": 4, **bad}
    args = P.GrpoArgs(**kw)
    with pytest.raises(ValueError, match=f"`{field}`") as ours:
        args.validate()
    case = _case(2, 4, "ragged", seed=0)
    # At trace time: lowering alone raises, before any kernel runs.
    with pytest.raises(ValueError) as traced:
        jax.jit(lambda lp: P.grpo_policy_loss(lp, case[1], case[2], case[3], case[4], case[5], args)[0]).lower(case[0])
    assert str(traced.value) == str(ours.value)
    assert str(ours.value) in _ffi_message(case, args)


def test_beta_without_reference_is_the_ffi_message():
    case = _case(2, 4, "ragged", seed=0)
    args = _args("dapo", beta=0.04)
    with pytest.raises(ValueError, match="`ref_per_token_logps`: required") as ours:
        jax.eval_shape(lambda lp: P.grpo_policy_loss(lp, case[1], case[2], case[3], case[4], None, args), case[0])
    assert str(ours.value) in _ffi_message(case[:5] + (None,), args)


BAD_CE = [(dict(label_smoothing=1.5), "label_smoothing"), (dict(label_smoothing=-0.1), "label_smoothing"),
          (dict(z_loss=-1e-4), "z_loss"), (dict(reduction="avg"), "reduction")]  # fmt: skip


@pytest.mark.parametrize("bad,field", BAD_CE, ids=[f for _, f in BAD_CE])
def test_bad_ce_arguments_raise_the_ffi_message(bad, field):
    kw = {"label_smoothing": 0.0, "z_loss": 0.0, "reduction": "mean", **bad}
    with pytest.raises(ValueError, match=f"`{field}`") as ours:
        P.ce_loss_from_stats(jnp.zeros(3), jnp.zeros(3), jnp.zeros(3), jnp.ones(3, bool), **kw)
    h, w, y = jnp.ones((3, 4)), jnp.ones((5, 4)), jnp.zeros(3, jnp.int32)
    with pytest.raises(Exception) as theirs:
        jax.block_until_ready(fj.linear_cross_entropy(h, w, y, **kw))
    assert str(ours.value) in str(theirs.value)


# ---- cross-entropy -----------------------------------------------------------------------------------------------


def _ce_stats(z, y, temperature):
    s = z / temperature
    lse = jax.nn.logsumexp(s, axis=-1)
    logp = jnp.take_along_axis(s, jnp.clip(y, 0)[:, None], -1)[:, 0] - lse
    return lse, logp, s.mean(-1)


def _ce_numpy(z, y, live, ls, zl, reduction, temperature):
    s = np.asarray(z, np.float64) / temperature
    mx = s.max(-1, keepdims=True)
    lse = (mx + np.log(np.exp(s - mx).sum(-1, keepdims=True)))[:, 0]
    logp = s[np.arange(len(y)), np.clip(y, 0, None)] - lse
    ell = np.where(live, (1 - ls) * -logp + ls * (lse - s.mean(-1)) + zl * lse**2, 0.0)
    return ell if reduction == "none" else ell.sum() if reduction == "sum" else ell.sum() / max(live.sum(), 1)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_ce_from_stats_matches_the_fused_cross_entropy(reduction):
    rng = np.random.default_rng(4)
    n, hd, v = 9, 8, 37
    h = jnp.asarray(rng.standard_normal((n, hd)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((v, hd)) * 0.7, jnp.float32)
    for ls, zl, temp, ignored in ((0.0, 0.0, 1.0, [2, 5]), (0.1, 1e-3, 0.7, [0]), (0.2, 0.0, 1.3, []),
                                  (0.1, 1e-3, 1.0, list(range(n)))):  # fmt: skip
        y = rng.integers(0, v, n)
        y[ignored] = -100
        live = y != -100
        yj = jnp.asarray(y, jnp.int32)
        kw = dict(label_smoothing=ls, z_loss=zl, reduction=reduction)

        def ours(hh):
            return P.ce_loss_from_stats(*_ce_stats(hh @ w.T, yj, temp), jnp.asarray(live), **kw)

        def theirs(hh):
            return fj.linear_cross_entropy(hh, w, yj, temperature=temp, **kw)

        got, want = np.asarray(ours(h), np.float64), np.asarray(theirs(h), np.float64)
        ref = _ce_numpy(np.asarray(h, np.float64) @ np.asarray(w, np.float64).T, y, live, ls, zl, reduction, temp)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
        if not live.any():
            assert not got.any()
        ct = jnp.asarray(rng.standard_normal(n), jnp.float32) if reduction == "none" else jnp.float32(1.0)
        g_ours = np.asarray(jax.vjp(ours, h)[1](ct)[0], np.float64)
        g_theirs = np.asarray(jax.vjp(theirs, h)[1](ct)[0], np.float64)
        ok, err, scale = _close_grad(g_ours, g_theirs)
        assert ok, (ls, zl, temp, err, scale)
        assert not g_ours[~live].any()
