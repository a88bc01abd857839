"""Every example runs at tiny size in CI and its outputs are checked, not just its exit code."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("model_type,extra", [("rat", ["--set", "chunk_size=4"])])
def test_pretrain_example_learns_and_saves(tmp_path, model_type, extra):
    summary = load_example("pretrain").main(
        ["--model-type", model_type, "--steps", "30", "--batch-size", "8", "--output-dir", str(tmp_path), *extra]
    )
    assert summary["model_type"] == model_type
    assert summary["last_loss"] < summary["first_loss"] - 0.5, summary
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert reloaded.config.model_type == model_type


def test_convert_and_adapt_example():
    result = load_example("convert_and_adapt").main([])
    assert result["max_logit_difference"] < 1e-4
    assert result["loss_after"]["D=16"] < result["loss_before"]["D=16"] - 0.3


def test_sparse_generation_example():
    result = load_example("sparse_generation").main([])
    assert result["entries"]["D=16"][0] < result["entries"]["dense"][0]
