"""Kernel-time tables (torch.profiler, CUDA activity) of one whole-model call, to see where a
training step or a decode step spends its GPU time.

    python -m benchmarks.profile train se_hybrid --seq 32768
    python -m benchmarks.profile prefill rat_plus_d16 --seq 32768
    python -m benchmarks.profile decode rat_plus_d16 --batch 8 --prompt 16384

Models: those of benchmarks.generation (8 layers of the 1.3B shape, bf16, random weights);
``train`` also takes ``llama_liger`` (the training baseline: Llama with Liger's kernels).
``train``: one ``model(ids, labels=ids).loss.backward()`` at B=1 after two warm-up steps.
``prefill``: one no-grad ``model(ids, logits_to_keep=1)`` at B=1 with the model's cache (the
models suite's prefill cell) after two warm-up calls.
``decode``: the static decode step run without a CUDA graph (mode ``"eager"``), so its kernels
show one by one, over ``--steps`` greedy tokens after the prefill and three warm-up steps
(benchmarks.generation.decode_loop_ms; the prefill is not in the table).
"""
from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from .generation import LLAMA_MODELS, MODELS, build_model, decode_loop_ms
from .train_gaps import _build as build_training_model


def profiled(fn) -> profile:
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return prof


def table(prof: profile, rows: int) -> str:
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=70)


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("train", "prefill", "decode"))
    parser.add_argument("model", choices=MODELS + ("llama_liger",))
    parser.add_argument("--seq", type=int, default=8192, help="train, prefill: tokens")
    parser.add_argument("--batch", type=int, default=8, help="decode: rows")
    parser.add_argument("--prompt", type=int, default=16384, help="decode: prompt tokens")
    parser.add_argument("--steps", type=int, default=8, help="decode: new tokens profiled")
    parser.add_argument("--rows", type=int, default=30, help="kernels listed")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    if args.what == "prefill":
        model = build_model(args.model, device, torch.bfloat16, args.seq + 16).eval()
        ids = torch.randint(3, model.config.vocab_size, (1, args.seq), device=device)

        def step():
            with torch.no_grad():
                model(input_ids=ids, logits_to_keep=1).logits.argmax(-1)

        for _ in range(2):  # compilation, autotuning
            step()
        prof = profiled(step)
    elif args.what == "train":
        model = build_training_model(args.model, args.seq, device).train()
        ids = torch.randint(3, model.config.vocab_size, (1, args.seq), device=device)

        def step():
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            model.zero_grad(set_to_none=True)

        for _ in range(2):  # compilation, autotuning
            step()
        prof = profiled(step)
    else:
        if args.model in LLAMA_MODELS:
            raise SystemExit("decode profiles cover this package's models (Llama has no static decode step here)")
        model = build_model(args.model, device, torch.bfloat16, args.prompt + args.steps + 16)
        ids = torch.randint(3, model.config.vocab_size, (args.batch, args.prompt), device=device)
        captured = []

        def measure(fn):
            captured.append(profiled(fn))
            return 1.0

        decode_loop_ms(model, ids, args.steps, mode="eager", measure=measure)
        prof = captured[0]
    text = table(prof, args.rows)
    print(text)
    return text


if __name__ == "__main__":
    main()
