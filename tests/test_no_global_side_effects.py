"""Importing hf_hybrid changes nothing about transformers' own models.

Our configs check their layer kinds themselves ("rat", "local", "mamba", ...) and our cache layers
are not registered under layer-type names, so a Llama config that carries those strings behaves
exactly as it does without hf_hybrid imported (here: transformers refuses it the same way).
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

_PROBE = r"""
import json, sys, tempfile
if sys.argv[1] == "with":
    import hf_hybrid  # noqa: F401
from transformers import DynamicCache, LlamaConfig, configuration_utils
from transformers import cache_utils

results = {
    "allowed": list(configuration_utils.ALLOWED_LAYER_TYPES),
    "allowed_attn": list(configuration_utils.ALLOWED_ATTN_LAYER_TYPES),
    "dynamic_layers": sorted(cache_utils.DYNAMIC_LAYER_TYPE_MAPPING),
    "static_layers": sorted(cache_utils.STATIC_LAYER_TYPE_MAPPING),
}
for kind in ["rat", "local", "global", "mamba", "attention", "fox"]:
    outcome = []
    try:
        config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                             vocab_size=32, layer_types=[kind, "full_attention"])
        outcome.append("built")
        try:
            with tempfile.TemporaryDirectory() as d:
                config.save_pretrained(d)
            outcome.append("saved")
        except Exception as e:
            outcome.append(type(e).__name__)
        try:
            cache = DynamicCache(config=config)
            outcome.append("cache:" + ",".join(type(layer).__name__ for layer in cache.layers))
        except Exception as e:
            outcome.append("cache:" + type(e).__name__)
    except Exception as e:
        outcome.append(type(e).__name__)
    results[kind] = outcome
print(json.dumps(results))
"""


def _probe(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_llama_configs_behave_as_without_hf_hybrid():
    without, with_ = _probe("without"), _probe("with")
    assert with_ == without
    # Not vacuous: transformers refuses our layer kinds for its own models.
    assert all(outcome != ["built", "saved", "cache:DynamicLayer,DynamicLayer"] for kind, outcome in with_.items()
               if kind in ("rat", "local", "mamba"))


@pytest.mark.parametrize("name", ["rat_swa", "rattention", "se_hybrid"])
def test_our_configs_validate_their_own_layer_types(name, tmp_path):
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent / "features"))
    from tiny_models import tiny_config

    config = tiny_config(name)
    config.save_pretrained(tmp_path)  # transformers' save-time validation passes
    assert json.loads((tmp_path / "config.json").read_text())["layer_types"] == list(config.layer_types)
    config.layer_types = ["llama"] + list(config.layer_types[1:])
    with pytest.raises(ValueError, match="layer_types"):
        config.save_pretrained(tmp_path / "bad")


@pytest.mark.parametrize("name", ["rat_swa", "rattention", "se_hybrid"])
def test_generic_config_class_reads_our_config(name, tmp_path):
    """transformers' generic PreTrainedConfig reads our config.json (Trainer does, to resume from a
    checkpoint), and still refuses kinds that are not the architecture's own."""
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent / "features"))
    from tiny_models import tiny_config
    from transformers import PreTrainedConfig

    config = tiny_config(name)
    config.save_pretrained(tmp_path)
    generic = PreTrainedConfig.from_json_file(str(tmp_path / "config.json"))
    assert len(generic.layer_types) == len(config.layer_types)  # (transformers renames mamba -> linear_attention)
    data = json.loads((tmp_path / "config.json").read_text())
    data["layer_types"] = ["sliding_window_llama"] + data["layer_types"][1:]
    with pytest.raises(Exception, match="layer_types"):
        PreTrainedConfig(**data)


def test_trainer_resumes_from_a_checkpoint(tmp_path):
    """Trainer(resume_from_checkpoint=...) on an hf-hybrid model: the checkpoint's config is read and
    training continues from the saved step."""
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent / "features"))
    import torch
    from tiny_models import tiny_model
    from transformers import Trainer, TrainingArguments

    ids = torch.randint(1, 61, (8, 12), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = dict(output_dir=str(tmp_path), per_device_train_batch_size=2, save_steps=2, report_to=[], use_cpu=True,
                learning_rate=1e-3, save_strategy="steps", dataloader_num_workers=0)
    Trainer(model=tiny_model("rattention").train(), args=TrainingArguments(max_steps=2, **args), train_dataset=data).train()
    trainer = Trainer(model=tiny_model("rattention").train(), args=TrainingArguments(max_steps=4, **args), train_dataset=data)
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert trainer.state.global_step == 4
