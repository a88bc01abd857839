"""Tile sweep of FoX's split-K decode kernel against the SDPA decode it replaced, at generate()'s shapes.

    python -m benchmarks.split_decode_sweep --json sweep.json [--generate]

One decode step of one layer (16 heads x 128, bf16, a buffer 64 columns longer than the filled part,
as generate() leaves it): the SDPA path (the cached K/V as stored, bias c_q - c_k rounded to bf16,
the static decode step before the kernel) and the Triton kernel for each (tile, warps, programs per
SM). Times are CUDA-graph replays (triton.testing.do_bench_cudagraph), so launch overhead counts as
it does inside generate()'s graphed step. ``--generate`` then sets the configuration with the lowest
summed time over the shapes (bf16 error <= 1e-2 against float32) and runs
benchmarks.generation for Llama (static cache), FoX and RAT
at both shapes in this process.
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from .sweeps import lowest_total, write_json

SHAPES = ((8, 16384), (32, 2048))  # (batch, filled keys): the generate() benchmark's two settings
# (BLOCK_N, warps, programs per SM, software-pipeline stages of the key loop)
CONFIGS = list(itertools.product((16, 32, 64), (2, 4, 8), (4, 8, 16, 32), (1,)))


def sdpa_step(q, keys, values, c_q, c_k, key_mask):
    """The replaced static decode step: SDPA over the buffers with a bf16-rounded additive bias."""
    batch, _, heads, dim = q.shape
    kv = keys.shape[2]
    bias = c_q.float().permute(0, 2, 1) - c_k.float().permute(0, 2, 1)
    bias = bias.masked_fill(~key_mask[:, None, :], float("-inf")).to(q.dtype)
    out = F.scaled_dot_product_attention(
        q[:, 0].reshape(batch, kv, heads // kv, dim), keys.transpose(1, 2), values.transpose(1, 2),
        attn_mask=bias.view(batch, kv, heads // kv, -1))
    return out.reshape(batch, 1, heads, dim)


def step_inputs(batch: int, filled: int, heads: int = 16, dim: int = 128):
    capacity = filled + 64
    dev = torch.device("cuda")
    q = torch.randn(batch, 1, heads, dim, device=dev, dtype=torch.bfloat16)
    k = torch.randn(batch, capacity, heads, dim, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    c_k = torch.cumsum(F.logsigmoid(torch.randn(batch, capacity, heads, device=dev) + 4), dim=1)
    c_q = c_k[:, filled - 1:filled].clone()
    length = torch.full((1,), filled, device=dev, dtype=torch.long)
    key_mask = (torch.arange(capacity, device=dev) < filled).expand(batch, -1)
    return q, k, v, c_q, c_k, length, key_mask


def set_config(block: int, warps: int, per_sm: int, stages: int = 1) -> None:
    from hf_hybrid.kernels import _split_decode
    from hf_hybrid.kernels.forgetting_attention import decode_triton

    decode_triton.BLOCK_N, decode_triton.WARPS, _split_decode.PROGRAMS_PER_SM = block, warps, per_sm
    decode_triton.STAGES = stages


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``"8x16384,160x4096"`` -> [(8, 16384), (160, 4096)] (batch x filled keys)."""
    return [tuple(int(x) for x in item.split("x")) for item in text.split(",") if item]


def parse_configs(text: str) -> list[tuple[int, ...]]:
    """``"64x4x16x1,128x8x16x2"`` -> BLOCK_N x warps x programs per SM x stages tuples."""
    return [tuple(int(x) for x in item.split("x")) for item in text.split(",") if item]


def sweep(shapes=SHAPES, configs=CONFIGS) -> dict:
    import triton.testing

    from hf_hybrid.kernels.forgetting_attention import decode_triton, forgetting_attention_decode_reference

    rows = []
    for batch, filled in shapes:
        q, k, v, c_q, c_k, length, key_mask = step_inputs(batch, filled)
        kv_bytes = 2 * batch * filled * k.shape[2] * k.shape[3] * k.element_size()  # what a step must read
        exact = forgetting_attention_decode_reference(q.float(), k.float(), v.float(), c_q, c_k, length)
        base = triton.testing.do_bench_cudagraph(lambda: sdpa_step(q, k, v, c_q, c_k, key_mask))
        error = ((sdpa_step(q, k, v, c_q, c_k, key_mask).float() - exact).norm() / exact.norm()).item()
        rows.append(dict(batch=batch, filled=filled, variant="sdpa (before)", ms=round(base, 4), rel_error=float(f"{error:.2e}"),
                         kv_gb_per_s=round(kv_bytes / base / 1e6, 1)))
        print(json.dumps(rows[-1]), flush=True)
        for block, warps, per_sm, stages in configs:
            set_config(block, warps, per_sm, stages)
            name = f"triton {block}x{warps}w {per_sm}/SM {stages} stages"
            fn = lambda: decode_triton.forgetting_attention_decode_triton(q, k, v, c_q, c_k, length)  # noqa: E731
            try:
                error = ((fn().float() - exact).norm() / exact.norm()).item()
                ms = triton.testing.do_bench_cudagraph(fn)
            except Exception as exc:  # a tile that does not compile on this GPU
                rows.append(dict(batch=batch, filled=filled, variant=name, error=str(exc)[:200]))
                continue
            rows.append(dict(batch=batch, filled=filled, variant=name, ms=round(ms, 4), vs_sdpa=round(base / ms, 3),
                             config=[block, warps, per_sm, stages], rel_error=float(f"{error:.2e}"),
                             kv_gb_per_s=round(kv_bytes / ms / 1e6, 1)))
            print(json.dumps(rows[-1]), flush=True)
        del q, k, v, c_q, c_k, key_mask
        torch.cuda.empty_cache()
    return dict(rows=rows, best=lowest_total(rows, "ms", len(shapes)), device=torch.cuda.get_device_name())


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the rows and the chosen configuration here")
    parser.add_argument("--generate", action="store_true", help="then time generate() with the best configuration")
    parser.add_argument("--shapes", type=parse_shapes, default=SHAPES, help="BATCHxKEYS,... (default: generate()'s two)")
    parser.add_argument("--configs", type=parse_configs, default=CONFIGS,
                        help="BLOCKxWARPSxPER_SMxSTAGES,... (default: the full grid)")
    args = parser.parse_args(argv)
    result = sweep(args.shapes, args.configs)
    print("best (BLOCK_N, warps, programs per SM, stages):", result["best"], flush=True)
    if args.generate:
        from .generation import main as generate_benchmark

        set_config(*result["best"])
        result["generate"] = []
        for batch, prompt in ((8, 16384), (32, 2048)):
            result["generate"] += generate_benchmark(["--batch", str(batch), "--prompt", str(prompt), "--models", "llama,fox,rat"])
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
