"""What is in GPU memory at the peak of one training step, by the line of code that allocated it.

The models suite reports a training step's peak (``torch.cuda.max_memory_allocated``); this says
what makes it up. It records the CUDA allocator's trace over one step (after two warm-up steps:
compilation, autotuning), replays the trace to find the moment of the peak, and groups the blocks
alive then by the innermost Python frame of this package, transformers, Liger or PyTorch's nn code
that allocated them (blocks allocated by autograd's C++ backward carry no Python frame).

    python -m benchmarks.peak_memory rat --seq 32768
    python -m benchmarks.peak_memory rat --seq 32768 --rows 40 --json peak.json

Models: those of benchmarks.generation (8 layers of the 1.3B shape, bf16, random weights).
Memory allocated before the recorded step (weights, the allocator's cached gradients are dropped
between steps) is reported as one line. CUDA only.
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from dataclasses import dataclass

import torch

from .generation import MODELS, build_model

_OWN_CODE = ("hf_hybrid", "kernels", "transformers", "liger_kernel", "torch/nn/")


@dataclass
class PeakReport:
    before_bytes: int  # allocated when the recording began
    peak_bytes: int  # before_bytes + the traced blocks alive at the peak
    phase: str  # "forward" or "backward" at the peak (by the frames of the allocation that reached it)
    groups: list[tuple[str, int, int]]  # (site, bytes, blocks), largest first

    def text(self, rows: int) -> str:
        lines = [
            f"peak {self.peak_bytes / 2**30:.2f} GiB, reached in the {self.phase}; "
            f"{self.before_bytes / 2**30:.2f} GiB allocated before the step (weights and the like)",
            f"{'GiB':>8}  {'blocks':>6}  allocated at",
        ]
        for site, nbytes, count in self.groups[:rows]:
            lines.append(f"{nbytes / 2**30:8.3f}  {count:6d}  {site}")
        return "\n".join(lines)


def _site(frames: list[dict]) -> str:
    """The innermost frame of our code or the libraries around it, with its caller for context."""
    for i, frame in enumerate(frames):
        name = frame.get("filename", "")
        if any(part in name for part in _OWN_CODE):
            here = f"{_short(name)}:{frame.get('line')} {frame.get('name')}"
            caller = next((f for f in frames[i + 1:] if any(p in f.get("filename", "") for p in _OWN_CODE)), None)
            return here if caller is None else f"{here} <- {_short(caller['filename'])}:{caller.get('line')}"
    return "(no Python frame: autograd's C++ backward or a C++ op)" if not frames else f"{_short(frames[0]['filename'])}"


def _short(path: str) -> str:
    for marker in ("hf_hybrid/", "kernels/", "transformers/", "liger_kernel/", "torch/"):
        if marker in path:
            return marker + path.split(marker, 1)[1]
    return path


def _in_backward(frames: list[dict]) -> bool:
    return any("backward" in frame.get("name", "") or "_engine_run_backward" in frame.get("name", "") for frame in frames)


def peak_of_trace(trace: list[dict], before_bytes: int) -> PeakReport:
    """Replay allocator events (``torch.cuda.memory._snapshot()["device_traces"][device]``)."""
    alive: dict[int, dict] = {}
    current = peak = 0
    peak_alive: dict[int, dict] = {}
    peak_event: dict | None = None
    for event in trace:
        action = event["action"]
        if action == "alloc":
            alive[event["addr"]] = event
            current += event["size"]
            if current > peak:
                peak, peak_alive, peak_event = current, dict(alive), event
        elif action in ("free_requested", "free_completed") and event["addr"] in alive:
            # The allocated count drops at the request (a block waiting on another stream's use
            # is no longer allocated to anyone).
            current -= alive.pop(event["addr"])["size"]
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for event in peak_alive.values():
        group = groups[_site(event.get("frames", []))]
        group[0] += event["size"]
        group[1] += 1
    ordered = sorted(((site, b, n) for site, (b, n) in groups.items()), key=lambda g: -g[1])
    phase = "backward" if peak_event is not None and _in_backward(peak_event.get("frames", [])) else "forward"
    return PeakReport(before_bytes, before_bytes + peak, phase, ordered)


def record_training_step(model, ids: torch.Tensor) -> PeakReport:
    def step():
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        model.zero_grad(set_to_none=True)

    for _ in range(2):  # compilation, autotuning
        step()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    try:
        step()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    return peak_of_trace(trace, before)


def main(argv=None) -> PeakReport:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", choices=MODELS)
    parser.add_argument("--seq", type=int, default=32768, help="tokens of the training step (batch 1)")
    parser.add_argument("--rows", type=int, default=30, help="allocation sites listed")
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("peak_memory needs a CUDA device (it reads the CUDA allocator's trace)")
    device = torch.device("cuda")
    model = build_model(args.model, device, torch.bfloat16, args.seq + 16).train()
    ids = torch.randint(3, model.config.vocab_size, (1, args.seq), device=device)
    report = record_training_step(model, ids)
    print(f"== {args.model}, training step T={args.seq}, B=1\n" + report.text(args.rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "seq": args.seq, "before_bytes": report.before_bytes,
                       "peak_bytes": report.peak_bytes, "phase": report.phase,
                       "groups": [list(g) for g in report.groups]}, f, indent=1)
    return report


if __name__ == "__main__":
    main()
