"""Where a training step's host time goes, measured with the device out of the way.

    python -m benchmarks.host_time rat --seq 8192
    python -m benchmarks.host_time llama_liger --seq 8192
    python -m benchmarks.host_time rat --seq 8192 --graphs   # the layers replayed as CUDA graphs

Before each timed step the GPU is given a long sleep kernel, so the host never waits for a kernel
to finish: the forward's and the backward's wall times are then the host's own cost of issuing the
step (Python, the dispatcher, kernel launches), except where the step synchronises (an ``.item()``,
a pageable copy), which the report names. A sampling thread reads the Python stacks of every thread
(the autograd engine's worker included) every ``--interval`` seconds and charges each sample to the
innermost frame of this project, its kernels, Liger or transformers, split by what runs at the leaf
(a Triton launch, a torch call or the project's own Python). The host times come from steps run
without the sampler; the sampled steps' own host time is printed beside them (the sampler holds the
GIL while it reads the stacks). ``--ops`` adds the self CPU time per ATen op and autograd node of
one more step, from torch.profiler with CPU activity only (the same sleep in front).

Models as train_gaps builds them (8 layers of the 1.3B shape, bf16; ``llama_liger`` is the
training baseline).
"""
from __future__ import annotations

import argparse
import collections
import functools
import json
import sys
import threading
import time

import torch

from .train_gaps import _PROJECT_FRAMES, _build

SLEEP_CYCLES = 600_000_000  # ~0.3 s at 2 GHz: longer than any step's host time
_IDLE_FILES = ("threading.py", "queue.py", "selectors.py")
_BLOCKING_CALLS = ("wait", "_wait_for_tstate_lock", "join", "get", "select", "acquire")
_STEP_FRAMES = _PROJECT_FRAMES + ("torch/autograd",)


@functools.lru_cache(maxsize=None)
def _short_path(path: str) -> str:
    for marker in ("/hf_hybrid/", "/kernels/", "/liger_kernel/", "/transformers/", "/triton/", "/torch/"):
        if marker in path:
            return marker.strip("/") + "/" + path.split(marker, 1)[1]
    return path


def _label(frame) -> str:
    return f"{_short_path(frame.f_code.co_filename)}({frame.f_lineno}): {frame.f_code.co_name}"


def _leaf_kind(label: str) -> str:
    if label.startswith("triton/"):
        return "triton launch"
    if label.startswith("torch/"):
        return "torch python"
    return "own python or op"


def charge(stack: list[str]) -> tuple[str, str]:
    """(owner, leaf kind) of one sampled stack (innermost frame first): the owner is the innermost
    frame of this project, its kernels, Liger or transformers; the leaf kind says what ran there."""
    owner = next((label for label in stack if any(p in label for p in _PROJECT_FRAMES)), stack[0] if stack else "(no frame)")
    return owner, _leaf_kind(stack[0]) if stack else "native"


class StackSampler:
    """Samples the Python stacks of every thread but its own (main thread, autograd workers)."""

    def __init__(self, interval: float):
        self.interval = interval
        self.samples: collections.Counter = collections.Counter()
        self.recording = False  # set around the sampled steps
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.is_set():
            time.sleep(self.interval)
            if self.recording:
                self.samples[self._one_charge(me)] += 1

    @staticmethod
    def _one_charge(me: int) -> tuple[str, str]:
        """One charge per tick: a busy thread's stack (an autograd worker's before the main thread's),
        or the autograd engine's native work when the main thread waits in backward() and no worker
        runs Python."""
        waiting_in_backward, busy = False, []
        main_ident = threading.main_thread().ident
        for ident, frame in sys._current_frames().items():
            if ident == me or frame is None:
                continue
            code = frame.f_code
            if code.co_filename.endswith(_IDLE_FILES) and code.co_name in _BLOCKING_CALLS:
                continue
            if code.co_name == "_engine_run_backward":
                waiting_in_backward = True
                continue
            stack = []
            while frame is not None:
                stack.append(_label(frame))
                frame = frame.f_back
            main = ident == main_ident
            if main or any(p in label for label in stack for p in _STEP_FRAMES):
                busy.append((main, stack))  # (not a compile worker's timer, a tqdm monitor, ...)
        if busy:
            return charge(sorted(busy, key=lambda b: b[0])[0][1])
        return ("(autograd engine: native backward ops)", "native") if waiting_in_backward else ("(idle)", "native")

    def __enter__(self):
        self._switch = sys.getswitchinterval()
        sys.setswitchinterval(self.interval / 4)  # the sampler gets the GIL at about its own rate
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        sys.setswitchinterval(self._switch)


