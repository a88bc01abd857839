"""Context parallelism's reach: per architecture, the longest sequence a training step takes on
one GPU and split over N GPUs (tokens/s per GPU against one GPU: benchmarks.context_parallel_scaling).

    python -m benchmarks.context_parallel_longest --json OUT.jsonl                                 # one GPU
    torchrun --standalone --nproc-per-node N -m benchmarks.context_parallel_longest --json OUT.jsonl
    python -m benchmarks.context_parallel_longest --report OUT.jsonl      # the table, from every N's lines

Shape: 8 layers of the 1.3B shape (the models suite's), bf16 weights, B=1, random tokens,
activation checkpointing per decoder layer (how sequences this long are trained). One step:
forward, loss (the fused LM head + loss on CUDA), backward, and on N GPUs the gradient sum over
the group (hf_hybrid.distributed.context_parallel, its default balanced layout: each rank an early
and a late chunk); no optimizer.
The length doubles from --first-tokens x N while the next length's predicted peak memory (linear in T
from the last two steps, the largest over the ranks) fits --memory-fraction of the GPU and the
last step took under --max-step-s; "longest" is the longest length that ran. Each length: one
warm-up step (compilation, autotuning at that shape), then one timed step.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from dataclasses import dataclass

import torch

MODELS = ("RAT", "RAT+", "FoX (llama)", "RATTENTION", "SE hybrid")


@dataclass
class Trial:
    tokens: int
    ok: bool
    step_s: float = 0.0
    peak_bytes: int = 0


def next_length(trials: list[Trial], capacity_bytes: int, memory_fraction: float, max_step_s: float, max_tokens: int) -> int | None:
    """The next length to try after ``trials`` (doubling), or None when it would not fit in memory
    (peak extrapolated linearly from the last two lengths), the last step was too slow, or the last
    one failed."""
    last = trials[-1]
    if not last.ok or last.step_s > max_step_s or 2 * last.tokens > max_tokens:
        return None
    target = 2 * last.tokens
    if len(trials) >= 2 and trials[-2].ok:
        before = trials[-2]
        slope = (last.peak_bytes - before.peak_bytes) / (last.tokens - before.tokens)
        predicted = last.peak_bytes + slope * (target - last.tokens)
    else:
        predicted = 2 * last.peak_bytes
    return target if predicted <= memory_fraction * capacity_bytes else None


def _build(name: str, device: torch.device):
    from hf_hybrid.bench.cases import BenchConfig
    from hf_hybrid.bench.models import architectures, build_ours

    arch = next(a for a in architectures(quick=False) if a.name == name)
    model = build_ours(arch, BenchConfig(device=device, dtype=torch.bfloat16)).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _step(model, cp, tokens: int, device: torch.device) -> None:
    from hf_hybrid.distributed.context_parallel import context_parallel

    ids = torch.randint(3, model.config.vocab_size, (1, tokens), device=device, generator=torch.Generator(device).manual_seed(tokens))
    if cp is None:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    else:
        targets = cp.shard_labels(ids)
        # The backward inside the block: checkpointed layers rerun their forward (and its exchanges) there.
        with context_parallel(model, cp):
            loss = model(input_ids=cp.shard(ids), shift_labels=targets, num_items_in_batch=cp.count_targets(targets), use_cache=False).loss
            loss.backward()
        cp.all_reduce_gradients(model)
    model.zero_grad(set_to_none=True)


def _timed_step(model, cp, tokens: int, device: torch.device) -> Trial:
    try:
        _step(model, cp, tokens, device)  # warm-up: compilation and autotuning at this shape
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        _step(model, cp, tokens, device)
        torch.cuda.synchronize()
        trial = Trial(tokens, True, time.perf_counter() - start, torch.cuda.max_memory_allocated())
    except torch.OutOfMemoryError:
        trial = Trial(tokens, False)
    torch.cuda.empty_cache()
    if cp is not None:  # the same verdict and the largest peak on every rank
        verdict = torch.tensor([0 if trial.ok else 1, trial.peak_bytes], device=device, dtype=torch.int64)
        torch.distributed.all_reduce(verdict, op=torch.distributed.ReduceOp.MAX, group=cp.group)
        trial.ok, trial.peak_bytes = bool(verdict[0] == 0), int(verdict[1])
    return trial


def sweep(args) -> None:
    import hf_hybrid  # noqa: F401  (registers the architectures)
    from hf_hybrid.distributed.context_parallel import ContextParallelGroup

    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    cp = None
    if world > 1:
        torch.distributed.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(seconds=180))
        cp = ContextParallelGroup.from_group()
    capacity = torch.cuda.get_device_properties(device).total_memory
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    for name in names:
        torch.manual_seed(0)
        model = _build(name, device)
        trials = [_timed_step(model, cp, args.first_tokens * world, device)]
        while (tokens := next_length(trials, capacity, args.memory_fraction, args.max_step_s, args.max_tokens)) is not None:
            trials.append(_timed_step(model, cp, tokens, device))
        if local_rank == 0 and (cp is None or cp.rank == 0):
            row = {
                "model": name, "gpus": world, "device": torch.cuda.get_device_name(device), "date": time.strftime("%Y-%m-%d"),
                "trials": [t.__dict__ for t in trials],
            }
            with open(args.json, "a") as out:
                out.write(json.dumps(row) + "\n")
            ran = [t for t in trials if t.ok]
            longest = max((t.tokens for t in ran), default=0)
            print(f"{name} on {world} GPU(s): longest {longest:,} tokens; "
                  + ", ".join(f"{t.tokens // 1024}K {t.step_s:.2f}s {t.peak_bytes / 2**30:.1f}GiB" for t in ran), flush=True)
        del model
        torch.cuda.empty_cache()
    if cp is not None:
        torch.distributed.destroy_process_group()


def report(path: str) -> str:
    """The table: the longest length that ran per model and GPU count, with its step time."""
    rows = [json.loads(line) for line in open(path) if line.strip()]
    runs = {(r["model"], r["gpus"]): [t for t in r["trials"] if t["ok"]] for r in rows}
    gpu_counts = sorted({g for _, g in runs})
    lines = ["| model | " + " | ".join(f"{g} GPU{'s' if g > 1 else ''}: longest (step)" for g in gpu_counts) + " |",
             "|---|" + "---|" * len(gpu_counts)]
    for model in dict.fromkeys(m for m, _ in runs):
        cells = []
        for g in gpu_counts:
            ran = runs.get((model, g), [])
            longest = max(ran, key=lambda t: t["tokens"], default=None)
            cells.append("-" if longest is None else f"{longest['tokens']:,} ({longest['step_s']:.2f} s)")
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="append one line per model and GPU count here")
    parser.add_argument("--report", help="print the table from such a file and exit")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--first-tokens", type=int, default=32768, help="first length per GPU (not --start: torchrun would take it for its --start-method)")
    parser.add_argument("--max-tokens", type=int, default=4 * 2**20)
    parser.add_argument("--memory-fraction", type=float, default=0.9)
    parser.add_argument("--max-step-s", type=float, default=6.0, help="stop doubling after a step this slow")
    args = parser.parse_args(argv)
    if args.report:
        print(report(args.report))
        return 0
    if not args.json:
        parser.error("--json OUT.jsonl is required for a sweep")
    sweep(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
