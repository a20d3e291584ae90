"""Vocab-parallel losses over torch.distributed (Gloo, CPU): 1, 2 and 4 processes, each
holding a block of the LM head's rows of a different size. Every rank's loss, per-token
outputs and hidden gradient equal the one-process call's, and its weight and bias
gradients equal its block of them (dist_worker.py checks them, rank by rank); a bad
input on one rank is the same ValueError on every rank, within the timeout."""

import os

import pytest
from ranks import run_ranks

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

WORKER = os.path.join(os.path.dirname(__file__), "dist_worker.py")


@pytest.mark.parametrize("world", [1, 2, 4])
def test_vocab_parallel_matches_one_process(world, tmp_path):
    outs = run_ranks(WORKER, world, tmp_path)
    assert [o["rank"] for o in outs] == list(range(world))
    if world == 1:
        return
    cases = outs[0]["errors"]
    assert len(cases) == 5
    for name, message in cases.items():
        assert message is not None, f"{name}: no error"
        for o in outs[1:]:
            assert o["errors"][name] == message, f"{name}: ranks disagree"
    assert "argument `hidden`" in cases["nan hidden on rank 1"] and "rank 1" in cases["nan hidden on rank 1"]
    assert "argument `weight`" in cases["float64 weight on the last rank"]
    assert "rows" in cases["fewer rows on rank 0"]
    assert "rank 0" in cases["id beyond the vocabulary"]
    assert "meta" in cases["a tensor on the meta device on rank 1"]
