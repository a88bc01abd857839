"""Triton Forgetting Attention of a block of queries against a block of earlier keys that every
query sees (no mask): the off-diagonal blocks of ring attention (blocks.py states the math).

Same design as triton.py (log2-unit scores, a per-block reference c_ref so float32 sums stay near
the size of the scores, FlashAttention-2 forward, a dK/dV/dc_k kernel and a dQ/dc_q kernel with no
atomics), with two differences: the queries' and the keys' cumulative log forget are separate
tensors (the keys belong to an earlier shard), and no key is masked but the ragged end. Outputs,
dQ, dK and dV are float32: a ring adds one such block per earlier shard to them.

Layouts: q [N, HQ, D], k/v [N, HKV, D] with N = batch x block (one row's tokens contiguous, the
same block length for queries and keys); c_q, c_k, lse, delta [HQ, N] float32; lse in log2 units.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._backend import triton_interpreting
from .._triton_dot import dot as _mm
from .triton import _dot_precision

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


def _tiles(q: torch.Tensor) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, warps): tiny tiles in the interpreter (tests cover several blocks and a
    ragged end at a few dozen tokens), small ones for float32 and head_dim 256 (shared memory)."""
    if triton_interpreting():
        return 16, 16, 4
    if q.dtype == torch.float32 or q.shape[-1] > 128:
        return 32, 32, 4
    return 64, 64, 8 if q.shape[-1] == 128 else 4


