"""Host time spent launching Triton kernels in a training step, per kernel (the device held by a
sleep kernel, so no launch waits for the GPU):

    python -m benchmarks.launch_cost rat,rattention,fox --seq 8192

Times every call of Triton's ``JITFunction.run`` and of hf_hybrid/_compat/triton_launch.py's cached launch (the
outermost of the two when one calls the other), grouped by kernel name. Models as train_gaps builds
them. Set ``HF_HYBRID_TRITON_FAST_LAUNCH=0`` to see Triton's own launch path for every kernel.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import threading
import time

import torch

from .host_time import SLEEP_CYCLES
from .train_gaps import _build


class LaunchTimes:
    """Calls and seconds per name, counting only the outermost of nested timed calls (per thread)."""

    def __init__(self):
        self.calls: collections.Counter = collections.Counter()
        self.seconds: collections.Counter = collections.Counter()
        self._depth = threading.local()

    def wrap(self, method, name_of):
        def timed(obj, *args, **kwargs):
            depth = getattr(self._depth, "n", 0)
            self._depth.n = depth + 1
            start = time.perf_counter()
            try:
                return method(obj, *args, **kwargs)
            finally:
                self._depth.n = depth
                if depth == 0:
                    name = name_of(obj)
                    self.calls[name] += 1
                    self.seconds[name] += time.perf_counter() - start
        return timed


@contextlib.contextmanager
def timed_methods(times: LaunchTimes, targets):
    """Patch ``(cls, method name, name_of(obj))`` targets to record into ``times`` while active."""
    originals = [(cls, attr, getattr(cls, attr)) for cls, attr, _ in targets]
    for (cls, attr, original), (_, _, name_of) in zip(originals, targets):
        setattr(cls, attr, times.wrap(original, name_of))
    try:
        yield times
    finally:
        for cls, attr, original in originals:
            setattr(cls, attr, original)


def _triton_targets():
    from triton.runtime.jit import JITFunction

    from hf_hybrid._compat.triton_launch import CachedLaunchKernel

    return [(JITFunction, "run", lambda fn: fn.fn.__name__),
            (CachedLaunchKernel, "launch", lambda k: k.jit_function.fn.__name__)]


def measure(name: str, seq: int, repeat: int) -> list[tuple[str, float, float, float]]:
    """(kernel, launches per step, host ms per step, host us per launch), most expensive first."""
    device = torch.device("cuda")
    model = _build(name, seq, device).train()
    ids = torch.randint(3, model.config.vocab_size, (1, seq), device=device)

    def step():
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        model.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    with timed_methods(LaunchTimes(), _triton_targets()) as times:
        for _ in range(repeat):
            torch.cuda.synchronize()
            torch.cuda._sleep(SLEEP_CYCLES)
            step()
        torch.cuda.synchronize()
    rows = [(k, times.calls[k] / repeat, times.seconds[k] / repeat * 1e3, times.seconds[k] / times.calls[k] * 1e6)
            for k in times.calls]
    return sorted(rows, key=lambda r: -r[2])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", help="comma-separated, as train_gaps names them")
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    out = {}
    for name in args.models.split(","):
        rows = out[name] = measure(name, args.seq, args.repeat)
        print(f"{name} T={args.seq}: Triton launches cost the host {sum(r[2] for r in rows):.2f} ms a step "
              f"over {sum(r[1] for r in rows):.0f} launches")
        for kernel, calls, ms, us in rows:
            print(f"  {ms:7.3f} ms  {calls:6.1f} launches  {us:6.1f} us each  {kernel}")
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
