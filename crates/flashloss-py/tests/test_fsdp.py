"""FSDP2 (``fully_shard``) over Gloo on the CPU, 2 processes: a tiny Qwen2 wrapped layer by
layer and at the root, patched by ``flashloss.transformers`` after wrapping, trains 3 AdamW
steps with the losses and every parameter's gradient of the unpatched model under the same
wrapping (fsdp_worker.py checks each rank); an LM head wrapped as an FSDP unit of its own,
whose weight the patched forward reads still sharded, is the same ValueError on every rank.
Skipped without transformers."""

import os

import pytest
from ranks import run_ranks

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

WORKER = os.path.join(os.path.dirname(__file__), "fsdp_worker.py")


def test_fsdp2_patched_training_matches_unpatched(tmp_path):
    outs = run_ranks(WORKER, 2, tmp_path)
    assert [o["rank"] for o in outs] == [0, 1]
    assert outs[0]["losses"] != outs[1]["losses"]  # a different batch per rank: data parallel
    for o in outs:
        assert len(o["losses"]) == 3 and o["worst_grad_error"] <= 1e-4
        error = o["head_unit_error"]
        assert error == outs[0]["head_unit_error"]
        assert error.startswith("argument `hidden`: a plain tensor with a vocabulary-sharded DTensor `weight`")
        assert "FSDP" in error


def test_fsdp2_grpo_trainer_matches_data_parallel(tmp_path):
    """FlashlossGRPOTrainer's and TRL's ``_compute_loss`` under accelerate's FSDP2 wrapping
    (trl_fsdp_worker.py): 2 SGD steps each, equal to the same steps data parallel by hand,
    and flashloss's losses equal to TRL's."""
    pytest.importorskip("trl")
    outs = run_ranks(os.path.join(os.path.dirname(__file__), "trl_fsdp_worker.py"), 2, tmp_path)
    assert [o["rank"] for o in outs] == [0, 1]
    for o in outs:
        assert len(o["losses"]) == 2 and o["losses"][0] != o["losses"][1]
        assert o["worst_grad_error"]["flashloss vs flashloss data parallel"] <= 1e-5
