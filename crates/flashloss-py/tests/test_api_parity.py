"""One API in both bindings: every public function of :mod:`flashloss.torch` and
:mod:`flashloss.jax` has the same parameters (names, order, kinds, defaults) and the same
return types, save the framework-specific parameters listed in ``ALLOWED``; the GRPO
defaults are TRL's, written once (:mod:`flashloss._spec`)."""

import dataclasses
import inspect

import pytest

ft = pytest.importorskip("flashloss.torch")
fj = pytest.importorskip("flashloss.jax")

from flashloss import _spec, liger  # noqa: E402

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
