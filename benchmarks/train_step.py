"""Training steps of the named models against Liger-Llama in one process (training mode, the models
suite's shape: 8 layers of the 1.3B shape, bf16, B=1), in rounds that time every model in turn:
for comparing two versions of the code, run it in a checkout of each, alternating.

    python -m benchmarks.train_step se_hybrid --seq 8192 --rounds 3 --steps 8
    python -m benchmarks.train_step se_hybrid --ssd-warps '{"chunk_bwd": 8}'   # the SSD kernels' warps changed
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch


def training_models(names, seq: int, device: torch.device) -> dict:
    """Liger-Llama and the named models, in training mode (the fused losses are training paths)."""
    from .train_gaps import _build

    return {name: _build(name, seq, device).train() for name in dict.fromkeys(("llama_liger", *names))}


def training_step(model, ids: torch.Tensor) -> None:
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    model.zero_grad(set_to_none=True)


def run(names: list[str], seq: int, rounds: int, steps: int) -> list[dict]:
    from hf_hybrid.bench.timing import time_fn

    device = torch.device("cuda")
    models = training_models(names, seq, device)
    ids = torch.randint(3, 32000, (1, seq), device=device)

    times: dict[str, list[float]] = {}
    for _ in range(rounds):
        for name, model in models.items():
            times.setdefault(name, []).append(time_fn(lambda: training_step(model, ids), device, warmup=2, repeat=steps).median_ms)
    baseline = statistics.median(times["llama_liger"])
    peak = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return [{"model": name, "ms": round(statistics.median(t), 2), "rounds_ms": [round(x, 2) for x in t],
             "x_llama_liger": round(baseline / statistics.median(t), 3), "process_peak_gb": peak,
             "device": torch.cuda.get_device_name()} for name, t in times.items()]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.train_step", description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", help="names from benchmarks.generation's build_model (rat, se_hybrid, ...)")
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per model and round")
    parser.add_argument("--ssd-warps", default=None, help='JSON update of ssd_scan.triton.WARPS, e.g. \'{"chunk_bwd": 8}\'')
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("train_step times CUDA training steps: run it on a GPU machine")
    if args.ssd_warps:
        from hf_hybrid.kernels.ssd_scan import triton as ssd

        ssd.WARPS.update(json.loads(args.ssd_warps))
    for row in run(args.models, args.seq, args.rounds, args.steps):
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
