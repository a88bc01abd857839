"""Tile sweep of RAT's one-kernel decode step (kernels/chunk_attention/rat_decode_triton.py) at
generate()'s shapes.

    python -m benchmarks.rat_decode_sweep --json sweep.json

One layer's step (16 heads x 128, q/k in 2 groups, chunk size 16, bf16; buffers as generate()
preallocates them, 64 tokens past the prompt), for each (BLOCK_N, warps, programs per SM) of the
chunk-end loop. Times are CUDA-graph replays (triton.testing.do_bench_cudagraph), as inside
generate()'s graphed step; GB/s counts the chunk ends read (keys and values). Each configuration's
output is checked against the shipped one's on the same inputs (bf16 relative error <= 1e-2; the
shipped kernel is tested against the reference in tests/kernels). ``best``: the lowest summed time.
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch

from .sweeps import cold_copies, lowest_total, write_json

SHAPES = ((8, 16384), (32, 2048))  # (batch, prompt tokens): the generate() benchmark's two settings
CONFIGS = list(itertools.product((16, 32, 64), (2, 4, 8), (4, 8, 16, 32)))  # (BLOCK_N, warps, programs per SM)
HEADS, GROUPS, DIM, CHUNK = 16, 2, 128, 16


def step_inputs(batch: int, prompt: int):
    dev, dt = torch.device("cuda"), torch.bfloat16
    slots = (prompt + 64) // CHUNK
    g = torch.Generator(device=dev).manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, device=dev, dtype=dt, generator=g)  # noqa: E731
    return dict(
        q_groups=rand(batch, 1, GROUPS, DIM), k_groups=rand(batch, 1, GROUPS, DIM), v=rand(batch, 1, HEADS, DIM),
        gate_logits=rand(batch, 1, HEADS, DIM), gate_bias=torch.zeros(HEADS * DIM, device=dev),
        state_key=rand(batch, HEADS, DIM), state_value=rand(batch, HEADS, DIM),
        position=torch.full((1,), prompt, device=dev, dtype=torch.long), chunk_size=CHUNK,
        cos_sin=(torch.ones(1, 1, 1, DIM, device=dev), torch.zeros(1, 1, 1, DIM, device=dev)),
        key_buffer=rand(batch, slots, HEADS, DIM), value_buffer=rand(batch, slots, HEADS, DIM),
    )


def set_config(block: int, warps: int, per_sm: int | None) -> None:
    from hf_hybrid.kernels.chunk_attention import rat_decode_triton

    rat_decode_triton.BLOCK_N, rat_decode_triton.WARPS, rat_decode_triton.PROGRAMS_PER_SM = block, warps, per_sm


def _fresh(inputs: dict) -> dict:
    """A copy whose in-place written state and buffers start equal for every configuration."""
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def sweep() -> dict:
    import triton.testing

    from hf_hybrid.kernels.chunk_attention import rat_decode_triton

    shipped = (rat_decode_triton.BLOCK_N, rat_decode_triton.WARPS, rat_decode_triton.PROGRAMS_PER_SM)
    step = rat_decode_triton.rat_decode_step_triton
    rows = []
    for batch, prompt in SHAPES:
        inputs = step_inputs(batch, prompt)
        read_bytes = 2 * batch * (prompt // CHUNK) * HEADS * DIM * 2
        # Each step reads its chunk ends from memory, as in a model's step (B=32 / 2K's 34 MB replayed
        # alone would stay in the 50 MB L2).
        copies = cold_copies(inputs, read_bytes, _fresh)
        set_config(*shipped)
        expected = step(**_fresh(inputs)).float()
        for block, warps, per_sm in [shipped] + CONFIGS:
            set_config(block, warps, per_sm)
            name = f"{block}x{warps}w {per_sm}/SM" + (" (shipped)" if (block, warps, per_sm) == shipped else "")
            try:
                got = step(**_fresh(inputs)).float()
                error = ((got - expected).norm() / expected.norm()).item()
                ms = triton.testing.do_bench_cudagraph(lambda: [step(**c) for c in copies]) / len(copies)
            except Exception as exc:  # a tile that does not compile on this GPU
                rows.append(dict(batch=batch, prompt=prompt, variant=name, error=str(exc)[:200]))
                continue
            rows.append(dict(batch=batch, prompt=prompt, variant=name, us=round(ms * 1e3, 2),
                             gb_per_s=round(read_bytes / ms / 1e6), config=[block, warps, per_sm],
                             rel_error=float(f"{error:.2e}")))
            print(json.dumps(rows[-1]), flush=True)
    set_config(*shipped)
    return dict(rows=rows, best=lowest_total(rows, "us", len(SHAPES)), shipped=list(shipped), device=torch.cuda.get_device_name())


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the rows and the chosen configuration here")
    args = parser.parse_args(argv)
    result = sweep()
    print("best (BLOCK_N, warps, programs per SM):", result["best"], "shipped:", result["shipped"], flush=True)
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
