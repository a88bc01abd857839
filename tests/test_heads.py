"""Task heads (sequence / token classification, question answering) for every architecture: Auto
classes, Llama's last-non-pad-token pooling, training, save / reload through the Auto classes and
through trust_remote_code in a process where hf-hybrid cannot be imported."""
from __future__ import annotations

import json
import textwrap

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

import hf_hybrid
from hf_hybrid.architectures import ARCHITECTURES, TINY_SHAPE, architecture
from helper_process import remote_code_helper

# Every registered architecture's tiny fixture (hf_hybrid/architectures.py), two layers; RAT's
# fixture is all RAT layers, mixed here with sliding-window attention so the heads see both kinds.
_OVERRIDES = {"rat": dict(layer_types=["rat", "sliding_attention"])}
MODEL_TYPES = [arch.model_type for arch in ARCHITECTURES]
PAD = TINY_SHAPE["pad_token_id"]


def tiny_config(model_type: str, **overrides):
    arch = architecture(model_type)
    return arch.load(arch.config_class_name)(**(arch.tiny_config_kwargs(2) | _OVERRIDES.get(model_type, {}) | overrides))


PREFIX = {arch.model_type: arch.class_prefix for arch in ARCHITECTURES}
HEADS = {
    "SequenceClassification": AutoModelForSequenceClassification,
    "TokenClassification": AutoModelForTokenClassification,
    "QuestionAnswering": AutoModelForQuestionAnswering,
}
ROWS = [[5, 9, 3, 12, 7, 30], [14, 6, 21], [8, 1, 33, 4]]


def tiny(model_type: str, auto_class, **config_overrides):
    torch.manual_seed(0)
    return auto_class.from_config(tiny_config(model_type, **({"num_labels": 3} | config_overrides))).eval()


