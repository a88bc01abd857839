"""generate()'s stop check one step late for this package's static decode step
(hf_hybrid/generation/deferred_stop.py), run on the CPU: transformers' DeferredStopCheck with a
stand-in for the CUDA event (the CPU backend has none; its work is synchronous anyway) and "cpu"
added to the devices that defer. The GPU test with a captured graph is in
tests/gpu/test_graph_decode_gpu.py."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.generation import utils as generation_utils

from hf_hybrid._compat.transformers_stop_check import deferred_stop_check_class, transformers_checked
from hf_hybrid.generation import deferred_stop
from test_generation_speed_path import MODELS

pytestmark = pytest.mark.skipif(deferred_stop_check_class() is None,
                                reason="this transformers has no DeferredStopCheck")


class HostEvent:
    def __init__(self, device=None, blocking=False):
        pass

    def record(self):
        pass

    def synchronize(self):
        pass


@pytest.fixture
def defer_on_cpu(monkeypatch):
    monkeypatch.setattr(deferred_stop, "DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(torch, "Event", HostEvent)
    undone = []
    finish = generation_utils.DeferredStopCheck.finish

    def spy(self):
        steps = finish(self)
        undone.append(steps)
        return steps

    monkeypatch.setattr(generation_utils.DeferredStopCheck, "finish", spy)
    return undone


def eos_ids_mid_generation(model, ids, new):
    """Two tokens the greedy rows produce part-way: EOS for a generation that stops early."""
    with torch.no_grad():
        free = model.generate(ids, max_new_tokens=new, do_sample=False, decode_cuda_graph=False)
    return [int(free[0, ids.shape[1] + 3]), int(free[1, ids.shape[1] + 5])]


@pytest.mark.parametrize("name", ["rat", "fox_pro", "rattention", "rat_plus_d4_w2_i2", "se_hybrid_full"])
def test_stop_at_eos_one_step_late_gives_the_same_tokens(name, defer_on_cpu):
    model = MODELS[name]()
    ids = torch.randint(1, 61, (2, 9), generator=torch.Generator().manual_seed(7))
    new = 12
    eos = eos_ids_mid_generation(model, ids, new)
    kwargs = dict(max_new_tokens=new, do_sample=False, eos_token_id=eos, pad_token_id=0)
    with torch.no_grad():
        synced = model.generate(ids, decode_cuda_graph=False, **kwargs)
        assert model.last_decode_report is None and defer_on_cpu == []
        deferred = model.generate(ids, decode_cuda_graph="eager", **kwargs)
    report = model.last_decode_report
    assert report["deferred_stop_check"] and report["static_steps"] > 0, report
    assert synced.shape[1] < ids.shape[1] + new  # EOS stopped it early ...
    assert defer_on_cpu == [1]  # ... one step late, and generate() undid that step
    assert torch.equal(deferred, synced)


def test_max_length_stops_on_time_and_streams_every_token(defer_on_cpu):
    model = MODELS["rat"]()
    ids = torch.randint(1, 61, (1, 5), generator=torch.Generator().manual_seed(8))
    streamed = []

    class Streamer:
        def put(self, tokens):
            streamed.append(tokens.reshape(-1).tolist())

        def end(self):
            pass

    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=6, do_sample=False, decode_cuda_graph="eager", streamer=Streamer())
        synced = model.generate(ids, max_new_tokens=6, do_sample=False, decode_cuda_graph=False)
    assert model.last_decode_report is None
    assert defer_on_cpu == [0]  # the host knows max_length: no extra step
    assert torch.equal(out, synced)
    assert sum(streamed[1:], []) == out[0, 5:].tolist()  # the prompt first, then every new token once


def test_returned_caches_assistants_and_opt_out_keep_the_synchronous_check(defer_on_cpu, monkeypatch):
    model = MODELS["rat"]()
    ids = torch.randint(1, 61, (2, 6), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=4, decode_cuda_graph="eager", return_dict_in_generate=True)
        assert not model.last_decode_report["deferred_stop_check"]  # the cache outlives generate()
        monkeypatch.setenv("HF_HYBRID_DEFERRED_STOP", "0")
        model.generate(ids, max_new_tokens=4, decode_cuda_graph="eager")
        assert not model.last_decode_report["deferred_stop_check"]
    assert defer_on_cpu == [] and out.sequences.shape[1] == 10
    # The decision itself: registered caches only, never for an assistant or a returned cache.
    class Cache:
        pass

    cache, device = Cache(), torch.device("cpu")
    monkeypatch.delenv("HF_HYBRID_DEFERRED_STOP")
    decide = generation_utils.DeferredStopCheck.is_supported
    assert not decide(device, cache, False, False)
    assert deferred_stop.allow_deferred_stop(cache)
    assert decide(device, cache, False, False)
    assert not decide(device, cache, True, False) and not decide(device, cache, False, True)
    assert not decide(torch.device("meta"), cache, False, False)
    deferred_stop.withdraw_deferred_stop(cache)
    assert not decide(device, cache, False, False)

    class UnhashableCache:
        __hash__ = None

    assert not decide(device, UnhashableCache(), False, False)  # another library's cache: transformers decides


def test_transformers_models_keep_their_own_decision(defer_on_cpu):
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=61, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2)).eval()
    ids = torch.randint(1, 61, (1, 4))
    with torch.no_grad():
        llama.generate(ids, max_new_tokens=3, do_sample=False)
        assert defer_on_cpu == []
        with deferred_stop.deferred_for_every_generation():  # the benchmark's row of Llama with the same loop
            llama.generate(ids, max_new_tokens=3, do_sample=False)
    assert defer_on_cpu == [0]


def test_other_transformers_versions_keep_transformers_decision():
    """The wrapper replaces a method on transformers' class: only checked versions get it."""
    assert transformers_checked("5.17.0") and transformers_checked("5.24.1")
    assert not transformers_checked("5.25.0") and not transformers_checked("4.57.0")
    assert not transformers_checked("main")
