"""Triton kernels around the dense attention call of sdpa_ends.py (layouts and math there).

Every kernel walks tokens t of one (batch, head) in tiles of BLOCK_T rows x HEAD_DIM columns.
Token t = c * L + r of head h with c >= 1 owns the slot (row h * L + r, column c - 1) of the
query-layout tensors [B, H * L, E, D] (queries, merged outputs, their gradients) and entry
(h * L + r) * E + c - 1 of the log-sum-exps [B, H * L, E]; tokens of chunk 0 own no slot.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .._grid import split_program_id
from ..._compat.triton_launch import launch_cached

BLOCK_T, WARPS = 32, 4


@triton.jit
def _slots(offs_t, h, L, E):
    """Slot index of each token (row-major in [H * L, E]) and whether it has one."""
    c = offs_t // L
    r = offs_t - c * L
    return (h * L + r) * E + c - 1, c >= 1


@launch_cached
@triton.jit
def _gather_queries_kernel(Q, QQ, sqb, sqt, sqg, T, H, G, L, E, BLOCK_T: tl.constexpr, HEAD_DIM: tl.constexpr):
    """QQ[b, h L + r, c - 1] = Q[b, t, h % G] for c >= 1; zeros for slots past the sequence."""
    pid_t, pid_bh = split_program_id(tl.cdiv(E * L, BLOCK_T))
    b, h = pid_bh // H, pid_bh % H
    offs_t = L + pid_t * BLOCK_T + tl.arange(0, BLOCK_T)  # chunk 0 has no slots
    dims = tl.arange(0, HEAD_DIM)
    in_slots = offs_t < (E + 1) * L
    q = tl.load(Q + b.to(tl.int64) * sqb + (h % G) * sqg + offs_t.to(tl.int64)[:, None] * sqt + dims[None, :],
                mask=(offs_t < T)[:, None], other=0.0)
    slot, _ = _slots(offs_t, h, L, E)
    base = (b.to(tl.int64) * H * L * E + slot.to(tl.int64)) * HEAD_DIM
    tl.store(QQ + base[:, None] + dims[None, :], q, mask=in_slots[:, None])


@triton.jit
def _own_score(Q, K, b, h, offs_t, row_ok, dims, sqb, sqt, sqg, skb, skt, skh, G, scale):
    q = tl.load(Q + b.to(tl.int64) * sqb + (h % G) * sqg + offs_t.to(tl.int64)[:, None] * sqt + dims[None, :],
                mask=row_ok[:, None], other=0.0).to(tl.float32)
    k = tl.load(K + b.to(tl.int64) * skb + h * skh + offs_t.to(tl.int64)[:, None] * skt + dims[None, :],
                mask=row_ok[:, None], other=0.0).to(tl.float32)
    return q, k, tl.sum(q * k, 1) * scale


@triton.jit
def _own_rows(Q, K, V, pid_t, pid_bh, sqb, sqt, sqg, skb, skt, skh, svb, svt, svh, T, H, G, L, E, scale,
              BLOCK_T: tl.constexpr, HEAD_DIM: tl.constexpr):
    """What both row kernels start from, for BLOCK_T tokens of one (batch, head): the rows, their
    q / k / v in float32, the own score s = scale q . k, and each token's slot (0 where it has
    none) with the mask of tokens that have one."""
    b, h = pid_bh // H, pid_bh % H
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    dims = tl.arange(0, HEAD_DIM)
    row_ok = offs_t < T
    q, k, s = _own_score(Q, K, b, h, offs_t, row_ok, dims, sqb, sqt, sqg, skb, skt, skh, G, scale)
    v = tl.load(V + b.to(tl.int64) * svb + h * svh + offs_t.to(tl.int64)[:, None] * svt + dims[None, :],
                mask=row_ok[:, None], other=0.0).to(tl.float32)
    slot, has_slot = _slots(offs_t, h, L, E)
    ends = row_ok & has_slot
    slot = b.to(tl.int64) * H * L * E + tl.where(ends, slot, 0).to(tl.int64)
    return b, h, offs_t, dims, row_ok, q, k, s, v, slot, ends


@launch_cached
@triton.jit
def _merge_kernel(
    Q, K, V, Z, OQ, LSEQ, Y,
    sqb, sqt, sqg, skb, skt, skh, svb, svt, svh, szb, szt, szh, syb, syt, syh,
    T, H, G, L, E, scale,
    HAS_GATE: tl.constexpr, STORE_MERGED: tl.constexpr, BLOCK_T: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    """Merges the ends' softmax (OQ, LSEQ: output and natural-log lse of the dense call) with the
    own pair: Y = sigmoid(Z) * merged; with STORE_MERGED (a backward follows) OQ, LSEQ become the
    merged output and lse, in place."""
    pid_t, pid_bh = split_program_id(tl.cdiv(T, BLOCK_T))
    b, h, offs_t, dims, row_ok, q, k, s, v, slot, ends = _own_rows(
        Q, K, V, pid_t, pid_bh, sqb, sqt, sqg, skb, skt, skh, svb, svt, svh, T, H, G, L, E, scale,
        BLOCK_T, HEAD_DIM)
    lse_a = tl.load(LSEQ + slot, mask=ends, other=float("-inf"))
    o_a = tl.load(OQ + slot[:, None] * HEAD_DIM + dims[None, :], mask=ends[:, None], other=0.0).to(tl.float32)
    m = tl.maximum(lse_a, s)
    w_a = tl.exp(lse_a - m)
    w_o = tl.exp(s - m)
    den = w_a + w_o
    o = (w_a[:, None] * o_a + w_o[:, None] * v) / den[:, None]
    if STORE_MERGED:
        tl.store(OQ + slot[:, None] * HEAD_DIM + dims[None, :], o.to(OQ.dtype.element_ty), mask=ends[:, None])
        tl.store(LSEQ + slot, m + tl.log(den), mask=ends)
    if HAS_GATE:
        z = tl.load(Z + b.to(tl.int64) * szb + h * szh + offs_t.to(tl.int64)[:, None] * szt + dims[None, :],
                    mask=row_ok[:, None], other=0.0).to(tl.float32)
        o = o * tl.sigmoid(z)
    tl.store(Y + b.to(tl.int64) * syb + h * syh + offs_t.to(tl.int64)[:, None] * syt + dims[None, :],
             o.to(Y.dtype.element_ty), mask=row_ok[:, None])


@launch_cached
@triton.jit
def _own_backward_kernel(
    Q, K, V, Z, OQ, LSEQ, DY, DOQ, DZ, DK, DV, DS,
    sqb, sqt, sqg, skb, skt, skh, svb, svt, svh, szb, szt, szh, syb, syt, syh,
    T, H, G, L, E, scale,
    HAS_GATE: tl.constexpr, BLOCK_T: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    """From dY: dO = sigmoid(Z) dY into the query layout (DOQ, for the dense backward), dZ, and the
    own pair's shares: dV = p dO, dK = ds scale q, DS = ds (float32 [B, H, T], for dQ), where
    p = exp(s - lse) with the merged lse and ds = p (dO . v - dO . O). DK / DV / DZ are laid out
    like K (contiguous [B, T, H, D]); chunk-0 tokens (output = own value) get dV = dO, no dK."""
    pid_t, pid_bh = split_program_id(tl.cdiv(T, BLOCK_T))
    b, h, offs_t, dims, row_ok, q, k, s, v, slot, ends = _own_rows(
        Q, K, V, pid_t, pid_bh, sqb, sqt, sqg, skb, skt, skh, svb, svt, svh, T, H, G, L, E, scale,
        BLOCK_T, HEAD_DIM)
    o = tl.load(OQ + slot[:, None] * HEAD_DIM + dims[None, :], mask=ends[:, None], other=0.0).to(tl.float32)
    o = tl.where(ends[:, None], o, v)
    do = tl.load(DY + b.to(tl.int64) * syb + h * syh + offs_t.to(tl.int64)[:, None] * syt + dims[None, :],
                 mask=row_ok[:, None], other=0.0).to(tl.float32)
    out = b.to(tl.int64) * T * H * HEAD_DIM + offs_t.to(tl.int64)[:, None] * H * HEAD_DIM + h * HEAD_DIM + dims[None, :]
    if HAS_GATE:
        z = tl.load(Z + b.to(tl.int64) * szb + h * szh + offs_t.to(tl.int64)[:, None] * szt + dims[None, :],
                    mask=row_ok[:, None], other=0.0).to(tl.float32)
        sig = tl.sigmoid(z)
        tl.store(DZ + out, (do * o * sig * (1.0 - sig)).to(DZ.dtype.element_ty), mask=row_ok[:, None])
        do = do * sig
    tl.store(DOQ + slot[:, None] * HEAD_DIM + dims[None, :], do.to(DOQ.dtype.element_ty), mask=ends[:, None])
    lse = tl.load(LSEQ + slot, mask=ends, other=0.0)
    p = tl.where(ends, tl.exp(s - lse), 1.0)
    ds = tl.where(ends, p * (tl.sum(do * v, 1) - tl.sum(do * o, 1)), 0.0)
    tl.store(DV + out, (p[:, None] * do).to(DV.dtype.element_ty), mask=row_ok[:, None])
    tl.store(DK + out, (ds[:, None] * scale * q).to(DK.dtype.element_ty), mask=row_ok[:, None])
    tl.store(DS + (b * H + h).to(tl.int64) * T + offs_t, ds, mask=row_ok)


@launch_cached
@triton.jit
def _dq_kernel(
    K, DS, DQQ, DQ, skb, skt, skh, T, H, G, L, E, scale,
    BLOCK_T: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    """DQ[b, t, g] = sum over heads h = g, g + G, ... of ds[t, h] scale k[t, h] (own pair) plus the
    dense backward's dQ at the token's slot (ends). DQ contiguous [B, T, G, D]."""
    pid_t, pid_bg = split_program_id(tl.cdiv(T, BLOCK_T))
    b, g = pid_bg // G, pid_bg % G
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    dims = tl.arange(0, HEAD_DIM)
    row_ok = offs_t < T
    acc = tl.zeros([BLOCK_T, HEAD_DIM], dtype=tl.float32)
    for h in range(g, H, G):
        k = tl.load(K + b.to(tl.int64) * skb + h * skh + offs_t.to(tl.int64)[:, None] * skt + dims[None, :],
                    mask=row_ok[:, None], other=0.0).to(tl.float32)
        ds = tl.load(DS + (b * H + h).to(tl.int64) * T + offs_t, mask=row_ok, other=0.0)
        slot, has_slot = _slots(offs_t, h, L, E)
        ends = row_ok & has_slot
        slot = b.to(tl.int64) * H * L * E + tl.where(ends, slot, 0).to(tl.int64)
        dqq = tl.load(DQQ + slot[:, None] * HEAD_DIM + dims[None, :], mask=ends[:, None], other=0.0).to(tl.float32)
        acc += ds[:, None] * scale * k + dqq
    out = b.to(tl.int64) * T * G * HEAD_DIM + offs_t.to(tl.int64)[:, None] * G * HEAD_DIM + g * HEAD_DIM + dims[None, :]
    tl.store(DQ + out, acc.to(DQ.dtype.element_ty), mask=row_ok[:, None])
