"""The cache's name across transformers versions (hf_hybrid/compat.py).

transformers 5.24 renamed ``past_key_values`` to ``cache`` in generate(), in the models' keywords
and in the output classes. Whatever transformers is installed, every hf-hybrid model takes the cache
as ``past_key_values=`` or ``cache=`` with identical results, returns it under the installed name
(the one its generate() reads), and generate() decodes with the model's own cache without touching
transformers' deprecation shims.
"""
from __future__ import annotations

import logging
import warnings

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import AutoModelForSequenceClassification
from transformers.modeling_outputs import CausalLMOutputWithPast

from hf_hybrid.compat import CACHE_NAME, cache_of
from tiny_models import MODEL_TYPES, random_ids, tiny_config, tiny_model

EXPECTED_NAME = "cache" if Version(transformers.__version__).release >= (5, 24) else "past_key_values"
SPELLINGS = ("past_key_values", "cache")


def cache_tensors(cache) -> list[tuple[int, str, torch.Tensor]]:
    """Every tensor each cache layer holds, by layer and attribute name (lists / dicts flattened)."""
    found = []
    for index, layer in enumerate(cache.layers):
        for attr, value in sorted(vars(layer).items()):
            items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else [("", value)]
            found += [(index, f"{attr}{key}", v) for key, v in items if isinstance(v, torch.Tensor)]
    return found


def assert_same_cache(a, b) -> None:
    assert type(a) is type(b) and a.get_seq_length() == b.get_seq_length()
    left, right = cache_tensors(a), cache_tensors(b)
    assert [name for *name, _ in left] == [name for *name, _ in right]
    assert left, "the cache holds no tensors to compare"
    for (layer, attr, x), (_, _, y) in zip(left, right):
        assert torch.equal(x, y), f"layer {layer} {attr} differs"


@pytest.fixture
def no_cache_deprecation(monkeypatch):
    """Fail on transformers' past_key_values deprecation (a FutureWarning from @deprecate_kwarg, or
    the ModelOutput rename's logger.warning_once): hf-hybrid must speak the installed name."""
    logged = []
    original = logging.Logger.warning_once

    def recording_warning_once(self, *args, **kwargs):
        logged.append(" ".join(map(str, args)))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(logging.Logger, "warning_once", recording_warning_once)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*past_key_values.*")
        yield
    assert not [m for m in logged if "past_key_values" in m], logged


def test_installed_transformers_name():
    assert CACHE_NAME == EXPECTED_NAME
    assert EXPECTED_NAME in CausalLMOutputWithPast.__dataclass_fields__
    for name in MODEL_TYPES:
        assert tiny_config(name).keys_to_ignore_at_inference == [EXPECTED_NAME]  # what the Trainer drops


@pytest.mark.parametrize("name", MODEL_TYPES)
def test_both_spellings_give_identical_logits_and_caches(name, no_cache_deprecation):
    model = tiny_model(name)
    ids = random_ids(2, 13)
    runs = {}
    for spelling in SPELLINGS:
        cache = model.model.cache_class(model.config)
        with torch.no_grad():
            prefill = model(ids[:, :9], use_cache=True, **{spelling: cache})
            step = model(ids[:, 9:10], use_cache=True, **{spelling: cache})
            rest = model.model(ids[:, 10:], use_cache=True, **{spelling: cache})  # the base model too
        assert cache_of(prefill) is cache and cache_of(step) is cache and cache_of(rest) is cache
        assert EXPECTED_NAME in step.keys() and EXPECTED_NAME in rest.keys()
        runs[spelling] = (torch.cat([prefill.logits, step.logits], dim=1), rest.last_hidden_state, cache)
    (logits_a, hidden_a, cache_a), (logits_b, hidden_b, cache_b) = runs.values()
    assert torch.equal(logits_a, logits_b) and torch.equal(hidden_a, hidden_b)
    assert_same_cache(cache_a, cache_b)
    # return_dict=False: the cache sits at the same place of the tuple
    with torch.no_grad():
        as_tuple = model(ids[:, :9], use_cache=True, return_dict=False, cache=model.model.cache_class(model.config))
    assert torch.equal(as_tuple[0], logits_a[:, :9]) and isinstance(as_tuple[1], model.model.cache_class)


@pytest.mark.parametrize("name", MODEL_TYPES)
def test_generate_decodes_with_the_model_cache_under_the_installed_name(name, no_cache_deprecation):
    model = tiny_model(name)
    ids = random_ids(2, 9)
    greedy = dict(max_new_tokens=5, do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0)
    with torch.no_grad():
        out = model.generate(ids, return_dict_in_generate=True, **greedy)
        cache = out[EXPECTED_NAME]
        assert isinstance(cache, model.model.cache_class), "generate() did not decode with the model's cache"
        assert cache.get_seq_length() == out.sequences.shape[1] - 1
        # The same tokens from a greedy loop over forward() with the cache keyword.
        sequence, loop_cache = ids, model.model.cache_class(model.config)
        pending = ids
        for _ in range(5):
            logits = model(pending, cache=loop_cache, use_cache=True).logits
            pending = logits[:, -1:].argmax(-1)
            sequence = torch.cat([sequence, pending], dim=1)
        assert torch.equal(out.sequences, sequence)
        assert_same_cache(cache, loop_cache)
        # A cache handed to generate() under either name is the one it decodes with.
        for spelling in SPELLINGS:
            given = model.model.cache_class(model.config)
            again = model.generate(ids, return_dict_in_generate=True, **{spelling: given}, **greedy)
            assert again[EXPECTED_NAME] is given and torch.equal(again.sequences, out.sequences)


def test_assisted_generate_under_the_installed_name(no_cache_deprecation):
    model = tiny_model("rat")
    ids = random_ids(1, 9)
    greedy = dict(max_new_tokens=6, do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0)
    with torch.no_grad():
        plain = model.generate(ids, **greedy)
        assisted = model.generate(ids, assistant_model=tiny_model("rat"), **greedy)
        lookup = model.generate(ids, prompt_lookup_num_tokens=3, **greedy)
    assert torch.equal(plain, assisted) and torch.equal(plain, lookup)


def test_task_head_takes_both_spellings(no_cache_deprecation):
    torch.manual_seed(0)
    head = AutoModelForSequenceClassification.from_config(tiny_config("rat", num_labels=3)).eval()
    ids = random_ids(2, 11)
    results = []
    for spelling in SPELLINGS:
        cache = head.model.cache_class(head.config)
        with torch.no_grad():
            out = head(ids, **{spelling: cache})
        assert cache_of(out) is cache and cache.get_seq_length() == 11
        results.append((out.logits, cache))
    assert torch.equal(results[0][0], results[1][0])
    assert_same_cache(results[0][1], results[1][1])


def test_both_names_at_once_is_an_error():
    model = tiny_model("rat")
    ids = random_ids(1, 5)
    with pytest.raises(ValueError, match="not both"):
        model(ids, past_key_values=model.model.cache_class(model.config), cache=model.model.cache_class(model.config))
