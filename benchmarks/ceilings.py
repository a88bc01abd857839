"""How far a model's ratio to Llama can go: each model timed as is and with its token mixer at zero
cost, in one process against transformers' Llama (as is and with Liger's kernels, which our models'
backbone uses; the compiled static cache for generate()), at the models suite's shape (hf_hybrid/bench/models.py).

    python -m benchmarks.ceilings --cells train8k,train32k,prefill32k
    python -m benchmarks.ceilings --cells decode16k,decode2k

A stand-in replaces the mixer's operators and keeps everything else of the model: its projections
(their forward and backward GEMMs), o_proj, the MLPs, norms, embeddings and loss, and every layer it
does not name. ``baseline / (model with the stand-in)`` is the ratio the model would reach if its
mixer cost nothing: a target above it cannot be met by any mixer kernel.

- ``RAT, free mixer``: RAT's layer is its five projections and o_proj(v) (the chunk recurrence, the
  chunk-end attention and the output gate cost nothing); in generate() only the decode step's
  mixer is replaced (``RAT, free decode mixer``), the prefill is RAT's own.
- ``RATTENTION, free local mixers``: its local layers are q / k / v projections and o_proj(q) (no
  sliding window, no residual linear attention, no branch norms); the global layers stay.
- ``RATTENTION, free RLA``: the residual linear attention costs nothing (its output is q, its
  gradient passed to q, k and v); the sliding window, the branch norms and the global layers stay.
- ``RATTENTION, RLA at its memory floor``: the residual linear attention replaced by elementwise
  work with its least memory traffic (the forward reads q, k, v and writes o; the backward reads
  q, k, v and dO and writes dq, dk, dv): what any RLA kernel bound by the GPU's memory would cost.
- ``SE hybrid, free Mamba mixers``: its Mamba-2 layers are in_proj and out_proj(gate) (no conv1d, no
  SSM scan, no gated norm); the attention layers stay. SE hybrid carries 13% more weights than
  Llama at this shape (465M against 411M outside the embeddings), so its GEMMs alone cost more.
- ``RAT-SWA, free RAT mixers``: RAT's stand-in above in the RAT layers; the sliding-window layers stay.
- ``FoX, cuDNN attention``: Forgetting Attention replaced by PyTorch's causal SDPA (cuDNN / flash on
  the GPU), the forget gate's projection kept (its gradient is zeros): the model if its attention
  kernel were exactly as fast as the one Llama runs.

The stand-ins compute nothing meaningful (their loss is not RAT's): timing only. Rows are printed as
JSON and, with ``--json``, appended to a JSON-lines file as they are timed.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math

import torch
from torch.nn import functional as F

from hf_hybrid.layers import forgetting_attention as fox_layer
from hf_hybrid.layers import rat_attention as rat_layer
from hf_hybrid.layers import residual_linear_attention as rattention_layer
from hf_hybrid.layers.projections import project_shared_input
from hf_hybrid.models.se_hybrid import modeling_se_hybrid as se_hybrid_model


class _FreeMixer(torch.autograd.Function):
    """The mixer's output is its first input (a view), at no cost; the others get the output's
    gradient (a view where size and dtype match, zeros elsewhere), so their projections' backward
    GEMMs run as in the real model."""

    @staticmethod
    def forward(ctx, main, *others):
        ctx.specs = [(o.shape, o.dtype) for o in others]
        return main.view_as(main)

    @staticmethod
    def backward(ctx, grad):
        return (grad, *[grad.reshape(shape) if grad.numel() == math.prod(shape) and grad.dtype == dtype
                        else grad.new_zeros(shape, dtype=dtype) for shape, dtype in ctx.specs])


def _rat_without_mixer(self, hidden_states, context, cache_layer=None):
    projections = (self.q_proj, self.k_proj, self.v_proj, self.g_proj, self.z_proj)
    q, k, v, gate_logits, gate_z = project_shared_input(hidden_states, projections)
    return self.o_proj(_FreeMixer.apply(v, q, k, gate_logits, gate_z))


def _rat_decode_without_mixer(self, q, k, v, gate_logits, gate_z, positions, chunk_index, cos_sin, cache_layer):
    return self.o_proj(v.reshape(v.shape[0], 1, -1))


def _rattention_local_without_mixer(self, hidden_states, context, cache_layer=None):
    batch, seq, _ = hidden_states.shape
    q, k, v = self.project(hidden_states)  # q has every head; k and v the key/value heads (GQA)
    return self.o_proj(_FreeMixer.apply(q, k, v).reshape(batch, seq, -1))


_RATTENTION_LOCAL_FORWARD = rattention_layer.RattentionLocalAttention.forward


def _rattention_local_decode_without_mixer(self, hidden_states, context, cache_layer=None):
    if hidden_states.shape[1] == 1 and cache_layer is not None and cache_layer.get_seq_length() > 0:
        q, _, _ = self.project(hidden_states)
        return self.o_proj(q.reshape(q.shape[0], 1, -1))
    return _RATTENTION_LOCAL_FORWARD(self, hidden_states, context, cache_layer)


def _free_rla(q, k, v, window_size, feature_map, initial_state=None, **_):
    return _FreeMixer.apply(q, k, v), None


class _RlaMemoryFloor(torch.autograd.Function):
    """o = q + k * v (key / value heads broadcast over their query heads): one kernel reading q, k, v
    and writing o; the backward's three products read q, k, v and dO and write dq, dk, dv."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        return torch.addcmul(_grouped(q, k), k.unsqueeze(3), v.unsqueeze(3)).view_as(q)

    @staticmethod
    def backward(ctx, grad):
        q, k, v = ctx.saved_tensors
        grouped = _grouped(grad, k)
        return q * grad, (grouped * v.unsqueeze(3)).sum(3), (grouped * k.unsqueeze(3)).sum(3)


