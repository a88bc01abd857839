"""The RAT+ and RAT authors' checkpoints -> hf-hybrid `rat_plus` / `rat`, and back.

Source checkpoints are written here in the official format (conversion/rat_official_random.py:
the trainer's `.pth` with `task`, an EasyDict config, optimizer and scheduler states; official key
names and layouts; random weights). The converted model, loaded with from_pretrained, must match a
float64 restatement of the official forward (conversion/rat_official_reference.py), dense and
with the adapted dilated pattern, at lengths that fill no whole chunk.
"""
from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_hybrid.conversion.checkpoint_io import load_state
from hf_hybrid.conversion.cli import main as convert_cli
from hf_hybrid.conversion.rat_official import convert_official, convert_to_official
from hf_hybrid.conversion.rat_official_format import (
    RAT,
    RAT_PLUS,
    UnsupportedCheckpoint,
    check_shapes,
    load_official,
    restricted_pickle,
    spec_from_config,
)
from hf_hybrid.conversion.rat_official_random import random_official_config, random_official_state, write_random_official_checkpoint
from hf_hybrid.conversion.rat_official_reference import official_logits_float64, official_mask

VOCAB = 128

CASES = {
    "rat_plus_pretrained": (RAT_PLUS, {}),
    "rat_plus_adapted": (RAT_PLUS, dict(joint_train=False, dilation_size=4, local_size=3, initial_size=2)),
    "rat_plus_no_recurrence": (RAT_PLUS, dict(apply_re=False)),
    "rat_plus_bias_tanh_untied": (RAT_PLUS, dict(ffn_bias=True, act_fn="fastgelu", tie_embedding=False)),
    "rat_plus_swiglu": (RAT_PLUS, dict(act_fn="swiglu")),
    "rat": (RAT, dict(chunk_size=4)),
    "rat_chunk_1": (RAT, dict(chunk_size=1)),
    "rat_one_group": (RAT, dict(chunk_size=5, ngroups=1)),
}


def write(tmp_path: Path, case: str, **extra) -> Path:
    kind, kwargs = CASES[case]
    return write_random_official_checkpoint(tmp_path / f"{case}.pth", kind, **{**kwargs, **extra})


def reference(path: Path, ids: torch.Tensor, pattern=(1, 0, 0)) -> torch.Tensor:
    state, config, _ = load_official(path)
    kind = RAT if any(k.endswith("gate_bias") for k in state) else RAT_PLUS
    return official_logits_float64(state, check_shapes(spec_from_config(config, kind), state), ids, pattern)


def ids_of(length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(seed))