@triton.jit
def _fwd_tiles(acc, l_i, m_i, q, K_ptr, V_ptr, CK_ptr, c_ref, stride_kt, stride_vt, lo, hi, seq_len, scale2,
               HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr, DOT_PREC: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in range(lo, hi, BLOCK_N):
        kn = start_n + offs_n
        if MASK:
            k_ok = kn < seq_len
            k = tl.load(K_ptr + kn.to(tl.int64)[:, None] * stride_kt + offs_d[None, :], mask=k_ok[:, None], other=0.0)
            v = tl.load(V_ptr + kn.to(tl.int64)[:, None] * stride_vt + offs_d[None, :], mask=k_ok[:, None], other=0.0)
            ck = tl.load(CK_ptr + kn, mask=k_ok, other=0.0) * LOG2E
        else:
            k = tl.load(K_ptr + kn.to(tl.int64)[:, None] * stride_kt + offs_d[None, :])
            v = tl.load(V_ptr + kn.to(tl.int64)[:, None] * stride_vt + offs_d[None, :])
            ck = tl.load(CK_ptr + kn) * LOG2E
        s = _mm(q, tl.trans(k), None, DOT_PREC) * scale2 - (ck - c_ref)[None, :]
        if MASK:
            s = tl.where(k_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = _mm(p.to(v.dtype), v, acc * alpha[:, None], DOT_PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _fwd_kernel(Q, K, V, CQ, CK, O, LSE, seq_len, scale2,
                stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_ch,
                GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PREC: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    h = tl.program_id(1)
    tok0 = tl.program_id(2).to(tl.int64) * seq_len
    kvh = h // GROUP
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    m_ok = offs_m < seq_len
    q = tl.load(Q + (tok0 + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=m_ok[:, None], other=0.0)
    CQ_ptr = CQ + h * stride_ch + tok0
    cq = tl.load(CQ_ptr + offs_m, mask=m_ok, other=0.0) * LOG2E
    c_ref = tl.load(CQ_ptr + start_m) * LOG2E
    K_ptr = K + tok0 * stride_kt + kvh * stride_kh
    V_ptr = V + tok0 * stride_vt + kvh * stride_vh
    CK_ptr = CK + h * stride_ch + tok0
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    inner_hi = (seq_len // BLOCK_N) * BLOCK_N
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, K_ptr, V_ptr, CK_ptr, c_ref, stride_kt, stride_vt, 0, inner_hi,
                               seq_len, scale2, HEAD_DIM, BLOCK_N, False, DOT_PREC)
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, K_ptr, V_ptr, CK_ptr, c_ref, stride_kt, stride_vt, inner_hi, seq_len,
                               seq_len, scale2, HEAD_DIM, BLOCK_N, True, DOT_PREC)
    lse = m_i + tl.math.log2(l_i) + (cq - c_ref)
    tl.store(O + (tok0 + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :], acc / l_i[:, None], mask=m_ok[:, None])
    tl.store(LSE + h * stride_ch + tok0 + offs_m, lse, mask=m_ok)


@triton.jit
def _dkdv_tiles(dk, dv, dc, k, v, kb, c_ref, Q_ptr, DO_ptr, CQ_ptr, LSE_ptr, DELTA_ptr, stride_qt, stride_dot,
                lo, hi, seq_len, scale2, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, MASK: tl.constexpr,
                DOT_PREC: tl.constexpr):
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    for start_m in range(lo, hi, BLOCK_M):
        qm = start_m + offs_m
        if MASK:
            q_ok = qm < seq_len
            q = tl.load(Q_ptr + qm.to(tl.int64)[:, None] * stride_qt + offs_d[None, :], mask=q_ok[:, None], other=0.0)
            do = tl.load(DO_ptr + qm.to(tl.int64)[:, None] * stride_dot + offs_d[None, :], mask=q_ok[:, None], other=0.0)
            cq = tl.load(CQ_ptr + qm, mask=q_ok, other=0.0) * LOG2E
            lse = tl.load(LSE_ptr + qm, mask=q_ok, other=float("inf"))  # P = 0 past the end
            delta = tl.load(DELTA_ptr + qm, mask=q_ok, other=0.0)
        else:
            q = tl.load(Q_ptr + qm.to(tl.int64)[:, None] * stride_qt + offs_d[None, :])
            do = tl.load(DO_ptr + qm.to(tl.int64)[:, None] * stride_dot + offs_d[None, :])
            cq = tl.load(CQ_ptr + qm) * LOG2E
            lse = tl.load(LSE_ptr + qm)
            delta = tl.load(DELTA_ptr + qm)
        row = cq - c_ref - lse
        p_t = tl.math.exp2(_mm(k, tl.trans(q), None, DOT_PREC) * scale2 - kb[:, None] + row[None, :])  # [keys, queries]
        dv = _mm(p_t.to(do.dtype), do, dv, DOT_PREC)
        ds_t = p_t * (_mm(v, tl.trans(do), None, DOT_PREC) - delta[None, :])
        dk = _mm(ds_t.to(q.dtype), q, dk, DOT_PREC)
        dc += tl.sum(ds_t, 1)
    return dk, dv, dc


@triton.jit
def _dkdv_kernel(Q, K, V, CQ, CK, LSE, DELTA, DO, DK, DV, DCK, seq_len, scale, scale2,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                 stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_ch,
                 GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PREC: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    start_n = tl.program_id(0) * BLOCK_N
    kvh = tl.program_id(1)
    tok0 = tl.program_id(2).to(tl.int64) * seq_len
    kn = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    k_ok = kn < seq_len
    k = tl.load(K + (tok0 + kn)[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :], mask=k_ok[:, None], other=0.0)
    v = tl.load(V + (tok0 + kn)[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :], mask=k_ok[:, None], other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    inner_hi = (seq_len // BLOCK_M) * BLOCK_M
    for g in range(GROUP):
        h = kvh * GROUP + g
        CK_ptr = CK + h * stride_ch + tok0
        c_ref = tl.load(CK_ptr + start_n) * LOG2E
        kb = tl.where(k_ok, tl.load(CK_ptr + kn, mask=k_ok, other=0.0) * LOG2E - c_ref, 0.0)
        dc = tl.zeros([BLOCK_N], tl.float32)
        Q_ptr = Q + tok0 * stride_qt + h * stride_qh
        DO_ptr = DO + tok0 * stride_dot + h * stride_doh
        CQ_ptr = CQ + h * stride_ch + tok0
        LSE_ptr = LSE + h * stride_ch + tok0
        DELTA_ptr = DELTA + h * stride_ch + tok0
        dk, dv, dc = _dkdv_tiles(dk, dv, dc, k, v, kb, c_ref, Q_ptr, DO_ptr, CQ_ptr, LSE_ptr, DELTA_ptr, stride_qt,
                                 stride_dot, 0, inner_hi, seq_len, scale2, HEAD_DIM, BLOCK_M, False, DOT_PREC)
        dk, dv, dc = _dkdv_tiles(dk, dv, dc, k, v, kb, c_ref, Q_ptr, DO_ptr, CQ_ptr, LSE_ptr, DELTA_ptr, stride_qt,
                                 stride_dot, inner_hi, seq_len, seq_len, scale2, HEAD_DIM, BLOCK_M, True, DOT_PREC)
        tl.store(DCK + h * stride_ch + tok0 + kn, -dc, mask=k_ok)
    tl.store(DK + (tok0 + kn)[:, None] * stride_dkt + kvh * stride_dkh + offs_d[None, :], dk * scale, mask=k_ok[:, None])
    tl.store(DV + (tok0 + kn)[:, None] * stride_dvt + kvh * stride_dvh + offs_d[None, :], dv, mask=k_ok[:, None])


@triton.jit
def _dq_tiles(dq, dcq, q, do, row, delta, c_ref, K_ptr, V_ptr, CK_ptr, stride_kt, stride_vt, lo, hi, seq_len, scale2,
              HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr, DOT_PREC: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in range(lo, hi, BLOCK_N):
        kn = start_n + offs_n
        if MASK:
            k_ok = kn < seq_len
            k = tl.load(K_ptr + kn.to(tl.int64)[:, None] * stride_kt + offs_d[None, :], mask=k_ok[:, None], other=0.0)
            v = tl.load(V_ptr + kn.to(tl.int64)[:, None] * stride_vt + offs_d[None, :], mask=k_ok[:, None], other=0.0)
            ck = tl.load(CK_ptr + kn, mask=k_ok, other=0.0) * LOG2E
        else:
            k = tl.load(K_ptr + kn.to(tl.int64)[:, None] * stride_kt + offs_d[None, :])
            v = tl.load(V_ptr + kn.to(tl.int64)[:, None] * stride_vt + offs_d[None, :])
            ck = tl.load(CK_ptr + kn) * LOG2E
        p = tl.math.exp2(_mm(q, tl.trans(k), None, DOT_PREC) * scale2 + row[:, None] - (ck - c_ref)[None, :])
        if MASK:
            p = tl.where(k_ok[None, :], p, 0.0)
        ds = p * (_mm(do, tl.trans(v), None, DOT_PREC) - delta[:, None])
        dq = _mm(ds.to(k.dtype), k, dq, DOT_PREC)
        dcq += tl.sum(ds, 1)
    return dq, dcq


@triton.jit
def _dq_kernel(Q, K, V, CQ, CK, LSE, DELTA, DO, DQ, DCQ, seq_len, scale, scale2,
               stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
               stride_dqt, stride_dqh, stride_ch,
               GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PREC: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    h = tl.program_id(1)
    tok0 = tl.program_id(2).to(tl.int64) * seq_len
    kvh = h // GROUP
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    m_ok = offs_m < seq_len
    q = tl.load(Q + (tok0 + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=m_ok[:, None], other=0.0)
    do = tl.load(DO + (tok0 + offs_m)[:, None] * stride_dot + h * stride_doh + offs_d[None, :], mask=m_ok[:, None], other=0.0)
    CQ_ptr = CQ + h * stride_ch + tok0
    cq = tl.load(CQ_ptr + offs_m, mask=m_ok, other=0.0) * LOG2E
    c_ref = tl.load(CQ_ptr + start_m) * LOG2E
    lse = tl.load(LSE + h * stride_ch + tok0 + offs_m, mask=m_ok, other=float("inf"))
    delta = tl.load(DELTA + h * stride_ch + tok0 + offs_m, mask=m_ok, other=0.0)
    row = cq - c_ref - lse
    K_ptr = K + tok0 * stride_kt + kvh * stride_kh
    V_ptr = V + tok0 * stride_vt + kvh * stride_vh
    CK_ptr = CK + h * stride_ch + tok0
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    dcq = tl.zeros([BLOCK_M], tl.float32)
    inner_hi = (seq_len // BLOCK_N) * BLOCK_N
    dq, dcq = _dq_tiles(dq, dcq, q, do, row, delta, c_ref, K_ptr, V_ptr, CK_ptr, stride_kt, stride_vt, 0, inner_hi,
                        seq_len, scale2, HEAD_DIM, BLOCK_N, False, DOT_PREC)
    dq, dcq = _dq_tiles(dq, dcq, q, do, row, delta, c_ref, K_ptr, V_ptr, CK_ptr, stride_kt, stride_vt, inner_hi, seq_len,
                        seq_len, scale2, HEAD_DIM, BLOCK_N, True, DOT_PREC)
    tl.store(DCQ + h * stride_ch + tok0 + offs_m, dcq, mask=m_ok)
    tl.store(DQ + (tok0 + offs_m)[:, None] * stride_dqt + h * stride_dqh + offs_d[None, :], dq * scale, mask=m_ok[:, None])


def full_block_forward(q, k, v, c_q, c_k, batch: int, scale: float):
    """(o [N, HQ, D] float32, lse [HQ, N] float32 in log2 units): every query sees every key."""
    total, hq, d = q.shape
    seq = total // batch
    o = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.empty((hq, total), dtype=torch.float32, device=q.device)
    block_m, block_n, warps = _tiles(q)
    _fwd_kernel[(triton.cdiv(seq, block_m), hq, batch)](
        q, k, v, c_q, c_k, o, lse, seq, scale * 1.4426950408889634,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), o.stride(0), o.stride(1), c_q.stride(0),
        GROUP=hq // k.shape[1], HEAD_DIM=d, DOT_PREC=_dot_precision(q.dtype), BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=warps,
    )
    return o, lse


def full_block_backward(do, q, k, v, c_q, c_k, lse, delta, batch: int, scale: float):
    """(dq, dk, dv float32, dc_q, dc_k [HQ, N] float32) of this block's share of a softmax whose
    (merged) log-sum-exp ``lse`` (log2 units) and rowsum(dO * O) ``delta`` are given."""
    total, hq, d = q.shape
    hkv = k.shape[1]
    seq = total // batch
    dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.empty(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.empty(v.shape, dtype=torch.float32, device=q.device)
    dc_q, dc_k = torch.empty_like(c_q), torch.empty_like(c_k)
    block_m, block_n, warps = _tiles(q)
    common = dict(GROUP=hq // hkv, HEAD_DIM=d, DOT_PREC=_dot_precision(q.dtype), BLOCK_M=block_m, BLOCK_N=block_n,
                  num_warps=warps)
    scale2 = scale * 1.4426950408889634
    _dkdv_kernel[(triton.cdiv(seq, block_n), hkv, batch)](
        q, k, v, c_q, c_k, lse, delta, do, dk, dv, dc_k, seq, scale, scale2,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), do.stride(0), do.stride(1),
        dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), c_q.stride(0), **common,
    )
    _dq_kernel[(triton.cdiv(seq, block_m), hq, batch)](
        q, k, v, c_q, c_k, lse, delta, do, dq, dc_q, seq, scale, scale2,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), do.stride(0), do.stride(1),
        dq.stride(0), dq.stride(1), c_q.stride(0), **common,
    )
    return dq, dk, dv, dc_q, dc_k
