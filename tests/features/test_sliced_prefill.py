"""generate() with the prefill in slices of the prompt (transformers' prefill_chunk_size, chosen
automatically by hf_hybrid/generation/sliced_prefill.py): every architecture, in every cache
variant, prefills in slices exactly as in one forward, and the decode steps after it (eager, or
the static step the CUDA graph captures) give the same logits and tokens.

Slices of odd lengths that fall across RAT's chunks of 4 and its window of 6, RATTENTION's window
of 3, RAT+'s dilation and block ends, and the SE hybrid's blocks of 2 and chunks of 8; prompts
left-padded by different amounts. The automatic choice is tested with a fake free-memory figure.
"""
from __future__ import annotations

import pytest
import torch

import hf_hybrid.generation.sliced_prefill as sliced_prefill
from hf_hybrid.compat import cache_of
from hf_hybrid.generation.sliced_prefill import CacheFootprint, choose_slice, plan_prefill_slices
from hf_hybrid.models.se_hybrid.configuration_se_hybrid import SE_ATTENTION_MODES

from tiny_models import MODEL_TYPES, PAD, random_ids, tiny_model

# Every variant of tests/features/tiny_models.py, and the SE hybrid in each attention mode.
CASES = {name: (name, {}) for name in MODEL_TYPES} | {
    f"se_hybrid_{mode}": ("se_hybrid", dict(attention_mode=mode)) for mode in SE_ATTENTION_MODES
}
# Stacks the static decode step covers (hf_hybrid/generation/graph_decode.py); the others decode eagerly.
STATIC = ("rat", "rat_plus", "rat_plus_sparse", "fox_llama", "fox_pro", "rattention", "se_hybrid_full")

_models: dict = {}


def model_of(case: str):
    if case not in _models:
        name, overrides = CASES[case]
        _models[case] = tiny_model(name, **overrides)
    return _models[case]


def left_padded(batch: int = 3, seq: int = 21) -> tuple[torch.Tensor, torch.Tensor]:
    ids = random_ids(batch, seq, seed=2)
    mask = torch.ones_like(ids)
    for row, pad in zip(range(1, batch), (5, 2, 9)):
        ids[row, :pad], mask[row, :pad] = PAD, 0
    return ids, mask


def generate(model, ids, mask=None, **kwargs):
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids) if mask is None else mask, max_new_tokens=7, do_sample=False,
            pad_token_id=PAD, return_dict_in_generate=True, output_logits=True, **kwargs,
        )
    return out, model.last_decode_report


def assert_same(out, ref) -> None:
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(out.logits, 1), torch.stack(ref.logits, 1), atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", sorted(CASES))
def test_sliced_prefill_of_left_padded_prompts_equals_one_forward(case):
    model = model_of(case)
    ids, mask = left_padded()
    reference, _ = generate(model, ids, mask)
    for tokens in (1, 3, 5, 7, 13):
        sliced, _ = generate(model, ids, mask, prefill_chunk_size=tokens)
        assert_same(sliced, reference)


@pytest.mark.parametrize("case", sorted(CASES))
def test_static_decode_steps_follow_a_sliced_prefill(case):
    """The static step (what generate() captures in a CUDA graph) decodes after a sliced prefill
    as after a one-shot one: the same steps on it, the same logits as the eager path."""
    model = model_of(case)
    ids = random_ids(2, 19, seed=5)
    eager, _ = generate(model, ids, decode_cuda_graph=False)
    one_shot, one_shot_report = generate(model, ids, decode_cuda_graph="eager")
    for tokens in (4, 7):
        sliced, report = generate(model, ids, decode_cuda_graph="eager", prefill_chunk_size=tokens)
        assert_same(sliced, eager)
        assert report["static_steps"] == one_shot_report["static_steps"], (report, one_shot_report)
        assert report["eager_decode_steps"] == one_shot_report["eager_decode_steps"]
    assert_same(one_shot, eager)
    if case in STATIC:
        assert one_shot_report["static_steps"] == 6, one_shot_report