def padded(rows, side="left"):
    longest = max(len(r) for r in rows)
    ids = torch.full((len(rows), longest), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        cols = slice(longest - len(row), longest) if side == "left" else slice(0, len(row))
        ids[i, cols], mask[i, cols] = torch.tensor(row), 1
    return ids, mask


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.parametrize("task", list(HEADS))
def test_auto_class_builds_the_head_and_it_trains(model_type, task):
    model = tiny(model_type, HEADS[task]).train()
    assert type(model) is getattr(hf_hybrid, f"{PREFIX[model_type]}For{task}")
    assert type(model.model) is getattr(hf_hybrid, f"{PREFIX[model_type]}Model")
    ids, mask = padded(ROWS)
    if task == "SequenceClassification":
        targets = dict(labels=torch.tensor([0, 2, 1]))
    elif task == "TokenClassification":
        targets = dict(labels=torch.randint(0, 3, ids.shape).masked_fill(mask == 0, -100))
    else:
        targets = dict(start_positions=torch.tensor([3, 4, 2]), end_positions=torch.tensor([5, 5, 4]))
    out = model(ids, attention_mask=mask, **targets)
    assert out.loss.ndim == 0 and torch.isfinite(out.loss)
    assert getattr(out, "past_key_values", None) is None, "a head builds no decoding cache unless asked"
    out.loss.backward()
    head = model.qa_outputs if task == "QuestionAnswering" else model.score
    assert head.weight.grad is not None and head.weight.grad.abs().sum() > 0
    assert model.model.embed_tokens.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.parametrize("side", ["left", "right"])
def test_sequence_classification_pools_each_rows_last_real_token(model_type, side):
    """The padded batch's logits == each row's alone == the score of the row's last token."""
    model = tiny(model_type, AutoModelForSequenceClassification)
    ids, mask = padded(ROWS, side)
    with torch.no_grad():
        batch = model(ids, attention_mask=mask).logits
        for i, row in enumerate(ROWS):
            alone_ids = torch.tensor([row])
            alone = model(alone_ids).logits[0]
            torch.testing.assert_close(batch[i], alone, rtol=1e-4, atol=1e-5)
            last_hidden = model.model(alone_ids).last_hidden_state[0, -1]
            torch.testing.assert_close(alone, model.score(last_hidden), rtol=1e-5, atol=1e-6)


def test_sequence_classification_without_pad_token_refuses_batches_like_llama():
    model = tiny("rat", AutoModelForSequenceClassification, pad_token_id=None)
    with torch.no_grad():
        assert model(torch.tensor([ROWS[0]])).logits.shape == (1, 3)
        with pytest.raises(ValueError, match="padding token"):
            model(torch.tensor([ROWS[0], ROWS[0]]))


def test_token_classification_and_qa_logits_match_rows_alone():
    ids, mask = padded(ROWS, "left")
    token_model = tiny("fox", AutoModelForTokenClassification)
    qa_model = tiny("fox", AutoModelForQuestionAnswering)
    with torch.no_grad():
        tokens = token_model(ids, attention_mask=mask).logits
        qa = qa_model(ids, attention_mask=mask)
        for i, row in enumerate(ROWS):
            real = slice(ids.shape[1] - len(row), None)
            torch.testing.assert_close(tokens[i, real], token_model(torch.tensor([row])).logits[0], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(qa.start_logits[i, real], qa_model(torch.tensor([row])).start_logits[0], rtol=1e-4, atol=1e-5)


def test_classifier_from_a_causal_lm_checkpoint_keeps_the_backbone(tmp_path):
    lm = tiny("rattention", AutoModelForCausalLM)
    lm.save_pretrained(tmp_path)
    classifier = AutoModelForSequenceClassification.from_pretrained(tmp_path, num_labels=2)
    assert type(classifier) is hf_hybrid.RattentionForSequenceClassification
    for name, tensor in lm.model.state_dict().items():
        assert torch.equal(classifier.model.state_dict()[name], tensor), name


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_auto_map_names_every_auto_class(model_type, tmp_path):
    model = tiny(model_type, AutoModelForSequenceClassification)
    model.save_pretrained(tmp_path)
    auto_map = json.loads((tmp_path / "config.json").read_text())["auto_map"]
    stem = f"modeling_{model_type}"
    prefix = PREFIX[model_type]
    assert auto_map == {
        "AutoConfig": f"configuration_{model_type}.{prefix}Config",
        "AutoModel": f"{stem}.{prefix}Model",
        "AutoModelForCausalLM": f"{stem}.{prefix}ForCausalLM",
        "AutoModelForSequenceClassification": f"{stem}.{prefix}ForSequenceClassification",
        "AutoModelForTokenClassification": f"{stem}.{prefix}ForTokenClassification",
        "AutoModelForQuestionAnswering": f"{stem}.{prefix}ForQuestionAnswering",
    }
    card = (tmp_path / "README.md").read_text()
    assert "pipeline_tag: text-classification" in card and "AutoModelForCausalLM" not in card
    assert 'AutoModelForSequenceClassification.from_pretrained("' in card
    reloaded = AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    assert type(reloaded) is type(model)
    ids, mask = padded(ROWS)
    with torch.no_grad():
        assert torch.equal(model(ids, attention_mask=mask).logits, reloaded(ids, attention_mask=mask).logits)


# Loads every checkpoint in a process where `import hf_hybrid` fails (remote_code_helper): only the
# saved code runs.
_REMOTE_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    import transformers

    jobs = json.load(open(sys.argv[1]))
    ids, mask = torch.load(sys.argv[2])
    results = {}
    for job in jobs:
        model = getattr(transformers, job["auto_class"]).from_pretrained(job["path"], trust_remote_code=True, **job["kwargs"]).eval()
        with torch.no_grad():
            out = model(ids, attention_mask=mask)
        logits = out.start_logits if job["auto_class"] == "AutoModelForQuestionAnswering" else out.logits
        results[job["name"]] = {"logits": logits, "module": type(model).__module__, "class": type(model).__name__,
                                "backbone": model.model.state_dict()}
    assert not any(name.split(".")[0] == "hf_hybrid" for name in sys.modules)
    torch.save(results, sys.argv[3])
    """
)


def test_heads_load_with_trust_remote_code_without_hf_hybrid(tmp_path):
    """Every architecture's sequence classifier, RAT's token / QA heads, and a classifier built from a
    causal-LM checkpoint, loaded through the Auto classes from the code saved with the checkpoint."""
    ids, mask = padded(ROWS)
    jobs, expected = [], {}
    cases = [(t, "SequenceClassification") for t in MODEL_TYPES]
    cases += [("rat", "TokenClassification"), ("rat", "QuestionAnswering")]
    for model_type, task in cases:
        model = tiny(model_type, HEADS[task])
        path = tmp_path / f"{model_type}_{task}"
        model.save_pretrained(path)
        name = f"{model_type}_{task}"
        with torch.no_grad():
            out = model(ids, attention_mask=mask)
        expected[name] = (out.start_logits if task == "QuestionAnswering" else out.logits, f"{PREFIX[model_type]}For{task}")
        jobs.append(dict(name=name, auto_class=HEADS[task].__name__, path=str(path), kwargs={}))
    lm = tiny("fox", AutoModelForCausalLM)
    lm.save_pretrained(tmp_path / "fox_lm")
    jobs.append(dict(name="fox_lm_to_classifier", auto_class="AutoModelForSequenceClassification",
                     path=str(tmp_path / "fox_lm"), kwargs={"num_labels": 2}))

    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    torch.save((ids, mask), tmp_path / "inputs.pt")
    remote_code_helper().run(_REMOTE_SCRIPT, tmp_path / "jobs.json", tmp_path / "inputs.pt", tmp_path / "out.pt")
    loaded = torch.load(tmp_path / "out.pt")

    for name, (logits, class_name) in expected.items():
        assert loaded[name]["module"].startswith("transformers_modules."), name
        assert loaded[name]["class"] == class_name
        assert torch.equal(loaded[name]["logits"], logits), f"{name}: remote-code logits are not bit-identical"
    converted = loaded["fox_lm_to_classifier"]
    assert converted["class"] == "FoxForSequenceClassification" and converted["logits"].shape == (len(ROWS), 2)
    for name, tensor in lm.model.state_dict().items():
        assert torch.equal(converted["backbone"][name], tensor), name
