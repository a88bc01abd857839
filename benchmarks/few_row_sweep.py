"""Tile sweep of the few-row projection kernel (kernels/few_row_linear) against cuBLAS (F.linear per
weight, what the modules run) at a decode step's shapes.

    python -m benchmarks.few_row_sweep --json sweep.json

The 1.3B shape (hidden 2048, 16 heads x 128, SwiGLU 5632), bf16, M = 8 and 32 rows (the generate()
benchmark's batches): RAT's five projections (q, k in 2 groups of 128, v, gate logits, z), a
Llama-style q/k/v, one 2048 x 2048 o_proj, the MLP's gate+up and its down projection. Times are
CUDA-graph replays (triton.testing.do_bench_cudagraph), as inside generate()'s graphed step, over
enough copies of the weights that each is read from memory, as in a model's step (one 8 MB o_proj
replayed alone stays in the 50 MB L2: sweeps.cold_copies); GB/s counts the weights read. ``best``:
the configuration with the lowest summed time over the cases, with every output within bf16
rounding (1e-2 relative) of cuBLAS.
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch
from torch.nn import functional as F

from .sweeps import cold_copies, lowest_total, write_json

CASES = {  # name: (input width K, output widths N_i)
    "rat_qkvgz": (2048, (256, 256, 2048, 2048, 2048)),
    "qkv": (2048, (2048, 2048, 2048)),
    "o_proj": (2048, (2048,)),
    "gate_up": (2048, (5632, 5632)),
    "down": (5632, (2048,)),
}
ROWS = (8, 32)
CONFIGS = list(itertools.product((16, 32), (64, 128, 256), (2, 4), (3, 5)))  # (BLOCK_N, BLOCK_K, warps, stages)


def set_config(block_n: int, block_k: int, warps: int, stages: int) -> None:
    from hf_hybrid.kernels.few_row_linear import triton as kernel

    kernel.BLOCK_N, kernel.BLOCK_K, kernel.WARPS, kernel.STAGES = block_n, block_k, warps, stages


def sweep() -> dict:
    import triton.testing

    from hf_hybrid.kernels.few_row_linear import few_row_linear
    from hf_hybrid.kernels.few_row_linear import triton as kernel

    shipped = (kernel.BLOCK_N, kernel.BLOCK_K, kernel.WARPS, kernel.STAGES)
    rows_out = []
    dev = torch.device("cuda")
    for rows, (name, (depth, widths)) in itertools.product(ROWS, CASES.items()):
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(rows, depth, device=dev, dtype=torch.bfloat16, generator=g)
        weights = tuple(torch.randn(n, depth, device=dev, dtype=torch.bfloat16, generator=g) / depth**0.5 for n in widths)
        nbytes = sum(w.numel() * 2 for w in weights)
        expected = [F.linear(x, w).float() for w in weights]
        copies = cold_copies(weights, nbytes, lambda ws: tuple(w.clone() for w in ws))
        cold = lambda run: triton.testing.do_bench_cudagraph(lambda: [run(ws) for ws in copies]) / len(copies)  # noqa: E731
        base = cold(lambda ws: [F.linear(x, w) for w in ws])
        rows_out.append(dict(rows=rows, case=name, variant="cuBLAS", us=round(base * 1e3, 2), gb_per_s=round(nbytes / base / 1e6)))
        print(json.dumps(rows_out[-1]), flush=True)
        for config in [shipped] + CONFIGS:
            set_config(*config)
            try:
                got = few_row_linear(x, weights, backend="triton")
                error = max(((o.float() - e).norm() / e.norm()).item() for o, e in zip(got, expected))
                ms = cold(lambda ws: few_row_linear(x, ws, backend="triton"))
            except Exception as exc:  # a tile that does not compile or fit
                rows_out.append(dict(rows=rows, case=name, config=list(config), error=str(exc)[:200]))
                continue
            rows_out.append(dict(rows=rows, case=name, config=list(config), us=round(ms * 1e3, 2),
                                 gb_per_s=round(nbytes / ms / 1e6), vs_cublas=round(base / ms, 3), rel_error=float(f"{error:.2e}")))
    set_config(*shipped)
    best = lowest_total(rows_out, "us", len(ROWS) * len(CASES))
    best_rows = [r for r in rows_out if r.get("config") == best or r.get("variant") == "cuBLAS"]
    return dict(rows=rows_out, best=best, shipped=list(shipped), best_rows=best_rows, device=torch.cuda.get_device_name())


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the rows and the chosen configuration here")
    args = parser.parse_args(argv)
    result = sweep()
    for r in result["best_rows"]:
        print(json.dumps(r), flush=True)
    print("best (BLOCK_N, BLOCK_K, warps, stages):", result["best"], "shipped:", result["shipped"], flush=True)
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
