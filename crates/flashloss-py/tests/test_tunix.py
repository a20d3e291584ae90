"""flashloss.tunix against Tunix itself (CPU, tiny random models): the patched GRPO loss
equals Tunix's own (loss, aux metrics, parameter gradients) for each loss_algo x
loss_agg_mode, with and without KL; the patch restores Tunix exactly; a GRPO learner
trains a few steps patched. Skipped without Tunix (the ``tunix`` extra)."""

from __future__ import annotations

import importlib.util
import itertools

import numpy as np
import pytest

pytest.importorskip("tunix")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from tunix.rl import algo_core, common, function_registry  # noqa: E402
from tunix.rl.grpo import grpo_learner  # noqa: E402

import flashloss.tunix as ft  # noqa: E402

V = 211  # a prime, so no other dimension of these models has it
ALGOS = ("grpo", "gspo-token")
AGG = (
    "token-mean",
    "sequence-mean-token-mean",
    "sequence-mean-token-scale",
    "seq-mean-token-sum",
    "sequence-mean-token-sum-norm",
)
LOSS_RTOL = 1e-5  # docs/spec/losses.md, f32 loss and logp
GRAD_REL = 1e-3  # ... and gradients relative to the largest, the CPU's compact block (auto)


def _qwen2(tied: bool):
    from tunix.models.qwen2 import model as m

    cfg = m.ModelConfig(num_layers=1, vocab_size=V, embed_dim=32, hidden_dim=48, num_heads=2, head_dim=16,
                        num_kv_heads=1, rope_theta=10000, norm_eps=1e-6, use_tied_embedding=tied)  # fmt: skip
    return m.Qwen2(cfg, rngs=nnx.Rngs(0))


def _qwen3():
    from tunix.models.qwen3 import model as m

    cfg = m.ModelConfig(num_layers=1, vocab_size=V, embed_dim=32, hidden_dim=48, num_heads=2, head_dim=16,
                        num_kv_heads=1, rope_theta=10000, norm_eps=1e-6, use_tied_embedding=False)  # fmt: skip
    return m.Qwen3(cfg, rngs=nnx.Rngs(0))


def _llama3():
    from tunix.models.llama3 import model as m

    cfg = m.ModelConfig(num_layers=1, vocab_size=V, embed_dim=32, hidden_dim=48, num_heads=2, head_dim=16,
                        num_kv_heads=1, rope_theta=10000, norm_eps=1e-6, weight_tying=False)  # fmt: skip
    return m.Llama3(cfg, rngs=nnx.Rngs(0))


def _gemma(softcap=None):
    from tunix.models.gemma import model as m

    cfg = m.ModelConfig(num_layers=1, num_embed=V, embed_dim=32, hidden_dim=48, num_heads=2, head_dim=16,
                        num_kv_heads=1, final_logit_softcap=softcap, use_post_attn_norm=False,
                        use_post_ffw_norm=False, attention_types=(m.AttentionType.GLOBAL,))  # fmt: skip
    return m.Gemma(cfg, rngs=nnx.Rngs(0))


def _gemma3(dtype=jnp.float32):
    from tunix.models.gemma3 import model as m

    cfg = m.ModelConfig(num_layers=1, num_embed=V, embed_dim=32, hidden_dim=48, num_heads=2, head_dim=16,
                        num_kv_heads=1, sliding_window_size=8, param_dtype=dtype)  # fmt: skip
    return m.Gemma3(cfg, rngs=nnx.Rngs(0))


MODELS = {
    "qwen2_tied": lambda: _qwen2(True),
    "qwen2_untied": lambda: _qwen2(False),
    "llama3": _llama3,
    "gemma": _gemma,
}
PAD, EOS = 0, 1


