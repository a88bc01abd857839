"""Triton kernel of :mod:`.` (the math is in reference.py): several bias-free linears of one input
with few rows, in one launch.

A decode step multiplies a handful of rows (the batch) by each weight: a weight-streaming problem.
cuBLAS tiles such a product 64 outputs wide (``nvjet_..._64x8``), so a 2048 x 2048 weight gets 32
thread blocks on 132 SMs and streams well below the memory's bandwidth, and each weight is its
own launch. Here every (weight, BLOCK_N outputs) pair is one
program: the program's rows of the weight stream through a pipelined K loop into a tensor-core dot
with the (zero-padded) rows of x, which every program reads from L2.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton_dot import dot

MAX_WEIGHTS = 6  # pointer slots of the kernel
# Tiles from `python -m benchmarks.few_row_sweep`: grouped weights gain 1.3-2.9x over one cuBLAS
# launch each; a single weight gains nothing, so callers keep cuBLAS there.
BLOCK_N, BLOCK_K, WARPS, STAGES = 32, 256, 2, 3


def tile_for(rows: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) for ``rows`` rows: the tuned tile up to 32 rows;
    past that it spills on sm_90 (64 x 256 x 2 warps), so a shallower K step over 4 warps."""
    block_m = max(16, triton.next_power_of_2(rows))
    if block_m > 32:
        return block_m, BLOCK_N, 64, 4, STAGES
    return block_m, BLOCK_N, BLOCK_K, WARPS, STAGES


@triton.jit
def _pick(i, a0, a1, a2, a3, a4, a5):
    """The i-th of six scalars / pointers (i a runtime program index)."""
    out = a0
    if i == 1:
        out = a1
    elif i == 2:
        out = a2
    elif i == 3:
        out = a3
    elif i == 4:
        out = a4
    elif i == 5:
        out = a5
    return out


@triton.jit
def _few_row_linear_kernel(
    X, W0, W1, W2, W3, W4, W5, O0, O1, O2, O3, O4, O5, N0, N1, N2, N3, N4, N5,
    M, K, sxm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr,
):
    tile = tl.program_id(0)
    which = tl.program_id(1)
    n_out = _pick(which, N0, N1, N2, N3, N4, N5)
    if tile * BLOCK_N >= n_out:  # this weight has fewer outputs than the grid's widest
        return
    w_ptr = _pick(which, W0, W1, W2, W3, W4, W5)
    o_ptr = _pick(which, O0, O1, O2, O3, O4, O5)
    rows = tl.arange(0, BLOCK_M)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(X + rows[:, None].to(tl.int64) * sxm + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * K + ks[None, :], mask=(cols[:, None] < n_out) & (ks[None, :] < K), other=0.0)
        acc = dot(x, tl.trans(w), acc, DOT_PREC)
    out_mask = (rows[:, None] < M) & (cols[None, :] < n_out)
    tl.store(o_ptr + rows[:, None].to(tl.int64) * n_out + cols[None, :], acc.to(o_ptr.dtype.element_ty), mask=out_mask)


def few_row_linear_triton(x2d: torch.Tensor, weights: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """x2d [M, K] (unit stride along K), weights contiguous [N_i, K] of x's dtype; returns [M, N_i] each."""
    rows, k = x2d.shape
    outs = tuple(torch.empty(rows, w.shape[0], device=x2d.device, dtype=x2d.dtype) for w in weights)
    pad = MAX_WEIGHTS - len(weights)
    w_args = list(weights) + [weights[0]] * pad
    o_args = list(outs) + [outs[0]] * pad
    n_args = [w.shape[0] for w in weights] + [0] * pad
    block_m, block_n, block_k, warps, stages = tile_for(rows)
    grid = (triton.cdiv(max(n_args), block_n), len(weights))
    _few_row_linear_kernel[grid](
        x2d, *w_args, *o_args, *n_args, rows, k, x2d.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PREC="ieee" if x2d.dtype == torch.float32 else "tf32", num_warps=warps, num_stages=stages,
    )
    return outs
