"""LM heads given as DTensors (flashloss/torch/_dtensor.py) over Gloo on the CPU, 2 and 3
processes: a vocabulary-sharded head (Shard(0)) with a replicated hidden runs
vocab-parallel over the mesh and equals the one-process call (loss, per-token outputs,
dH, this rank's block of dW and dbias, returned as DTensors of the weight's placement),
eager and (2 ranks) under torch.compile; a replicated head runs locally; every other layout is the
same ValueError on every rank (dtensor_worker.py checks each rank)."""

import os

import pytest
from ranks import run_ranks

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

WORKER = os.path.join(os.path.dirname(__file__), "dtensor_worker.py")


@pytest.mark.parametrize("world", [2, 3])
def test_dtensor_head_matches_one_process(world, tmp_path):
    outs = run_ranks(WORKER, world, tmp_path)
    assert [o["rank"] for o in outs] == list(range(world))
    assert len(outs[0]["checks"]) == (11 if world == 2 else 10) and all(o["checks"] == outs[0]["checks"] for o in outs)
    cases = outs[0]["errors"]
    assert len(cases) == 10
    for name, message in cases.items():
        assert message is not None, f"{name}: no error"
        for o in outs[1:]:
            assert o["errors"][name] == message, f"{name}: ranks disagree"
    assert "argument `weight`" in cases["weight Shard(1)"] and "Shard(dim=1)" in cases["weight Shard(1)"]
    assert "hidden dimension" in cases["weight Shard(1)"]
    assert "Partial" in cases["weight Partial"]
    assert "argument `hidden`: a plain tensor" in cases["plain per-rank hidden"]
    assert "FSDP" in cases["plain per-rank hidden"]
    assert "Shard(dim=0)" in cases["hidden Shard(0)"] and "argument `hidden`" in cases["hidden Shard(0)"]
    assert "argument `bias`" in cases["plain bias with a sharded weight"]
    assert "2-D mesh" in cases["2-D mesh"]
    assert "argument `weight`" in cases["an empty block"] and "empty block" in cases["an empty block"]
    assert "argument `vocab_parallel_group`" in cases["another group"]
    assert "argument `vocab_parallel_group`" in cases["group with a replicated weight"]
    assert "argument `hidden`: a plain tensor with a replicated" in cases["plain hidden with a replicated weight"]
