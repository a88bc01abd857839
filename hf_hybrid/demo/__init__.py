"""`hf-hybrid demo`: train the five architectures and a Llama baseline briefly, save, reload, compare.

Every contestant goes through the same steps, so the table compares architectures fairly:
1. build from a config (AutoConfig.for_model) and train on the package's own data: batches alternate
   between multi-query associative recall and a synthetic language with long-range structure;
2. save_pretrained, reload with AutoModelForCausalLM.from_pretrained, check identical logits;
3. for each inference variant of the model (RAT+ at several dilations, SE-Attn `se` and `full`):
   recall accuracy (teacher forced) and generated answers, held-out language loss, the real bytes
   of the decoding cache after a 4K-token prefill and, on a machine with a GPU, decode tokens/s.
   The decode column runs on the GPU whenever one is present (whatever --device trains on), batch
   64 after a 4000-token prompt, where the cache matters. Without a GPU it is left out: at a prompt
   short enough for the CPU it would time per-step Python overhead, not the cache, and it swings
   with the machine's load from one run to the next.
It says where it writes first, prints one table, writes the checkpoints, results.json and
results.png (the chart) to --output-dir (default ./demo_output) and ends with its running time.

What to expect from the default size (400 steps of 2-layer, hidden-64 models, about 3 minutes on two
CPU cores): the cache column is exact whatever the training. Recall separates models by how fast they
learn to bind a key to the value stored after it. Plain attention needs an induction circuit (a
previous-token head feeding a matching head), which takes thousands of steps to form, so Llama stays
near the "elimination" level printed under the table (it knows which values were stored, not which
key owns which); FoX Pro's KV-shift mixes each key into the next token in one layer and reaches
100%. `--size small` (meant for `--device cuda`) trains wider, deeper models ten times longer.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

import hf_hybrid  # noqa: F401  (registers the architectures)

from ..data.language import oracle_loss_by_position
from .measure import measure_row, train
from .report import format_table, plot_results
from .setup import SIZES, Contestant, DemoSize, build_config, default_contestants, make_data, select

__all__ = ["main", "run", "format_table", "SIZES"]


@contextlib.contextmanager
def _quiet_transformers():
    """Hide transformers' one-off notices (e.g. the Mamba reference-kernel fallback) during the demo."""
    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(previous)


def _folder_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_+" else "_" for c in name).strip("_")


def run_contestant(contestant: Contestant, size: DemoSize, data, device: str, output_dir: Path, seed: int) -> list[dict]:
    torch.manual_seed(seed)
    config = build_config(contestant, size, data.vocab_size)
    model = AutoModelForCausalLM.from_config(config)
    if contestant.prepare is not None:
        contestant.prepare(model)
    model = model.to(device)
    start = time.perf_counter()
    loss = train(model, data, size, device, contestant.name, seed)
    train_seconds = time.perf_counter() - start

    folder = output_dir / _folder_name(contestant.name)
    model.save_pretrained(folder)
    reloaded = AutoModelForCausalLM.from_pretrained(folder).to(device).eval()
    shared = {
        "contestant": contestant.key,
        "model_type": config.model_type,
        "class": type(reloaded).__name__,
        "parameters": sum(p.numel() for p in reloaded.parameters()),
        "train_loss": loss,
        "train_seconds": train_seconds,
        "saved_to": str(folder),
    }
    return [
        {"model": variant.name, **shared, "inference": variant.describe(),
         **measure_row(model, reloaded, data, device, variant.name, variant.forward_kwargs)}
        for variant in contestant.rows
    ]


def run(contestants: list[Contestant], size: DemoSize, device: str, output_dir: Path, seed: int = 0) -> tuple[list[dict], float]:
    """Train and measure every contestant; returns the rows and the ideal predictor's language loss."""
    torch.manual_seed(seed)
    data = make_data(size, seed)
    # What a predictor that knows the generating process pays on the same held-out documents.
    oracle = float(oracle_loss_by_position(data.language_eval.tolist(), data.language).mean())
    results = []
    with _quiet_transformers():
        for contestant in tqdm(contestants, desc="contestants"):
            results += run_contestant(contestant, size, data, device, output_dir, seed)
    return results, oracle


