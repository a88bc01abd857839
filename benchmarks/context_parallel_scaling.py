"""Context parallelism's scaling: tokens/s per GPU of a training step with one sequence of N x T
tokens split over N ranks, against one GPU stepping a sequence of T.

    torchrun --standalone --nproc-per-node N -m benchmarks.context_parallel_scaling [--seq T] [--only FoX (pro),RAT]
        [--layout contiguous,balanced] [--json OUT]
    torchrun --standalone --nproc-per-node 2 -m benchmarks.context_parallel_scaling --device cpu --quick   # CPU smoke run (gloo)

Shape: the models suite's (hf_hybrid/bench/models.py: 8 layers of the 1.3B shape, bf16, B=1;
``--quick``: its tiny shape in float32). Each rank first times a step on its own at T (no
exchange: the one-GPU baseline, every GPU at once), then the ranks time steps of the N x T
sequence under ``context_parallel`` (hf_hybrid.distributed.context_parallel; loss.backward() and
the gradients' all-reduce over the group). A cell is the median of --repeat steps after one
warm-up, the slowest rank's. ``ratio`` = (T / split step) / (T / one-GPU step): 1.0 is perfect
scaling; the peak memory per GPU of both is reported. ``--layout``: how the sequence is split
(contiguous shards, or balanced: 2N chunks, rank r holding chunks r and 2N - 1 - r, so causal
attention's work is even over the ranks); a comma-separated list gives a row per layout. Rank 0
prints the table and writes --json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from hf_hybrid.bench.cases import BenchConfig
from hf_hybrid.bench.models import architectures, build_ours
from hf_hybrid.distributed.context_parallel import ContextParallelGroup, context_parallel


def _timed(step, device: torch.device, repeat: int) -> float:
    """Median seconds of ``step()`` after one warm-up (CUDA events on GPUs, a clock on CPU)."""
    step()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _peak_gb(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _slowest(value: float, cp: ContextParallelGroup) -> float:
    """The largest ``value`` over the group (every rank's step must finish)."""
    t = torch.tensor([value], dtype=torch.float64, device="cuda" if dist.get_backend(cp.group) == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=cp.group)
    return t.item()


def measure(arch, config: BenchConfig, cp: ContextParallelGroup, seq: int, repeat: int) -> dict:
    """One architecture's row: the one-GPU step at ``seq``, the split step at ranks x ``seq``."""
    torch.manual_seed(0)
    model = build_ours(arch, config).train()
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(1)
    alone = torch.randint(3, vocab, (1, seq), generator=generator).to(config.device)
    whole = torch.randint(3, vocab, (1, seq * cp.world_size), generator=generator).to(config.device)

    def one_gpu_step():
        model(input_ids=alone, labels=alone, use_cache=False).loss.backward()
        model.zero_grad(set_to_none=True)

    ids, targets = cp.shard(whole), cp.shard_labels(whole)
    count = cp.count_targets(targets)

    def split_step():
        with context_parallel(model, cp):
            loss = model(input_ids=ids, shift_labels=targets, num_items_in_batch=count, use_cache=False).loss
        loss.backward()
        cp.all_reduce_gradients(model)
        model.zero_grad(set_to_none=True)

    _reset_peak(config.device)
    one = _slowest(_timed(one_gpu_step, config.device, repeat), cp)
    one_peak = _slowest(_peak_gb(config.device), cp)
    dist.barrier(group=cp.group)
    _reset_peak(config.device)
    split = _slowest(_timed(split_step, config.device, repeat), cp)
    split_peak = _slowest(_peak_gb(config.device), cp)
    return {"name": arch.name, "layout": cp.layout, "ranks": cp.world_size, "seq_per_rank": seq, "one_gpu_s": one, "split_s": split,
            "one_gpu_tokens_per_s": seq / one, "split_tokens_per_s_per_gpu": seq / split, "ratio": one / split,
            "one_gpu_peak_gb": one_peak, "split_peak_gb": split_peak}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=None, help="tokens per rank (default 8192; --quick 32)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--only", default="FoX (pro)", help="comma-separated rows of the models suite, or 'all'")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--quick", action="store_true", help="the models suite's tiny shape, float32")
    parser.add_argument("--layout", default="contiguous,balanced", help="comma-separated: contiguous, balanced (a row each)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group("nccl")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    groups = [ContextParallelGroup.from_group(layout=layout.strip()) for layout in args.layout.split(",")]
    cp = groups[0]
    config = BenchConfig(device=device, dtype=torch.float32 if args.quick else torch.bfloat16, quick=args.quick)
    seq = args.seq or (32 if args.quick else 8192)
    wanted = None if args.only == "all" else {name.strip() for name in args.only.split(",")}
    rows = []
    for arch in architectures(args.quick):
        if not arch.trains or (wanted is not None and arch.name not in wanted):
            continue
        for group in groups:
            try:
                rows.append(measure(arch, config, group, seq, args.repeat))
            except (NotImplementedError, ValueError) as error:  # no exchange, or a shard too short: alike on every rank
                rows.append({"name": arch.name, "layout": group.layout, "skipped": str(error).split(";")[0]})
            except torch.OutOfMemoryError:  # pragma: no cover (GPUs only)
                rows.append({"name": arch.name, "layout": group.layout, "skipped": "out of memory"})
                torch.cuda.empty_cache()
    if cp.rank == 0:
        print(f"{cp.world_size} ranks x {seq} tokens vs one GPU at {seq}, {device.type}, {config.dtype}")
        print(f"{'model':<14} {'layout':<11} {'1 GPU tok/s':>12} {'split tok/s/GPU':>16} {'ratio':>6} {'1 GPU GB':>9} {'split GB':>9}")
        for row in rows:
            if "skipped" in row:
                print(f"{row['name']:<14} {row['layout']:<11} skipped: {row['skipped']}")
                continue
            print(f"{row['name']:<14} {row['layout']:<11} {row['one_gpu_tokens_per_s']:12.0f} {row['split_tokens_per_s_per_gpu']:16.0f} "
                  f"{row['ratio']:6.2f} {row['one_gpu_peak_gb']:9.2f} {row['split_peak_gb']:9.2f}")
        if args.json:
            with open(args.json, "w") as file:
                json.dump(rows, file, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