def _timed_step(step_forward, step_backward) -> tuple[float, float, float]:
    """(host forward ms, host backward ms, device ms) of one step issued behind a sleep kernel."""
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    loss = step_forward()
    t1 = time.perf_counter()
    step_backward(loss)
    t2 = time.perf_counter()
    end.record()
    torch.cuda.synchronize()
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3, start.elapsed_time(end)


def measure(step_forward, step_backward, repeat: int, interval: float) -> dict:
    """Host ms of the forward and the backward (device held by a sleep kernel) and device ms of the
    step, from ``repeat`` steps without the sampler; then ``repeat`` sampled steps say where the host
    time goes (charges scaled to the unsampled host time; ``sampled_host_ms`` shows the sampler's cost)."""
    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(SLEEP_CYCLES)
    end.record()
    torch.cuda.synchronize()
    sleep_ms = start.elapsed_time(end)
    host_fwd, host_bwd, device = zip(*(_timed_step(step_forward, step_backward) for _ in range(repeat)))
    sampled = []
    with StackSampler(interval) as sampler:
        for _ in range(repeat):
            sampler.recording = True
            fwd, bwd, _ = _timed_step(step_forward, step_backward)
            sampler.recording = False
            sampled.append(fwd + bwd)
    total = sum(sampler.samples.values()) or 1
    host_ms = median(host_fwd) + median(host_bwd)
    return dict(
        host_forward_ms=median(host_fwd), host_backward_ms=median(host_bwd), device_ms=median(device),
        samples=total, sleep_ms=sleep_ms, sampled_host_ms=median(sampled),
        by_owner=[(owner, kind, host_ms * n / total) for (owner, kind), n in sampler.samples.most_common()],
    )


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--interval", type=float, default=5e-4, help="seconds between stack samples")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--ops", action="store_true", help="also list the host's self time per ATen op / autograd node")
    parser.add_argument("--json", default=None, help="append the report as one JSON line to this file")
    parser.add_argument("--graphs", action="store_true", help="the decoder layers through hf_hybrid.graph_training_layers")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    model = _build(args.model, args.seq, device, graphs=args.graphs).train()
    ids = torch.randint(3, model.config.vocab_size, (1, args.seq), device=device)

    def forward():
        return model(input_ids=ids, labels=ids, use_cache=False).loss

    def backward(loss):
        loss.backward()
        model.zero_grad(set_to_none=True)

    for _ in range(3):  # compilation, autotuning, allocator warm-up
        backward(forward())
    report = measure(forward, backward, args.repeat, args.interval)
    report.update(model=args.model, seq=args.seq, graphs=args.graphs)
    print(f"{args.model} T={args.seq}: host forward {report['host_forward_ms']:.2f} ms, backward "
          f"{report['host_backward_ms']:.2f} ms; device {report['device_ms']:.2f} ms; {report['samples']} samples "
          f"(sampled steps' host time {report['sampled_host_ms']:.2f} ms)")
    if report["host_forward_ms"] + report["host_backward_ms"] > 0.8 * report["sleep_ms"]:
        print(f"  the host waited on the device (a sync: the sleep kernel lasts {report['sleep_ms']:.0f} ms); "
              "the owner holding most of that wait is the synchronising line")
    for owner, kind, ms in report["by_owner"][: args.top]:
        print(f"  {ms:7.3f} ms  {kind:16s} {owner}")
    if args.ops:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            _timed_step(forward, backward)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(report) + "\n")
    return report


if __name__ == "__main__":
    main()
