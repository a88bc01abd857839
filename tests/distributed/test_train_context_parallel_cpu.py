"""examples/train_context_parallel.py on CPU: 4 gloo processes as dp=2 x cp=2, under FSDP2 over
dp x cp, with plain gradient sums and under torch's DDP, train like one process on the whole global
batch (float32, reference kernels): every step's loss, every gradient and the parameters after 2
SGD steps, for one tiny model of each architecture (every variant with HF_HYBRID_SLOW=1; context parallelism covers
every mixer of these). The plain runs use the mesh accelerate's ParallelismConfig builds. One
torchrun launch runs every check (tests/distributed/train_context_parallel_worker.py)."""
from __future__ import annotations

import json
import os

import pytest

from distributed_launch import TINY_TYPES, torchrun

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train_context_parallel_worker.py")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("train_cp")
    torchrun(WORKER, 4, str(out), *TINY_TYPES)
    with open(out / "results.json") as file:
        return json.load(file)


def test_mesh_layout_and_coalesced_reduction(results):
    assert results["dp_rank_and_cp_rank"]  # ranks d * cp .. d * cp + cp - 1 split data-parallel rank d's rows
    assert results["accelerate_layout_matches"]  # accelerate's ParallelismConfig mesh: the same ranks
    assert results["coalesced_matches_per_tensor"]
    assert results["wrong_size_refused"]  # dp x cp must be the number of processes, and the error says so


@pytest.mark.parametrize("mode", ["fsdp", "plain", "ddp"])
@pytest.mark.parametrize("name", TINY_TYPES)
def test_dp_x_cp_trains_like_one_process(results, name, mode):
    result = results[name][mode]
    assert result["missing_grads"] == []
    assert len(result["losses"]) == 2
    assert result["loss_diff"] <= 1e-5
    assert max(result["grad_diffs"]) <= 1e-5 * max(1.0, result["grad_scale"])  # both steps
    assert result["param_diff"] <= 1e-5
    assert result["moved"] > 1e-3  # the steps changed the weights: the comparison sees training
