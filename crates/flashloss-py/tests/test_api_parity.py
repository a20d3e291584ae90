"""One API in both bindings: every public function of :mod:`flashloss.torch` and
:mod:`flashloss.jax` has the same parameters (names, order, kinds, defaults, annotated)
and the same return types, save the framework-specific parameters listed in
``ALLOWED``; each loss's arguments are its argument class's fields, with the class's
defaults (TRL's, written once in :mod:`flashloss._spec`), which are Rust's; the bindings
agree where a user can see it (metrics' dtype, the logits' shapes, ``outside_support``,
errors naming the caller's argument); the drop-ins keep their peer's positional order."""

import dataclasses
import inspect
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
ft = pytest.importorskip("flashloss.torch")
fj = pytest.importorskip("flashloss.jax")
jnp = pytest.importorskip("jax.numpy")

from flashloss import _config, _native, _spec, liger  # noqa: E402
from flashloss._spec import CeArgs, GrpoArgs, LogprobRequest, SamplerFilters  # noqa: E402

#: The only differences allowed, per binding: how a framework splits the work over
#: devices (a torch ``ProcessGroup``; JAX mesh axes), and JAX's choice of path (FFI or
#: Pallas), its interpret mode and a Flax kernel's ``[H, V]`` layout.
ALLOWED = {
    "torch": {"vocab_parallel_group"},
    "jax": {"vocab_axis", "token_axis", "impl", "interpret", "weight_layout"},
}
FUNCTIONS = ("grpo_loss", "linear_cross_entropy", "linear_grpo_loss", "linear_logprobs")
TYPES = ("GRPOOutputs", "LogprobOutputs")


def _params(fn, binding: str) -> list:
    """``(name, kind, default)`` of each parameter not in ``ALLOWED[binding]``."""
    sig = inspect.signature(fn)
    return [(p.name, p.kind, p.default) for p in sig.parameters.values() if p.name not in ALLOWED[binding]]


def test_the_bindings_export_the_same_names():
    assert sorted(ft.__all__) == sorted(fj.__all__) == sorted(FUNCTIONS + TYPES)


@pytest.mark.parametrize("name", FUNCTIONS)
def test_same_signature(name):
    torch_params, jax_params = _params(getattr(ft, name), "torch"), _params(getattr(fj, name), "jax")
    assert torch_params == jax_params, f"{name}: torch {torch_params} != jax {jax_params}"


@pytest.mark.parametrize("name", FUNCTIONS)
def test_allowed_differences_are_only_framework_specific(name):
    """A parameter only one binding has is one of that binding's ``ALLOWED``."""
    torch_names = set(inspect.signature(getattr(ft, name)).parameters)
    jax_names = set(inspect.signature(getattr(fj, name)).parameters)
    assert torch_names - jax_names <= ALLOWED["torch"], name
    assert jax_names - torch_names <= ALLOWED["jax"], name


@pytest.mark.parametrize("name", TYPES)
def test_same_return_types(name):
    assert getattr(ft, name) is getattr(fj, name) is getattr(_spec, name)


@pytest.mark.parametrize("name", ("grpo_loss", "linear_grpo_loss"))
def test_grpo_defaults_are_trls(name):
    """Every GRPO parameter's default is ``GrpoArgs``' (TRL's), in both bindings."""
    trl = {f.name: f.default for f in dataclasses.fields(_spec.GrpoArgs)}
    for fn in (getattr(ft, name), getattr(fj, name)):
        for p in inspect.signature(fn).parameters.values():
            if p.name in trl:
                assert p.default == trl[p.name], (fn.__module__, name, p.name)


@pytest.mark.parametrize("name", FUNCTIONS)
def test_shared_documentation(name):
    """The parameters' documentation is :mod:`flashloss._spec.doc`'s, in both bindings."""
    for section in _spec.doc.SECTIONS.values():
        in_torch, in_jax = section in getattr(ft, name).__doc__, section in getattr(fj, name).__doc__
        assert in_torch == in_jax, (name, section[:60])
    for binding in (ft, fj):
        assert all("{" + key + "}" not in getattr(binding, name).__doc__ for key in _spec.doc.SECTIONS)


