"""The README's main job, at its smallest size, through the console script: every contestant trains,
reloads exactly, is measured with its inference options, and the table, JSON and chart agree."""
from __future__ import annotations

import contextlib
import io
import json
import math
import struct

import pytest
import torch

from hf_hybrid.cli import main as cli_main
from hf_hybrid.data import RecallVocab, make_mqar_dataset
from hf_hybrid.demo import format_table, main as demo_main

ROWS = {  # row -> (trained contestant, model class)
    "Llama": ("llama", "LlamaForCausalLM"),
    "RAT(L=4)": ("rat", "RatForCausalLM"),
    "RAT-SWA(L=4,W=4)": ("rat_swa", "RatForCausalLM"),
    "RAT+ D=1": ("rat_plus", "RatPlusForCausalLM"),
    "RAT+ D=2": ("rat_plus", "RatPlusForCausalLM"),
    "RAT+ D=4": ("rat_plus", "RatPlusForCausalLM"),
    "FoX (llama)": ("fox", "FoxForCausalLM"),
    "FoX (pro)": ("fox_pro", "FoxForCausalLM"),
    "RATTENTION(W=4)": ("rattention", "RattentionForCausalLM"),
    "SE-hybrid (se)": ("se_hybrid", "SEHybridForCausalLM"),
    "SE-hybrid (full)": ("se_hybrid", "SEHybridForCausalLM"),
}


def test_mqar_dataset_labels_only_answers():
    vocab = RecallVocab()
    data = make_mqar_dataset(4, num_pairs=5, num_queries=3, noise_length=7, vocab=vocab, seed=1)
    assert len(data) == 4
    for row in data:
        ids, labels = row["input_ids"], row["labels"]
        assert len(ids) == len(labels) == 1 + 2 * 5 + 1 + 7 + 1 + 2 * 3
        stored = dict(zip(ids[1:11:2], ids[2:12:2]))
        answers = [(ids[i - 1], labels[i]) for i, label in enumerate(labels) if label != -100]
        assert len(answers) == 3 and all(stored[key] == value for key, value in answers)


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """`hf-hybrid demo --size smoke` once, through the console script's function."""
    out = tmp_path_factory.mktemp("demo")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # capsys is per test; this fixture is per module
        assert cli_main(["demo", "--size", "smoke", "--output-dir", str(out)]) == 0
    return out, json.loads((out / "results.json").read_text()), printed.getvalue()


def test_demo_smoke_rows_are_sane(smoke_run):
    out, summary, _ = smoke_run
    rows = summary["rows"]
    assert [r["model"] for r in rows] == list(ROWS)
    for r in rows:
        contestant, cls = ROWS[r["model"]]
        assert (r["contestant"], r["class"]) == (contestant, cls)
        assert r["parameters"] > 0 and r["reload_identical"] is True
        for key in ("train_loss", "language_eval_loss"):
            assert math.isfinite(r[key]) and 0 < r[key] < 10, (r["model"], key, r[key])
        assert 0.0 <= r["recall_accuracy"] <= 1.0 and 0.0 <= r["generated_recall"] <= 1.0
        assert r["kv_cache_bytes_4k"] > 0
        folder = out / r["saved_to"].split("/")[-1]
        assert (folder / "model.safetensors").exists()
        assert json.loads((folder / "config.json").read_text())["model_type"] == r["model_type"]
    # Inference variants share one trained model: same weights, same checkpoint, different keywords.
    by_name = {r["model"]: r for r in rows}
    for group in (["RAT+ D=1", "RAT+ D=2", "RAT+ D=4"], ["SE-hybrid (se)", "SE-hybrid (full)"]):
        assert len({(by_name[n]["saved_to"], by_name[n]["parameters"], by_name[n]["train_loss"]) for n in group}) == 1
    assert [by_name[f"RAT+ D={d}"]["inference"]["sparse_config"]["dilation"] for d in (1, 2, 4)] == [1, 2, 4]
    assert by_name["SE-hybrid (se)"]["inference"] == {"attention_mode": "se"}
    assert 0 < summary["oracle_language_loss"] < 10 and summary["recall_chance"] < summary["recall_by_elimination"] < 1


def test_demo_smoke_kv_cache_facts(smoke_run):
    cache = {r["model"]: r["kv_cache_bytes_4k"] for r in smoke_run[1]["rows"]}
    llama = cache["Llama"]
    # RAT(L=4) keeps one K/V entry per 4 tokens (plus the open chunk's running state).
    assert 0.24 < cache["RAT(L=4)"] / llama < 0.27
    # Every other layer of RAT-SWA is a 4-token window: less than RAT alone.
    assert cache["RAT-SWA(L=4,W=4)"] < cache["RAT(L=4)"]
    # RAT+ at dilation D keeps the block ends (T/D) plus 4 sinks: the cache shrinks with D.
    assert cache["RAT+ D=4"] < cache["RAT+ D=2"] < cache["RAT+ D=1"]
    assert 0.23 < cache["RAT+ D=4"] / cache["RAT+ D=1"] < 0.27
    # Half the layers are local (window + linear-attention state) or Mamba: well under Llama's.
    assert cache["RATTENTION(W=4)"] < 0.6 * llama and cache["SE-hybrid (se)"] < 0.6 * llama
    # The SE cache keeps all K/V in every mode (the mode may change between calls).
    assert cache["SE-hybrid (se)"] == cache["SE-hybrid (full)"]
    # FoX stores K/V plus its forget-gate cumsum per head: a little more than Llama.
    assert llama <= cache["FoX (llama)"] < 1.1 * llama


