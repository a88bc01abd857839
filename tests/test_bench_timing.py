"""hf_hybrid.bench.timing.time_fn: the warm-up by time that lets the GPU's clocks settle per op."""
import time

import torch

from hf_hybrid.bench.timing import time_fn


def _counting_sleeper(ms):
    calls = []

    def fn():
        calls.append(time.perf_counter())
        time.sleep(ms / 1e3)

    return fn, calls


def test_warm_ms_keeps_calling_before_timing():
    fn, calls = _counting_sleeper(2.0)
    timing = time_fn(fn, torch.device("cpu"), warmup=1, repeat=10, warm_ms=30.0)
    # 1 warm-up call, then >= 30 ms of untimed calls (at most 15 of 2 ms), then the 10 timed ones.
    untimed = len(calls) - 1 - 10
    assert 1 <= untimed <= 16
    assert calls[1 + untimed] - calls[1] >= 0.030 - 1e-3  # the timed calls start after the warm window
    assert timing.repeat == 10 and timing.median_ms >= 2.0


def test_without_warm_ms_only_the_warm_up_calls_run_untimed():
    fn, calls = _counting_sleeper(0.1)
    time_fn(fn, torch.device("cpu"), warmup=3, repeat=10)
    assert len(calls) == 13
