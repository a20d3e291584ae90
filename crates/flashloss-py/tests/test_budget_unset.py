"""Issue 51: a call without ``budget_mib`` reaches the native side unset (the spec leaves the
field out), so each backend takes its own default: the CPU's 160 MiB (the same result as that
budget given), CUDA's from the device's memory. A budget given is passed as given."""

import json

import pytest

torch = pytest.importorskip("torch")
import flashloss.torch as fl  # noqa: E402
from flashloss import _config  # noqa: E402
from flashloss.torch import _ops  # noqa: E402


def test_a_call_without_a_budget_reaches_the_native_side_unset(monkeypatch):
    specs = []
    real = _ops.call_spec

    def spy(*args, **kwargs):
        text = real(*args, **kwargs)
        specs.append(json.loads(text))
        return text

    monkeypatch.setattr(_ops, "call_spec", spy)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(6, 8, generator=g)
    w = torch.randn(33, 8, generator=g)
    t = torch.randint(33, (6,), generator=g)
    unset = fl.linear_cross_entropy(h, w, t)
    assert specs and all("budget_mib" not in s for s in specs), specs
    specs.clear()
    given = fl.linear_cross_entropy(h, w, t, budget_mib=_config.DEFAULT_BUDGET_MIB)
    assert specs and all(s["budget_mib"] == _config.DEFAULT_BUDGET_MIB for s in specs), specs
    assert torch.equal(unset, given)
    assert _config.budget_or_unset(None) is None and _config.budget_or_unset(64) == 64.0
