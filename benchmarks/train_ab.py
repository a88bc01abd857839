"""Two ways of one part of the training step, in one process: each model's step timed in rounds
that alternate the two ways, with Liger-Llama (the training baseline) timed in the same rounds, at
the models suite's shape (8 layers of the 1.3B shape, bf16, B=1). One process keeps the host's
speed the same for every row (these steps are about as long on the host as on the GPU, so a slower
host moves them).

    python -m benchmarks.train_ab --compare window --seq 8192 --rounds 3 --json F
    python -m benchmarks.train_ab --compare backbone --seq 8192 --rounds 3 --json F
    python -m benchmarks.train_ab --compare graphs --seq 8192 --rounds 3 --json F
    python -m benchmarks.train_ab --compare rla --seq 8192 --rounds 3 --json F
    python -m benchmarks.train_ab --compare window_kernel --seq 8192 --rounds 3 --json F
    python -m benchmarks.train_ab --compare rla_partials --seq 8192 --rounds 3 --json F

``--compare window``: the sliding-window layers' attention, ``window`` (kernels/window_attention,
the default) against ``flex``: RAT-SWA's window layers through transformers' compiled flex_attention
with a BlockMask (``window_attention_applies`` answering False), RATTENTION's local layers with
``backend="flex"``.
``--compare backbone``: the backbone's RMSNorm and SwiGLU product, ``ours`` (kernels/residual_norm
and kernels/output_gate, the default) against ``liger`` (Liger's RMSNorm in its "gemma" casting
mode, the same math, and Liger's SwiGLU).
``--compare graphs``: the decoder layers ``eager`` (the default) against ``graphs``
(``hf_hybrid.graph_training_layers``: each layer's forward and backward replayed as CUDA graphs);
Liger-Llama takes both ways too, so each way has its own baseline row.
``--compare rla``: RATTENTION's residual linear attention kernels with their default tiling,
``stacked`` (the query heads of a group stacked into each tile), against ``split`` (one query head
per tile, the feature halves apart over whole value rows in both passes: the former default below
16K tokens).
``--compare window_kernel``: kernels/window_attention's two ways for the window layers of RAT-SWA
and RATTENTION, ``flash`` (PyTorch's FlashAttention-2 with its window, the default for bf16)
against ``triton`` (the Triton kernels).
``--compare rla_partials``: how RATTENTION's residual linear attention adds its two feature halves'
partial sums, ``atomics`` (one launch over both halves, float32 atomics into a zeroed buffer, then a
conversion: the default) against ``per_half`` (one launch per half, the second adding the first's
float32 partial and storing the result).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys

import torch

COMPARISONS = {  # compare -> (its models, its two ways, the default first)
    "window": (("rat_swa", "rattention"), ("window", "flex")),
    "backbone": (("rat", "rat_swa", "fox", "rattention", "se_hybrid"), ("ours", "liger")),
    "graphs": (("llama_liger", "rat", "rat_swa", "fox_llama", "fox", "rattention", "se_hybrid"), ("eager", "graphs")),
    "rla": (("rattention",), ("stacked", "split")),
    "window_kernel": (("rat_swa", "rattention"), ("flash", "triton")),
    "rla_partials": (("rattention",), ("atomics", "per_half")),
}
SPLIT_RLA = {"fuse_halves": False, "block_v": 128, "heads_per_tile": 1}


def _liger_rms_norm(x, weight, eps):
    from liger_kernel.ops import LigerRMSNormFunction

    return LigerRMSNormFunction.apply(x, weight, eps, 0.0, "gemma", False)


def _liger_silu_mul(gate, up):
    from liger_kernel.ops import LigerSiLUMulFunction

    return LigerSiLUMulFunction.apply(gate, up)


@contextlib.contextmanager
def way(model, name: str):
    """The model's step on ``name``, one of the ways in COMPARISONS (the defaults change nothing)."""
    from hf_hybrid.layers import attention as attention_module
    from hf_hybrid.layers import mlp as mlp_module
    from hf_hybrid.layers import norm as norm_module
    from hf_hybrid.bench.rattention import rla_options
    from hf_hybrid.layers.residual_linear_attention import RattentionLocalAttention
    from hf_hybrid.training import graph_training_layers, ungraph_training_layers

    known = [w for _, ways in COMPARISONS.values() for w in ways]
    if name not in known:
        raise ValueError(f"way must be one of {', '.join(known)}; got {name!r}.")
    locals_ = [m for m in model.modules() if isinstance(m, RattentionLocalAttention)]
    saved = attention_module.window_attention_applies, norm_module.fused_rms_norm, mlp_module.fused_silu_mul
    saved_flash = attention_module.flash_window_applies
    if name == "triton":
        attention_module.flash_window_applies = lambda query: False
        for m in locals_:
            m._swa_backend = lambda: "triton"
    if name == "flex":
        attention_module.window_attention_applies = lambda query: False
        for m in locals_:
            m._swa_backend = lambda: "flex"
    if name == "liger":
        norm_module.fused_rms_norm, mlp_module.fused_silu_mul = _liger_rms_norm, _liger_silu_mul
    if name == "graphs":
        graph_training_layers(model)
    try:
        with rla_options({"split": SPLIT_RLA, "per_half": {"half_launches": True}}.get(name, {})):
            yield
    finally:
        ungraph_training_layers(model)
        attention_module.window_attention_applies, norm_module.fused_rms_norm, mlp_module.fused_silu_mul = saved
        attention_module.flash_window_applies = saved_flash
        for m in locals_:
            m.__dict__.pop("_swa_backend", None)


def run(compare: str, seq: int, rounds: int, steps: int) -> list[dict]:
    from hf_hybrid.bench.timing import time_fn

    from .train_step import training_models, training_step

    names, ways = COMPARISONS[compare]
    device = torch.device("cuda")
    rows: dict[str, list[float]] = {}
    models = training_models(names, seq, device)
    ids = torch.randint(3, 32000, (1, seq), device=device)

    for _ in range(rounds):
        for name, model in models.items():
            for choice in (ways if name in names else ("",)):
                with way(model, choice or ways[0]):
                    ms = time_fn(lambda: training_step(model, ids), device, warmup=2, repeat=steps).median_ms
                rows.setdefault(f"{name} {choice}".strip(), []).append(ms)

    def baseline(row: str) -> float:  # the way's own Liger-Llama row when the baseline takes the ways too
        choice = row.rsplit(" ", 1)[-1]
        return statistics.median(rows.get(f"llama_liger {choice}", rows.get("llama_liger", [float("nan")])))

    return [{"row": row, "ms": round(statistics.median(times), 3), "rounds_ms": [round(t, 3) for t in times],
             "x_llama_liger": round(baseline(row) / statistics.median(times), 3), "device": torch.cuda.get_device_name()}
            for row, times in rows.items()]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.train_ab", description=__doc__.split("\n\n")[0])
    parser.add_argument("--compare", choices=sorted(COMPARISONS), default="window")
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per row and round")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("train_ab needs a CUDA device", file=sys.stderr)
        return 1
    rows = run(args.compare, args.seq, args.rounds, args.steps)
    for row in rows:
        print(json.dumps(row))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
