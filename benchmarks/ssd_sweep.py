"""Tile sweep of the SSD scan's Triton kernels (kernels/ssd_scan/triton.py): chunk length, P / N
block and num_warps per kernel, timed on the op's forward + backward at one shape, each
configuration checked against the shipped one.

    python -m benchmarks.ssd_sweep --seq 32768 --heads 64 --json ssd_sweep.json

Shape: the SE hybrid's Mamba-2 mixer at hidden 2048 (64 heads x 64, d_state 128, one group), bf16.
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch

from hf_hybrid.kernels.ssd_scan import ssd_scan
from hf_hybrid.kernels.ssd_scan import triton as ssd_triton

from hf_hybrid.bench.timing import time_fn


def _inputs(seq: int, heads: int, head_dim: int, state: int):
    gen = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    leaves = dict(x=r(1, seq, heads, head_dim).bfloat16(), dt=r(1, seq, heads).bfloat16(),
                  B=r(1, seq, 1, state).bfloat16(), C=r(1, seq, 1, state).bfloat16(), D=torch.ones(heads, device="cuda"))
    for t in leaves.values():
        t.requires_grad_(True)
    fixed = dict(A=-torch.rand(heads, device="cuda") - 0.5, dt_bias=torch.zeros(heads, device="cuda"))
    return leaves, fixed, torch.randn(1, seq, heads, head_dim, device="cuda", generator=gen).bfloat16()


def _run(leaves, fixed, grad):
    y = ssd_scan(leaves["x"], leaves["dt"], fixed["A"], leaves["B"], leaves["C"], D=leaves["D"],
                 dt_bias=fixed["dt_bias"], dt_softplus=True)
    grads = torch.autograd.grad(y, list(leaves.values()), grad)
    return [y, *grads]


def _apply(config: dict) -> None:
    ssd_triton.CHUNK, ssd_triton.BLOCK_PN = config["chunk"], config["block"]
    ssd_triton.WARPS.update(config["warps"])


def sweep(seq: int, heads: int, head_dim: int = 64, state: int = 128) -> dict:
    shipped = dict(chunk=ssd_triton.CHUNK, block=ssd_triton.BLOCK_PN, warps=dict(ssd_triton.WARPS))
    leaves, fixed, grad = _inputs(seq, heads, head_dim, state)
    expected = [t.float() for t in _run(leaves, fixed, grad)]
    rows = []
    for chunk, block, out_warps, bwd_warps in itertools.product((64, 128), (64, 32), (4, 8), (4, 8)):
        config = dict(chunk=chunk, block=block, warps=dict(states=4, output=out_warps, dstates=4, chunk_bwd=bwd_warps))
        _apply(config)
        try:
            got = _run(leaves, fixed, grad)
            error = max(float((g.float() - e).abs().max() / e.abs().max().clamp_min(1e-30)) for g, e in zip(got, expected))
            row = dict(config, ms=time_fn(lambda: _run(leaves, fixed, grad), torch.device("cuda"), warmup=1).median_ms,
                       max_rel_error=error)
        except Exception as exc:  # a tile that does not compile (registers, shared memory) is a row too
            row = dict(config, ms=None, error=f"{type(exc).__name__}: {str(exc)[:120]}")
        print(json.dumps(row), flush=True)
        rows.append(row)
        torch.cuda.empty_cache()
    _apply(shipped)
    timed = [r for r in rows if r.get("ms") is not None]
    best = min(timed, key=lambda r: r["ms"]) if timed else None
    return dict(seq=seq, heads=heads, head_dim=head_dim, state=state, device=torch.cuda.get_device_name(),
                shipped=shipped, rows=rows, best=best)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--json", help="write the rows and the best configuration here")
    args = parser.parse_args(argv)
    result = sweep(args.seq, args.heads)
    print("best:", json.dumps(result["best"]), flush=True)
    if args.json:
        with open(args.json, "w") as f:  # the rows and the shipped / best configurations
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
