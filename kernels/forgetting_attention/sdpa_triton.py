"""Triton kernel of sdpa.py: queries and keys with the forget bias as extra head dimensions."""
from __future__ import annotations

import triton
import triton.language as tl

from .._grid import split_program_id

BLOCK_T, WARPS = 32, 4


@triton.jit
def _augment_kernel(
    Q, K, C, QA, KA, sqb, sqt, sqh, skb, skt, skh,
    T, HQ, REP, neg_inv_scale,
    HEAD_DIM: tl.constexpr, EXTRA: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """QA[b, t, h] = [q, 1, 1, 1, 0 ..]; KA[b, t, h] = [k of kv head h // REP, p1, p2, p3, 0 ..] with
    p1 + p2 + p3 = -c[h, b T + t] / scale split into three values of QA's dtype (float32 exactness
    for 16-bit tensors; p2 = p3 = 0 for float32). QA, KA contiguous [B, T, HQ, HEAD_DIM + EXTRA]."""
    tiles = tl.cdiv(T, BLOCK_T)
    pid_t, pid_bh = split_program_id(tiles)
    b, h = pid_bh // HQ, pid_bh % HQ
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = offs_t < T
    dims = tl.arange(0, HEAD_DIM)
    extra = tl.arange(0, EXTRA)
    width = HEAD_DIM + EXTRA
    rows = offs_t.to(tl.int64)
    q = tl.load(Q + b.to(tl.int64) * sqb + h * sqh + rows[:, None] * sqt + dims[None, :], mask=row_ok[:, None])
    k = tl.load(K + b.to(tl.int64) * skb + (h // REP) * skh + rows[:, None] * skt + dims[None, :], mask=row_ok[:, None])
    out = ((b.to(tl.int64) * T + rows) * HQ + h) * width
    tl.store(QA + out[:, None] + dims[None, :], q.to(QA.dtype.element_ty), mask=row_ok[:, None])
    tl.store(KA + out[:, None] + dims[None, :], k.to(KA.dtype.element_ty), mask=row_ok[:, None])
    ones = tl.where(extra < 3, 1.0, 0.0)
    tl.store(QA + out[:, None] + HEAD_DIM + extra[None, :],
             (ones[None, :] + tl.zeros([BLOCK_T, EXTRA], tl.float32)).to(QA.dtype.element_ty), mask=row_ok[:, None])
    batch = tl.num_programs(0) // (tiles * HQ)
    x = tl.load(C + h.to(tl.int64) * batch * T + b.to(tl.int64) * T + offs_t,
                mask=row_ok, other=0.0) * neg_inv_scale
    p1 = x.to(KA.dtype.element_ty).to(tl.float32)
    rest = x - p1
    p2 = rest.to(KA.dtype.element_ty).to(tl.float32)
    p3 = (rest - p2).to(KA.dtype.element_ty).to(tl.float32)
    e = extra[None, :]
    pieces = tl.where(e == 0, p1[:, None], tl.where(e == 1, p2[:, None], tl.where(e == 2, p3[:, None], 0.0)))
    tl.store(KA + out[:, None] + HEAD_DIM + e, pieces.to(KA.dtype.element_ty), mask=row_ok[:, None])