def test_demo_smoke_decode_column_only_on_a_gpu(smoke_run):
    """Decode speed is measured on the GPU at the long-context setting; without a GPU the column, the
    chart panel and the JSON fields are left out and the printout says why."""
    from hf_hybrid.demo.setup import DECODE_GPU

    _, summary, printed = smoke_run
    header = format_table(summary["rows"]).splitlines()[0]
    if torch.cuda.is_available():
        for r in summary["rows"]:
            assert r["decode_device"] == "cuda" and r["decode_tokens_per_s"] > 0
            assert (r["decode_batch"], r["decode_context"], r["decode_new_tokens"]) == (
                DECODE_GPU.batch, DECODE_GPU.context, DECODE_GPU.new_tokens)
        assert f"after a {DECODE_GPU.context}-token prompt" in printed and "decode tok/s" in header
    else:
        assert not any(key.startswith("decode_") for r in summary["rows"] for key in r)
        assert "decode tok/s" not in header and "measured on a GPU only" in printed


def test_demo_says_where_it_writes_and_how_long_it_took(smoke_run):
    out, summary, printed = smoke_run
    lines = printed.strip().splitlines()
    assert f"go to {out.resolve()}/" in lines[0]
    assert lines[-1].startswith("Done in ") and 0 < summary["seconds"]


def test_decode_speed_counts_tokens_after_the_prefill(monkeypatch):
    """The timed span runs from the first generated token to the last: a slow prefill does not count."""
    import time as time_module

    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_hybrid.demo import measure as demo_measure
    from hf_hybrid.demo.setup import DecodeSetting

    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, pad_token_id=0)).eval()
    fake_now = iter(range(1000))  # every clock read advances one second
    monkeypatch.setattr(time_module, "perf_counter", lambda: float(next(fake_now)))
    speed = demo_measure.decode_tokens_per_second(model, "cpu", DecodeSetting(batch=3, context=5, new_tokens=4))
    assert speed == 3 * 3 / 3  # 3 rows x 3 tokens after the first, one (fake) second per token


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_demo_decode_column_on_gpu_shows_the_compact_cache():
    """At the GPU setting (4K context) RAT's cache (1/4 of Llama's) decodes faster than Llama's."""
    from transformers import AutoModelForCausalLM

    from hf_hybrid.demo.measure import decode_speed_row
    from hf_hybrid.demo.setup import SIZES, build_config, default_contestants

    size = SIZES["tiny"]
    speed = {}
    for contestant in default_contestants(size)[:2]:  # Llama, RAT(L=4)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(build_config(contestant, size, 400)).eval()
        row = decode_speed_row(model)
        assert row["decode_device"] == "cuda" and next(model.parameters()).device.type == "cpu"  # moved back
        speed[contestant.key] = row["decode_tokens_per_s"]
    assert speed["rat"] > speed["llama"], speed


def test_demo_smoke_table_json_and_chart(smoke_run):
    out, summary, printed = smoke_run
    assert summary["size"] == "smoke" and summary["device"] == "cpu"
    table = format_table(summary["rows"])
    assert table in printed
    for header in ("params", "train loss", "lang loss", "recall acc", "KV cache @4K"):
        assert header in table.splitlines()[0]
    png = out / "results.png"
    assert summary["chart"] == str(png)
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 400 and height > 200


def test_demo_only_subset_returns_its_rows(tmp_path):
    results = demo_main(["--size", "smoke", "--steps", "2", "--only", "llama,rat_plus", "--output-dir", str(tmp_path)])
    assert [r["model"] for r in results] == ["Llama", "RAT+ D=1", "RAT+ D=2", "RAT+ D=4"]
    assert json.loads((tmp_path / "results.json").read_text())["rows"] == results


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--only", "llama,gpt5"], "unknown contestant"),
        (["--steps", "0"], "--steps"),
        (["--device", "not-a-device"], "--device"),
    ],
)
def test_demo_rejects_bad_options(argv, message, capsys):
    with pytest.raises(SystemExit) as error:
        demo_main(argv)
    assert error.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown when CUDA is missing")
def test_demo_cuda_without_cuda_names_the_fix(capsys):
    with pytest.raises(SystemExit):
        demo_main(["--device", "cuda"])
    err = capsys.readouterr().err
    assert "--device cuda" in err and "--device cpu" in err


def test_cli_lists_commands_and_rejects_unknown(capsys):
    assert cli_main([]) == 0
    listed = capsys.readouterr().out
    for command in ("demo", "convert", "adapt", "bench", "eval"):
        assert f"  {command} " in listed
    assert cli_main(["no-such-command"]) == 2