@pytest.mark.parametrize("case", ["fox_pro", "se_hybrid_full"])
def test_sliced_prefill_continues_in_the_reserved_buffers(case):
    """FoX's cache takes the first slice into the buffers generate() reserved for the static step,
    and the later slices after it in the same buffers (no copy of the filled columns per slice)."""
    from hf_hybrid.models.cache_layer import ReservedColumnsMixin

    model = model_of(case)
    ids = random_ids(2, 19, seed=5)
    out, report = generate(model, ids, decode_cuda_graph="eager", prefill_chunk_size=5)
    layers = [layer for layer in cache_of(out).layers if isinstance(layer, ReservedColumnsMixin)]
    assert layers and report["static_steps"] == 6
    if case == "fox_pro":
        for layer in layers:  # 19 + 7 columns reserved as 32 (generate()'s capacity, aligned)
            assert layer._static.capacity == 32 and layer._static.used == 19 + 6
            assert layer.keys.data_ptr() == layer._static.buffers[0].data_ptr()


@pytest.mark.parametrize("case", ["rattention", "rat_swa", "se_hybrid_full"])
def test_softmax_layers_continue_a_cache_without_a_block_mask(case, monkeypatch):
    """A slice after the first, nothing padded, runs SDPA (causal from the last key, or one mask
    row block shared by the batch where a window hides keys), not a flex_attention BlockMask; with
    padding it keeps the masked path. Both equal the one-shot prefill."""
    import hf_hybrid.layers.attention as attention

    calls = []
    original = attention._sdpa_continuation
    monkeypatch.setattr(attention, "_sdpa_continuation", lambda *args: calls.append(1) or original(*args))
    model = model_of(case)
    ids = random_ids(2, 19, seed=5)
    reference, _ = generate(model, ids)
    sliced, _ = generate(model, ids, prefill_chunk_size=6)
    assert_same(sliced, reference)
    assert calls
    calls.clear()
    ids, mask = left_padded()
    reference, _ = generate(model, ids, mask)
    sliced, _ = generate(model, ids, mask, prefill_chunk_size=6)
    assert_same(sliced, reference)
    assert not calls


def test_choose_slice_from_the_estimate():
    cache = CacheFootprint(per_row=100.0, per_token=10.0)
    # 4 rows x 1000 tokens x 1 byte of activations + 4 x (100 + 10 x 1010) of cache
    cache_bytes = 4 * (100 + 10 * 1010)
    fits = (cache_bytes + 4000) / sliced_prefill.HEADROOM
    assert choose_slice(4, 1000, 1010, 1.0, cache, fits, align=64) == (None, "the one-shot prefill fits")
    tokens, reason = choose_slice(4, 1000, 1010, 1.0, cache, (cache_bytes + 4 * 300) / sliced_prefill.HEADROOM, align=64)
    assert tokens == 256 and "does not fit" in reason  # the longest multiple of 64 with 4 x n <= 1200
    tokens, reason = choose_slice(4, 1000, 1010, 1.0, cache, cache_bytes / sliced_prefill.HEADROOM, align=64)
    assert tokens == 64 and reason.startswith("not even")
    # a slice over a filled cache may cost more (FoX's scores): counted where keys > tokens
    extra = lambda tokens, keys: 2.0 * tokens * keys
    tokens, _ = choose_slice(4, 1000, 1010, 1.0, cache, (cache_bytes + 4 * 300) / sliced_prefill.HEADROOM, extra, align=64)
    assert tokens is None or tokens < 256
    assert choose_slice(4, 100, 110, 1.0, cache, 0.0, align=64)[0] is None  # shorter than two slices


def test_plan_probes_the_cache_only_when_the_bound_does_not_fit(monkeypatch):
    model = tiny_model("rat")
    probes = []
    original = sliced_prefill.probe_cache_footprint

    def probe(m, *args, **kwargs):
        probes.append(m)
        return original(m, *args, **kwargs)

    monkeypatch.setattr(sliced_prefill, "probe_cache_footprint", probe)
    plan = plan_prefill_slices(model, 8, 4096, 4128, free_bytes=1e12)
    assert plan.slice_tokens is None and "even if every layer" in plan.reason and probes == []
    per_token = sliced_prefill.activation_bytes_per_token(model.config, model.dtype)
    assert plan.activation_bytes == 8 * 4096 * per_token
    # room for a quarter of the one-shot activations beside RAT's (small) cache
    free = (plan.activation_bytes / 4 + original(model).bytes(8, 4128)) / sliced_prefill.HEADROOM
    plan = plan_prefill_slices(model, 8, 4096, 4128, free_bytes=free)
    assert plan.slice_tokens == 1024 and len(probes) == 1
    plan_prefill_slices(model, 8, 4096, 4128, free_bytes=free)
    assert len(probes) == 1  # once per model, dtype and device
    assert plan_prefill_slices(model, 8, 4096, 4128, free_bytes=None).slice_tokens is None