def max_rel(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("case", sorted(CASES))
def test_converted_model_matches_the_official_forward(case, tmp_path):
    src = write(tmp_path, case)
    convert_official(src, tmp_path / "hf", verify_tokens=0)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert model.config.mlp_type == ("gated" if case == "rat_plus_swiglu" else "plain")
    for length in (13, 7, 1):  # no whole number of chunks / dilation blocks
        ids = ids_of(length)
        pattern = (4, 3, 2) if case == "rat_plus_adapted" else (1, 0, 0)
        with torch.no_grad():
            ours = model(ids, use_cache=False).logits
        assert max_rel(ours, reference(src, ids, pattern)) <= 1e-5, (case, length)


def test_the_adapted_pattern_is_the_default_and_differs_from_dense(tmp_path):
    src = write(tmp_path, "rat_plus_adapted")
    convert_official(src, tmp_path / "hf", verify_tokens=0)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    sparse = model.config.sparse_config
    assert (sparse["dilation"], sparse["local_window"], sparse["num_sink_tokens"]) == (4, 3, 2)
    ids = ids_of(13)
    dense_ref, sparse_ref = reference(src, ids), reference(src, ids, (4, 3, 2))
    assert max_rel(sparse_ref, dense_ref) > 1e-3  # the check above tells the patterns apart
    with torch.no_grad():
        dense = model(ids, use_cache=False, sparse_config={"dilation": 1}).logits
    assert max_rel(dense, dense_ref) <= 1e-5
    # the official mask: W = 0 keeps the token itself, D = 1 is causal
    assert official_mask(5, 1, 0, 0).equal(torch.ones(5, 5, dtype=torch.bool).tril())
    assert official_mask(5, 100, 0, 0).equal(torch.eye(5, dtype=torch.bool))


def test_pretrained_model_trains_jointly_and_infers_dense(tmp_path):
    convert_official(write(tmp_path, "rat_plus_pretrained"), tmp_path / "hf", verify_tokens=0)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["training_dilations"] == [1, 64]
    assert config["sparse_config"]["dilation"] == 1
    assert (config["mlp_type"], config["hidden_act"], config["mlp_bias"], config["intermediate_size"]) == ("plain", "gelu", False, 256)
    assert (config["rms_norm_eps"], config["rope_theta"], config["tie_word_embeddings"], config["head_dim"]) == (1e-6, 10000.0, True, 16)


def test_parity_is_measured_and_written_into_the_model_card(tmp_path):
    src = write(tmp_path, "rat_plus_adapted")
    _, parity = convert_official(src, tmp_path / "hf", verify_tokens=11, verify_layers=None, command="hf-hybrid convert x")
    assert parity.max_rel <= 1e-5 and parity.layers == 2 and parity.tokens == 11
    card = (tmp_path / "hf" / "README.md").read_text()
    assert str(src) in card and "Parity at conversion" in card and f"{parity.max_abs:.3g}" in card
    assert "D=4, W=3, I=2" in card


def test_generate_with_the_dilated_default_and_the_cache(tmp_path):
    convert_official(write(tmp_path, "rat_plus_adapted"), tmp_path / "hf", verify_tokens=0)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ids = ids_of(9)[:1]
    model.generation_config.eos_token_id = None  # random weights: no early stop
    out = model.generate(ids, max_new_tokens=6, do_sample=False)
    with torch.no_grad():  # greedy decoding with the cache == argmax of full forwards
        expected = ids
        for _ in range(6):
            next_id = model(expected, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            expected = torch.cat([expected, next_id], dim=1)
    assert out.equal(expected)


def test_round_trip_through_the_official_format_is_bit_exact(tmp_path):
    for case in ("rat_plus_adapted", "rat", "rat_plus_bias_tanh_untied", "rat_plus_swiglu"):
        src = write(tmp_path, case)
        first = tmp_path / f"{case}-hf"
        convert_official(src, first, verify_tokens=0)
        official = convert_to_official(first, tmp_path / f"{case}-official", RAT if case == "rat" else RAT_PLUS)
        original, _, _ = load_official(src)
        back, config, _ = load_official(official)
        assert set(back) == set(original)
        assert all(torch.equal(back[k], original[k]) for k in original)
        second = tmp_path / f"{case}-hf2"
        convert_official(official, second, verify_tokens=0)
        a, b = load_state(first), load_state(second)
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
        assert json.loads((first / "config.json").read_text()) == json.loads((second / "config.json").read_text())


def test_cli_converts_both_ways(tmp_path, capsys):
    src = write(tmp_path, "rat")
    convert_cli(["rat-official", str(src), str(tmp_path / "hf"), "--verify-tokens", "9"])
    printed = capsys.readouterr().out
    assert "relative" in printed and "rat" in printed
    convert_cli(["rat-official", str(tmp_path / "hf"), str(tmp_path / "back.pth"), "--to", "official"])
    assert (tmp_path / "back.pth").exists()
    with pytest.raises(SystemExit, match="rat-official"):  # RAT weights given to the RAT+ converter
        convert_cli(["rat-plus-official", str(src), str(tmp_path / "wrong")])


def test_pickled_code_never_runs(tmp_path):
    marker = tmp_path / "pickled-code-ran"

    class Payload:
        def __reduce__(self):
            return os.mkdir, (str(marker),)

    config = random_official_config(RAT_PLUS)
    torch.save({"task": random_official_state(config), "config": config, "resume_kwargs": {"x": Payload()}}, tmp_path / "c.pth")
    state, read_config, _ = load_official(tmp_path / "c.pth")
    assert not marker.exists()
    assert read_config["model"]["backbone"]["num_layers"] == 2 and "embedding.wte.weight" in state
    with pytest.raises(pickle.UnpicklingError):  # what the plain weights-only loader says about the same file
        torch.load(tmp_path / "c.pth", weights_only=True)


def test_easydict_config_and_orig_mod_prefixes_are_read(tmp_path):
    src = write(tmp_path, "rat_plus_pretrained")
    raw = torch.load(src, weights_only=False, pickle_module=restricted_pickle)
    assert type(raw["config"]).__name__ == "ConfigDict" and all(k.startswith("_orig_mod.") for k in raw["task"])
    state, config, _ = load_official(src)
    assert not any("_orig_mod" in k for k in state) and isinstance(config["model"], dict)


def test_bare_state_dicts_take_presets_and_options(tmp_path):
    src = write(tmp_path, "rat_plus_pretrained", with_config=False)
    with pytest.raises(UnsupportedCheckpoint, match="d-head|d_head"):
        convert_official(src, tmp_path / "a", verify_tokens=0)
    with pytest.raises(UnsupportedCheckpoint, match="num_layers = 24"):  # the 1B preset on a 2-layer file
        convert_official(src, tmp_path / "b", preset="1b", verify_tokens=0)
    config, parity = convert_official(src, tmp_path / "c", overrides=dict(d_head=16, seq_len=64), verify_tokens=9)
    assert (config.num_hidden_layers, config.hidden_size, config.head_dim, config.vocab_size) == (2, 64, 16, VOCAB)
    assert config.tie_word_embeddings and parity.max_rel <= 1e-5
    adapted = write(tmp_path, "rat_plus_adapted", with_config=False)
    config, _ = convert_official(adapted, tmp_path / "d", verify_tokens=0, overrides=dict(
        d_head=16, seq_len=64, joint_train=False, dilation_size=4, local_size=3, initial_size=2))
    assert config.sparse_config["dilation"] == 4


def test_hub_folder_layout(tmp_path):
    hub = tmp_path / "ratplus"
    write_random_official_checkpoint(hub / "adapt" / "1b" / "d16w256.pth", RAT_PLUS)
    (hub / "README.md").write_text("model card")
    config, _ = convert_official(hub, tmp_path / "hf", verify_tokens=0)
    assert config.model_type == "rat_plus"
    write_random_official_checkpoint(hub / "pretrain" / "1b" / "52451.pth", RAT_PLUS)
    with pytest.raises(FileNotFoundError, match="2 .pth"):
        convert_official(hub, tmp_path / "hf2", verify_tokens=0)


def test_older_checkpoints_with_a_separate_gate_projection(tmp_path):
    config = random_official_config(RAT_PLUS)
    state = random_official_state(config, compiled=False)
    split = dict(state)
    for i in range(2):
        w = split.pop(f"backbone.layers.{i}.seq_layer.in_proj.weight")
        split[f"backbone.layers.{i}.seq_layer.in_proj.weight"], split[f"backbone.layers.{i}.seq_layer.fgate_proj.weight"] = w[:256], w[256:]
    torch.save({"task": state, "config": config}, tmp_path / "new.pth")
    torch.save({"task": split, "config": config}, tmp_path / "old.pth")
    convert_official(tmp_path / "new.pth", tmp_path / "new", verify_tokens=0)
    convert_official(tmp_path / "old.pth", tmp_path / "old", verify_tokens=0)
    a, b = load_state(tmp_path / "new"), load_state(tmp_path / "old")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("edit, field", [
    (lambda c: c["model"]["backbone"].update(ln="layernorm"), "model.backbone.ln"),
    (lambda c: c["model"]["backbone"]["seq_cell"].update(dilation_size=-1, local_size=8), "dilation_size"),
    (lambda c: c["model"]["backbone"].update(_name_="sequence_interleave"), "_name_"),
    (lambda c: c["model"]["backbone"]["hidden_cell"].update(act_fn="tanh"), "act_fn"),
    (lambda c: c["model"]["embedding"]["pe"].update(_name_="interrope"), "pe._name_"),
])
def test_what_cannot_be_represented_is_refused_naming_the_field(tmp_path, edit, field):
    config = random_official_config(RAT_PLUS)
    state = random_official_state(config)
    edit(config)
    torch.save({"task": state, "config": config}, tmp_path / "c.pth")
    with pytest.raises(UnsupportedCheckpoint, match=field.replace(".", r"\.")):
        convert_official(tmp_path / "c.pth", tmp_path / "hf", verify_tokens=0)


def test_shards_stream_and_load(tmp_path):
    src = write(tmp_path, "rat_plus_pretrained")
    convert_official(src, tmp_path / "hf", max_shard_size="60KB", verify_tokens=9)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 2 and all((tmp_path / "hf" / f).stat().st_size <= 60_000 + 40_000 for f in files)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ids = ids_of(7)
    with torch.no_grad():
        assert max_rel(model(ids).logits, reference(src, ids)) <= 1e-5


def test_bfloat16_output_and_its_parity(tmp_path):
    src = write(tmp_path, "rat")
    _, parity = convert_official(src, tmp_path / "hf", dtype="bfloat16", verify_tokens=12)
    state = load_state(tmp_path / "hf")
    assert {t.dtype for t in state.values()} == {torch.bfloat16}
    assert parity.weights_dtype == "bfloat16" and parity.max_rel <= 1e-5  # the reference reads the same rounded weights


def test_converted_folder_loads_from_its_bundled_code_alone(tmp_path):
    """trust_remote_code=True in a process where `import hf_hybrid` fails gives the same logits and tokens."""
    from models.model_checks import _REMOTE_CODE_SCRIPT, _load_elsewhere
    from helper_process import remote_code_helper

    convert_official(write(tmp_path, "rat_plus_adapted"), tmp_path / "ckpt", verify_tokens=0)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
    model.generation_config.eos_token_id = None
    ids = ids_of(10)[:1]
    with torch.no_grad():
        logits = model(ids).logits
        generated = model.generate(ids, max_new_tokens=3, do_sample=False)
    remote = _load_elsewhere(remote_code_helper(), _REMOTE_CODE_SCRIPT, tmp_path, ids, "remote.pt")
    assert remote["module"].startswith("transformers_modules.")
    assert torch.equal(remote["logits"], logits)
    assert torch.equal(remote["generated"][:, :11], generated[:, :11])


def test_per_layer_patterns_become_layer_overrides(tmp_path):
    src = write_random_official_checkpoint(tmp_path / "c.pth", RAT_PLUS, num_layers=3, joint_train=False,
                                           dilation_size=[4, 1, 4], local_size=[3, 0, 3], initial_size=2)
    config, parity = convert_official(src, tmp_path / "hf", verify_tokens=13, verify_layers=2)
    overrides = config.sparse_config["layer_overrides"]
    assert list(overrides) == [1] and overrides[1]["dilation"] == 1
    assert parity.max_rel <= 1e-5
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ids = ids_of(13)
    with torch.no_grad():
        ours = model(ids, use_cache=False).logits
    assert max_rel(ours, reference(src, ids, [(4, 3, 2), (1, 0, 2), (4, 3, 2)])) <= 1e-5


@pytest.mark.parametrize("kind", [RAT_PLUS, RAT])
def test_hf_hybrid_model_round_trips_through_the_official_format_bit_exact(kind, tmp_path):
    from hf_hybrid.models.rat import RatConfig
    from hf_hybrid.models.rat_plus import RatPlusConfig

    shape = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=64)
    if kind == RAT_PLUS:  # the official backbone's MLP; adapted pattern as the default
        pattern = {"dilation": 8, "local_window": 2, "num_sink_tokens": 1}
        config = RatPlusConfig(**shape, mlp_type="plain", hidden_act="gelu", training_dilations=[pattern], sparse_config=pattern)
    else:  # SwiGLU (the official "swiglu" FFN), untied head
        config = RatConfig(**shape, chunk_size=4, num_qk_groups=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(tmp_path / "ours")
    official = convert_to_official(tmp_path / "ours", tmp_path / "official.pth", kind)
    convert_official(official, tmp_path / "back", verify_tokens=0)
    before, after = load_state(tmp_path / "ours"), load_state(tmp_path / "back")
    before = {k: v for k, v in before.items() if not (config.tie_word_embeddings and k == "lm_head.weight")}
    assert set(before) == set(after) and all(torch.equal(before[k], after[k]) for k in before)
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    for field in ("mlp_type", "hidden_act", "intermediate_size", "head_dim", "rope_theta", "tie_word_embeddings", "sparse_config",
                  "training_dilations", "chunk_size", "num_qk_groups"):
        assert getattr(back.config, field, None) == getattr(model.config, field, None), field
    ids = ids_of(11)
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model(ids).logits)


def test_legacy_serialisation_is_read_too(tmp_path):
    config = random_official_config(RAT_PLUS)
    torch.save({"task": random_official_state(config), "config": config}, tmp_path / "legacy.pth", _use_new_zipfile_serialization=False)
    state, read_config, _ = load_official(tmp_path / "legacy.pth")
    assert read_config == config and state["embedding.wte.weight"].shape == (VOCAB, 64)
