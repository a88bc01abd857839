"""Timing with CUDA events: warm-up calls first, then the median of >= 10 timed calls.

Device work is asynchronous, so each call is bracketed by CUDA events and read after one final
synchronize. Off CUDA (smoke runs) the host clock is used. Peak memory is reported per measure.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

MIN_REPEAT = 10


@dataclass
class Timing:
    median_ms: float
    min_ms: float
    max_ms: float
    repeat: int
    peak_mem_gb: float | None = None
    first_ms: float | None = None  # the variant's first call (compiling and autotuning its kernels), where timed


def time_fn(fn: Callable[[], object], device: torch.device, warmup: int = 3, repeat: int = MIN_REPEAT,
            warm_ms: float = 0.0) -> Timing:
    """Median wall time of ``fn()`` in milliseconds (repeat is raised to at least MIN_REPEAT).

    ``warm_ms``: after the warm-up calls, keep calling ``fn`` until this much time has passed, so that
    the GPU's clocks settle at this workload's own level before timing: a kernel timed within ~100 ms
    of a different one can run up to 10% off its steady speed, in either direction, which a few
    warm-up calls of a 2 ms kernel do not cover."""
    repeat = max(repeat, MIN_REPEAT)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(warmup):
        fn()
    if warm_ms > 0:
        _synchronize(device)
        start = time.perf_counter()
        while (time.perf_counter() - start) * 1e3 < warm_ms:
            fn()
            _synchronize(device)
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeat)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        times = [start.elapsed_time(end) for start, end in events]
        peak = torch.cuda.max_memory_allocated(device) / 2**30
    else:
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        peak = None
    return Timing(statistics.median(times), min(times), max(times), repeat, peak)


def latency_ms(fn: Callable[[], object], warmup: int = 3, repeat: int = 20) -> float:
    """Median wall time of one CUDA call in milliseconds, the device synchronised after each call: the
    host's launch time counts, which back-to-back calls (:func:`time_fn`) hide behind the GPU's."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_cuda_graph(fn: Callable[[], object], device: torch.device, warmup: int = 3, repeat: int = MIN_REPEAT) -> Timing:
    """Median time of replaying ``fn`` captured once in a CUDA graph: the same kernels without
    the per-launch host cost (what a decode loop run under CUDA graphs pays). ``fn`` must be
    capturable: fixed shapes and buffers, no host synchronisation."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up (compilation, autotuning, allocations) off the capture
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_fn(graph.replay, device, warmup=warmup, repeat=repeat)


def free_memory(device: torch.device) -> None:
    """Drop cached blocks between variants so each starts from an empty allocator."""
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