def test_the_liger_convention_lives_apart():
    """Liger's call shapes (positional ``old_logp, ref_logp``, ``(loss, [metrics])``) are
    :mod:`flashloss.liger`'s, under Liger's names; neither binding has them."""
    assert list(inspect.signature(liger.triton_grpo_loss).parameters)[:3] == ["logits", "old_logp", "ref_logp"]
    for binding in (ft, fj):
        assert not hasattr(binding, "LinearGRPOLoss") and not hasattr(binding, "triton_grpo_loss")


#: The fields of each function's argument class that its signature takes (in the class's order).
_LOGPROB_FIELDS = tuple(n for n in LogprobRequest.names() if n != "support") + SamplerFilters.names()
FIELDS = {
    "linear_grpo_loss": GrpoArgs.names(),
    "grpo_loss": tuple(n for n in GrpoArgs.names() if n not in ("entropy_coef",) + SamplerFilters.names()),
    "linear_cross_entropy": CeArgs.names(),
    "linear_logprobs": _LOGPROB_FIELDS,
}
DEFAULTS = {
    **{f.name: f.default for f in dataclasses.fields(GrpoArgs)},
    **{f.name: f.default for f in dataclasses.fields(CeArgs)},
    **{f.name: f.default for f in dataclasses.fields(LogprobRequest)},
    **{f.name: f.default for f in dataclasses.fields(SamplerFilters)},
}


@pytest.mark.parametrize("name", FUNCTIONS)
def test_signatures_are_the_argument_classes(name):
    """Each signature's explicit keywords that are argument fields are exactly its
    class's fields, in the class's order, with the class's defaults: the function builds
    the class from its bound arguments by these names (``Bound.fields_of(locals())``), so
    a field added to the class and not to a signature (or the reverse) fails here."""
    names = set(
        _LOGPROB_FIELDS if name == "linear_logprobs" else CeArgs.names() if "cross" in name else GrpoArgs.names()
    )
    for binding in (ft, fj):
        params = inspect.signature(getattr(binding, name)).parameters.values()
        taken = [p for p in params if p.name in names]
        assert tuple(p.name for p in taken) == FIELDS[name], (binding.__name__, name)
        for p in taken:
            assert p.default == DEFAULTS[p.name], (binding.__name__, name, p.name)


@pytest.mark.parametrize("name", FUNCTIONS)
def test_both_bindings_annotate_every_parameter(name):
    for binding in (ft, fj):
        sig = inspect.signature(getattr(binding, name))
        bare = [p.name for p in sig.parameters.values() if p.annotation is inspect.Parameter.empty]
        assert not bare, (binding.__name__, name, bare)
        assert sig.return_annotation is not inspect.Signature.empty, (binding.__name__, name)


def test_liger_takes_the_fields_by_its_own_names():
    """Liger's shims take :class:`GrpoArgs`' fields under Liger's names and defaults
    (``eps_low``/``eps_high``; ``beta``, ``temperature``, ``use_bias_correction_kl``)."""
    own = {"beta", "temperature", "epsilon_high", "use_bias_correction_kl", "eps_low", "eps_high"}
    for fn in (liger.LigerFusedLinearGRPOLoss.__init__, liger.triton_grpo_loss):
        for p in inspect.signature(fn).parameters.values():
            if p.name in GrpoArgs.names() and p.name not in own:
                assert p.default == DEFAULTS[p.name], (fn.__qualname__, p.name)


def test_the_rust_defaults_are_the_argument_classes():
    """``GrpoLossConfig::default()`` and ``CeConfig::default()`` (read through the native
    module) have the fields and defaults of :class:`GrpoArgs` and :class:`CeArgs` (TRL's:
    ``loss_type="dapo"``), and the default budget is Rust's."""
    d = _native.defaults()
    for cls, key in ((GrpoArgs, "grpo"), (CeArgs, "ce")):
        rust = json.loads(d[key])
        assert set(rust) == set(cls.names()), key
        assert {k: v for k, v in rust.items() if v is not None} == json.loads(cls().config_json()), key
    assert json.loads(d["grpo"])["loss_type"] == "dapo"
    assert _config.DEFAULT_BUDGET_MIB == d["budget_mib"] > 0


def _batch(b=2, t=5, h=8, v=33, seed=0):
    g = np.random.default_rng(seed)
    hidden = g.normal(size=(b, t, h)).astype(np.float32)
    weight = (g.normal(size=(v, h)) * 0.5).astype(np.float32)
    ids = g.integers(0, v, size=(b, t))
    mask = np.ones((b, t), bool)
    mask[1, 3:] = False
    adv = g.normal(size=(b,)).astype(np.float32)
    return hidden, weight, ids, mask, adv


