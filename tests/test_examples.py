"""Every example runs at tiny size in CI and its outputs are checked, not just its exit code."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import huggingface_hub
import torch
import yaml
from huggingface_hub import constants as hub_constants
from transformers import AutoConfig, AutoModelForCausalLM

from hf_hybrid.data import RecallVocab, make_mqar_dataset
from hf_hybrid.eval import recall_accuracy
from hub_server import HubServer

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Per architecture, the --set overrides that keep it tiny at the example's default sizes (hidden 64,
# 2 layers, 4 heads) on MQAR sequences of 51 tokens; llama is transformers' own softmax baseline.
PRETRAIN_CASES = {
    "rat": ["--set", "chunk_size=4"],
    "rat_plus": ["--set", "training_dilations=[1,4]"],
    "fox": [],
    "rattention": ["--set", "window_size=8", "--set", "layer_types=['local','global']"],
    "se_hybrid": ["--set", "se_chunk_sizes=[16]", "--set", "se_select_every=8", "--set", "se_block_size=4",
                  "--set", "mamba_d_head=16", "--set", "mamba_d_state=16", "--set", "mamba_chunk_size=16"],
    "llama": [],
}


@pytest.mark.parametrize("model_type", list(PRETRAIN_CASES))
def test_pretrain_example_learns_and_saves(tmp_path, model_type):
    summary = load_example("pretrain").main(
        ["--model-type", model_type, "--steps", "30", "--batch-size", "8", "--output-dir", str(tmp_path),
         *PRETRAIN_CASES[model_type]]
    )
    assert summary["model_type"] == model_type
    assert summary["world_size"] == 1
    assert summary["last_loss"] < summary["first_loss"] - 0.5, summary
    assert 0.0 <= summary["recall_accuracy"] <= 1.0

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert reloaded.config.model_type == model_type
    package = "transformers." if model_type == "llama" else "hf_hybrid."
    assert type(reloaded).__module__.startswith(package), type(reloaded)
    if model_type != "llama":  # hf-hybrid's save_pretrained adds the model card and the remote code
        assert (tmp_path / "README.md").is_file()
        assert "auto_map" in json.loads((tmp_path / "config.json").read_text())
    # The saved weights are the trained ones: same recall on the example's held-out set (seed 0 + 1).
    eval_set = make_mqar_dataset(128, 8, 8, 16, RecallVocab(), seed=1).with_format("torch")[:]
    assert recall_accuracy(reloaded, eval_set["input_ids"], eval_set["labels"]) == summary["recall_accuracy"]


@pytest.mark.slow  # ~25 s on a 2-core runner (HF_HYBRID_SLOW=1); conversion and adaptation have their own tests
def test_convert_and_adapt_example():
    result = load_example("convert_and_adapt").main([])
    assert result["max_logit_difference"] < 1e-4
    assert result["loss_after"]["D=16"] < result["loss_before"]["D=16"] - 0.3


def test_convert_rat_plus_official_example(tmp_path):
    import re

    result = load_example("convert_rat_plus_official").main(["--out", str(tmp_path)])
    sparse = result["sparse_config"]
    assert (sparse["dilation"], sparse["local_window"], sparse["num_sink_tokens"]) == (16, 256, 4)
    assert result["new_tokens"] == 8
    relative = float(re.search(r"relative ([0-9.e+-]+)", result["parity"]).group(1))
    assert relative <= 1e-5 and "320 random tokens" in result["parity"]


@pytest.mark.slow  # ~40 s on a 2-core runner (HF_HYBRID_SLOW=1); sparse generation has its own tests
def test_sparse_generation_example():
    result = load_example("sparse_generation").main([])
    assert result["entries"]["D=16"][0] < result["entries"]["dense"][0]


HUB_TOKEN = "hf_test"
TRAINING_DATA = "nothing: randomly initialised"


def _hub_client_env(hub: HubServer, hf_home: Path) -> dict[str, str]:
    """This environment without Hub settings, tokens or offline switches, plus the loopback endpoint,
    an empty HF_HOME, no telemetry (its requests would reach the loopback hub) and one CPU thread."""
    hub_settings = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_OFFLINE", "TRANSFORMERS_CACHE")
    env = {k: v for k, v in os.environ.items() if not k.startswith(hub_settings) or k.startswith("HF_HYBRID_")}
    env.update(HF_HOME=str(hf_home), HF_HUB_DISABLE_TELEMETRY="1", OMP_NUM_THREADS="1", NO_PROXY="127.0.0.1,localhost")
    return env


# How each architecture's case runs the example:
#   script     `python examples/push_to_hub.py --endpoint URL` in a fresh process, whose HF_ENDPOINT the
#              example sets before importing huggingface_hub (the endpoint is not in the environment);
#   in_process main(argv) here, where huggingface_hub is already imported: the example repoints its
#              endpoint constants for the call and must restore them;
#   model_path in process, pushing a checkpoint saved beforehand (--model-path) with --training-data.
PUSH_CASES = [("rat", "script"), ("fox", "model_path"), ("rat_plus", "in_process"),
              ("rattention", "in_process"), ("se_hybrid", "in_process")]


@pytest.mark.parametrize("model_type,how", PUSH_CASES)
def test_push_to_hub_example_through_a_loopback_hub(tmp_path, monkeypatch, model_type, how):
    example = load_example("push_to_hub")
    with HubServer(token=HUB_TOKEN) as hub:
        argv = ["--model-type", model_type, "--endpoint", hub.endpoint, "--token", HUB_TOKEN]
        if how == "script":
            result = subprocess.run(
                [sys.executable, str(EXAMPLES / "push_to_hub.py"), *argv], env=_hub_client_env(hub, tmp_path / "hf_home"),
                cwd=tmp_path, capture_output=True, text=True, timeout=300,
            )
            assert result.returncode == 0, result.stderr[-4000:]
            summary = json.loads(result.stdout.strip().splitlines()[-1])
        else:
            if hub_constants.HF_HUB_OFFLINE:
                pytest.skip("huggingface_hub was imported with HF_HUB_OFFLINE set")
            monkeypatch.setattr(hub_constants, "HF_HUB_DISABLE_TELEMETRY", True)
            monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
            if how == "model_path":
                config = AutoConfig.for_model(model_type, **example.tiny_config_kwargs(model_type))
                torch.manual_seed(1)
                AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "checkpoint")
                argv = ["--model-path", str(tmp_path / "checkpoint"), "--repo-id", "me/checkpoint",
                        "--training-data", TRAINING_DATA, "--endpoint", hub.endpoint, "--token", HUB_TOKEN]
            endpoint_before, template_before = hub_constants.ENDPOINT, hub_constants.HUGGINGFACE_CO_URL_TEMPLATE
            # huggingface_hub's process-wide HTTP client: a fresh one (it reads NO_PROXY when created), and
            # closed afterwards, so no keep-alive connection holds the hub's stop() for its idle timeout.
            huggingface_hub.close_session()
            try:
                summary = example.main(argv)
            finally:
                huggingface_hub.close_session()
            assert (hub_constants.ENDPOINT, hub_constants.HUGGINGFACE_CO_URL_TEMPLATE) == (endpoint_before, template_before)

        assert hub.unhandled == [] and hub.errors == [], (hub.unhandled, hub.errors)
        repo_id = "me/checkpoint" if how == "model_path" else f"me/tiny-{model_type.replace('_', '-')}"
        head = hub.head(repo_id)
        assert summary["endpoint"] == hub.endpoint
        assert (summary["repo_id"], summary["commit"], summary["model_type"]) == (repo_id, head.oid, model_type)

        # Reloaded through the hub from an empty cache: bit-identical logits, our class.
        assert summary["logits_identical"] is True and summary["max_logit_difference"] == 0.0
        assert summary["reloaded_model_type"] == model_type
        assert summary["reloaded_class"].startswith(f"hf_hybrid.models.{model_type}.")
        downloads = {path for method, path in hub.requests if method == "GET" and "/resolve/" in path}
        assert f"/{repo_id}/resolve/{head.oid}/model.safetensors" in downloads

        # The files the example listed are the ones on the hub: weights, config, card, remote code.
        files = set(summary["files"])
        assert files == set(head.files)
        assert {"config.json", "model.safetensors", "README.md", f"configuration_{model_type}.py",
                f"modeling_{model_type}.py"} <= files
        assert set(summary["remote_code_files"]) == {name for name in files if name.endswith(".py")}
        assert summary["auto_map"] == json.loads(head.files["config.json"])["auto_map"]
        assert summary["auto_map"]["AutoModelForCausalLM"].startswith(f"modeling_{model_type}.")

        # The card fields the example read are the front matter of the README.md on the hub.
        card = head.files["README.md"].decode()
        front = yaml.safe_load(card[4:].partition("\n---\n")[0])
        assert summary["card"] == {key: front.get(key) for key in ("library_name", "pipeline_tag", "license", "tags")}
        assert summary["card"]["library_name"] == "transformers"
        assert summary["card"]["pipeline_tag"] == "text-generation"
        assert {"hf-hybrid", model_type} <= set(summary["card"]["tags"])
        assert f'from_pretrained("{repo_id}")' in card
        if how == "model_path":
            assert TRAINING_DATA in card
