"""Generated data: needle tasks put labels, needles and depths where they claim; the synthetic language
has long-range structure (an ideal predictor's loss falls as it sees more context)."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest

from hf_hybrid.data import (
    LANGUAGE_PRESETS,
    RULER_TASKS,
    NeedleTask,
    NeedleVocab,
    SyntheticLanguage,
    make_language_dataset,
    make_needle_dataset,
    needle_example,
    oracle_loss_by_position,
)
from hf_hybrid.data.needle import NOUNS, TEMPLATES, _essay_sentence, resolve_task, sentence_text

VOCAB = NeedleVocab()


def _find(haystack: list, needle: list) -> list[int]:
    return [i for i in range(len(haystack) - len(needle) + 1) if haystack[i : i + len(needle)] == needle]


def _check_row(row: dict, task: NeedleTask) -> None:
    """Labels sit exactly on the answers, and every answer is the value of a needle for the asked key."""
    ids, labels, spans = row["input_ids"], row["labels"], row["answer_spans"]
    labelled = [i for i, label in enumerate(labels) if label != -100]
    assert labelled == [i for s, e in spans for i in range(s, e)]
    assert all(labels[i] == ids[i] for i in labelled)
    assert len(spans) == task.num_queries * task.num_values == len(row["answers"])
    for (start, end), answer in zip(spans, row["answers"]):
        assert "".join(VOCAB.units[i] for i in ids[start:end]) == answer
    context = ids[: row["answer_spans"][0][0]]
    # each answer value is stored in the context as "<key> <template> <value>" ("key : value ." / "is : value .")
    colon = VOCAB.encode([":"])
    for k, (start, end) in enumerate(spans):
        value = ids[start:end]
        # answers read "... : v1 , v2 ." (one key) or "... : v ." per asked key
        assert VOCAB.units[ids[start - 1]] in ((":", ",") if task.task == "multivalue" else (":",))
        assert VOCAB.units[ids[end]] in (".", ",")
        hits = _find(context, colon + value + VOCAB.encode(["."]))
        assert hits, f"answer {row['answers'][k]} is not stored in the context"
    if task.task == "multivalue":  # values listed in order of appearance
        firsts = [min(_find(context, colon + ids[s:e])) for s, e in spans]
        assert firsts == sorted(firsts)


@pytest.mark.parametrize("name", sorted(RULER_TASKS))
@pytest.mark.parametrize("template", ["compact", "ruler"])
def test_ruler_tasks_have_exact_length_and_labels_on_answers(name, template):
    task = resolve_task(name, template=template)
    length = 420 if template == "ruler" else 200
    data = make_needle_dataset(2, task, lengths=(length,), depths=(0.0, 0.6, 1.0), seed=3)
    assert len(data) == 6 and set(data["task"]) == {name}
    for row in data:
        assert len(row["input_ids"]) == length  # exact with the built-in vocabulary
        assert max(row["input_ids"]) < VOCAB.size
        _check_row(row, task)


def test_depth_places_the_needle_where_asked():
    depths = [0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0]
    data = make_needle_dataset(3, "single_2", lengths=(512,), depths=depths, seed=0)
    needle_words = VOCAB.encode("one of the special magic numbers for".split())
    for index in range(3):
        rows = [data[index * len(depths) + k] for k in range(len(depths))]
        starts = [r["needle_start"] for r in rows]
        assert starts == sorted(set(starts)), "deeper needles must start later"
        for depth, row in zip(depths, rows):
            ids = row["input_ids"]
            assert ids[row["needle_start"] : row["needle_start"] + len(needle_words)] == needle_words
            # placed at a sentence boundary, so within one essay sentence (<= 14 of ~440 tokens) of the goal
            assert abs(row["needle_depth"] - depth) < 0.04, (depth, row["needle_depth"])
        # depth 0: first thing after the intro; depth 1: last thing before the question
        intro = len(TEMPLATES["ruler"].intro.split())  # one token per word
        assert rows[0]["needle_start"] == 1 + intro and rows[0]["needle_depth"] == 0.0
        question = VOCAB.encode("what is the special magic number for".split())
        last = rows[-1]["input_ids"]
        needle_end = rows[-1]["needle_start"] + len(needle_words) + 3 + 2 + 7 + 1  # key (3) "is :" value (7) "."
        assert last[needle_end : needle_end + len(question)] == question and rows[-1]["needle_depth"] == 1.0
    # depths move the same needle through the same haystack
    first, last = data[0], data[len(depths) - 1]
    assert first["answers"] == last["answers"] and sorted(first["input_ids"]) == sorted(last["input_ids"])


def test_multikey_distractors_and_needle_haystack():
    task = resolve_task("multikey_1", template="compact")
    row = needle_example(random.Random(1), task, 160, 0.5)
    keys = [tuple(row["input_ids"][i - 3 : i]) for i in _find(row["input_ids"], VOCAB.encode([":"]))]
    asked = keys[-1]
    assert len(set(keys[:-1])) == 4 and keys[:-1].count(asked) == 1  # 4 distinct keys, one asked
    # multikey_2: the haystack is made of needles, the asked key appears once among them
    row = needle_example(random.Random(2), resolve_task("multikey_2", template="compact"), 300, 0.3)
    keys = [tuple(row["input_ids"][i - 3 : i]) for i in _find(row["input_ids"], VOCAB.encode([":"]))]
    assert len(keys) > 15 and keys[:-1].count(keys[-1]) == 1


def test_payload_types_and_word_values():
    row = needle_example(random.Random(0), NeedleTask("single", "noise", "uuids", "words", template="compact"), 120, 0.5)
    assert row["answers"][0] in NOUNS and len(row["answer_spans"][0]) == 2
    row = needle_example(random.Random(0), NeedleTask("multiquery", "essay", "numbers", "uuids", num_needles=3, num_queries=2), 400, 0.5)
    assert all(len(a) == 36 and a.count("-") == 4 for a in row["answers"]) and len(row["answers"]) == 2
    assert all(e - s == 36 for s, e in row["answer_spans"])


def test_seeded_and_deterministic():
    a = make_needle_dataset(2, "multivalue", lengths=(300,), depths=(0.5,), seed=7)
    b = make_needle_dataset(2, "multivalue", lengths=(300,), depths=(0.5,), seed=7)
    c = make_needle_dataset(2, "multivalue", lengths=(300,), depths=(0.5,), seed=8)
    assert a["input_ids"] == b["input_ids"] and a["input_ids"] != c["input_ids"]


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="length=40 is too short"):
        needle_example(random.Random(0), "single_1", 40, 0.5)
    with pytest.raises(ValueError, match="depth must lie in"):
        needle_example(random.Random(0), "single_1", 400, 1.5)
    with pytest.raises(ValueError, match="NeedleTask.haystack"):
        NeedleTask(haystack="books")
    with pytest.raises(ValueError, match="num_queries"):
        NeedleTask("multiquery", num_needles=2, num_queries=3)
    with pytest.raises(ValueError, match="single is 1/1/1"):
        NeedleTask("single", num_values=3)
    with pytest.raises(ValueError, match="RULER task"):
        make_needle_dataset(1, "single_9")


def _word_tokenizer():
    """A real (fast) transformers tokenizer built in-process: byte-level BPE trained on built-in text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    corpus = [sentence_text(_essay_sentence(rng)) for _ in range(300)]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>")


