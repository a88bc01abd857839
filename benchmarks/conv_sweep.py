"""Tile sweep of the causal conv1d's Triton kernels (kernels/causal_conv1d/triton.py): tokens x
channels per program and num_warps for the forward and for each backward kernel, and the dtype the
backward stores its pre-activation gradient in (float32, or the inputs' bf16), each kernel launched
directly and timed alone; then the shipped op's forward and forward + backward.

    python -m benchmarks.conv_sweep --seq 8192 --channels 4352 --json conv_sweep.json

Shape: the SE hybrid's conv at hidden 2048 (4096 inner channels + B and C of one group of 128),
width 4, SiLU, bias, batch 1, bf16. Times in microseconds (CUDA events over 50 launches).
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch

from hf_hybrid.kernels.causal_conv1d import causal_conv1d
from hf_hybrid.kernels.causal_conv1d import triton as conv

from .sweeps import write_json

WIDTH = 4
TILES = [(bt, bc, warps) for bt, bc, warps in itertools.product((32, 64, 128), (64, 128, 256), (2, 4, 8)) if bt * bc <= 128 * 128]


def _us(fn, repeat: int = 50) -> float:
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    torch.cuda.synchronize()
    return round(start.elapsed_time(end) / repeat * 1000, 1)


def sweep(seq: int, channels: int) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, seq, channels, device="cuda", generator=gen).bfloat16()
    weight = (torch.randn(channels, WIDTH, device="cuda", generator=gen) * 0.5).bfloat16()
    bias = torch.randn(channels, device="cuda", generator=gen).bfloat16()
    dout = torch.randn(1, seq, channels, device="cuda", generator=gen).bfloat16()
    rows = []
    for (bt, bc, warps), dpre_dtype in itertools.product(TILES, (torch.float32, torch.bfloat16)):
        grid = conv.conv_grid(1, seq, channels, bt, bc)
        dpre = torch.empty(1, seq, channels, device="cuda", dtype=dpre_dtype)
        dw_part = torch.empty(grid[0], channels, WIDTH, device="cuda")
        db_part = torch.empty(grid[0], channels, device="cuda")
        dx = torch.empty_like(x)

        def pre():
            conv._conv_bwd_pre[grid](
                x, weight, bias, weight, dout, dpre, dw_part, db_part, seq, channels, x.stride(0), x.stride(1), 0, 0,
                dout.stride(0), dout.stride(1), K=WIDTH, HAS_BIAS=True, HAS_STATE=False, SILU=True, BT=bt, BC=bc,
                num_warps=warps,
            )

        def input_grad():
            conv._conv_bwd_dx[grid](dpre, weight, dx, seq, channels, dx.stride(0), dx.stride(1), K=WIDTH, BT=bt, BC=bc,
                                    num_warps=warps)

        row = dict(kernel="backward", tile=[bt, bc, warps], dpre=str(dpre_dtype).removeprefix("torch."))
        rows.append(dict(row, pre_us=_us(pre), dx_us=_us(input_grad)))
    for bt, bc, warps in TILES:
        grid = conv.conv_grid(1, seq, channels, bt, bc)
        out = torch.empty_like(x)

        def forward():
            conv._conv_fwd[grid](x, weight, bias, weight, out, seq, channels, x.stride(0), x.stride(1), 0, 0,
                                 out.stride(0), out.stride(1), K=WIDTH, HAS_BIAS=True, HAS_STATE=False, SILU=True,
                                 BT=bt, BC=bc, num_warps=warps)

        rows.append(dict(kernel="forward", tile=[bt, bc, warps], us=_us(forward)))
    leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]

    def forward_backward():
        torch.autograd.grad(causal_conv1d(*leaves, None, "silu"), leaves, dout)

    rows.append(dict(kernel="shipped op", forward=list(conv.FORWARD_TILE), backward=list(conv.BACKWARD_TILE),
                     forward_us=_us(lambda: causal_conv1d(x, weight, bias, None, "silu")), forward_backward_us=_us(forward_backward)))
    device = torch.cuda.get_device_name()
    return [dict(r, device=device, seq=seq, channels=channels) for r in rows]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.conv_sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--channels", type=int, default=4352)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("the sweep times CUDA kernels: run it on a GPU machine")
    rows = sweep(args.seq, args.channels)
    for row in rows:
        print(json.dumps(row))
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
