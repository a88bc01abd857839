"""FoX checkpoints of the official code and of flash-linear-attention -> hf-hybrid `fox`, and back.

Source checkpoints are written here with each format's own parameter names and shapes (from the
official modeling file and FLA's), random weights; the converted model must match a float64
restatement of the source forward (conversion/fox_reference.py), which reads the source names.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_hybrid
from hf_hybrid.conversion.checkpoint_io import load_state, save_state
from hf_hybrid.conversion.fox import convert_from_fox, convert_to_fox, main
from hf_hybrid.conversion.fox_formats import UnsupportedCheckpoint
from hf_hybrid.conversion.fox_reference import source_logits_float64

HIDDEN, HEADS, LAYERS, VOCAB = 64, 4, 2, 97


def official_config(**overrides) -> dict:
    config = dict(
        model_type="forgetting_transformer-project_fox", vocab_size=VOCAB, hidden_size=HIDDEN, hidden_ratio=2,
        intermediate_size=None, num_hidden_layers=LAYERS, num_heads=HEADS, num_kv_heads=None, hidden_act="swish",
        window_size=None, max_position_embeddings=None, norm_eps=1e-6, tie_word_embeddings=False,
        attention_bias=False, use_rope=False, rope_base=500000.0, use_output_gate=False, ogate_act="sigmoid",
        fgate_type="full", fgate_bias_init=False, decay_time_min=None, decay_time_max=None, use_output_norm=False,
        qk_norm=False, qk_norm_share_param_across_head=False, use_k_shift=False, use_v_shift=False,
        log_pruning_tolerance=None, fuse_norm=True, fuse_cross_entropy=True,
    )
    config.update(overrides)
    return config


def fla_config(**overrides) -> dict:
    config = dict(
        model_type="forgetting_transformer", vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
        num_heads=HEADS, num_kv_heads=None, qkv_bias=False, qk_norm=False, window_size=None, use_output_gate=False,
        hidden_ratio=4, intermediate_size=96, hidden_act="swish", norm_eps=1e-6, tie_word_embeddings=False,
        fuse_norm=True, fuse_swiglu=True, fuse_cross_entropy=True, fuse_linear_cross_entropy=False, use_l2warp=False,
    )
    config.update(overrides)
    return config


def source_state(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under the source format's own module names (official modeling file / FLA)."""
    gen = torch.Generator().manual_seed(seed)
    official = config["model_type"].endswith("project_fox")
    hidden, heads = config["hidden_size"], config["num_heads"]
    dim = hidden // heads
    kv_dim = (config.get("num_kv_heads") or heads) * dim
    if config.get("intermediate_size") is not None:
        inner = config["intermediate_size"]
    else:
        inner = 256 * ((int(hidden * config["hidden_ratio"] * 2 / 3) + 255) // 256)

    def rand(*shape, scale=0.3):
        return torch.randn(*shape, generator=gen) * scale

    def norm(*shape):
        return 1 + rand(*shape, scale=0.2)

    state = {"model.embeddings.weight": rand(config["vocab_size"], hidden, scale=1.0), "model.norm.weight": norm(hidden)}
    if not config["tie_word_embeddings"]:
        state["lm_head.weight"] = rand(config["vocab_size"], hidden)
    for i in range(config["num_hidden_layers"]):
        a, m = f"model.layers.{i}.attn.", f"model.layers.{i}.mlp."
        state[f"model.layers.{i}.attn_norm.weight"] = norm(hidden)
        state[f"model.layers.{i}.mlp_norm.weight"] = norm(hidden)
        state[a + "q_proj.weight"] = rand(hidden, hidden)
        state[a + "o_proj.weight"] = rand(hidden, hidden)
        for kv in ("k", "v"):
            if official and config.get(f"use_{kv}_shift"):
                state[a + f"{kv}_proj.linear.weight"] = rand(kv_dim, hidden)
                state[a + f"{kv}_proj.shift_proj.weight"] = rand(heads, hidden)
            else:
                state[a + f"{kv}_proj.weight"] = rand(kv_dim, hidden)
        fgate = config.get("fgate_type", "full")
        if not official:
            state[a + "f_proj.weight"], state[a + "f_proj.bias"] = rand(heads, hidden), rand(heads, scale=1.0) + 3
        elif fgate == "full":
            state[a + "fgate_proj.weight"], state[a + "fgate_proj.bias"] = rand(heads, hidden), rand(heads, scale=1.0) + 3
        elif fgate in ("bias_only", "fixed"):
            state[a + "fgate_bias"] = rand(heads, scale=1.0) + 2
        if config.get("use_output_gate"):
            state[a + ("ogate_proj.weight" if official else "g_proj.weight")] = rand(hidden, hidden)
        if config.get("qk_norm"):
            shared = config.get("qk_norm_share_param_across_head")
            state[a + "q_norm.weight"] = norm(dim if shared else hidden)
            state[a + "k_norm.weight"] = norm(dim if shared else kv_dim)
        if official and config.get("use_output_norm"):
            state[a + "output_norm.weight"] = norm(hidden)
        if official:
            state[m + "gate_proj.weight"] = rand(2 * inner, hidden)
        else:
            state[m + "gate_proj.weight"], state[m + "up_proj.weight"] = rand(inner, hidden), rand(inner, hidden)
        state[m + "down_proj.weight"] = rand(hidden, inner)
    return state


def write_source(path: Path, config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    state = source_state(config, seed)
    save_state(path, config, state)
    (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 128}))
    return state


