"""Where a training step's GPU sits idle: its kernels and the gaps between them in a torch.profiler
trace, each gap charged to the Python frame that launched the kernel after it when that launch came
after the previous kernel had ended (the host was late), else counted as a device-side gap.

    python -m benchmarks.train_gaps rat --seq 8192
    python -m benchmarks.train_gaps llama_liger --seq 8192
    python -m benchmarks.train_gaps rat --seq 8192 --graphs   # the layers replayed as CUDA graphs

Models as benchmarks/generation.py builds them (8 layers of the 1.3B shape, bf16);
``llama_liger`` is transformers' Llama with Liger's kernels, the training baseline. The profiler
(with Python stacks) slows the host, so the gaps are larger than in an unprofiled step: compare
models with each other, not with wall times. Launches are matched through the runtime and driver
API events (Triton launches through the driver).
"""
from __future__ import annotations

import argparse
import bisect
import collections
import json
import os
import tempfile

import torch

_PROJECT_FRAMES = ("hf_hybrid", "kernels/", "liger", "transformers")


def _build(name: str, seq: int, device: torch.device, graphs: bool = False):
    """``graphs``: the decoder layers through hf_hybrid.graph_training_layers."""
    from .generation import build_model

    if name == "llama_liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        model = build_model("llama", device, torch.bfloat16, seq + 16)
        apply_liger_kernel_to_llama(model=model)
    else:
        model = build_model(name, device, torch.bfloat16, seq + 16)
    if graphs:
        from hf_hybrid.training import graph_training_layers

        graph_training_layers(model)
    return model


def _trace_events(step) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        step()
        torch.cuda.synchronize()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        return json.load(f)["traceEvents"]


def gap_report(events: list[dict], top: int = 25) -> dict:
    """Kernel time, gap time, and the host-late gaps per launching Python frame (innermost frame of
    this project, its kernels, Liger or transformers enclosing the launch)."""
    spans = [e for e in events if e.get("ph") == "X"]
    kernels = sorted((e for e in spans if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")), key=lambda e: e["ts"])
    launches = {e["args"]["correlation"]: e for e in spans
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    frames = sorted((e for e in spans if e.get("cat") == "python_function" and any(p in e["name"] for p in _PROJECT_FRAMES)),
                    key=lambda e: e["ts"])
    starts = [e["ts"] for e in frames]

    def frame_at(ts: float) -> str:
        best, end = None, bisect.bisect_right(starts, ts)
        # Frames that began before ts; the enclosing ones began within the last few thousand (a layer's calls).
        for e in reversed(frames[max(0, end - 4000):end]):
            if e["ts"] + e["dur"] >= ts and (best is None or e["dur"] < best["dur"]):
                best = e
        return best["name"] if best else "(no project frame)"

    late, late_count, device_side = collections.Counter(), collections.Counter(), 0.0
    for prev, kernel in zip(kernels, kernels[1:]):
        prev_end = prev["ts"] + prev["dur"]
        gap = kernel["ts"] - prev_end
        if gap <= 1.0:
            continue
        launch = launches.get(kernel.get("args", {}).get("correlation"))
        if launch is not None and launch["ts"] + launch["dur"] > prev_end:
            frame = frame_at(launch["ts"])
            late[frame] += gap
            late_count[frame] += 1
        else:
            device_side += gap
    busy = sum(k["dur"] for k in kernels)
    span = kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]
    return dict(kernels=len(kernels), kernel_ms=busy / 1e3, span_ms=span / 1e3, gap_ms=(span - busy) / 1e3,
                host_late_ms=sum(late.values()) / 1e3, device_side_ms=device_side / 1e3,
                by_frame=[(frame, ms / 1e3, late_count[frame]) for frame, ms in late.most_common(top)])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--graphs", action="store_true", help="the decoder layers through hf_hybrid.graph_training_layers")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    model = _build(args.model, args.seq, device, graphs=args.graphs).train()
    ids = torch.randint(3, model.config.vocab_size, (1, args.seq), device=device)

    def step():
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        model.zero_grad(set_to_none=True)

    for _ in range(3):  # compilation, autotuning, allocator warm-up
        step()
    torch.cuda.synchronize()
    report = gap_report(_trace_events(step), args.top)
    print(f"{args.model} T={args.seq}: span {report['span_ms']:.2f} ms, kernels {report['kernel_ms']:.2f} ms "
          f"({report['kernels']} launches), gaps {report['gap_ms']:.2f} ms: host late {report['host_late_ms']:.2f}, "
          f"device side {report['device_side_ms']:.2f}")
    for frame, ms, count in report["by_frame"]:
        print(f"  {ms:7.3f} ms  {count:4d} gaps  {frame}")
    return report


if __name__ == "__main__":
    main()
