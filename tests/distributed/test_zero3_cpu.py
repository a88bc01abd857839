"""DeepSpeed ZeRO-3 on CPU with 2 gloo processes (needs the ``deepspeed`` package; skipped without
it), every tiny model type: each DecoderLayer gathered whole
(hf_hybrid.distributed.gather_whole_decoder_layers) and run once per step (RAT+'s joint objective:
its training patterns as row groups of one forward), the loss of every step equals one process on
the whole global batch (float32), a DeepSpeed checkpoint written mid-run resumes to the same
losses bit for bit, and the gathered final weights load into a plain CPU model bit for bit.
The ranks run tests/distributed/zero3_cpu_worker.py under torchrun; this test compares its results.
"""
from __future__ import annotations

import json
import os

import pytest

from distributed_launch import TINY_TYPES, torchrun

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.slow  # ~60 s of two processes on a 2-core runner (HF_HYBRID_SLOW=1)

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zero3_cpu_worker.py")
CHECKPOINT_AFTER = 2  # as in the worker
ZERO3_TYPES = list(TINY_TYPES)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("zero3")
    torchrun(WORKER, 2, str(out), *ZERO3_TYPES)
    with open(out / "results.json") as file:
        return json.load(file)


@pytest.mark.parametrize("name", ZERO3_TYPES)
def test_loss_matches_one_process(results, name):
    result = results[name]
    assert len(result["sharded_losses"]) == len(result["reference_losses"]) == 3
    for sharded, reference in zip(result["sharded_losses"], result["reference_losses"]):
        assert sharded == pytest.approx(reference, abs=1e-5, rel=0)


@pytest.mark.parametrize("name", ZERO3_TYPES)
def test_one_forward_per_step(results, name):
    """Each layer runs once per step (RAT+: its training patterns as row groups of that forward)."""
    assert results[name]["layer_calls_per_step"] == [1] * CHECKPOINT_AFTER


@pytest.mark.parametrize("name", ZERO3_TYPES)
def test_checkpoint_resumes_exactly(results, name):
    result = results[name]
    assert result["resumed_losses"] == result["sharded_losses"][CHECKPOINT_AFTER:]


@pytest.mark.parametrize("name", ZERO3_TYPES)
def test_final_weights_load_on_cpu(results, name):
    result = results[name]
    assert result["loaded_bit_exact"]
    # AdamW divides by the root of tiny second moments: float32 reduction-order noise in the
    # gradients moves some parameters by ~1e-5 after 3 steps at lr 1e-3.
    assert result["max_param_diff_vs_reference"] < 1e-4
    assert result["final_logits_diff_vs_reference"] < 1e-4


def test_rat_plus_joint_objective_is_accepted():
    """RAT+ with several training patterns trains under ZeRO-3 (one forward per step: the patterns'
    rows stacked), so preparing it for ZeRO-3 is no longer refused."""
    from tiny_models import tiny_model

    from hf_hybrid.distributed import gather_whole_decoder_layers

    model = tiny_model("rat_plus")
    assert len(model.config.training_dilations) > 1
    assert gather_whole_decoder_layers(model) is model
