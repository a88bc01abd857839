"""RAT+'s joint training step (active recurrence learning: dense D=1 and sparse D=64 on each batch)
against the two passes timed alone: time and peak memory.

Per sequence length, three training steps (forward + backward, batch 1, labels = inputs), each in
its own measurement: ``dense`` (``training_dilations=[1]``), ``d64`` (``[64]``: dilation 64, no
window, no sinks) and ``joint`` (``[1, 64]``, hf_hybrid/models/rat_plus/joint_objective.py); with
``--kept-graphs`` also ``joint_kept_graphs``, the joint step that keeps both patterns' activations
until the backward: one forward over the patterns' rows stacked along the batch
(hf_hybrid/models/rat_plus/stacked_patterns.py; the path taken under torch.compile, FSDP2, ZeRO-3). The summary row gives
time(joint) / (time(dense) + time(d64)) and peak(joint) / peak(dense).

    python -m benchmarks.rat_plus_joint_step                       8 layers of the 1.3B shape, bf16, T 8192 and 32768
    python -m benchmarks.rat_plus_joint_step --seq 8192 --kept-graphs --json joint.jsonl

Time: median of ``--repeat`` steps after ``--warmup`` (CUDA events); memory: the peak of
``torch.cuda.max_memory_allocated`` over those steps, weights included. ``--device cpu --tiny`` runs
the same measurement on a tiny model on the CPU path (times only), for the benchmark's own test.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from unittest import mock

import torch

from .generation import SHAPE

TINY = dict(hidden_size=32, num_attention_heads=4, head_dim=8, intermediate_size=64, vocab_size=64, num_hidden_layers=2)
VARIANTS = {"dense": [1], "d64": [64], "joint": [1, 64], "joint_kept_graphs": [1, 64]}


def build_model(device: torch.device, dtype: torch.dtype, seq: int, tiny: bool):
    from transformers import AutoModelForCausalLM

    from hf_hybrid.models.rat_plus import RatPlusConfig

    shape = TINY if tiny else SHAPE
    config = RatPlusConfig(**shape, num_key_value_heads=shape["num_attention_heads"], max_position_embeddings=seq)
    config.pad_token_id, config.eos_token_id = 0, None
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype).train()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _kept_graphs(model):
    """The joint step that keeps every pattern's activations (the stacked forward), as under FSDP2 and ZeRO-3."""
    return mock.patch.object(type(model), "_keeps_every_pattern_graph", lambda self: "measured for comparison")


def measure(model, variant: str, seq: int, warmup: int, repeat: int) -> dict:
    """Median step time (ms) and peak allocated memory (GiB, CUDA only) of one variant."""
    device = model.device
    generator = torch.Generator().manual_seed(seq)  # the same tokens for every variant
    ids = torch.randint(3, model.config.vocab_size, (1, seq), generator=generator).to(device)
    dilations = VARIANTS[variant]
    def step():
        with _kept_graphs(model) if variant == "joint_kept_graphs" else contextlib.nullcontext():
            out = model(input_ids=ids, labels=ids, use_cache=False, training_dilations=dilations)
            out.loss.backward()
        model.zero_grad(set_to_none=True)
        return out.loss.detach(), out.logits is None  # the logits go: held, they would count in the next step

    for _ in range(warmup):
        step()
    _sync(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(repeat):
        _sync(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loss, fused = step()
            end.record()
            _sync(device)
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            loss, fused = step()
            times.append((time.perf_counter() - t0) * 1e3)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return dict(variant=variant, seq=seq, ms=round(statistics.median(times), 2),
                peak_gib=None if peak is None else round(peak, 3), loss=round(loss.item(), 4), fused_loss=fused)


def summary(rows: list[dict]) -> dict:
    """Ratios of one sequence length's rows: the targets are time <= 1.05 and memory <= 1.1."""
    by = {row["variant"]: row for row in rows}
    passes_ms = by["dense"]["ms"] + by["d64"]["ms"]
    result = dict(variant="summary", seq=rows[0]["seq"], joint_over_passes_time=round(by["joint"]["ms"] / passes_ms, 3))
    if by["dense"]["peak_gib"] is not None:
        result["joint_over_dense_peak"] = round(by["joint"]["peak_gib"] / by["dense"]["peak_gib"], 3)
        if "joint_kept_graphs" in by:
            result["kept_graphs_over_dense_peak"] = round(by["joint_kept_graphs"]["peak_gib"] / by["dense"]["peak_gib"], 3)
    if "joint_kept_graphs" in by:
        result["kept_graphs_over_passes_time"] = round(by["joint_kept_graphs"]["ms"] / passes_ms, 3)
    return result


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", default="8192,32768", help="comma list of sequence lengths")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--kept-graphs", action="store_true", help="also time the joint step that keeps both graphs")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny model (the CPU test of this script)")
    parser.add_argument("--json", help="append the rows to this JSON-lines file")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    variants = ["dense", "d64", "joint"] + (["joint_kept_graphs"] if args.kept_graphs else [])
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    all_rows = []
    for seq in (int(s) for s in args.seq.split(",")):
        model = build_model(device, dtype, seq, args.tiny)
        rows = [measure(model, variant, seq, args.warmup, args.repeat) for variant in variants]
        rows.append(summary(rows))
        for row in rows:
            row["device"] = name
            print(json.dumps(row), flush=True)
            if args.json:
                with open(args.json, "a") as file:
                    file.write(json.dumps(row) + "\n")
        all_rows += rows
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return all_rows


if __name__ == "__main__":
    main()