def test_metrics_have_one_dtype():
    hidden, weight, ids, mask, adv = _batch()
    _, out_t = ft.linear_grpo_loss(*map(torch.tensor, (hidden, weight, ids, mask, adv)))
    _, out_j = fj.linear_grpo_loss(*map(jnp.asarray, (hidden, weight, ids, mask, adv)))
    for k in _spec.METRICS:
        assert out_t.metrics[k].dtype == torch.float32 and out_j.metrics[k].dtype == jnp.float32, k
        np.testing.assert_allclose(float(out_t.metrics[k]), float(out_j.metrics[k]), rtol=1e-5, atol=1e-6)


def test_grpo_loss_takes_ligers_logits_in_both():
    """``[B, T+1, V]`` logits (Liger's; the last position not read) give the ``[B, T, V]``
    call's loss in both bindings."""
    hidden, weight, ids, mask, adv = _batch()
    logits = np.einsum("bth,vh->btv", hidden, weight).astype(np.float32)
    longer = np.concatenate([logits, np.full_like(logits[:, :1], 7.0)], axis=1)
    for binding, arr in ((ft, torch.tensor), (fj, jnp.asarray)):
        want = binding.grpo_loss(arr(logits), arr(ids), arr(mask), arr(adv))[0]
        got = binding.grpo_loss(arr(longer), arr(ids), arr(mask), arr(adv))[0]
        np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
    with pytest.raises(ValueError, match="argument `logits`"):
        fj.grpo_loss(jnp.asarray(logits[:, :3]), jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(adv))


def test_outside_support_is_one_rule():
    """``outside_support`` is ``completion_mask & (logp == -inf)`` in both bindings: a
    masked token is never flagged."""
    hidden, weight, ids, mask, adv = _batch()
    _, out_t = ft.linear_grpo_loss(*map(torch.tensor, (hidden, weight, ids, mask, adv)), top_k=2)
    _, out_j = fj.linear_grpo_loss(*map(jnp.asarray, (hidden, weight, ids, mask, adv)), top_k=2)
    flags_t, flags_j = out_t.outside_support.numpy(), np.asarray(out_j.outside_support)
    np.testing.assert_array_equal(flags_t, flags_j)
    assert flags_t.any() and not flags_t[~mask].any()


def test_errors_name_the_callers_budget():
    """A budget too small for one row is an error naming ``budget_mib`` (what the caller
    passed), not the kernels' bytes."""
    hidden, weight, ids, _, _ = _batch()
    with pytest.raises(ValueError, match="argument `budget_mib`"):
        ft.linear_cross_entropy(torch.tensor(hidden), torch.tensor(weight), torch.tensor(ids), budget_mib=1e-4)
    with pytest.raises(Exception, match="argument `budget_mib`"):
        fj.linear_cross_entropy(jnp.asarray(hidden), jnp.asarray(weight), jnp.asarray(ids), budget_mib=1e-4)


#: The positional parameters of flashloss's own functions (every option is keyword-only);
#: ``linear_cross_entropy`` keeps CCE's bias (see ``CCE_POSITIONAL``).
OWN_POSITIONAL = {
    "grpo_loss": ("logits", "completion_ids", "completion_mask", "advantages"),
    "linear_cross_entropy": ("hidden", "weight", "targets", "bias"),
    "linear_grpo_loss": ("hidden", "weight", "completion_ids", "completion_mask", "advantages"),
    "linear_logprobs": ("hidden", "weight", "ids"),
}


@pytest.mark.parametrize("name", FUNCTIONS)
def test_options_are_keyword_only_in_both(name):
    """The tensors are positional, every option keyword-only, in both bindings."""
    for binding in (ft, fj):
        assert tuple(_positional(getattr(binding, name))) == OWN_POSITIONAL[name], (binding.__name__, name)
    with pytest.raises(TypeError):
        hidden, weight, ids, _, _ = _batch()
        ft.linear_logprobs(torch.tensor(hidden), torch.tensor(weight), torch.tensor(ids), 0.7)