def recall_baselines(size: DemoSize) -> tuple[float, float]:
    """Recall accuracy of guessing any value, and of guessing among the stored values not yet answered.

    Every pair is queried once in random order, so the i-th query (0-based) has num_pairs - i
    candidates left: the second number is the mean of 1 / (num_pairs - i).
    """
    pairs = size.num_pairs
    return 1 / size.recall_keys, sum(1 / (pairs - i) for i in range(pairs)) / pairs


def _check_device(parser: argparse.ArgumentParser, device: str) -> None:
    try:
        kind = torch.device(device).type
    except RuntimeError:
        parser.error(f"--device {device!r} is not a torch device; use --device cpu or --device cuda")
    if kind == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {device} was given but torch sees no CUDA device "
                     f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); use --device cpu, "
                     "or install a CUDA build of torch on a machine with a GPU")


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="hf-hybrid demo", description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=list(SIZES), default="tiny",
                        help="model and training size: smoke (seconds), tiny (default, ~3 min on 2 CPU cores), small (GPU)")
    parser.add_argument("--device", default="cpu", help="torch device: cpu (default) or cuda")
    parser.add_argument("--output-dir", type=Path, default=Path("demo_output"), help="checkpoints, results.json, results.png")
    parser.add_argument("--only", help="comma-separated subset of contestants: " + ",".join(c.key for c in default_contestants(SIZES["smoke"])))
    parser.add_argument("--steps", type=int, help="training steps per model (default: the size's)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    _check_device(parser, args.device)
    size = SIZES[args.size]
    if args.steps is not None:
        if args.steps < 1:
            parser.error(f"--steps must be >= 1, got {args.steps}")
        size = dataclasses.replace(size, steps=args.steps)
    try:
        contestants = select(default_contestants(size), args.only)
    except ValueError as error:
        parser.error(str(error))
    args.output_dir.mkdir(parents=True, exist_ok=True)
    print(f"hf-hybrid demo: {len(contestants)} models, size {args.size}, on {args.device}; checkpoints, "
          f"results.json and results.png go to {args.output_dir.resolve()}/ (--output-dir to change)", flush=True)

    start = time.perf_counter()
    results, oracle = run(contestants, size, args.device, args.output_dir, args.seed)
    print()
    print(format_table(results))
    print(f"\nlang loss: held-out synthetic language; a predictor that knows the generating process pays {oracle:.3f}.")
    chance, elimination = recall_baselines(size)
    print(f"recall acc: MQAR answers, teacher forced (chance {chance:.1%}; knowing which values were stored, but not\n"
          f"  under which key, reaches {elimination:.1%} by elimination: above that a model binds keys to values);\n"
          "  gen recall: the first answer from greedy generate() with the row's inference options.")
    if results and "decode_tokens_per_s" in results[0]:
        first = results[0]
        print(f"decode tok/s: greedy generate() of {first['decode_new_tokens']} tokens after a {first['decode_context']}-token prompt, "
              f"batch {first['decode_batch']}, on {first['decode_device']}\n  (tokens after the first / their time; "
              "on the GPU whenever one is present, at a context where the cache matters).")
    else:
        print("decode tok/s: measured on a GPU only (none here); on a CPU, at these sizes, it would time per-step overhead,\n"
              "  not the cache, and swing with the machine's load.")
    try:
        chart = plot_results(results, args.output_dir / "results.png", f"hf-hybrid demo, size {args.size}, {args.device}", oracle)
    except ImportError as error:  # matplotlib is optional for the library itself
        chart = None
        print(f"\nno chart: {error}")
    summary = {"size": args.size, "device": args.device, "seed": args.seed, "oracle_language_loss": oracle,
               "recall_chance": chance, "recall_by_elimination": elimination,
               "chart": str(chart) if chart else None, "seconds": time.perf_counter() - start, "rows": results}
    (args.output_dir / "results.json").write_text(json.dumps(summary, indent=2))
    print(f"\nCheckpoints, results.json{' and results.png' if chart else ''} in {args.output_dir.resolve()}/")
    print(f"Done in {_minutes_seconds(summary['seconds'])}.")
    return results


def _minutes_seconds(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes} min {seconds:02d} s" if minutes else f"{seconds} s"
