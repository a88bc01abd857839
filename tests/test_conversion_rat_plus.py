"""Dense Llama -> RAT+ conversion (exact at D=1), its CLI, and resolution adaptation (hf_hybrid.adapt)."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import hf_hybrid  # noqa: F401
from hf_hybrid.adapt import (
    adapt,
    evaluate_patterns,
    dilation_patterns,
    lm_dataset,
    load_user_data,
    main_adapt,
    open_recurrence_gates,
    recurrence_gates_closed,
    synthetic_language,
)
from hf_hybrid.conversion.dense_to_rat_plus import (
    config_from_llama,
    convert_llama_checkpoint,
    main_convert,
    max_logit_difference,
)
from hf_hybrid.sparse import SparseInferenceConfig

VOCAB = 50


def save_tiny_llama(path, **overrides):
    torch.manual_seed(0)
    settings = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    settings.update(overrides)
    model = LlamaForCausalLM(LlamaConfig(**settings))
    model.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return model


@pytest.mark.parametrize("overrides", [{}, {"tie_word_embeddings": True}, {"num_key_value_heads": 4, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}])
def test_converted_random_llama_reproduces_logits_at_D1(tmp_path, overrides):
    save_tiny_llama(tmp_path / "llama", **overrides)
    model = convert_llama_checkpoint(tmp_path / "llama", tmp_path / "rat_plus")
    ids = torch.randint(0, VOCAB, (2, 45))
    assert max_logit_difference(tmp_path / "llama", model, ids) < 1e-4
    # The saved checkpoint is a rat_plus model that loads through the Auto classes, with side files.
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "rat_plus")
    assert reloaded.config.model_type == "rat_plus" and reloaded.config.recurrence_gate_bias
    assert (tmp_path / "rat_plus" / "generation_config.json").exists()
    assert max_logit_difference(tmp_path / "llama", reloaded, ids) < 1e-4


def test_new_parameters_are_closed_gate_and_compensated_output_gate(tmp_path):
    llama = save_tiny_llama(tmp_path / "llama")
    model = convert_llama_checkpoint(tmp_path / "llama", gate_logit=-15.0)
    attn = model.model.layers[1].self_attn
    assert not attn.z_proj.weight.any() and not attn.g_proj.weight.any()
    assert torch.all(attn.g_proj.bias == -15.0)
    torch.testing.assert_close(attn.o_proj.weight, 2 * llama.model.layers[1].self_attn.o_proj.weight)
    assert recurrence_gates_closed(model)
    # With a fully closed gate the only difference left is floating-point order: none at all here.
    shut = convert_llama_checkpoint(tmp_path / "llama", gate_logit=-100.0)
    assert max_logit_difference(tmp_path / "llama", shut, torch.randint(0, VOCAB, (1, 30))) < 1e-6


def test_unsupported_checkpoints_get_clear_errors(tmp_path):
    base = dict(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)
    with pytest.raises(ValueError, match="rope type 'llama3'"):
        config_from_llama(dict(base, rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}))
    with pytest.raises(ValueError, match="rope type 'linear'"):
        config_from_llama(dict(base, rope_theta=1e4, rope_scaling={"type": "linear", "factor": 2.0}))
    with pytest.raises(ValueError, match="attention_bias"):
        config_from_llama(dict(base, attention_bias=True))
    with pytest.raises(ValueError, match="model_type"):
        config_from_llama(dict(base, model_type="gpt2"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        convert_llama_checkpoint(tmp_path / "missing")


def test_convert_cli(tmp_path, capsys):
    save_tiny_llama(tmp_path / "llama")
    main_convert(["dense-to-rat-plus", str(tmp_path / "llama"), str(tmp_path / "out"), "--verify",
                  "--training-dilations", "1,16", "--sparse-config", '{"dilation": 8}'])
    printed = capsys.readouterr().out
    assert "max |logits difference| at D=1" in printed
    difference = float(printed.strip().split()[-1])
    assert difference < 1e-4
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == "rat_plus" and config["training_dilations"] == [1, 16]
    assert config["sparse_config"]["dilation"] == 8


# ---------------------------------------------------------------- resolution adaptation


def test_synthetic_language_is_deterministic_and_in_range():
    a = synthetic_language(4, 200, vocab_size=20, seed=3)
    b = synthetic_language(4, 200, vocab_size=20, seed=3)
    assert torch.equal(a, b) and a.shape == (4, 200)
    assert a.min() >= 3 and a.max() < 23
    assert not torch.equal(a, synthetic_language(4, 200, vocab_size=20, seed=4))


def test_open_recurrence_gates_spreads_memories_up_to_L(tmp_path):
    save_tiny_llama(tmp_path / "llama")
    model = convert_llama_checkpoint(tmp_path / "llama")
    open_recurrence_gates(model, max_length=64)
    bias = torch.cat([layer.self_attn.g_proj.bias for layer in model.model.layers])
    gate = torch.sigmoid(bias)
    assert gate.min() >= 0.5 - 1e-6 and gate.max() <= 63 / 64 + 1e-6 and gate.std() > 0.05
    assert not recurrence_gates_closed(model)


def test_adapt_trains_the_joint_objective_with_trainer(tmp_path):
    save_tiny_llama(tmp_path / "llama")
    model = convert_llama_checkpoint(tmp_path / "llama")
    data = lm_dataset(synthetic_language(48, 40, vocab_size=20, seed=0))
    held_out = synthetic_language(8, 40, vocab_size=20, seed=1)
    before = evaluate_patterns(model, held_out, dilation_patterns([1, 8]))
    trainer = adapt(model, data, tmp_path / "run", training_dilations=[1, {"dilation": 8, "local_window": 2}],
                    max_steps=12, learning_rate=3e-3, batch_size=8, logging_steps=4)
    after = evaluate_patterns(model, held_out, dilation_patterns([1, 8]))
    assert trainer.state.global_step == 12
    assert not recurrence_gates_closed(model)
    assert model.config.training_dilations[1]["local_window"] == 2
    assert after["D=8"] < before["D=8"] and after["D=1"] < before["D=1"]
    with pytest.raises(ValueError, match="training_dilations"):
        adapt(model, data, tmp_path / "run2", training_dilations=[0], max_steps=1)


def test_adapt_cli_on_generated_and_user_data(tmp_path, capsys):
    save_tiny_llama(tmp_path / "llama")
    convert_llama_checkpoint(tmp_path / "llama", tmp_path / "rat_plus")
    main_adapt([str(tmp_path / "rat_plus"), "--output-dir", str(tmp_path / "adapted"), "--generated", "16",
                "--seq-len", "32", "--max-steps", "3", "--learning-rate", "1e-3", "--batch-size", "4",
                "--eval-dilations", "1,4", "--eval-sequences", "4", "--training-dilations", "1,4"])
    printed = capsys.readouterr().out
    assert "D=4" in printed and "saved the adapted model" in printed
    adapted = AutoModelForCausalLM.from_pretrained(tmp_path / "adapted")
    assert adapted.config.training_dilations == [1, 4] and not recurrence_gates_closed(adapted)

    data = lm_dataset(synthetic_language(8, 32, vocab_size=20, seed=5))
    data.save_to_disk(str(tmp_path / "user_data"))
    assert load_user_data(tmp_path / "user_data", tmp_path / "rat_plus", 32)["input_ids"] == data["input_ids"]
    main_adapt([str(tmp_path / "adapted"), "--output-dir", str(tmp_path / "adapted2"), "--data", str(tmp_path / "user_data"),
                "--max-steps", "2", "--batch-size", "4", "--eval-dilations", "1", "--eval-sequences", "2"])
    assert (tmp_path / "adapted2" / "config.json").exists()
    with pytest.raises(ValueError, match="--data"):
        load_user_data(tmp_path / "notes.csv", tmp_path / "rat_plus", 32)


def test_sparse_generation_after_conversion_runs(tmp_path):
    save_tiny_llama(tmp_path / "llama")
    model = convert_llama_checkpoint(tmp_path / "llama")
    ids = torch.randint(3, VOCAB, (1, 20))
    pattern = SparseInferenceConfig(dilation=4, local_window=2)
    with torch.no_grad():
        cached = model.generate(ids, max_new_tokens=5, do_sample=False, sparse_config=pattern)
        uncached = model.generate(ids, max_new_tokens=5, do_sample=False, sparse_config=pattern, use_cache=False)
    assert torch.equal(cached, uncached)