def test_text_form_with_a_real_tokenizer():
    tokenizer = _word_tokenizer()
    data = make_needle_dataset(1, "multivalue", lengths=(700,), depths=(0.0, 0.5, 1.0), tokenizer=tokenizer, seed=1)
    starts = []
    for row in data:
        ids = row["input_ids"]
        assert 600 < len(ids) <= 700 and ids[0] == tokenizer.bos_token_id
        labelled = [i for i, label in enumerate(row["labels"]) if label != -100]
        assert labelled == [i for s, e in row["answer_spans"] for i in range(s, e)]
        assert [tokenizer.decode(ids[s:e]).strip() for s, e in row["answer_spans"]] == row["answers"]
        assert tokenizer.decode(ids[row["needle_start"] :]).lstrip().startswith("one of the special magic numbers for")
        starts.append(row["needle_start"])
    assert starts == sorted(starts) and data[0]["needle_depth"] == 0.0 and data[2]["needle_depth"] == 1.0


# ---------------------------------------------------------------------------------------------- language


def test_language_documents_are_exact_seeded_and_in_vocab():
    language = SyntheticLanguage()
    data = make_language_dataset(3, 100, language, seed=4)
    assert data["input_ids"] == make_language_dataset(3, 100, language, seed=4)["input_ids"]
    for row in data:
        assert len(row["input_ids"]) == 100 == row["length"] and row["input_ids"] == row["labels"]
        assert row["input_ids"][0] == 1 and max(row["input_ids"]) < language.vocab_size
    assert "." in language.decode(data[0]["input_ids"])
    with pytest.raises(ValueError, match="copy_probability"):
        SyntheticLanguage(copy_probability=1.5)


def test_language_has_long_range_repeats_in_raw_statistics():
    """Model-free: the share of tokens whose bigram already occurred earlier in the document grows with position."""
    docs = make_language_dataset(24, 512, seed=5)["input_ids"]
    seen_rate = np.zeros(511)
    for doc in docs:
        seen = set()
        for t in range(1, 512):
            seen_rate[t - 1] += (doc[t - 1], doc[t]) in seen
            seen.add((doc[t - 1], doc[t]))
    seen_rate /= len(docs)
    assert seen_rate[:64].mean() + 0.1 < seen_rate[256:].mean()


def test_language_oracle_is_a_calibrated_distribution():
    language = SyntheticLanguage()
    losses, entropies = [], []
    for doc in make_language_dataset(12, 256, language, seed=6)["input_ids"]:
        for probs, token in zip(language.oracle_predictions(doc), doc[1:]):
            assert abs(probs.sum() - 1.0) < 1e-9 and probs[token] > 0
            nonzero = probs[probs > 0]
            losses.append(-math.log(probs[token]))
            entropies.append(-(nonzero * np.log(nonzero)).sum())
    gap = np.array(losses) - np.array(entropies)
    # for the true conditional distribution, E[-log p(x)] equals the expected entropy
    assert abs(gap.mean()) < 4 * gap.std() / math.sqrt(len(gap))


@pytest.mark.parametrize("preset", sorted(LANGUAGE_PRESETS))
def test_language_optimal_loss_falls_with_context(preset):
    language = LANGUAGE_PRESETS[preset]
    docs = make_language_dataset(8, 384, language, seed=7)["input_ids"]
    by_window = {w: oracle_loss_by_position(docs, language, w) for w in (2, 8, 32, 128, None)}
    means = [by_window[w][128:].mean() for w in (2, 8, 32, 128, None)]  # same positions, more context
    assert all(a > b + 0.05 for a, b in zip(means, means[1:])), means
    full = by_window[None]
    assert full[256:].mean() < full[:32].mean() - 0.2  # with all context, later tokens are easier
    assert np.array_equal(oracle_loss_by_position(docs, language, 384), full)  # window >= length == everything
