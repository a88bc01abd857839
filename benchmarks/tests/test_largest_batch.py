"""benchmarks/largest_batch.py: the batch search, and its CPU-sized run with out-of-memory errors
raised above a batch (a GPU's limit, faked)."""
from __future__ import annotations

import pytest
import torch

import benchmarks.largest_batch as largest_batch
from benchmarks.largest_batch import search_largest


def test_search_doubles_then_bisects_to_the_resolution():
    largest, capped, tries = search_largest(lambda b: b <= 100, start=32, max_batch=512, resolution=16, max_tries=10)
    assert (largest, capped) == (96, False)
    assert tries == [(32, True), (64, True), (128, False), (96, True), (112, False)]
    largest, _, tries = search_largest(lambda b: b <= 100, start=32, max_batch=512, resolution=4, max_tries=10)
    assert largest == 100 and len(tries) == 7


def test_search_stops_at_the_cap_and_the_try_budget():
    assert search_largest(lambda b: True, 32, 200, 16, 10) == (200, True, [(32, True), (64, True), (128, True), (200, True)])
    largest, capped, tries = search_largest(lambda b: b <= 100, 32, 512, 1, max_tries=4)
    assert (largest, capped, len(tries)) == (96, False, 4)


def test_search_starts_no_try_after_its_deadline():
    clock = iter(range(100)).__next__  # one second per look at the clock
    largest, _, tries = search_largest(lambda b: True, 2, 512, 1, 20, deadline=3, clock=clock)
    assert largest == 8 and len(tries) == 3


def test_search_halves_when_the_first_batch_fails():
    largest, _, tries = search_largest(lambda b: b <= 5, 32, 512, 1, 20)
    assert largest == 5 and tries[:4] == [(32, False), (16, False), (8, False), (4, True)]
    assert search_largest(lambda b: False, 4, 512, 1, 20)[0] is None


def test_cpu_run_finds_the_faked_limit_and_reports_against_llama(monkeypatch):
    real = largest_batch.generate_once

    def limited(model, batch, *args, **kwargs):
        if batch == 8 and model.config.model_type == "rat":
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture (faked)")
        if batch > 5:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (faked above 5 rows)")
        return real(model, batch, *args, **kwargs)

    monkeypatch.setattr(largest_batch, "generate_once", limited)
    rows = largest_batch.main([
        "--device", "cpu", "--shape", "tiny", "--layers", "2", "--prompt", "20", "--new", "3", "--models", "rat,llama",
        "--start", "2", "--max-batch", "16", "--resolution", "1", "--llama-eager", "--search-seconds", "0",
    ])
    assert [r["model"] for r in rows] == ["rat", "llama"]
    for row in rows:
        assert row["largest_batch"] == 5 and row["timed_batch"] == 5 and not row["capped"]
        assert row["tries"] == [(2, True), (4, True), (8, False), (6, False), (5, True)]
        assert row["tokens_per_s"] == pytest.approx(1000 * 5 / row["ms_per_token"], rel=1e-3)
    assert list(rows[0]["errors"]) == [8] and "previous error during capture" in rows[0]["errors"][8]
    assert rows[1]["errors"] == {}
    assert rows[1]["ratio_vs_llama"] == 1.0
    assert rows[0]["ratio_vs_llama"] == pytest.approx(rows[0]["tokens_per_s"] / rows[1]["tokens_per_s"], abs=0.01)
    assert rows[0]["prefill_plan"]["rows"] == 5  # our model's planner saw the batch (no slicing on CPU)
    # The memory-bound ceiling at the timed batch: weights and the whole cache read once per step.
    for row in rows:
        bound = row["memory_bound"]
        assert bound["weight_bytes"] > 0 and bound["cache_bytes"] > 0 and bound["bandwidth_bytes_per_s"] > 0
        expected = 5 * bound["bandwidth_bytes_per_s"] / (bound["weight_bytes"] + bound["cache_bytes"])
        assert bound["ceiling_tokens_per_s"] == pytest.approx(expected, rel=0.01)
        assert bound["fraction_of_ceiling"] == pytest.approx(row["tokens_per_s"] / bound["ceiling_tokens_per_s"], abs=1e-3)
    shape = largest_batch.TINY_SHAPE
    llama_cache = 2 * 2 * shape["num_attention_heads"] * shape["head_dim"] * (20 + 3) * 5 * 4  # K and V, 2 layers, fp32
    assert rows[1]["memory_bound"]["cache_bytes"] == llama_cache
    assert rows[0]["ceiling_vs_llama"] == pytest.approx(
        rows[0]["memory_bound"]["ceiling_tokens_per_s"] / rows[1]["tokens_per_s"], abs=0.01)


def test_decode_cache_bytes_of_llama_and_of_our_caches():
    """Llama's static cache by its shape; ours as the prefill planner measures it (RAT's cache holds
    a fraction of the keys: its chunk ends, the current chunk and states)."""
    from benchmarks.generation import build_model

    device = torch.device("cpu")
    shape = dict(num_hidden_layers=2) | largest_batch.TINY_SHAPE
    llama = build_model("llama", device, torch.float32, 64, **shape)
    rat = build_model("rat", device, torch.float32, 64, **shape)
    llama_bytes = largest_batch.decode_cache_bytes(llama, "llama", batch=3, tokens=48)
    assert llama_bytes == 2 * 2 * 4 * 16 * 48 * 3 * 4
    assert 0 < largest_batch.decode_cache_bytes(rat, "rat", batch=3, tokens=48) < llama_bytes
    assert largest_batch.copy_bandwidth(device, nbytes=2**20) > 0


def test_fixed_batch_skips_the_search(monkeypatch):
    batches = []
    real = largest_batch.generate_once

    def counted(model, batch, *args, **kwargs):
        batches.append((model.config.model_type, batch))
        return real(model, batch, *args, **kwargs)

    monkeypatch.setattr(largest_batch, "generate_once", counted)
    rows = largest_batch.main([
        "--device", "cpu", "--shape", "tiny", "--layers", "2", "--prompt", "20", "--new", "3", "--models", "rat,llama",
        "--fixed-batch", "rat=3,llama=2", "--llama-eager", "--search-seconds", "0",
    ])
    assert [(r["largest_batch"], r["timed_batch"], r["tries"]) for r in rows] == [(3, 3, [(3, True)]), (2, 2, [(2, True)])]
    assert batches == [("rat", 3), ("rat", 3), ("llama", 2), ("llama", 2)]  # a warm-up, then the timed call
    assert rows[0]["ratio_vs_llama"] == pytest.approx(rows[0]["tokens_per_s"] / rows[1]["tokens_per_s"], abs=0.01)


def test_fixed_batch_names_its_format():
    assert largest_batch.parse_fixed_batches("rattention=256, fox=160") == {"rattention": 256, "fox": 160}
    with pytest.raises(Exception, match="NAME=ROWS"):
        largest_batch.parse_fixed_batches("rattention:256")