def test_drop_in_errors_name_the_peers_arguments():
    """An error inside a drop-in names the argument its caller passed: Liger's ``_input``
    and ``vllm_is_ratio``, verl's ``hidden_states`` and ``labels``, not flashloss's ``hidden``
    or ``ids``."""
    from flashloss import verl

    hidden, weight, ids, mask, adv = (torch.tensor(x) for x in _batch())
    module = liger.LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False)
    with pytest.raises(ValueError, match="argument `_input`: expected shape"):
        module(hidden, weight[:, :-1], ids, mask, adv)
    with pytest.raises(ValueError, match="argument `vllm_is_ratio`"):
        module(hidden, weight, ids, mask, adv, vllm_is_ratio=torch.ones(7, 3))
    logits = torch.einsum("bth,vh->btv", hidden, weight)
    with pytest.raises(ValueError, match="argument `old_logp`"):
        liger.triton_grpo_loss(logits, torch.zeros(7, 3), None, ids, adv, mask)
    with pytest.raises(ValueError, match="argument `hidden_states`: expected shape"):
        verl.fused_linear_for_ppo_forward(None, hidden, weight[:, :-1], ids)
    with pytest.raises(ValueError, match="argument `labels`"):
        verl.linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), weight, ids.reshape(-1) + weight.shape[0])


#: The peers' documented positional orders of the functions flashloss offers under their
#: names: Cut Cross-Entropy's ``linear_cross_entropy(e, c, targets, bias=None, ...)``,
#: Liger's ``LigerFusedLinearGRPOLoss.forward`` and ``triton_grpo_loss``.
CCE_POSITIONAL = 4
LIGER_FORWARD = ("_input", "lin_weight", "selected_token_ids", "attention_mask", "advantages", "bias",
                 "ref_per_token_logps", "old_per_token_logps", "ref_input", "ref_weight", "ref_bias")  # fmt: skip
LIGER_TRITON = ("logits", "old_logp", "ref_logp", "completion_ids", "advantages", "completion_mask", "temperature",
                "beta", "eps_low", "eps_high", "inplace", "loss_type", "max_completion_length",
                "importance_sampling_level", "reduce")  # fmt: skip


def _positional(fn) -> list:
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in inspect.signature(fn).parameters.values() if p.kind in kinds and p.name != "self"]


def test_cce_positional_call_runs_in_both():
    """CCE's ``linear_cross_entropy(e, c, targets, bias)`` (bias positional) is the
    keyword call's loss in both bindings."""
    hidden, weight, ids, _, _ = _batch()
    bias = np.linspace(-0.5, 0.5, weight.shape[0]).astype(np.float32)
    for binding, arr in ((ft, torch.tensor), (fj, jnp.asarray)):
        assert len(_positional(binding.linear_cross_entropy)) == CCE_POSITIONAL
        positional = binding.linear_cross_entropy(arr(hidden), arr(weight), arr(ids), arr(bias))
        keyword = binding.linear_cross_entropy(arr(hidden), arr(weight), arr(ids), bias=arr(bias))
        assert float(positional) == float(keyword)


def test_liger_drop_ins_keep_ligers_positional_order():
    assert _positional(liger.LigerFusedLinearGRPOLoss.forward)[: len(LIGER_FORWARD)] == list(LIGER_FORWARD)
    assert _positional(liger.triton_grpo_loss)[: len(LIGER_TRITON)] == list(LIGER_TRITON)
    hidden, weight, ids, mask, adv = (torch.tensor(x) for x in _batch())
    module = liger.LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False)
    loss, metrics = module(hidden.reshape(-1, hidden.shape[-1]), weight, ids, mask, adv, None, None, None)
    assert torch.isfinite(loss) and len(metrics) == 1
    logits = torch.einsum("bth,vh->btv", hidden, weight)
    old = torch.zeros(ids.shape)
    loss, metrics = liger.triton_grpo_loss(logits, old, None, ids, adv, mask, 1.0, 0.0, 0.2, 0.2, False)
    assert torch.isfinite(loss) and len(metrics) == 1


@pytest.mark.parametrize("name", ("trl", "verl", "liger", "transformers", "tunix"))
def test_the_integrations_keep_their_names(name):
    """Each integration lives in :mod:`flashloss.integrations` and is the same module
    under its public name (``flashloss.trl``, ...), so a patch through either is one."""
    import importlib
    import sys

    public = importlib.import_module(f"flashloss.{name}")
    assert public is importlib.import_module(f"flashloss.integrations.{name}") is sys.modules[f"flashloss.{name}"]