def _example(kl: bool, seed: int = 0, sampler_is: bool = False):
    rng = np.random.default_rng(seed)
    b, p, t = 4, 5, 7
    prompt = rng.integers(2, V, (b, p)).astype(np.int32)
    prompt[0, :2] = PAD  # left padding
    completion = rng.integers(2, V, (b, t)).astype(np.int32)
    completion[1, 4:] = PAD  # right padding
    mask = (completion != PAD).astype(np.int32)
    old = rng.normal(-5.4, 0.3, (b, t)).astype(np.float32)
    ref = rng.normal(-5.4, 0.3, (b, t)).astype(np.float32) if kl else None
    return grpo_learner.TrainExample(
        prompt_ids=jnp.asarray(prompt), prompt_mask=jnp.asarray(prompt != PAD, jnp.int32),
        completion_ids=jnp.asarray(completion), completion_mask=jnp.asarray(mask),
        advantages=jnp.asarray(rng.normal(size=b), jnp.float32), ref_per_token_logps=ref,
        old_per_token_logps=jnp.asarray(old),
        sampler_is_weights=jnp.asarray(rng.uniform(0.5, 1.0, (b, t)), jnp.float32) if sampler_is else None,
    )  # fmt: skip


def _config(algo: str, agg: str, kl: bool, **extra):
    cfg = grpo_learner.GRPOConfig(num_generations=2, loss_algo=algo, loss_agg_mode=agg,
                                  beta=0.04 if kl else 0.0, epsilon=0.2)  # fmt: skip
    cfg.temperature = extra.pop("temperature", 1.0)
    for k, v in extra.items():
        setattr(cfg, k, v)
    return cfg


def _run_all(model, cases):
    """``{case: (loss, aux, grads)}`` for every case, in one compiled function, through the
    registered "grpo" policy loss (patched or not, as the registry holds now)."""
    loss_fn = function_registry.get_policy_loss_fn("grpo")
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state):
        out = {}
        for key, (example, cfg) in cases.items():

            def f(st, example=example, cfg=cfg):
                return loss_fn(nnx.merge(graphdef, st), example, cfg, PAD, EOS)

            (loss, aux), grads = jax.value_and_grad(f, has_aux=True)(state)
            out[key] = (loss, aux, grads)
        return out

    return jax.device_get(run(state))


def _cases():
    cases = {}
    for algo, agg, kl in itertools.product(ALGOS, AGG, (False, True)):
        cases[f"{algo}/{agg}/kl={kl}"] = (_example(kl), _config(algo, agg, kl))
    # Tunix's other knobs, once each: dual clip, KL modes with a clamp, sampler IS weights, temperature.
    cases["epsilon_c"] = (_example(True), _config("grpo", "token-mean", True, epsilon_c=1.5))
    cases["low_var_kl"] = (_example(True), _config("grpo", "token-mean", True, kl_loss_mode="low_var_kl",
                                                   kl_clamp_value=5.0))  # fmt: skip
    cases["mse_kl"] = (_example(True), _config("gspo-token", "token-mean", True, kl_loss_mode="mse_kl"))
    cases["sampler_is"] = (_example(True, sampler_is=True), _config("grpo", "seq-mean-token-sum", True))
    cases["temperature"] = (_example(True), _config("grpo", "token-mean", True, temperature=0.7))
    return cases


def _grad_close(got, want, where, rel=GRAD_REL):
    g = [np.asarray(x, np.float32) for x in jax.tree.leaves(got)]
    w = [np.asarray(x, np.float32) for x in jax.tree.leaves(want)]
    assert len(g) == len(w)
    scale = max(float(np.max(np.abs(x))) for x in w)
    err = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(g, w))
    assert err <= rel * scale + 1e-6, f"{where}: gradient error {err:.3e} vs largest {scale:.3e}"