def test_probe_counts_what_the_cache_keeps():
    """RAT keeps a chunk end per 4 tokens, FoX every token's K/V: FoX's cache grows faster per token."""
    rat = sliced_prefill.probe_cache_footprint(tiny_model("rat"), tokens=(16, 48))
    fox = sliced_prefill.probe_cache_footprint(tiny_model("fox_llama"), tokens=(16, 48))
    assert 0 < rat.per_token < fox.per_token
    # FoX: per token and layer, K and V of 2 kv heads x 8 dims (fp32) and 4 heads' forget sums
    assert fox.per_token == pytest.approx(2 * (2 * 2 * 8 * 4 + 4 * 4), rel=0.01)


def test_probe_runs_past_the_longest_window():
    """RATTENTION's local layers keep a ring of the last w + 1 tokens: probed past w, the cache
    grows per token by what its global layers keep (K and V of 2 kv heads x 8 dims, fp32)."""
    model = tiny_model("rattention", num_hidden_layers=4, window_size=40)
    assert sliced_prefill.probe_lengths(model.config) == (40 + 64, 40 + 192)
    footprint = sliced_prefill.probe_cache_footprint(model)
    globals_ = model.config.layer_types.count("global")
    assert footprint.per_token == pytest.approx(globals_ * 2 * 2 * 8 * 4, rel=0.01)


@pytest.mark.parametrize("case", ["rat", "fox_pro", "rattention", "se_hybrid_se"])
def test_generate_slices_automatically_when_memory_is_short(case, monkeypatch):
    """generate() with a fake free-memory figure: the estimate slices the prefill, the result is
    exact, ``last_prefill_plan`` says why; a user's prefill_chunk_size wins and
    prefill_slicing=False turns the choice off."""
    model = model_of(case)
    ids, mask = left_padded()
    reference, _ = generate(model, ids, mask)
    assert model.last_prefill_plan["slice_tokens"] is None  # CPU: no free-memory figure
    monkeypatch.setattr(sliced_prefill, "SLICE_ALIGN", 4)
    monkeypatch.setattr(sliced_prefill, "free_device_memory", lambda device: 1.0)
    sliced_prefill._cached_footprint(model, {})  # the cache probe's forwards, before counting the prefill's
    calls = []
    model.model.register_forward_pre_hook(lambda module, args, kwargs: calls.append(kwargs["input_ids"].shape[1]),
                                          with_kwargs=True)
    sliced, _ = generate(model, ids, mask)
    assert_same(sliced, reference)
    plan = model.last_prefill_plan
    assert plan["slice_tokens"] == 4 and plan["rows"] == 3 and plan["prompt_tokens"] == 21
    assert calls[:6] == [4, 4, 4, 4, 4, 1]
    calls.clear()
    generate(model, ids, mask, prefill_chunk_size=10)
    assert model.last_prefill_plan is None and calls[:3] == [10, 10, 1]
    calls.clear()
    generate(model, ids, mask, prefill_slicing=False)
    assert model.last_prefill_plan is None and calls[0] == 21
    calls.clear()
    model.config.prefill_slicing = False
    try:
        generate(model, ids, mask)
        assert calls[0] == 21
    finally:
        del model.config.prefill_slicing
    with pytest.raises(ValueError, match="prefill_slicing"):
        generate(model, ids, mask, prefill_slicing="yes")
    # assisted decoding (prompt lookup here) records the cache's past for crops: not sliced
    calls.clear()
    generate(model, ids[:1], mask[:1], prompt_lookup_num_tokens=2)
    assert model.last_prefill_plan is None and calls[0] == 21
