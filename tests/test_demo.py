"""The README's main job, at its smallest size: every step runs and the table holds real numbers."""
from __future__ import annotations

import json

from hf_hybrid.cli import main as cli_main
from hf_hybrid.data import RecallVocab, make_mqar_dataset
from hf_hybrid.demo import format_table, main as demo_main


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


def test_demo_smoke_trains_saves_reloads_and_reports(tmp_path, capsys):
    results = demo_main(["--size", "smoke", "--output-dir", str(tmp_path)])
    names = [r["model"] for r in results]
    assert names == ["Attention", "RAT(L=4)", "RAT-SWA(L=4)"]
    by_name = {r["model"]: r for r in results}
    for r in results:
        assert r["class"] == "RatForCausalLM" and r["parameters"] > 0
        assert r["train_loss"] > 0 and 0.0 <= r["recall_accuracy"] <= 1.0 and r["decode_tokens_per_s"] > 0
        assert (tmp_path / r["saved_to"].split("/")[-1] / "model.safetensors").exists()
    # RAT(L=4) keeps one K/V entry per 4 tokens: its 4K cache is about a quarter of attention's.
    ratio = by_name["RAT(L=4)"]["kv_cache_bytes_4k"] / by_name["Attention"]["kv_cache_bytes_4k"]
    assert 0.24 < ratio < 0.27
    assert json.loads((tmp_path / "results.json").read_text()) == results
    printed = capsys.readouterr().out
    assert format_table(results) in printed and "KV cache @4K" in printed


def test_cli_lists_commands_and_rejects_unknown(capsys):
    assert cli_main([]) == 0
    listed = capsys.readouterr().out
    for command in ("demo", "convert", "adapt", "bench", "eval"):
        assert f"  {command} " in listed
    assert cli_main(["no-such-command"]) == 2