@pytest.fixture(autouse=True)
def _always_unpatched():
    ft.unpatch()
    yield
    ft.unpatch()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_patched_equals_tunix(name):
    model, cases = MODELS[name](), _cases()
    want = _run_all(model, cases)
    ft.patch()
    got = _run_all(model, cases)
    for key in cases:
        (l_got, a_got, g_got), (l_want, a_want, g_want) = got[key], want[key]
        np.testing.assert_allclose(l_got, l_want, rtol=LOSS_RTOL, atol=1e-7, err_msg=f"{name} {key} loss")
        assert set(a_got) == set(a_want), key
        for metric in a_want:
            np.testing.assert_allclose(a_got[metric], a_want[metric], rtol=LOSS_RTOL, atol=2e-6,
                                       err_msg=f"{name} {key} aux {metric}")  # fmt: skip
        _grad_close(g_got, g_want, f"{name} {key}")


@pytest.mark.parametrize("name", ["qwen3", "gemma3", "gemma3_bf16"])
def test_other_families(name):
    """Qwen3 and Gemma3 (f32, and Gemma3's default bf16 parameters, where Tunix's logits
    and entropy are bf16: the spec's bf16 tolerances)."""
    model = {"qwen3": _qwen3, "gemma3": _gemma3, "gemma3_bf16": lambda: _gemma3(jnp.bfloat16)}[name]()
    rtol, grad_rel = (1e-2, 2e-2) if name.endswith("bf16") else (LOSS_RTOL, 1e-4)
    cases = {"grpo": (_example(True), _config("grpo", "token-mean", True))}
    want = _run_all(model, cases)
    ft.patch(mode="auto_f32")
    got = _run_all(model, cases)
    np.testing.assert_allclose(got["grpo"][0], want["grpo"][0], rtol=rtol)
    np.testing.assert_allclose(got["grpo"][1]["entropy"], want["grpo"][1]["entropy"], rtol=rtol)
    _grad_close(got["grpo"][2], want["grpo"][2], name, grad_rel)


def test_ppo_loss_with_entropy_bonus():
    """Tunix's registered "ppo" policy loss, whose entropy bonus takes the gradient through
    the entropy, patched and not (dual clip and a KL term too)."""
    from types import SimpleNamespace

    model, example = _qwen2(False), _example(True)
    rng = np.random.default_rng(1)  # PPO's advantages are per token
    example = example.replace(advantages=jnp.asarray(rng.normal(size=example.completion_ids.shape), jnp.float32))
    cfg = SimpleNamespace(epsilon_low=0.2, epsilon_high=0.28, entropy_coef=0.05, epsilon_c=3.0, kl_coef=0.04,
                          kl_clamp_value=None)  # fmt: skip
    graphdef, state = nnx.split(model)

    def run():
        loss_fn = function_registry.get_policy_loss_fn("ppo")
        f = lambda st: loss_fn(nnx.merge(graphdef, st), example, cfg, PAD, EOS)  # noqa: E731
        return jax.device_get(jax.jit(jax.value_and_grad(f, has_aux=True))(state))

    (l_want, a_want), g_want = run()
    ft.patch(mode="auto_f32")
    (l_got, a_got), g_got = run()
    np.testing.assert_allclose(l_got, l_want, rtol=LOSS_RTOL)
    for metric in a_want:
        np.testing.assert_allclose(a_got[metric], a_want[metric], rtol=LOSS_RTOL, atol=2e-6, err_msg=metric)
    _grad_close(g_got, g_want, "ppo", 1e-4)


