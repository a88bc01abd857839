"""examples/train_multi_gpu.py at tiny size on one CPU process: it logs every step's loss, a run
resumed from its mid-run checkpoint repeats the remaining losses exactly, and the final
save_pretrained checkpoint reloads on CPU with the trained weights. (Its multi-GPU launches,
FSDP2 and ZeRO-3, are checked by tests/gpu/multi_gpu_check.py.)"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_multi_gpu.py"
TINY = ["--hidden-size", "32", "--layers", "2", "--heads", "4", "--vocab-size", "61", "--seq-len", "24",
        "--batch-size", "2", "--max-steps", "4", "--save-steps", "2", "--set", "rat:chunk_size=4", "--set", "fox:block_type=llama"]


def load_example():
    spec = importlib.util.spec_from_file_location("train_multi_gpu", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_losses_resume_and_final_checkpoint(tmp_path):
    example = load_example()
    [first] = example.main(["--model-type", "rat", "--output-dir", str(tmp_path / "first"), *TINY])
    [resumed] = example.main(["--model-type", "rat", "--output-dir", str(tmp_path / "resumed"), *TINY,
                              "--resume-from-checkpoint", str(tmp_path / "first" / "{model_type}" / "checkpoint-2")])
    assert sorted(first["losses"]) == [1, 2, 3, 4]
    assert all(0.0 < loss < 10.0 for loss in first["losses"].values())
    assert [resumed["losses"][step] for step in (3, 4)] == [first["losses"][step] for step in (3, 4)]
    assert json.loads((tmp_path / "first" / "rat" / "losses.json").read_text())["losses"]["4"] == first["losses"][4]

    final = AutoModelForCausalLM.from_pretrained(first["final"])
    again = AutoModelForCausalLM.from_pretrained(resumed["final"])
    for (name, weight), (_, other) in zip(final.state_dict().items(), again.state_dict().items()):
        assert torch.equal(weight, other), name
    torch.manual_seed(0)  # the example's initial weights: training moved them
    initial = AutoModelForCausalLM.from_config(final.config)
    assert not torch.equal(final.lm_head.weight, initial.lm_head.weight)