def _grouped(x, kv):
    """[B, T, H, D] -> [B, T, H_kv, H / H_kv, D], the query heads of each key / value head together."""
    return x.view(*kv.shape[:3], -1, x.shape[-1])


def _rla_at_memory_floor(q, k, v, window_size, feature_map, initial_state=None, **_):
    return _RlaMemoryFloor.apply(q, k, v), None


def _mamba_without_mixer(self, hidden_states, valid, cache_layer):
    gate, xBC, dt = self.in_proj(hidden_states).split([self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
    return self.out_proj(_FreeMixer.apply(gate, xBC, dt))


def _fox_with_cudnn_attention(q, k, v, log_f, **_):
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                         enable_gqa=q.shape[2] != k.shape[2])
    return _FreeMixer.apply(out.transpose(1, 2), log_f)  # log_f gets a zero gradient


# stand-in name -> [(owner, attribute, replacement)]
STAND_INS = {
    "free mixer": [(rat_layer.RatAttention, "forward", _rat_without_mixer)],
    "free decode mixer": [(rat_layer.RatAttention, "_decode_step", _rat_decode_without_mixer)],
    "free local mixers": [(rattention_layer.RattentionLocalAttention, "forward", _rattention_local_without_mixer)],
    "free local decode": [(rattention_layer.RattentionLocalAttention, "forward", _rattention_local_decode_without_mixer)],
    "free RLA": [(rattention_layer, "residual_linear_attention", _free_rla)],
    "RLA at its memory floor": [(rattention_layer, "residual_linear_attention", _rla_at_memory_floor)],
    "free Mamba mixers": [(se_hybrid_model.SEMambaMixer, "_mix", _mamba_without_mixer)],
    "cuDNN attention": [(fox_layer, "forgetting_attention", _fox_with_cudnn_attention)],
}


@contextlib.contextmanager
def stand_in(name: str | None):
    """The named stand-in installed for the block (None: the model as it is)."""
    replaced = [] if name is None else STAND_INS[name]
    saved = [(owner, attribute, getattr(owner, attribute)) for owner, attribute, _ in replaced]
    for owner, attribute, replacement in replaced:
        setattr(owner, attribute, replacement)
    try:
        yield
    finally:
        for owner, attribute, original in saved:
            setattr(owner, attribute, original)


# (row, bench/models.py architecture name or "Llama", stand-in)
FORWARD_ROWS = [
    ("Llama", "Llama", None), ("Llama + Liger", "Llama + Liger", None),
    ("RAT", "RAT", None), ("RAT, free mixer", "RAT", "free mixer"),
    ("RATTENTION", "RATTENTION", None), ("RATTENTION, free local mixers", "RATTENTION", "free local mixers"),
    ("RATTENTION, free RLA", "RATTENTION", "free RLA"),
    ("RATTENTION, RLA at its memory floor", "RATTENTION", "RLA at its memory floor"),
    ("FoX (llama)", "FoX (llama)", None), ("FoX (llama), cuDNN attention", "FoX (llama)", "cuDNN attention"),
    ("FoX (pro)", "FoX (pro)", None), ("FoX (pro), cuDNN attention", "FoX (pro)", "cuDNN attention"),
    ("RAT-SWA", "RAT-SWA", None), ("RAT-SWA, free RAT mixers", "RAT-SWA", "free mixer"),
    ("SE hybrid", "SE hybrid", None), ("SE hybrid, free Mamba mixers", "SE hybrid", "free Mamba mixers"),
]
# (row, benchmarks/generation.py model name, stand-in)
DECODE_ROWS = [
    ("Llama static", "llama", None),
    ("RAT", "rat", None), ("RAT, free decode mixer", "rat", "free decode mixer"), ("RAT+ D=16", "rat_plus_d16", None),
    ("RATTENTION", "rattention", None), ("RATTENTION, free local decode", "rattention", "free local decode"),
]
CELLS = {"train8k": ("train", 8192), "train32k": ("train", 32768), "prefill32k": ("prefill", 32768),
         "decode16k": ("decode", (8, 16384, 64)), "decode2k": ("decode", (32, 2048, 128))}


def _forward_row(kind: str, seq: int, arch_name: str, stand: str | None, config, warmup: int, repeat: int) -> dict:
    from hf_hybrid.bench.models import architectures, build_llama, build_ours, prefill_builder, train_step_builder
    from hf_hybrid.bench.timing import time_fn

    if arch_name.startswith("Llama"):
        make = lambda: build_llama(config, liger=arch_name == "Llama + Liger")  # noqa: E731
    else:
        arch = next(a for a in architectures(config.quick) if a.name == arch_name)
        make = lambda: build_ours(arch, config)  # noqa: E731
    builder = (train_step_builder if kind == "train" else prefill_builder)(make, seq, config)
    with stand_in(stand):
        step, _ = builder()
        timing = time_fn(step, config.device, warmup=warmup, repeat=repeat)
    return dict(ms=round(timing.median_ms, 3), peak_gb=round(timing.peak_mem_gb or 0.0, 2))


def _decode_row(shape, model_name: str, stand: str | None, device: torch.device) -> dict:
    from transformers import StaticCache

    from .generation import build_model, ms_per_token

    batch, prompt, new = shape
    model = build_model(model_name, device, torch.bfloat16, prompt + new + 16)
    ids = torch.randint(3, model.config.vocab_size, (batch, prompt), device=device)
    kwargs = {}
    if model_name == "llama":
        kwargs["static_cache"] = StaticCache(config=model.config, max_cache_len=prompt + new)
    with stand_in(stand):
        ms, _ = ms_per_token(model, ids, 8, new, 2, **kwargs)
    return dict(ms=round(ms, 3))


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cells", default="train8k,train32k,prefill32k", help=f"comma list of {sorted(CELLS)}")
    parser.add_argument("--rows", default=None, help="semicolon list of row names (default: every row of the cell)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=6)
    parser.add_argument("--json", default=None, help="append the rows to this JSON-lines file")
    args = parser.parse_args(argv)
    from hf_hybrid.bench.cases import BenchConfig

    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.ceilings: needs a CUDA device (the stand-ins are timed against Llama on it).")
    device = torch.device("cuda")
    config = BenchConfig(device=device)
    wanted = None if args.rows is None else set(args.rows.split(";"))
    rows = []
    for cell in args.cells.split(","):
        if cell not in CELLS:
            raise SystemExit(f"--cells: unknown cell {cell!r}; choose from {sorted(CELLS)}.")
        kind, shape = CELLS[cell]
        table = DECODE_ROWS if kind == "decode" else FORWARD_ROWS
        for name, model, stand in table:
            if wanted is not None and name not in wanted and not name.startswith("Llama"):
                continue  # the baselines always run
            try:
                if kind == "decode":
                    result = _decode_row(shape, model, stand, device)
                else:
                    result = _forward_row(kind, shape, model, stand, config, args.warmup, args.repeat)
            except Exception as exc:  # one row's failure (OOM, a missing package) does not end the run
                result = dict(error=f"{type(exc).__name__}: {exc}"[:300])
            row = dict(cell=cell, row=name, **result, device=torch.cuda.get_device_name())
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(row) + "\n")
            torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    main()