def test_no_logits_in_the_step():
    """The compiled CPU step of the patched loss and its gradient holds no array of rank 2
    or more whose last axis is the vocabulary, but the head [H, V] itself; Tunix's holds
    the [B, T, V] logits. (The jaxpr of ``impl="auto"`` also holds the Pallas branch, which
    is lowered only for a TPU; its blocks span the whole of this small V.)"""
    import re

    model, (example, cfg) = _qwen2(False), (_example(True), _config("grpo", "token-mean", True))
    graphdef, state = nnx.split(model)

    def vocab_shapes():
        loss_fn = function_registry.get_policy_loss_fn("grpo")
        f = lambda st: loss_fn(nnx.merge(graphdef, st), example, cfg, PAD, EOS)  # noqa: E731
        hlo = jax.jit(jax.value_and_grad(f, has_aux=True)).lower(state).compile().as_text()
        return set(re.findall(rf"\[((?:\d+,)+){V}\]", hlo))

    assert vocab_shapes() - {"32,"}  # Tunix: the logits
    ft.patch()
    assert vocab_shapes() == {"32,"}  # the head [H, V] and its gradient only


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu (pip install 'jax[tpu]')")
def test_train_step_compiled_for_v6e():
    """Tunix's GRPO train step compiled for v6e by libtpu (nothing runs on a TPU), tiny
    Qwen2: Tunix's holds the [B, T, V] logits, the patched one no [tokens, V] array."""
    from flashloss.tunix import tpu_memory

    b, t = 2, 16
    cfg = dict(tpu_memory.DEFAULTS, vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
               num_attention_heads=2, num_key_value_heads=1, group_size=b, prompt_len=8, max_new_tokens=t)  # fmt: skip
    tunix, patched = (tpu_memory.compile_arm(cfg, arm) for arm in ("tunix", "flashloss"))
    assert tunix["ok"] and patched["ok"] and not ft.is_patched()
    assert f"f32[{b},{t},{V}]" in tunix["vocab_last_axis_shapes"]
    shapes = patched["vocab_last_axis_shapes"]  # such as f32[1,211]
    rows = [np.prod([int(d) for d in s.split("[")[1].split(",")[:-1]]) for s in shapes]
    assert max(rows, default=1) < b * t, shapes
    assert patched["temp_size_in_bytes"] < tunix["temp_size_in_bytes"]


def test_reference_pass_and_unpatch_restores():
    model = _qwen2(True)
    graphdef, state = nnx.split(model)
    ex = _example(False)
    originals = (common.compute_per_token_logps, algo_core.compute_entropy_from_logits,
                 {n: function_registry.get_policy_loss_fn(n) for n in ("grpo", "ppo")})  # fmt: skip
    want = common.compute_per_token_logps(graphdef, state, ex.prompt_ids, ex.completion_ids, PAD, EOS)
    ft.patch()
    assert ft.is_patched() and common.compute_per_token_logps is ft.compute_per_token_logps
    got = common.compute_per_token_logps(graphdef, state, ex.prompt_ids, ex.completion_ids, PAD, EOS)
    np.testing.assert_allclose(got, want, rtol=LOSS_RTOL, atol=1e-6)
    # Outside a patched loss, the logits are still Tunix's when asked for.
    _, logits = common.compute_per_token_logps(graphdef, state, ex.prompt_ids, ex.completion_ids, PAD, EOS,
                                               return_logits=True)  # fmt: skip
    assert logits.shape == (*ex.completion_ids.shape, V)
    ft.unpatch()
    assert not ft.is_patched()
    assert common.compute_per_token_logps is originals[0]
    assert algo_core.compute_entropy_from_logits is originals[1]
    for n, fn in originals[2].items():
        assert function_registry.get_policy_loss_fn(n) is fn


def test_refusals():
    ex, cfg = _example(False), _config("grpo", "token-mean", False)
    ft.patch()
    loss_fn = function_registry.get_policy_loss_fn("grpo")
    with pytest.raises(ValueError, match="final_logit_softcap=30.0"):
        loss_fn(_gemma(30.0), ex, cfg, PAD, EOS)
    with pytest.raises(ValueError, match="argument `impl`"):
        ft.patch(impl="cuda")


def test_grpo_learner_trains_patched():
    """Tunix's GRPOLearner, patched, trains a tiny Qwen2 for 3 steps on a toy reward."""
    from flashloss.tunix import ab

    cfg = dict(ab.DEFAULTS, steps=3, sft_steps=0, prompts_per_step=2, group_size=2, max_new_tokens=4,
               out_dir=None, loss_impl="flashloss")  # fmt: skip
    rows = ab.run(cfg, progress=False)
    assert len(rows) == 3
    assert all(np.isfinite(r["loss"]) and np.isfinite(r["entropy"]) for r in rows)
    assert ft.is_patched() is False
