"""Triton forward and backward of "attention over block ends + the token's own key" (math: reference.py).

One kernel family serves two layouts:

* block mode (:func:`block_end_attention_triton`): q, k, v [B, T, H, Dh]; query i sees key j <= i iff
  (j + 1) % D == 0, i - j <= W, or j < S. RAT(L) is D = L, W = 0, S = 0; RAT+ adds W and sinks.
* compact mode (:func:`chunk_end_attention_triton`): the block ends live in their own tensor
  k_ends/v_ends [B, C, H, Dh] (e.g. a decode cache); query t sees ends c < query_chunk[b, t] and its
  own k_own/v_own[t].

Each visible pair (i, j) falls in exactly one *category*, and each category is a loop over its own
small key set instead of a masked sweep over all T keys:

    own     j == i                          one elementwise dot per query (no tile)
    ends    block end, j >= S, i - j > W    a strided tile over the ends only (T / D keys)
    window  i - W <= j < i                  contiguous tiles near the diagonal (W > 0 only)
    sinks   j < S, i - j > W                one small tile (S > 0 only)

The own term seeds the online softmax (m = own score, l = 1, acc = v_own), so no separate
log-sum-exp merge pass exists. Scores use exp2 with log2(e) folded into the scale; the saved
row statistic is the log2-domain log-sum-exp.

Backward: a row-wise kernel computes delta = rowsum(dO * O) and the own pair's gradients, a
query-centric kernel computes dQ, key-centric kernels compute dK/dV of window keys and of the
ends/sinks, each written by exactly one program (later launches add to what earlier ones wrote;
no atomics). With ATOMIC_DQ (RAT's geometry only) the dQ kernel is skipped: the ends' kernel adds
dS k to a float32 dQ with atomics.

Output gate (RAT's z): the forward writes sigmoid(z) * O, and O itself when a backward will
follow; the row-wise backward kernel turns dY into dO = dY sigmoid(z) and dZ, so the gate costs
no pass of its own in either direction.
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from .._common import last_dim_contiguous
from .._common import leading_strides as _strides
from .._grid import folded, split_program_id
from ..._compat.triton_launch import launch_cached


LOG2E = 1.4426950408889634

# (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel; chosen on an H100 for head_dim 128.
# The forward's best tile depends on the length: 64x64 / 4 warps below LONG_SEQ, 128x128 / 8 from
# there (`python -m benchmarks.tune --seq T` times the tiles).
FWD_CONFIG = (64, 64, 4, 3)
FWD_CONFIG_LONG = (128, 128, 8, 3)
LONG_SEQ = 131072
# Backward tiles: the fastest pair over 32K and 131K in the RAT L=16 fwd+bwd sweep
# (`python -m benchmarks.tune`); three stages beat two at both lengths.
DQ_CONFIG = (128, 64, 8, 3)
DKV_CONFIG = (64, 128, 8, 3)  # (queries per step, keys per program, warps, stages)
INTERPRET_CONFIG = (16, 16, 4, 1)
# fp32 tiles take twice the shared memory: the bf16 tiles above overflow an H100's 227 KiB.
FWD_CONFIG_FP32 = (64, 64, 8, 2)
DQ_CONFIG_FP32 = (64, 64, 8, 1)
DKV_CONFIG_FP32 = (64, 64, 8, 1)
ROWS_BLOCK, ROWS_WARPS = 32, 8  # rows per program and warps of the row-wise backward kernel
# RAT's geometry (block ends + own pair, no window or sinks) can take dQ from the dK/dV kernel, as
# float32 atomic adds of dS k, instead of recomputing P and dP in a dQ kernel (5 matmul passes in
# the backward instead of 7). Off: it gains ~1% and makes dQ's summation order run-dependent
# (`python -m benchmarks.tune`).
ATOMIC_DQ = False


def _configs(device: torch.device, dtype: torch.dtype, seq: int = 0):
    if device.type != "cuda":
        return INTERPRET_CONFIG, INTERPRET_CONFIG, INTERPRET_CONFIG
    if dtype == torch.float32:
        return FWD_CONFIG_FP32, DQ_CONFIG_FP32, DKV_CONFIG_FP32
    return FWD_CONFIG_LONG if seq >= LONG_SEQ else FWD_CONFIG, DQ_CONFIG, DKV_CONFIG


# --------------------------------------------------------------------------------------------------
# shared pieces


@triton.jit
def _mm(a, b, DOT_PREC: tl.constexpr):
    """Matrix product with fp32 accumulation. "upcast" multiplies in fp32: Triton's CPU interpreter
    mis-computes 16-bit dots, and bf16 x bf16 products are exact in fp32 anyway."""
    if DOT_PREC == "upcast":
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b, input_precision=DOT_PREC)
    return out


@triton.jit
def _rows(base, idx, stride, dims, mask):
    """Load rows base[idx * stride + dims] as a [len(idx), HEAD_DIM] tile (zeros where masked)."""
    return tl.load(base + idx.to(tl.int64)[:, None] * stride + dims[None, :], mask=mask[:, None], other=0.0)


@triton.jit
def _visible_ends(offs_m, T, QC, W, D, COMPACT: tl.constexpr, C):
    """Number of chunk ends in the *ends* category for every query row (0 for rows past T)."""
    valid = offs_m < T
    if COMPACT:
        n = tl.load(QC + offs_m, mask=valid, other=0).to(tl.int32)
        n = tl.minimum(tl.maximum(n, 0), C)
    else:
        n = tl.maximum(offs_m - W, 0) // D
    return tl.where(valid, n, 0)


@triton.jit
def _softmax_step(s, v_tile, m_i, l_i, acc, DOT_PREC: tl.constexpr):
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _mm(p.to(v_tile.dtype), v_tile, DOT_PREC)
    return m_new, l_i, acc


# --------------------------------------------------------------------------------------------------
# forward


@launch_cached
@triton.jit
def _fwd_kernel(
    Q, K, V, KE, VE, QC, O, LSE, Z, OU,
    sqb, sqt, sqh, skb, skt, skh, svb, svt, svh,
    seb, sec, seh, sfb, sfc, sfh, sob, sot, soh, sqcb, szb, szt, szh,
    H, QH, T, C, D, W, S, c_min, qk_scale,
    COMPACT: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_GATE: tl.constexpr,
    STORE_UNGATED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    tile, pid_bh = split_program_id(tl.cdiv(T, BLOCK_M))
    pid_m = tl.cdiv(T, BLOCK_M) - 1 - tile  # last tiles see the most ends: launch them first
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < T
    Q += b * sqb + (h % QH) * sqh  # QH < H: q shared by groups of heads (RAT), read in place
    K += b * skb + h * skh
    V += b * svb + h * svh
    KE += b * seb + h * seh
    VE += b * sfb + h * sfh

    q = _rows(Q, offs_m, sqt, dims, row_ok)
    k_own = _rows(K, offs_m, skt, dims, row_ok)
    v_own = _rows(V, offs_m, svt, dims, row_ok)
    # own pair seeds the online softmax: m = its score, l = 1, acc = its value
    m_i = tl.sum(q.to(tl.float32) * k_own.to(tl.float32), 1) * qk_scale
    l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    acc = v_own.to(tl.float32)

    n_i = _visible_ends(offs_m, T, QC + b * sqcb, W, D, COMPACT, C)
    n_hi = tl.max(n_i, 0)
    n_lo = tl.min(tl.where(row_ok, n_i, n_hi), 0)
    # ends every row sees: no mask
    c_full = c_min + tl.maximum(n_lo - c_min, 0) // BLOCK_N * BLOCK_N
    for c0 in range(c_min, c_full, BLOCK_N):
        offs_c = c0 + tl.arange(0, BLOCK_N)
        ke = tl.load(KE + offs_c.to(tl.int64)[:, None] * sec + dims[None, :])
        ve = tl.load(VE + offs_c.to(tl.int64)[:, None] * sfc + dims[None, :])
        s = _mm(q, tl.trans(ke), DOT_PREC) * qk_scale
        m_i, l_i, acc = _softmax_step(s, ve, m_i, l_i, acc, DOT_PREC)
    for c0 in range(c_full, n_hi, BLOCK_N):
        offs_c = c0 + tl.arange(0, BLOCK_N)
        ke = _rows(KE, offs_c, sec, dims, offs_c < n_hi)
        ve = _rows(VE, offs_c, sfc, dims, offs_c < n_hi)
        s = _mm(q, tl.trans(ke), DOT_PREC) * qk_scale
        s = tl.where(offs_c[None, :] < n_i[:, None], s, float("-inf"))
        m_i, l_i, acc = _softmax_step(s, ve, m_i, l_i, acc, DOT_PREC)
    if HAS_WINDOW:
        lo = tl.maximum(m0 - W, 0)
        hi = tl.minimum(m0 + BLOCK_M - 1, T)
        for j0 in range(lo, hi, BLOCK_N):
            offs_j = j0 + tl.arange(0, BLOCK_N)
            kw = _rows(K, offs_j, skt, dims, offs_j < T)
            vw = _rows(V, offs_j, svt, dims, offs_j < T)
            s = _mm(q, tl.trans(kw), DOT_PREC) * qk_scale
            gap = offs_m[:, None] - offs_j[None, :]
            s = tl.where((gap > 0) & (gap <= W), s, float("-inf"))
            m_i, l_i, acc = _softmax_step(s, vw, m_i, l_i, acc, DOT_PREC)
    if HAS_SINKS:
        offs_s = tl.arange(0, BLOCK_S)
        ks = _rows(K, offs_s, skt, dims, offs_s < S)
        vs = _rows(V, offs_s, svt, dims, offs_s < S)
        s = _mm(q, tl.trans(ks), DOT_PREC) * qk_scale
        gap = offs_m[:, None] - offs_s[None, :]
        s = tl.where((offs_s[None, :] < S) & (gap > W), s, float("-inf"))
        m_i, l_i, acc = _softmax_step(s, vs, m_i, l_i, acc, DOT_PREC)

    out = acc / l_i[:, None]
    o_off = b * sob + h * soh + offs_m.to(tl.int64)[:, None] * sot + dims[None, :]
    if HAS_GATE:  # out = sigmoid(z) * attention; the backward reads the ungated rows (STORE_UNGATED)
        if STORE_UNGATED:
            tl.store(OU + o_off, out.to(OU.dtype.element_ty), mask=row_ok[:, None])
        out = out * tl.sigmoid(_rows(Z + b * szb + h * szh, offs_m, szt, dims, row_ok).to(tl.float32))
    tl.store(O + o_off, out.to(O.dtype.element_ty), mask=row_ok[:, None])
    tl.store(LSE + pid_bh.to(tl.int64) * T + offs_m, m_i + tl.math.log2(l_i), mask=row_ok)


# --------------------------------------------------------------------------------------------------
# backward: dQ (query-centric) + own pairs


@triton.jit
def _ds_step(q, do, k_tile, v_tile, lse, delta, s_mask, qk_scale, DOT_PREC: tl.constexpr):
    """dS = P * (dP - delta) for a [BLOCK_M, BLOCK_N] tile (zero where masked)."""
    s = _mm(q, tl.trans(k_tile), DOT_PREC) * qk_scale
    p = tl.where(s_mask, tl.math.exp2(s - lse[:, None]), 0.0)
    dp = _mm(do, tl.trans(v_tile), DOT_PREC)
    return p * (dp - delta[:, None])


@launch_cached
@triton.jit
def _own_rows_kernel(
    Q, K, V, O, DO, LSE, DELTA, DSO, DKO, DVO, Z, DY, DZ, DQA,
    sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sob, sot, soh, szb, szt, szh,
    H, QH, T, qk_scale, scale,
    WRITE_OWN: tl.constexpr, HAS_GATE: tl.constexpr, ATOMIC_DQ: tl.constexpr, BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """Row-wise part of the backward: delta = rowsum(dO * O) and the own pair's dS (both saved for
    the dQ / dK dV kernels), and, when WRITE_OWN, the own pair's dK = dS q and dV = P dO.
    HAS_GATE (output y = sigmoid(z) * O): from dY it first writes dO = dY sigmoid(z) for the other
    kernels and dZ = dY O sigmoid(z) (1 - sigmoid(z)) (DY, DZ laid out like DO). ATOMIC_DQ: the
    own pair's dQ share dS_own k_own starts the float32 rows of DQA that the dK/dV kernel adds to.
    Kept apart from the dQ kernel so that its tile loop does not carry five row tiles."""
    pid_m, pid_bh = split_program_id(tl.cdiv(T, BLOCK_M))
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < T
    o_off = b * sob + h * soh + offs_m.to(tl.int64)[:, None] * sot + dims[None, :]
    stat = pid_bh.to(tl.int64) * T + offs_m
    q = _rows(Q + b * sqb + (h % QH) * sqh, offs_m, sqt, dims, row_ok).to(tl.float32)
    k_own = _rows(K + b * skb + h * skh, offs_m, skt, dims, row_ok).to(tl.float32)
    v_own = _rows(V + b * svb + h * svh, offs_m, svt, dims, row_ok).to(tl.float32)
    o = tl.load(O + o_off, mask=row_ok[:, None], other=0.0).to(tl.float32)
    if HAS_GATE:
        dy = tl.load(DY + o_off, mask=row_ok[:, None], other=0.0).to(tl.float32)
        gate = tl.sigmoid(_rows(Z + b * szb + h * szh, offs_m, szt, dims, row_ok).to(tl.float32))
        tl.store(DZ + o_off, (dy * o * gate * (1.0 - gate)).to(DZ.dtype.element_ty), mask=row_ok[:, None])
        do = (dy * gate).to(DO.dtype.element_ty)
        tl.store(DO + o_off, do, mask=row_ok[:, None])
        do = do.to(tl.float32)  # the rounded dO, as the dQ / dK dV kernels read it
    else:
        do = tl.load(DO + o_off, mask=row_ok[:, None], other=0.0).to(tl.float32)
    lse = tl.load(LSE + stat, mask=row_ok, other=0.0)
    delta = tl.sum(do * o, 1)
    p_own = tl.math.exp2(tl.sum(q * k_own, 1) * qk_scale - lse)
    ds_own = p_own * (tl.sum(do * v_own, 1) - delta)
    tl.store(DELTA + stat, delta, mask=row_ok)
    tl.store(DSO + stat, ds_own, mask=row_ok)
    if ATOMIC_DQ:
        tl.store(DQA + o_off, ds_own[:, None] * k_own, mask=row_ok[:, None])
    if WRITE_OWN:
        tl.store(DKO + o_off, (ds_own[:, None] * q * scale).to(DKO.dtype.element_ty), mask=row_ok[:, None])
        tl.store(DVO + o_off, (p_own[:, None] * do).to(DVO.dtype.element_ty), mask=row_ok[:, None])


@launch_cached
@triton.jit
def _dq_kernel(
    Q, K, V, KE, VE, QC, DO, LSE, DELTA, DSO, DQ,
    sqb, sqt, sqh, skb, skt, skh, svb, svt, svh,
    seb, sec, seh, sfb, sfc, sfh, sob, sot, soh, sqcb,
    H, QH, T, C, D, W, S, c_min, qk_scale, scale,
    COMPACT: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    # DO and DQ share the contiguous [B, T, H, Dh] strides (sob, sot, soh).
    tile, pid_bh = split_program_id(tl.cdiv(T, BLOCK_M))
    pid_m = tl.cdiv(T, BLOCK_M) - 1 - tile  # heaviest tiles first, as in the forward
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < T
    Q += b * sqb + (h % QH) * sqh
    K += b * skb + h * skh
    V += b * svb + h * svh
    KE += b * seb + h * seh
    VE += b * sfb + h * sfh
    o_off = b * sob + h * soh + offs_m.to(tl.int64)[:, None] * sot + dims[None, :]
    stat = pid_bh.to(tl.int64) * T + offs_m

    q = _rows(Q, offs_m, sqt, dims, row_ok)
    do = tl.load(DO + o_off, mask=row_ok[:, None], other=0.0)
    lse = tl.load(LSE + stat, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + stat, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    n_i = _visible_ends(offs_m, T, QC + b * sqcb, W, D, COMPACT, C)
    n_hi = tl.max(n_i, 0)
    for c0 in range(c_min, n_hi, BLOCK_N):
        offs_c = c0 + tl.arange(0, BLOCK_N)
        ke = _rows(KE, offs_c, sec, dims, offs_c < n_hi)
        ve = _rows(VE, offs_c, sfc, dims, offs_c < n_hi)
        ds = _ds_step(q, do, ke, ve, lse, delta, offs_c[None, :] < n_i[:, None], qk_scale, DOT_PREC)
        dq += _mm(ds.to(ke.dtype), ke, DOT_PREC)
    if HAS_WINDOW:
        lo = tl.maximum(m0 - W, 0)
        hi = tl.minimum(m0 + BLOCK_M - 1, T)
        for j0 in range(lo, hi, BLOCK_N):
            offs_j = j0 + tl.arange(0, BLOCK_N)
            kw = _rows(K, offs_j, skt, dims, offs_j < T)
            vw = _rows(V, offs_j, svt, dims, offs_j < T)
            gap = offs_m[:, None] - offs_j[None, :]
            ds = _ds_step(q, do, kw, vw, lse, delta, (gap > 0) & (gap <= W), qk_scale, DOT_PREC)
            dq += _mm(ds.to(kw.dtype), kw, DOT_PREC)
    if HAS_SINKS:
        offs_s = tl.arange(0, BLOCK_S)
        ks = _rows(K, offs_s, skt, dims, offs_s < S)
        vs = _rows(V, offs_s, svt, dims, offs_s < S)
        gap = offs_m[:, None] - offs_s[None, :]
        ds = _ds_step(q, do, ks, vs, lse, delta, (offs_s[None, :] < S) & (gap > W), qk_scale, DOT_PREC)
        dq += _mm(ds.to(ks.dtype), ks, DOT_PREC)
    # own pair: dQ += dS_own k_own (dS_own from _own_rows_kernel)
    ds_own = tl.load(DSO + stat, mask=row_ok, other=0.0)
    dq += ds_own[:, None] * _rows(K, offs_m, skt, dims, row_ok).to(tl.float32)
    tl.store(DQ + o_off, (dq * scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])


# --------------------------------------------------------------------------------------------------
# backward: dK, dV (key-centric)


@triton.jit
def _dkdv_step(k_tile, v_tile, Q, DO, LSE, DELTA, offs_i, sqt, sot, dims, row_ok, pair_mask, dq_pairs, qk_scale,
               dk, dv, DQA, DOT_PREC: tl.constexpr, MASKED: tl.constexpr = True, ATOMIC_DQ: tl.constexpr = False):
    """Add the contribution of the query rows offs_i to dK, dV of the key tile (transposed scores).

    MASKED=False skips the pair mask: only rows of keys that are never stored can be wrong then
    (their k rows load as zeros, so they add nothing to dQ either). ATOMIC_DQ: also add the
    query rows' dQ share dS k (unscaled, float32) over the pairs dq_pairs to DQA with atomics
    (the own pair's share comes from the row-wise kernel).
    """
    q = _rows(Q, offs_i, sqt, dims, row_ok)
    do = _rows(DO, offs_i, sot, dims, row_ok)
    lse = tl.load(LSE + offs_i, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + offs_i, mask=row_ok, other=0.0)
    s_t = _mm(k_tile, tl.trans(q), DOT_PREC) * qk_scale
    p_t = tl.math.exp2(s_t - lse[None, :])
    if MASKED:
        p_t = tl.where(pair_mask, p_t, 0.0)
    dv += _mm(p_t.to(do.dtype), do, DOT_PREC)
    dp_t = _mm(v_tile, tl.trans(do), DOT_PREC)
    ds_t = p_t * (dp_t - delta[None, :])
    dk += _mm(ds_t.to(q.dtype), q, DOT_PREC)
    if ATOMIC_DQ:
        dq = _mm(tl.trans(tl.where(dq_pairs, ds_t, 0.0)).to(k_tile.dtype), k_tile, DOT_PREC)
        tl.atomic_add(DQA + offs_i.to(tl.int64)[:, None] * sot + dims[None, :], dq, mask=row_ok[:, None], sem="relaxed")
    return dk, dv


@triton.jit
def _dkdv_category_step(k_tile, v_tile, j, key_ok, Q, DO, LSE, DELTA, i0, T, W, sqt, sot, dims, qk_scale, dk, dv,
                        DQA, OWN: tl.constexpr, BLOCK_M: tl.constexpr, DOT_PREC: tl.constexpr,
                        ATOMIC_DQ: tl.constexpr = False):
    """_dkdv_step for keys at positions j (ends or sinks) and query rows i0.., pairs masked by
    category: i - j > W (past the window), or i == j when OWN (the key's own token)."""
    offs_i = i0 + tl.arange(0, BLOCK_M)
    row_ok = offs_i < T
    gap = offs_i[None, :] - j[:, None]
    past_window = (gap > W) & row_ok[None, :] & key_ok[:, None]
    pair = past_window
    if OWN:
        pair = pair | ((gap == 0) & key_ok[:, None])
    return _dkdv_step(k_tile, v_tile, Q, DO, LSE, DELTA, offs_i, sqt, sot, dims, row_ok, pair, past_window, qk_scale,
                      dk, dv, DQA, DOT_PREC, ATOMIC_DQ=ATOMIC_DQ)


@launch_cached
@triton.jit
def _dkdv_window_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV,
    sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sob, sot, soh,
    H, QH, T, W, qk_scale, scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Own + window pairs (0 <= i - j <= W) for a contiguous key tile; overwrites DK, DV there."""
    pid_n, pid_bh = split_program_id(tl.cdiv(T, BLOCK_N))
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    n0 = pid_n * BLOCK_N
    offs_j = n0 + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    key_ok = offs_j < T
    Q += b * sqb + (h % QH) * sqh
    DO += b * sob + h * soh
    LSE += pid_bh.to(tl.int64) * T
    DELTA += pid_bh.to(tl.int64) * T
    k_tile = _rows(K + b * skb + h * skh, offs_j, skt, dims, key_ok)
    v_tile = _rows(V + b * svb + h * svh, offs_j, svt, dims, key_ok)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    hi = tl.minimum(n0 + BLOCK_N + W, T)
    for i0 in range(n0 // BLOCK_M * BLOCK_M, hi, BLOCK_M):
        offs_i = i0 + tl.arange(0, BLOCK_M)
        row_ok = offs_i < T
        gap = offs_i[None, :] - offs_j[:, None]
        pair = (gap >= 0) & (gap <= W) & row_ok[None, :]
        dk, dv = _dkdv_step(k_tile, v_tile, Q, DO, LSE, DELTA, offs_i, sqt, sot, dims, row_ok, pair, pair, qk_scale,
                            dk, dv, DO, DOT_PREC)
    out = b * sob + h * soh + offs_j.to(tl.int64)[:, None] * sot + dims[None, :]
    tl.store(DK + out, (dk * scale).to(DK.dtype.element_ty), mask=key_ok[:, None])
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=key_ok[:, None])


@launch_cached
@triton.jit
def _dkdv_ends_kernel(
    Q, K, V, KE, VE, QC, DO, LSE, DELTA, DKE, DVE, DKF, DVF, DQA,
    sqb, sqt, sqh, skb, skt, skh, svb, svt, svh,
    seb, sec, seh, sfb, sfc, sfh, sob, sot, soh, sqcb,
    sdb, sdc, sdh,
    H, QH, T, C, D, W, S, c_min, num_end_tiles, qk_scale, scale,
    COMPACT: tl.constexpr, OWN: tl.constexpr, ACCUMULATE: tl.constexpr, HAS_SINKS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr,
    DOT_PREC: tl.constexpr, ATOMIC_DQ: tl.constexpr = False,
):
    """dK, dV of the ends (programs < num_end_tiles) and of the sinks (one more program).
    ATOMIC_DQ (block mode with W = 0 and no sinks: every pair is an end or the own pair): the
    ends' share of dQ is added to DQA (float32, laid out like DO) here, instead of recomputing
    P and dP in the dQ kernel.

    DKE/DVE address key slot c with strides (sdb, sdc, sdh): in block mode they point at dK/dV at
    position D - 1 with stride D rows (slot c = key c*D + D - 1), in compact mode at dk_ends.
    OWN: also add the key's own pair (block mode, W = 0); ACCUMULATE: add to what DKE holds.
    """
    programs = num_end_tiles
    if HAS_SINKS:
        programs += 1  # the sinks' program
    pid_n, pid_bh = split_program_id(programs)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM)
    Q += b * sqb + (h % QH) * sqh
    DO += b * sob + h * soh
    DQA += b * sob + h * soh
    LSE += pid_bh.to(tl.int64) * T
    DELTA += pid_bh.to(tl.int64) * T
    QC += b * sqcb
    if pid_n < num_end_tiles:
        offs_c = c_min + pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        key_ok = offs_c < C
        k_tile = _rows(KE + b * seb + h * seh, offs_c, sec, dims, key_ok)
        v_tile = _rows(VE + b * sfb + h * sfh, offs_c, sfc, dims, key_ok)
        dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
        c_first = c_min + pid_n * BLOCK_N
        if COMPACT:
            for i0 in range(0, T, BLOCK_M):
                offs_i = i0 + tl.arange(0, BLOCK_M)
                row_ok = offs_i < T
                qc = tl.load(QC + offs_i, mask=row_ok, other=0)
                if tl.max(qc, 0) > c_first:  # some row of this tile sees the tile's first end
                    pair = (offs_c[:, None] < qc[None, :]) & row_ok[None, :]
                    dk, dv = _dkdv_step(k_tile, v_tile, Q, DO, LSE, DELTA, offs_i, sqt, sot, dims, row_ok, pair, pair,
                                        qk_scale, dk, dv, DQA, DOT_PREC)
        else:
            j = offs_c * D + D - 1
            j_first = c_first * D + D - 1
            j_last = tl.minimum(c_first + BLOCK_N, C) * D - 1
            if OWN:
                i_start = j_first // BLOCK_M * BLOCK_M
            else:
                i_start = (j_first + W + 1) // BLOCK_M * BLOCK_M
            i_mid = tl.maximum(tl.minimum((j_last + W + BLOCK_M) // BLOCK_M * BLOCK_M, T // BLOCK_M * BLOCK_M), i_start)
            i_full = T // BLOCK_M * BLOCK_M
            # Queries from the sequence's end backwards: every key tile of a (batch, head) then reads
            # the same q / dO rows at about the same time, so they come from L2, not once per tile
            # from memory (a forward sweep from each tile's own start reads them at scattered rows).
            for i0 in range(tl.maximum(i_full, i_mid), T, BLOCK_M):  # ragged last tile
                dk, dv = _dkdv_category_step(k_tile, v_tile, j, key_ok, Q, DO, LSE, DELTA, i0, T, W, sqt, sot, dims,
                                             qk_scale, dk, dv, DQA, OWN, BLOCK_M, DOT_PREC, ATOMIC_DQ)
            for back in range(0, (i_full - i_mid) // BLOCK_M):  # every pair visible
                offs_i = i_full - (back + 1) * BLOCK_M + tl.arange(0, BLOCK_M)
                row_ok = offs_i < T
                dk, dv = _dkdv_step(k_tile, v_tile, Q, DO, LSE, DELTA, offs_i, sqt, sot, dims, row_ok, row_ok,
                                    row_ok[None, :], qk_scale, dk, dv, DQA, DOT_PREC, MASKED=False, ATOMIC_DQ=ATOMIC_DQ)
            for back in range(0, (i_mid - i_start) // BLOCK_M):  # near the keys: mask by category
                dk, dv = _dkdv_category_step(k_tile, v_tile, j, key_ok, Q, DO, LSE, DELTA, i_mid - (back + 1) * BLOCK_M,
                                             T, W, sqt, sot, dims, qk_scale, dk, dv, DQA, OWN, BLOCK_M, DOT_PREC,
                                             ATOMIC_DQ)
        out = b * sdb + h * sdh + offs_c.to(tl.int64)[:, None] * sdc + dims[None, :]
        dk = dk * scale
        if ACCUMULATE:
            dk += tl.load(DKE + out, mask=key_ok[:, None], other=0.0).to(tl.float32)
            dv += tl.load(DVE + out, mask=key_ok[:, None], other=0.0).to(tl.float32)
        tl.store(DKE + out, dk.to(DKE.dtype.element_ty), mask=key_ok[:, None])
        tl.store(DVE + out, dv.to(DVE.dtype.element_ty), mask=key_ok[:, None])
    elif HAS_SINKS:
        # sinks: keys j < S, paired with queries i - j > W (and i == j when OWN). Block mode only:
        # DKF/DVF are the full dK/dV, laid out like DO.
        offs_j = tl.arange(0, BLOCK_S)
        key_ok = offs_j < S
        k_tile = _rows(K + b * skb + h * skh, offs_j, skt, dims, key_ok)
        v_tile = _rows(V + b * svb + h * svh, offs_j, svt, dims, key_ok)
        dk = tl.zeros([BLOCK_S, HEAD_DIM], dtype=tl.float32)
        dv = tl.zeros([BLOCK_S, HEAD_DIM], dtype=tl.float32)
        if OWN:
            i_start = 0
        else:
            i_start = (W + 1) // BLOCK_M * BLOCK_M
        for i0 in range(i_start, T, BLOCK_M):
            dk, dv = _dkdv_category_step(k_tile, v_tile, offs_j, key_ok, Q, DO, LSE, DELTA, i0, T, W, sqt, sot, dims,
                                         qk_scale, dk, dv, DQA, OWN, BLOCK_M, DOT_PREC)
        out = b * sob + h * soh + offs_j[:, None] * sot + dims[None, :]
        dk = dk * scale
        if ACCUMULATE:
            dk += tl.load(DKF + out, mask=key_ok[:, None], other=0.0).to(tl.float32)
            dv += tl.load(DVF + out, mask=key_ok[:, None], other=0.0).to(tl.float32)
        tl.store(DKF + out, dk.to(DKF.dtype.element_ty), mask=key_ok[:, None])
        tl.store(DVF + out, dv.to(DVF.dtype.element_ty), mask=key_ok[:, None])


# --------------------------------------------------------------------------------------------------
# host side


def _dot_precision(dtype: torch.dtype, device: torch.device) -> str:
    """fp32 inputs compute in fp32: on a GPU as three TF32 tensor-core products per dot ("tf32x3",
    each operand split into a TF32 head and tail), ~3e-7 relative error against float64 where one
    TF32 product gives ~1e-3; exact "ieee" dots compile to FMA loops that take minutes to build and
    spill at these tiles. In the CPU interpreter fp32 stays "ieee". 16-bit operands ignore it."""
    if device.type != "cuda":
        return "ieee" if dtype == torch.float32 else "upcast"
    return "tf32x3"


def _check_head_dim(op: str, head_dim: int) -> None:
    if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
        raise ValueError(
            f"{op}: the Triton kernel needs head_dim a power of two in [16, 256], got {head_dim}; "
            "pass backend='reference'."
        )


class _Geometry:
    """Everything that tells block mode from compact mode, in one place for forward and backward."""

    def __init__(self, compact, num_ends, block_size, window, sinks, c_min):
        self.compact, self.num_ends = compact, num_ends
        self.block_size, self.window, self.sinks, self.c_min = block_size, window, sinks, c_min
        self.sink_tile = triton.next_power_of_2(max(sinks, 1))

    def block_s(self, key_tile: int) -> int:
        """Sink tile as wide as the kernel's key tile: the sinks then use the same dot shapes as
        the other tiles (a 16-row dot under 8 warps is the one shape nothing else exercises)."""
        return max(key_tile, self.sink_tile)

    def scalars(self):
        return (self.num_ends, self.block_size, self.window, self.sinks, self.c_min)


def _forward(q, k, v, ke, ve, qc, geo: _Geometry, scale: float, gate: torch.Tensor | None = None,
             ungated: torch.Tensor | None = None):
    """q may have fewer heads than k / v (a divisor): head h reads q head h % q_heads. gate
    [B, T, H, D]: the output is sigmoid(gate) * attention, and the attention itself is also written
    to ``ungated`` when given (laid out like the output; the backward reads it)."""
    batch, seq, q_heads, head_dim = q.shape
    heads = k.shape[2]
    out = torch.empty(batch, seq, heads, head_dim, device=q.device, dtype=q.dtype)
    lse = torch.empty(batch, heads, seq, device=q.device, dtype=torch.float32)
    (block_m, block_n, warps, stages), _, _ = _configs(q.device, q.dtype, seq)
    grid = tiles_grid(seq, block_m, batch * heads)
    z = out if gate is None else gate  # never read without a gate
    _fwd_kernel[grid](
        q, k, v, ke, ve, qc, out, lse, z, out if ungated is None else ungated,
        *_strides(q), *_strides(k), *_strides(v), *_strides(ke), *_strides(ve), *_strides(out), qc.stride(0),
        *_strides(z), heads, q_heads, seq, *geo.scalars(), scale * LOG2E,
        COMPACT=geo.compact, HAS_WINDOW=geo.window > 0, HAS_SINKS=geo.sinks > 0 and not geo.compact,
        HAS_GATE=gate is not None, STORE_UNGATED=gate is not None and ungated is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_S=geo.block_s(block_n), HEAD_DIM=head_dim,
        DOT_PREC=_dot_precision(q.dtype, q.device), num_warps=warps, num_stages=stages,
    )
    return out, lse


def _backward(q, k, v, ke, ve, qc, out, lse, dout, geo: _Geometry, scale: float, dk, dv, dke, dve,
              gate=None, dgate=None):
    """Fills dq (returned) and dk/dv (own pairs, window) and dke/dve (ends, sinks) in place.

    Block mode: dke/dve are views of dk/dv (ends rows / sink rows); compact mode: separate tensors.
    With ``gate`` (the forward returned sigmoid(gate) * out; ``out`` is the ungated attention),
    dout is the gated output's gradient and dgate [like out] receives the gate's.
    """
    batch, seq, q_heads, head_dim = q.shape
    heads = k.shape[2]
    dy = dout.contiguous()
    dout = torch.empty_like(out) if gate is not None else dy  # dO of the attention: the rows kernel writes it
    z = out if gate is None else gate  # never read without a gate
    dq = torch.empty_like(out)  # per head; heads sharing a q head are summed at the end
    delta, ds_own = torch.empty_like(lse), torch.empty_like(lse)
    (_, _, _, _), (bm, bn, w, st), (km, kn, kw, kst) = _configs(q.device, q.dtype)
    prec = _dot_precision(q.dtype, q.device)
    has_window = geo.window > 0 and not geo.compact
    has_sinks = geo.sinks > 0 and not geo.compact
    common = (*_strides(q), *_strides(k), *_strides(v))
    rows = ROWS_BLOCK if q.is_cuda else 16
    atomic_dq = ATOMIC_DQ and not geo.compact and not has_window and not has_sinks
    dqa = torch.empty(out.shape, device=q.device, dtype=torch.float32) if atomic_dq else dq  # dq: never written
    _own_rows_kernel[tiles_grid(seq, rows, batch * heads)](
        q, k, v, out, dout, lse, delta, ds_own, dk, dv, z, dy, out if dgate is None else dgate, dqa,
        *common, *_strides(out), *_strides(z), heads, q_heads, seq, scale * LOG2E, scale,
        WRITE_OWN=not has_window, HAS_GATE=gate is not None, ATOMIC_DQ=atomic_dq, BLOCK_M=rows,
        HEAD_DIM=head_dim, num_warps=ROWS_WARPS if q.is_cuda else 4,
    )
    if not atomic_dq:
        _dq_kernel[tiles_grid(seq, bm, batch * heads)](
            q, k, v, ke, ve, qc, dout, lse, delta, ds_own, dq,
            *common, *_strides(ke), *_strides(ve), *_strides(out), qc.stride(0),
            heads, q_heads, seq, *geo.scalars(), scale * LOG2E, scale,
            COMPACT=geo.compact, HAS_WINDOW=has_window, HAS_SINKS=has_sinks,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_S=geo.block_s(bn), HEAD_DIM=head_dim, DOT_PREC=prec,
            num_warps=w, num_stages=st,
        )
    if has_window:
        _dkdv_window_kernel[tiles_grid(seq, kn, batch * heads)](
            q, k, v, dout, lse, delta, dk, dv, *common, *_strides(out),
            heads, q_heads, seq, geo.window, scale * LOG2E, scale,
            BLOCK_M=km, BLOCK_N=kn, HEAD_DIM=head_dim, DOT_PREC=prec, num_warps=kw, num_stages=kst,
        )
    num_end_tiles = triton.cdiv(max(geo.num_ends - geo.c_min, 0), kn)
    programs = num_end_tiles + (1 if has_sinks else 0)
    if programs:
        _dkdv_ends_kernel[folded(programs, batch * heads)](
            q, k, v, ke, ve, qc, dout, lse, delta, dke, dve, dk, dv, dqa,
            *common, *_strides(ke), *_strides(ve), *_strides(out), qc.stride(0), *_strides(dke),
            heads, q_heads, seq, *geo.scalars(), num_end_tiles, scale * LOG2E, scale,
            COMPACT=geo.compact, OWN=not geo.compact and not has_window, ACCUMULATE=has_window,
            HAS_SINKS=has_sinks, BLOCK_M=km, BLOCK_N=kn, BLOCK_S=geo.block_s(kn), HEAD_DIM=head_dim, DOT_PREC=prec,
            num_warps=kw, num_stages=kst, ATOMIC_DQ=atomic_dq,
        )
    if atomic_dq:
        return _sum_shared_heads(dqa.mul_(scale), q_heads).to(q.dtype)
    return _sum_shared_heads(dq, q_heads)


def tiles_grid(seq: int, block: int, rows: int) -> tuple[int]:
    """Programs of a row-tiled kernel: every (batch x head row, tile of ``block`` tokens) pair on
    grid axis 0, tiles fastest (batch x heads passes axis 1's limit of 65,535 at large batch)."""
    return folded(triton.cdiv(seq, block), rows)


def _sum_shared_heads(dq: torch.Tensor, q_heads: int) -> torch.Tensor:
    """dQ per q head from dQ per head: head h read q head h % q_heads."""
    batch, seq, heads, head_dim = dq.shape
    return dq if q_heads == heads else dq.view(batch, seq, heads // q_heads, q_heads, head_dim).sum(2)


_DUMMY_QUERY_CHUNKS: dict[torch.device, torch.Tensor] = {}


def _dummy_query_chunk(device: torch.device) -> torch.Tensor:
    """The query-chunk operand block mode never reads: one per device, not an allocation and a
    fill per call (none kept from inside a CUDA graph capture, whose memory the graph owns)."""
    dummy = _DUMMY_QUERY_CHUNKS.get(device)
    if dummy is None:
        dummy = torch.zeros(1, 1, device=device, dtype=torch.int32)
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _DUMMY_QUERY_CHUNKS[device] = dummy
    return dummy


class _BlockEndAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, block_size, local_window, num_sink_tokens, scale, gate=None):
        q, k, v = (last_dim_contiguous(t) for t in (q, k, v))
        seq = q.shape[1]
        geo = _Geometry(False, seq // block_size, block_size, local_window, num_sink_tokens, num_sink_tokens // block_size)
        qc = _dummy_query_chunk(q.device)
        ke, ve = k[:, block_size - 1 :: block_size], v[:, block_size - 1 :: block_size]
        gate = None if gate is None else last_dim_contiguous(gate)
        # the backward needs the ungated attention: written next to the gated output only then
        ungated = torch.empty(k.shape, device=q.device, dtype=q.dtype) if gate is not None and any(ctx.needs_input_grad) else None
        out, lse = _forward(q, k, v, ke, ve, qc, geo, scale, gate, ungated)
        if gate is None:
            ctx.save_for_backward(q, k, v, out, lse)
        else:
            ctx.save_for_backward(q, k, v, out if ungated is None else ungated, lse, gate)
        ctx.geo, ctx.scale = geo, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, *gate = ctx.saved_tensors
        gate = gate[0] if gate else None
        geo, D = ctx.geo, ctx.geo.block_size
        qc = _dummy_query_chunk(q.device)
        ke, ve = k[:, D - 1 :: D], v[:, D - 1 :: D]
        dk = torch.empty(k.shape, device=k.device, dtype=k.dtype)  # contiguous, laid out like dout
        dv = torch.empty(v.shape, device=v.device, dtype=v.dtype)
        dgate = None if gate is None else torch.empty(k.shape, device=k.device, dtype=gate.dtype)
        dq = _backward(q, k, v, ke, ve, qc, out, lse, dout, geo, ctx.scale, dk, dv, dk[:, D - 1 :: D], dv[:, D - 1 :: D],
                       gate, dgate)
        return dq, dk, dv, None, None, None, None, dgate


class _ChunkEndAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k_own, v_own, k_ends, v_ends, query_chunk, scale):
        q, k_own, v_own, k_ends, v_ends = (last_dim_contiguous(t) for t in (q, k_own, v_own, k_ends, v_ends))
        query_chunk = query_chunk.to(torch.int32).contiguous()
        geo = _Geometry(True, k_ends.shape[1], 1, 0, 0, 0)
        out, lse = _forward(q, k_own, v_own, k_ends, v_ends, query_chunk, geo, scale)
        ctx.save_for_backward(q, k_own, v_own, k_ends, v_ends, query_chunk, out, lse)
        ctx.geo, ctx.scale = geo, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k_own, v_own, k_ends, v_ends, query_chunk, out, lse = ctx.saved_tensors
        dk_own = torch.empty(q.shape, device=q.device, dtype=k_own.dtype)
        dv_own = torch.empty(q.shape, device=q.device, dtype=v_own.dtype)
        dk_ends = torch.zeros(k_ends.shape, device=q.device, dtype=k_ends.dtype)
        dv_ends = torch.zeros(v_ends.shape, device=q.device, dtype=v_ends.dtype)
        dq = _backward(q, k_own, v_own, k_ends, v_ends, query_chunk, out, lse, dout, ctx.geo, ctx.scale,
                       dk_own, dv_own, dk_ends, dv_ends)
        return dq, dk_own, dv_own, dk_ends, dv_ends, None, None


def block_end_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_size: int,
    local_window: int = 0,
    num_sink_tokens: int = 0,
    scale: float | None = None,
    output_gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton path of :func:`hf_hybrid.kernels.chunk_attention.block_end_attention`; differentiable in q, k, v
    and the output gate. q may have fewer heads than k (a divisor G; head h reads q head h % G):
    every kernel reads it in place and dQ sums over the heads sharing a q head. The output gate
    is applied in the forward kernel's epilogue, and its gradient (and dO of the attention) comes
    from the backward's row-wise kernel."""
    _check_head_dim("block_end_attention", q.shape[-1])
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if q.shape[1] == 0:
        return q.new_empty(k.shape)
    return _BlockEndAttention.apply(q, k, v, int(block_size), int(local_window), int(num_sink_tokens), scale, output_gate)


def chunk_end_attention_triton(
    q: torch.Tensor,
    k_own: torch.Tensor,
    v_own: torch.Tensor,
    k_ends: torch.Tensor,
    v_ends: torch.Tensor,
    query_chunk: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Triton path of :func:`hf_hybrid.kernels.chunk_attention.chunk_end_attention` (compact layout);
    differentiable in q, k_own, v_own, k_ends, v_ends. query_chunk [batch, seq] integer."""
    _check_head_dim("chunk_end_attention", q.shape[-1])
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if q.shape[1] == 0:
        return q.clone()
    return _ChunkEndAttention.apply(q, k_own, v_own, k_ends, v_ends, query_chunk, scale)
