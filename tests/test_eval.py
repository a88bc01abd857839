"""Evaluation tools: per-token loss / perplexity for any causal LM, needle scoring, plots and `hf-hybrid eval`."""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import hf_hybrid  # noqa: F401  (registers the architectures)
from hf_hybrid.data import NeedleVocab, make_language_dataset, make_needle_dataset
from hf_hybrid.eval import NeedleGrid, needle_accuracy, needle_scores, per_token_loss
from hf_hybrid.eval.cli import main as eval_main
from hf_hybrid.eval.plots import log_buckets, plot_loss_by_position, plot_needle_heatmaps

VOCAB = 530  # SyntheticLanguage().vocab_size
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def tiny_llama(vocab: int = VOCAB) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return LlamaForCausalLM(config).eval()


def tiny_rat(vocab: int = VOCAB):
    torch.manual_seed(0)
    config = AutoConfig.for_model("rat", vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, chunk_size=4, max_position_embeddings=512)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("build", [tiny_llama, tiny_rat], ids=["llama", "rat"])
def test_per_token_loss_one_value_per_position_matching_the_model_loss(build):
    model = build()
    data = make_language_dataset(3, 37, seed=0)  # 37 tokens: odd, not a multiple of the RAT chunk
    result = per_token_loss(model, data, batch_size=2)
    assert result.loss.shape == (36,) and torch.equal(result.count, torch.full((36,), 3))
    assert torch.isfinite(result.loss).all()
    ids = torch.tensor(data["input_ids"])
    with torch.no_grad():
        reference = model(ids, labels=ids, use_cache=False).loss.item()
    assert result.loss.mean().item() == pytest.approx(reference, rel=1e-5)  # the HF loss is the mean of L(i)
    assert result.perplexity([36])[36] == pytest.approx(math.exp(reference), rel=1e-5)
    assert result.perplexity([1])[1] == pytest.approx(math.exp(result.loss[0].item()))
    # causal: changing token 20 leaves the losses of predicting tokens 1..19 untouched
    changed = ids.clone()
    changed[:, 20] = (changed[:, 20] + 1) % VOCAB
    again = per_token_loss(model, changed, batch_size=3)
    assert torch.allclose(again.loss[:19], result.loss[:19], atol=1e-6) and not torch.allclose(again.loss[19:], result.loss[19:])


def test_per_token_loss_respects_labels_and_checks_inputs():
    model = tiny_llama(NeedleVocab().size)
    data = make_needle_dataset(2, "single_1", lengths=(64,), depths=(0.5,), template="compact")
    result = per_token_loss(model, data)  # the dataset's labels: only answer tokens are scored
    start, end = data[0]["answer_spans"][0]
    scored = (result.count > 0).nonzero().flatten().tolist()
    assert scored == list(range(start - 1, end - 1)) and torch.isnan(result.loss[0])
    with pytest.raises(ValueError, match="vocab_size"):
        per_token_loss(tiny_llama(vocab=10), data)
    with pytest.raises(ValueError, match="context length 100"):
        result.perplexity([100])


class Cheater(torch.nn.Module):
    """A fake causal LM that reads the answer off the input (teacher forcing lets it) except where told."""

    def __init__(self, vocab: int, wrong_after: int | None = None):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.config = SimpleNamespace(vocab_size=vocab)
        self.wrong_after = wrong_after  # positions >= this predict a wrong token

    def forward(self, input_ids, logits_to_keep: int = 0, use_cache: bool = False):
        following = torch.roll(input_ids, -1, dims=1)
        if self.wrong_after is not None:
            following[:, self.wrong_after :] = (following[:, self.wrong_after :] + 1) % self.config.vocab_size
        logits = torch.nn.functional.one_hot(following, self.config.vocab_size).float()
        return SimpleNamespace(logits=logits[:, -logits_to_keep:] if logits_to_keep else logits)


def test_needle_scores_are_exact_match_per_value():
    vocab = NeedleVocab().size
    data = make_needle_dataset(2, "multivalue", lengths=(160,), depths=(0.0, 1.0), template="compact")
    assert needle_accuracy(Cheater(vocab), data).mean == 1.0
    assert needle_accuracy(Cheater(vocab, wrong_after=0), data).mean == 0.0
    # wrong from the last value's last token on: 3 of 4 values right
    last_end = data[0]["answer_spans"][-1][1]
    scores = needle_scores(Cheater(vocab, wrong_after=last_end - 2), data)
    assert [s["score"] for s in scores] == [0.75] * 4 and not any(s["exact"] for s in scores)
    assert {(s["length"], s["depth"], s["task"]) for s in scores} == {(160, 0.0, "multivalue"), (160, 1.0, "multivalue")}