CASES = {
    "official-llama-rope": official_config(use_rope=True, rope_base=10000.0),
    "official-pro": official_config(qk_norm=True, use_k_shift=True, use_v_shift=True, use_output_gate=True, use_output_norm=True),
    "official-pro-shared-qk-norm-bias-only": official_config(
        qk_norm=True, qk_norm_share_param_across_head=True, use_k_shift=True, use_v_shift=True, use_output_gate=True,
        use_output_norm=True, fgate_type="bias_only", fgate_bias_init=True, decay_time_min=2.0, decay_time_max=64.0),
    "official-fixed-gate-norm-only": official_config(fgate_type="fixed", fgate_bias_init=True, decay_time_min=2.0,
                                                     decay_time_max=128.0, use_output_norm=True),
    "official-no-gate-tied": official_config(fgate_type="none", use_rope=True, tie_word_embeddings=True),
    "fla-llama": fla_config(),
    "fla-gqa-qknorm-gate-tied": fla_config(num_kv_heads=2, qk_norm=True, use_output_gate=True, tie_word_embeddings=True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_converted_checkpoint_matches_float64_source(tmp_path, case):
    config = CASES[case]
    state = write_source(tmp_path / "src", config)
    convert_to_fox(tmp_path / "src", tmp_path / "dst", verify_tokens=0)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "dst", dtype=torch.float32).eval()
    assert isinstance(model, hf_hybrid.FoxForCausalLM)
    ids = torch.randint(0, VOCAB, (2, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(ids).logits.double()
    reference = source_logits_float64(config, state, ids)
    assert (ours - reference).abs().max() <= 1e-5 * reference.abs().max()
    # the cache path decodes the converted model exactly too
    with torch.no_grad():
        prefill = model(ids[:, :15], use_cache=True)
        step = model(ids[:, 15:], past_key_values=prefill.past_key_values).logits.double()
    assert torch.allclose(step, ours[:, 15:], atol=1e-4, rtol=1e-4)
    assert (tmp_path / "dst" / "tokenizer_config.json").exists()


def test_pro_block_is_recognised_and_eps_kept(tmp_path):
    write_source(tmp_path / "src", CASES["official-pro"])
    model, _ = convert_to_fox(tmp_path / "src", None, verify_tokens=0)
    assert model.config.block_type == "pro"
    assert model.config.qk_norm_eps == 1e-5 and model.config.rms_norm_eps == 1e-6
    assert model.model.layers[0].self_attn.q_norm.eps == 1e-5


@pytest.mark.parametrize("fmt, base", [("fla", "fla-gqa-qknorm-gate-tied"), ("fla", "fla-llama"), ("official", "official-pro"),
                                        ("official", "official-pro-shared-qk-norm-bias-only")])
def test_round_trip_ours_source_ours_is_bit_exact(tmp_path, fmt, base):
    write_source(tmp_path / "src", CASES[base])
    first, _ = convert_to_fox(tmp_path / "src", tmp_path / "ours", verify_tokens=0)
    convert_from_fox(tmp_path / "ours", tmp_path / "back", fmt)
    second, _ = convert_to_fox(tmp_path / "back", tmp_path / "ours2", verify_tokens=0)
    a, b = load_state(tmp_path / "ours"), load_state(tmp_path / "ours2")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert first.config.to_dict()["block_type"] == second.config.to_dict()["block_type"]


def test_export_refuses_what_the_format_cannot_express(tmp_path):
    write_source(tmp_path / "src", CASES["official-pro"])
    convert_to_fox(tmp_path / "src", tmp_path / "ours", verify_tokens=0)
    with pytest.raises(UnsupportedCheckpoint, match="kv_shift"):
        convert_from_fox(tmp_path / "ours", tmp_path / "fla", "fla")


@pytest.mark.parametrize("make, field", [
    (lambda: official_config(window_size=512), "window_size"),
    (lambda: official_config(attention_bias=True), "attention_bias"),
    (lambda: official_config(use_output_gate=True, ogate_act="silu"), "ogate_act"),
    (lambda: official_config(use_k_shift=True), "use_k_shift"),
    (lambda: official_config(hidden_act="sigmoid"), "hidden_act"),
    (lambda: official_config(num_kv_heads=2), "num_kv_heads"),
    (lambda: fla_config(qkv_bias=True), "qkv_bias"),
    (lambda: fla_config(window_size=64), "window_size"),
    (lambda: dict(fla_config(), model_type="llama"), "model_type"),
])
def test_unrepresentable_fields_are_refused_by_name(tmp_path, make, field):
    config = make()
    save_state(tmp_path / "src", config, {})
    with pytest.raises(UnsupportedCheckpoint, match=field):
        convert_to_fox(tmp_path / "src", None, verify_tokens=0)


def test_leftover_tensors_are_an_error(tmp_path):
    config = CASES["fla-llama"]
    state = source_state(config)
    state["model.layers.0.attn.extra.weight"] = torch.zeros(3)
    save_state(tmp_path / "src", config, state)
    with pytest.raises(UnsupportedCheckpoint, match="extra"):
        convert_to_fox(tmp_path / "src", None, verify_tokens=0)


def test_cli_writes_card_with_source_command_and_parity(tmp_path, capsys):
    write_source(tmp_path / "src", CASES["official-pro"])
    main(["fox", str(tmp_path / "src"), str(tmp_path / "dst"), "--verify-tokens", "16"])
    out = capsys.readouterr().out
    assert "pro block" in out and "max |logit difference|" in out
    card = (tmp_path / "dst" / "README.md").read_text()
    assert "## Conversion" in card and str(tmp_path / "src") in card and "hf-hybrid convert fox" in card
    rel = float(card.split("(relative ")[1].split(")")[0])
    assert rel < 1e-5
    main(["fox", str(tmp_path / "dst"), str(tmp_path / "official"), "--to", "official"])
    assert json.loads((tmp_path / "official" / "config.json").read_text())["model_type"] == "forgetting_transformer-project_fox"


def test_convert_example_runs(tmp_path):
    import runpy

    example = Path(__file__).resolve().parents[1] / "examples" / "convert_fox.py"
    module = runpy.run_path(str(example))
    module["main"](["--out", str(tmp_path)])