def test_needle_grid_and_heatmap(tmp_path):
    vocab = NeedleVocab().size
    data = make_needle_dataset(2, "single_1", lengths=(64, 96), depths=(0.0, 0.5, 1.0), template="compact")
    grid = needle_accuracy(tiny_llama(vocab), data, batch_size=4)
    assert grid.lengths == [64, 96] and grid.depths == [0.0, 0.5, 1.0]
    assert [[c for c in row] for row in grid.count] == [[2, 2]] * 3
    assert all(0.0 <= a <= 1.0 for row in grid.accuracy for a in row)
    perfect = needle_accuracy(Cheater(vocab), data)
    path = plot_needle_heatmaps({"tiny llama": grid, "cheater": perfect}, tmp_path / "needle.png")
    assert path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 5000
    assert NeedleGrid(**{k: v for k, v in perfect.to_dict().items() if k in ("lengths", "depths", "accuracy", "count")}).mean == 1.0


def test_loss_plot_and_buckets(tmp_path):
    assert log_buckets(100)[-1] == 100 and log_buckets(100) == sorted(set(log_buckets(100)))
    path = plot_loss_by_position({"a": [3.0 - 0.01 * i for i in range(100)], "b": [float("nan")] + [2.5] * 99}, tmp_path / "loss.png", {"a": {50: 9.0, 100: 8.0}})
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_eval_cli_compares_saved_models(tmp_path, capsys):
    tiny_llama().save_pretrained(tmp_path / "llama")
    tiny_rat().save_pretrained(tmp_path / "rat")
    out = tmp_path / "out"
    models = [str(tmp_path / "llama"), f"RAT={tmp_path / 'rat'}"]
    result = eval_main([*models, "--task", "loss-by-position", "--lengths", "16,32", "--num-examples", "2", "--oracle", "--language", "small", "--output-dir", str(out)])
    assert set(result["models"]) == {"llama", "RAT", "oracle"}
    for r in result["models"].values():
        assert len(r["loss"]) == 32 and set(r["perplexity"]) == {16, 32}
    saved = json.loads((out / "loss_by_position.json").read_text())
    assert saved["models"]["RAT"]["perplexity"]["32"] == pytest.approx(result["models"]["RAT"]["perplexity"][32])
    assert (out / "loss_by_position.png").read_bytes()[:8] == PNG_MAGIC
    printed = capsys.readouterr().out
    assert result["table"] in printed and "PPL(32)" in printed
    # the ideal predictor beats untrained models by far
    assert result["models"]["oracle"]["perplexity"][32] < 0.5 * result["models"]["llama"]["perplexity"][32]

    result = eval_main([*models, "--task", "needle", "--needle-task", "multiquery", "--template", "compact", "--lengths", "120",
                        "--depths", "0,1", "--num-examples", "1", "--output-dir", str(out)])
    assert result["task"] == "multiquery" and set(result["models"]) == {"llama", "RAT"}
    assert result["models"]["RAT"]["count"] == [[1], [1]] and result["models"]["RAT"]["tokenizer"] == "NeedleVocab"
    assert (out / "needle.png").read_bytes()[:8] == PNG_MAGIC and json.loads((out / "needle.json").read_text())["depths"] == [0.0, 1.0]


def test_eval_cli_rejects_bad_input(tmp_path):
    tiny_llama(vocab=64).save_pretrained(tmp_path / "small")
    with pytest.raises(SystemExit, match="vocab_size >= 530"):
        eval_main([str(tmp_path / "small"), "--lengths", "8"])
    with pytest.raises(SystemExit):
        eval_main([str(tmp_path / "small"), "--task", "needle", "--depths", "0,2"])


def test_eval_cli_with_a_model_tokenizer(tmp_path):
    from test_data import _word_tokenizer

    tokenizer = _word_tokenizer()
    folder = tmp_path / "llama-bpe"
    tiny_llama(vocab=len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    text = tmp_path / "book.txt"
    text.write_text(" ".join(f"the {w} of the garden opens the river." for w in ["red", "blue", "green"] * 40))
    result = eval_main([str(folder), "--data", str(text), "--lengths", "8,24", "--num-examples", "3", "--output-dir", str(tmp_path / "o")])
    assert result["models"]["llama-bpe"]["count"] == [3] * 24
    result = eval_main([str(folder), "--task", "needle", "--needle-task", "single_2", "--lengths", "400", "--depths", "0.5",
                        "--num-examples", "2", "--output-dir", str(tmp_path / "o")])
    assert result["models"]["llama-bpe"]["tokenizer"] == "model" and result["models"]["llama-bpe"]["count"] == [[2]]
