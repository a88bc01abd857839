"""Triton residual linear attention: chunked forward and backward with the w + 1 lag (RATTENTION Sec. 3.2).

Same function as ``reference.residual_linear_attention_reference``. Design notes:

* The lag is a shift. With L = w + 1, RLA is causal linear attention over the key/value stream
  delayed by L tokens: the key tile of chunk c is loaded from rows p - L (rows p < L are empty).
  Inside a chunk the usual chunkwise form applies (paper Eq. 2-3):
      o_c = phi(Q_c) S_c + (phi(Q_c) phi(K'_c)^T * causal) V'_c,   S_{c+1} = S_c + phi(K'_c)^T V'_c,
  so chunk-level states carry the lag for free: S_c holds exactly the keys j <= cC - 1 - L.
* The feature map is fused (paper Sec. 3.2): q and k tiles are loaded once, phi is computed in
  float32 in registers, and only the rounded features enter the tensor-core products
  (float32 accumulators; the state lives in float32).
* Grid = (feature half x value block, batch x key/value head, segment). phi = [phi+(x), phi-(x)]
  splits the F = 2D state rows into two halves that need no communication (each half only
  needs the whole row of x, e.g. for its softmax); the value columns split into blocks of BV.
  Outputs of the halves (and, for dq / dk, of the value blocks) are partial sums. Exactly two
  partials are added with float32 atomics into one zeroed buffer: two addends onto zero give the
  same bits in either order, so the result stays deterministic. With ``half_launches`` each half
  has its own launch instead: the first stores its partials in float32 scratch, the second adds
  them to its own and stores the result (no zeroed buffer, no atomics, no conversion; the same
  bits). More partials (dq / dk with BV < D) are stored apart and added on the host in float32,
  where atomics would make the rounding depend on the order. ``fuse_halves=True`` instead keeps
  both halves' states in one program for the forward and dq kernels: the intra-chunk score
  matrix sum_f phi_f(q) phi_f(k)^T is formed once and no output partials exist, at the price of
  two [D, BV] float32 states in registers. On CUDA the forward runs fused from
  FUSE_HALVES_MIN_TOKENS tokens (over BV = 64: no partial outputs to zero, add and convert) and
  the dq kernel always split (its fused form spills more on sm_90).
* Interleaved state saving (Sec. 3.2, Fig. 2): the sequence is cut into segments of m chunks.
  A light state pass (phi(k) and one product per chunk, one program per segment) sums each
  segment's phi(K')^T V'; a float32 prefix sum over the segments on the host (torch.cumsum,
  S_0 in front) turns these sums into S at every segment start and the final state. The output /
  dq kernels then run one program per segment and recompute the states of the chunks in between
  on chip. m = whole sequence stores nothing and runs one sequential program per (half, block,
  kv head); smaller m buys parallelism with one extra pass over K, V. The backward dk / dv pass
  runs in reverse with the adjoint state G = sum_{later i} phi(q_i)^T do_i, formed the same way
  at segment ends (per-segment sums over Q, dO, then a prefix sum from the end, dS_final first).
  Default m on CUDA: 16 chunks, the fastest of 4, 8 and 16 with these parallel passes (longer
  segments lengthen the dq kernel's sequential part; `python -m hf_hybrid.bench.rattention`
  times the variants).
* GQA: k, v have H_kv heads; query head h reads head h // (H / H_kv). phi(k) v^T does not depend
  on the query head, so programs run per key/value head and serve the query heads of the group:
  the state is updated once per chunk, kept per key/value head ([B, H_kv, F, D]), and the
  backward's adjoint state is the sum over the group (dk, dv need only that sum). The group's
  heads are stacked into the rows of one query tile, HG at a time (``heads_per_tile``): row r of a
  chunk's tile is token r // HG at head r % HG, contiguous in [B, T, H, D], so a chunk takes one
  [C x HG, D] product per operand instead of HG products of C rows (tensor-core tiles of 64+ rows
  where C = 32), and the causal masks compare token r // HG with the key.
* ``chunk_parallel=True`` runs the other way of triton_chunk_parallel.py instead: every chunk's
  state stored, outputs and gradients computed in parallel over chunks with no partial sums.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._backend import triton_interpreting
from .._grid import folded, split_program_id
from ..._compat.triton_launch import launch_cached
from .._triton_dot import dot as _mm

FEATURE_IDS = {"softmax": 0, "relu": 1, "identity": 2}
HEAD_DIMS = (16, 32, 64, 128)


@triton.jit
def _phi(x, sign, FEATURE: tl.constexpr):
    """One half of the feature map on float32 rows x [C, D]: softmax(sign x), relu(sign x) or x."""
    if FEATURE == 0:
        y = x * sign
        y = y - tl.max(y, 1)[:, None]
        e = tl.exp(y)
        return e / tl.sum(e, 1)[:, None]
    elif FEATURE == 1:
        return tl.maximum(x * sign, 0.0)
    else:
        return x


@triton.jit
def _phi_bwd(x, f, df, sign, FEATURE: tl.constexpr):
    """dL/dx from dL/dphi for one half: f = phi(x) of that half, all float32 [C, D]."""
    if FEATURE == 0:
        return sign * f * (df - tl.sum(df * f, 1)[:, None])
    elif FEATURE == 1:
        return tl.where(x * sign > 0, df * sign, 0.0)
    else:
        return df


# ----------------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------------


@triton.jit
def _program(NV: tl.constexpr, NH: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BV: tl.constexpr,
             C: tl.constexpr, HALF: tl.constexpr = -1):
    """Grid (batch x kv head x half x value block, segment; see ``segment_grid``) -> this program's
    indices, the feature sign of its half, the chunk / feature / value offsets and the element
    offsets of its [D, BV] block of a [F, D] state. HALF >= 0: the grid holds that half's value
    blocks only (one launch per half, ``_write_partial``)."""
    if HALF >= 0:
        vb_only, pid_bk = split_program_id(NV)
        pid_fv = HALF * NV + vb_only
    else:
        pid_fv, pid_bk = split_program_id(NH * NV)
    seg = tl.program_id(1)
    half = pid_fv // NV
    vb = pid_fv % NV
    sign = 1.0 - 2.0 * half.to(tl.float32)
    offs_c = tl.arange(0, C)
    offs_d = tl.arange(0, D)
    offs_v = vb * BV + tl.arange(0, BV)
    rows = (half * D + offs_d)[:, None] * D + offs_v[None, :]
    return pid_fv, pid_bk, seg, half, pid_bk // HKV, pid_bk % HKV, sign, offs_c, offs_d, offs_v, rows


@triton.jit
def _state_slot(STATES, slot, B, pid_bk, rows, HKV: tl.constexpr, F: tl.constexpr, D: tl.constexpr):
    """Pointers to this program's [D, BV] block in slot `slot` of segment-major states
    [slots, B, HKV, F, D] (a single state [B, HKV, F, D] is slot 0)."""
    return STATES + (slot * B * HKV + pid_bk).to(tl.int64) * F * D + rows


@triton.jit
def _segment_state(S_IN, slot, B, pid_bk, rows, HKV: tl.constexpr, F: tl.constexpr, D: tl.constexpr,
                   BV: tl.constexpr, MODE: tl.constexpr):
    """The [D, BV] state block a segment starts from. MODE 0: zeros; 1: the one given state
    [B, HKV, F, D] (single segment, slot 0); 2: slot `slot` of the stored states [slots, B, HKV, F, D]."""
    if MODE == 0:
        state = tl.zeros([D, BV], dtype=tl.float32)
    else:
        state = tl.load(_state_slot(S_IN, slot, B, pid_bk, rows, HKV, F, D))
    return state


@triton.jit
def _write_partial(PTR, RES, part, B, T, b, pos, head, cols, x, mask, HEADS: tl.constexpr, D: tl.constexpr,
                   PARTS: tl.constexpr, HALF: tl.constexpr):
    """Adds float32 x (rows: tokens pos of batch b at head `head`, columns cols) into a [B, T, HEADS, D]
    result that is the sum of PARTS partials.

    PARTS == 2, one launch for both halves (HALF < 0): atomics into one zeroed float32 buffer PTR.
    PARTS == 2, one launch per half (HALF 0, then 1): the first stores its partial in float32
    scratch PTR; the second adds it to its own and stores the sum in RES, in RES's dtype: no zeroed
    buffer, no atomics and no conversion pass. Both give x0 + x1 rounded once, the same bits.
    Otherwise PTR holds PARTS slices [PARTS, B, T, HEADS, D] and x is stored in its own slice `part`
    (PARTS == 1: the result itself, in its dtype; more: float32 slices summed on the host)."""
    if PARTS == 2:
        off = ((b * T + pos).to(tl.int64) * HEADS + head) * D
        ptrs = off[:, None] + cols[None, :]
        if HALF == 0:
            tl.store(PTR + ptrs, x, mask=mask)
        elif HALF == 1:
            x = tl.load(PTR + ptrs, mask=mask, other=0.0) + x
            tl.store(RES + ptrs, x.to(RES.dtype.element_ty), mask=mask)
        else:
            # Deterministic although the order is not: each element gets exactly two addends x, y onto
            # a zero, and (0 + x) + y == (0 + y) + x bit for bit in IEEE arithmetic (0 + x is x, or +0
            # for x = -0, and addition commutes). A third addend would make the rounding order-dependent.
            tl.atomic_add(PTR + ptrs, x, mask=mask, sem="relaxed")
    else:
        off = (((part * B + b) * T + pos).to(tl.int64) * HEADS + head) * D
        tl.store(PTR + off[:, None] + cols[None, :], x.to(PTR.dtype.element_ty), mask=mask)


@triton.jit
def _lagged_keys(K, V, b, hk, p, q_ok, T, LAG, HKV: tl.constexpr, D: tl.constexpr, offs_d, offs_v):
    """Keys and values of the tokens that enter the state LAG positions behind queries p:
    (j, k_ok, k [C, D], v [C, BV]), j their positions, rows before the sequence start masked to zero."""
    j = p - LAG
    k_ok = q_ok & (j >= 0)
    kv_off = ((b * T + j).to(tl.int64) * HKV + hk) * D
    k = tl.load(K + kv_off[:, None] + offs_d[None, :], mask=k_ok[:, None], other=0.0)
    v = tl.load(V + kv_off[:, None] + offs_v[None, :], mask=k_ok[:, None], other=0.0)
    return j, k_ok, k, v


@triton.jit
def _row_tokens(C: tl.constexpr, HG: tl.constexpr):
    """The chunk-local token of each row of a query tile of C tokens x HG heads (token-major)."""
    return tl.arange(0, C * HG) // HG


@triton.jit
def _query_rows(b, T, c, hk, s, H: tl.constexpr, GROUP: tl.constexpr, HG: tl.constexpr, C: tl.constexpr,
                D: tl.constexpr):
    """Rows of one query tile: chunk c's C tokens, each with HG query heads of key/value head hk's
    group (slice s of it), token-major. The group's heads of a token sit side by side in
    [B, T, H, D], so a tile is C x HG rows of contiguous memory and one product serves HG heads.
    Returns (p: positions [C * HG], head [C * HG], ok: inside the sequence and the group, off:
    element offsets of the rows)."""
    r = tl.arange(0, C * HG)
    g = s * HG + r % HG
    p = c * C + _row_tokens(C, HG)
    ok = (p < T) & (g < GROUP)
    head = hk * GROUP + g
    off = ((b * T + p).to(tl.int64) * H + head) * D
    return p, head, ok, off


@triton.jit
def _fold_chunk(K, V, S, b, hk, c, T, LAG, sign, offs_c, offs_d, offs_v, HKV: tl.constexpr, D: tl.constexpr,
                C: tl.constexpr, FEATURE: tl.constexpr, DOT_PREC: tl.constexpr):
    """S + phi(K'_c)^T V'_c: this program's state block after the keys that chunk c's queries read
    (LAG behind them)."""
    p = c * C + offs_c
    j, k_ok, k, v = _lagged_keys(K, V, b, hk, p, p < T, T, LAG, HKV, D, offs_d, offs_v)
    kf = tl.where(k_ok[:, None], _phi(k.to(tl.float32), sign, FEATURE), 0.0).to(v.dtype)
    return _mm(tl.trans(kf), v, S, DOT_PREC)


@triton.jit
def _fold_queries(Q, DO, G, b, hk, c, T, sign, offs_d, offs_v, H: tl.constexpr, GROUP: tl.constexpr, HG: tl.constexpr,
                  C: tl.constexpr, D: tl.constexpr, FEATURE: tl.constexpr, DOT_PREC: tl.constexpr):
    """G + sum over chunk c's queries and kv head hk's query heads of phi(q)^T dO: the adjoint
    block before chunk c's keys, from the one after them."""
    SLICES: tl.constexpr = (GROUP + HG - 1) // HG
    for s in range(SLICES):  # a loop, not unrolled: one slice of HG heads lives at a time
        _, _, ok, q_off = _query_rows(b, T, c, hk, s, H, GROUP, HG, C, D)
        q = tl.load(Q + q_off[:, None] + offs_d[None, :], mask=ok[:, None], other=0.0)
        do = tl.load(DO + q_off[:, None] + offs_v[None, :], mask=ok[:, None], other=0.0).to(q.dtype)
        qf = tl.where(ok[:, None], _phi(q.to(tl.float32), sign, FEATURE), 0.0).to(q.dtype)
        G = _mm(tl.trans(qf), do, G, DOT_PREC)
    return G


@launch_cached
@triton.jit
def _state_pass_kernel(
    K, V, S0, STATES,
    B, T, LAG, SEG_CHUNKS, NUM_CHUNKS,
    HKV: tl.constexpr, D: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, NH: tl.constexpr,
    FEATURE: tl.constexpr, HAS_S0: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Per (half, value block, batch x kv head, segment): the segment's sum of phi(k'_j) v'_j^T into
    slot seg + 1 of STATES [NSEG + 1, B, HKV, F, D]; segment 0 also writes S_0 (zeros without
    HAS_S0) into slot 0. An inclusive cumsum over the slots then leaves S at the start of segment s
    in slot s and the final S in slot NSEG."""
    NV: tl.constexpr = D // BV
    F: tl.constexpr = NH * D
    pid_fv, pid_bk, seg, half, b, hk, sign, offs_c, offs_d, offs_v, rows = _program(NV, NH, HKV, D, BV, C)
    S = tl.zeros([D, BV], dtype=tl.float32)
    c_stop = tl.minimum((seg + 1) * SEG_CHUNKS, NUM_CHUNKS)
    for c in range(seg * SEG_CHUNKS, c_stop):
        S = _fold_chunk(K, V, S, b, hk, c, T, LAG, sign, offs_c, offs_d, offs_v, HKV, D, C, FEATURE, DOT_PREC)
    tl.store(_state_slot(STATES, seg + 1, B, pid_bk, rows, HKV, F, D), S)
    if seg == 0:
        if HAS_S0:
            start = tl.load(_state_slot(S0, 0, B, pid_bk, rows, HKV, F, D))
        else:
            start = tl.zeros([D, BV], dtype=tl.float32)
        tl.store(_state_slot(STATES, 0, B, pid_bk, rows, HKV, F, D), start)


@launch_cached
@triton.jit
def _fwd_kernel(
    Q, K, V, S_IN, O, O_RES, S_OUT,
    B, T, LAG, SEG_CHUNKS, NUM_CHUNKS,
    H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, HG: tl.constexpr,
    NH: tl.constexpr, FEATURE: tl.constexpr, S_IN_MODE: tl.constexpr, STORE_FINAL: tl.constexpr,
    DOT_PREC: tl.constexpr, HALF: tl.constexpr,
):
    """Outputs of one segment of chunks for (half, value block, batch x kv head), every query head
    of the group in turn against the group's one state.

    S_IN_MODE: 0 = start from zeros, 1 = from the initial state [B, HKV, F, D] (single segment),
    2 = from the stored segment states [NSEG + 1, B, HKV, F, D]. O: the sum of one partial output
    per feature half (see ``_write_partial``; O_RES: the result when each half has its own launch,
    HALF), [B, T, H, D]. STORE_FINAL (single segment): write the final state.
    """
    NV: tl.constexpr = D // BV
    F: tl.constexpr = NH * D
    GROUP: tl.constexpr = H // HKV
    SLICES: tl.constexpr = (GROUP + HG - 1) // HG
    pid_fv, pid_bk, seg, half, b, hk, sign, offs_c, offs_d, offs_v, rows = _program(NV, NH, HKV, D, BV, C, HALF)
    S = _segment_state(S_IN, seg, B, pid_bk, rows, HKV, F, D, BV, S_IN_MODE)
    causal = _row_tokens(C, HG)[:, None] >= offs_c[None, :]  # [query row, key]
    c_stop = tl.minimum((seg + 1) * SEG_CHUNKS, NUM_CHUNKS)
    for c in range(seg * SEG_CHUNKS, c_stop):
        p = c * C + offs_c
        j, k_ok, k, v = _lagged_keys(K, V, b, hk, p, p < T, T, LAG, HKV, D, offs_d, offs_v)
        kf = tl.where(k_ok[:, None], _phi(k.to(tl.float32), sign, FEATURE), 0.0).to(v.dtype)
        s_op = S.to(v.dtype)
        for s in range(SLICES):  # a loop, not unrolled: one slice of HG heads lives at a time
            pq, head, ok, q_off = _query_rows(b, T, c, hk, s, H, GROUP, HG, C, D)
            q = tl.load(Q + q_off[:, None] + offs_d[None, :], mask=ok[:, None], other=0.0)
            qf = _phi(q.to(tl.float32), sign, FEATURE).to(v.dtype)
            o = _mm(qf, s_op, tl.zeros([C * HG, BV], dtype=tl.float32), DOT_PREC)
            a = _mm(qf, tl.trans(kf), tl.zeros([C * HG, C], dtype=tl.float32), DOT_PREC)
            a = tl.where(causal, a, 0.0).to(v.dtype)
            o = _mm(a, v, o, DOT_PREC)
            _write_partial(O, O_RES, half, B, T, b, pq, head, offs_v, o, ok[:, None], H, D, NH, HALF)
        S = _mm(tl.trans(kf), v, S, DOT_PREC)
    if STORE_FINAL:
        tl.store(_state_slot(S_OUT, 0, B, pid_bk, rows, HKV, F, D), S)


@launch_cached
@triton.jit
def _fwd_fused_kernel(
    Q, K, V, S_IN, O, S_OUT,
    B, T, LAG, SEG_CHUNKS, NUM_CHUNKS,
    H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, HG: tl.constexpr,
    FEATURE: tl.constexpr, S_IN_MODE: tl.constexpr, STORE_FINAL: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """``_fwd_kernel`` with both feature halves (states S1 = rows [0, D), S2 = rows [D, 2D)) in one
    program per (value block, batch x kv head, segment): O is the finished [B, T, H, D] output."""
    F: tl.constexpr = 2 * D
    GROUP: tl.constexpr = H // HKV
    vb, pid_bk = split_program_id(D // BV)
    seg = tl.program_id(1)
    b = pid_bk // HKV
    hk = pid_bk % HKV
    offs_c = tl.arange(0, C)
    offs_d = tl.arange(0, D)
    offs_v = vb * BV + tl.arange(0, BV)
    rows1 = offs_d[:, None] * D + offs_v[None, :]
    rows2 = rows1 + D * D
    S1 = _segment_state(S_IN, seg, B, pid_bk, rows1, HKV, F, D, BV, S_IN_MODE)
    S2 = _segment_state(S_IN, seg, B, pid_bk, rows2, HKV, F, D, BV, S_IN_MODE)
    SLICES: tl.constexpr = (GROUP + HG - 1) // HG
    causal = _row_tokens(C, HG)[:, None] >= offs_c[None, :]  # [query row, key]
    c_stop = tl.minimum((seg + 1) * SEG_CHUNKS, NUM_CHUNKS)
    for c in range(seg * SEG_CHUNKS, c_stop):
        p = c * C + offs_c
        j, k_ok, k, v = _lagged_keys(K, V, b, hk, p, p < T, T, LAG, HKV, D, offs_d, offs_v)
        k = k.to(tl.float32)
        kf1 = tl.where(k_ok[:, None], _phi(k, 1.0, FEATURE), 0.0).to(v.dtype)
        kf2 = tl.where(k_ok[:, None], _phi(k, -1.0, FEATURE), 0.0).to(v.dtype)
        s1 = S1.to(v.dtype)
        s2 = S2.to(v.dtype)
        for s in range(SLICES):  # a loop, not unrolled: one slice of HG heads lives at a time
            pq, head, ok, q_off = _query_rows(b, T, c, hk, s, H, GROUP, HG, C, D)
            q = tl.load(Q + q_off[:, None] + offs_d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
            qf1 = _phi(q, 1.0, FEATURE).to(v.dtype)
            qf2 = _phi(q, -1.0, FEATURE).to(v.dtype)
            o = _mm(qf1, s1, tl.zeros([C * HG, BV], dtype=tl.float32), DOT_PREC)
            o = _mm(qf2, s2, o, DOT_PREC)
            a = _mm(qf1, tl.trans(kf1), tl.zeros([C * HG, C], dtype=tl.float32), DOT_PREC)
            a = _mm(qf2, tl.trans(kf2), a, DOT_PREC)
            a = tl.where(causal, a, 0.0).to(v.dtype)
            o = _mm(a, v, o, DOT_PREC)
            tl.store(O + q_off[:, None] + offs_v[None, :], o.to(O.dtype.element_ty), mask=ok[:, None])
        S1 = _mm(tl.trans(kf1), v, S1, DOT_PREC)
        S2 = _mm(tl.trans(kf2), v, S2, DOT_PREC)
    if STORE_FINAL:
        tl.store(_state_slot(S_OUT, 0, B, pid_bk, rows1, HKV, F, D), S1)
        tl.store(_state_slot(S_OUT, 0, B, pid_bk, rows2, HKV, F, D), S2)


@launch_cached
@triton.jit
def _dq_fused_kernel(
    Q, K, V, DO, S_IN, DQ,
    B, T, LAG, SEG_CHUNKS, NUM_CHUNKS,
    H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, HG: tl.constexpr,
    FEATURE: tl.constexpr, S_IN_MODE: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """``_dq_kernel`` with both feature halves in one program: dO v^T is formed once and dq is
    summed over the halves on chip. DQ: the sum of one partial per value block (see ``_write_partial``)."""
    F: tl.constexpr = 2 * D
    GROUP: tl.constexpr = H // HKV
    vb, pid_bk = split_program_id(D // BV)
    seg = tl.program_id(1)
    b = pid_bk // HKV
    hk = pid_bk % HKV
    offs_c = tl.arange(0, C)
    offs_d = tl.arange(0, D)
    offs_v = vb * BV + tl.arange(0, BV)
    rows1 = offs_d[:, None] * D + offs_v[None, :]
    rows2 = rows1 + D * D
    S1 = _segment_state(S_IN, seg, B, pid_bk, rows1, HKV, F, D, BV, S_IN_MODE)
    S2 = _segment_state(S_IN, seg, B, pid_bk, rows2, HKV, F, D, BV, S_IN_MODE)
    SLICES: tl.constexpr = (GROUP + HG - 1) // HG
    causal = _row_tokens(C, HG)[:, None] >= offs_c[None, :]  # [query row, key]
    c_stop = tl.minimum((seg + 1) * SEG_CHUNKS, NUM_CHUNKS)
    for c in range(seg * SEG_CHUNKS, c_stop):
        p = c * C + offs_c
        j, k_ok, k, v = _lagged_keys(K, V, b, hk, p, p < T, T, LAG, HKV, D, offs_d, offs_v)
        k = k.to(tl.float32)
        kf1 = tl.where(k_ok[:, None], _phi(k, 1.0, FEATURE), 0.0).to(v.dtype)
        kf2 = tl.where(k_ok[:, None], _phi(k, -1.0, FEATURE), 0.0).to(v.dtype)
        s1_t = tl.trans(S1.to(v.dtype))
        s2_t = tl.trans(S2.to(v.dtype))
        for s in range(SLICES):  # a loop, not unrolled: one slice of HG heads lives at a time
            pq, head, ok, q_off = _query_rows(b, T, c, hk, s, H, GROUP, HG, C, D)
            q = tl.load(Q + q_off[:, None] + offs_d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
            do = tl.load(DO + q_off[:, None] + offs_v[None, :], mask=ok[:, None], other=0.0).to(v.dtype)
            da = _mm(do, tl.trans(v), tl.zeros([C * HG, C], dtype=tl.float32), DOT_PREC)
            da = tl.where(causal, da, 0.0).to(v.dtype)
            dqf = _mm(do, s1_t, tl.zeros([C * HG, D], dtype=tl.float32), DOT_PREC)
            dqf = _mm(da, kf1, dqf, DOT_PREC)
            dq = _phi_bwd(q, _phi(q, 1.0, FEATURE), dqf, 1.0, FEATURE)
            dqf = _mm(do, s2_t, tl.zeros([C * HG, D], dtype=tl.float32), DOT_PREC)
            dqf = _mm(da, kf2, dqf, DOT_PREC)
            dq += _phi_bwd(q, _phi(q, -1.0, FEATURE), dqf, -1.0, FEATURE)
            _write_partial(DQ, DQ, vb, B, T, b, pq, head, offs_d, dq, ok[:, None], H, D, D // BV, -1)
        S1 = _mm(tl.trans(kf1), v, S1, DOT_PREC)
        S2 = _mm(tl.trans(kf2), v, S2, DOT_PREC)


# ----------------------------------------------------------------------------------------------
# backward
# ----------------------------------------------------------------------------------------------


@launch_cached
@triton.jit
def _dq_kernel(
    Q, K, V, DO, S_IN, DQ, DQ_RES,
    B, T, LAG, SEG_CHUNKS, NUM_CHUNKS,
    H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, HG: tl.constexpr,
    NH: tl.constexpr, FEATURE: tl.constexpr, S_IN_MODE: tl.constexpr, DOT_PREC: tl.constexpr, HALF: tl.constexpr,
):
    """dq of one segment: dphi(q)_i = dO_i S_i^T + sum_{j in chunk, causal} (dO_i . v'_j) phi(k'_j),
    then through the feature map. DQ: the sum of one partial per (half, value block), see
    ``_write_partial``."""
    NV: tl.constexpr = D // BV
    F: tl.constexpr = NH * D
    GROUP: tl.constexpr = H // HKV
    SLICES: tl.constexpr = (GROUP + HG - 1) // HG
    pid_fv, pid_bk, seg, half, b, hk, sign, offs_c, offs_d, offs_v, rows = _program(NV, NH, HKV, D, BV, C, HALF)
    S = _segment_state(S_IN, seg, B, pid_bk, rows, HKV, F, D, BV, S_IN_MODE)
    causal = _row_tokens(C, HG)[:, None] >= offs_c[None, :]  # [query row, key]
    c_stop = tl.minimum((seg + 1) * SEG_CHUNKS, NUM_CHUNKS)
    for c in range(seg * SEG_CHUNKS, c_stop):
        p = c * C + offs_c
        j, k_ok, k, v = _lagged_keys(K, V, b, hk, p, p < T, T, LAG, HKV, D, offs_d, offs_v)
        kf = tl.where(k_ok[:, None], _phi(k.to(tl.float32), sign, FEATURE), 0.0).to(v.dtype)
        s_t = tl.trans(S.to(v.dtype))
        for s in range(SLICES):  # a loop, not unrolled: one slice of HG heads lives at a time
            pq, head, ok, q_off = _query_rows(b, T, c, hk, s, H, GROUP, HG, C, D)
            q = tl.load(Q + q_off[:, None] + offs_d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
            do = tl.load(DO + q_off[:, None] + offs_v[None, :], mask=ok[:, None], other=0.0).to(v.dtype)
            qf = _phi(q, sign, FEATURE)
            dqf = _mm(do, s_t, tl.zeros([C * HG, D], dtype=tl.float32), DOT_PREC)
            da = _mm(do, tl.trans(v), tl.zeros([C * HG, C], dtype=tl.float32), DOT_PREC)
            da = tl.where(causal, da, 0.0).to(v.dtype)
            dqf = _mm(da, kf, dqf, DOT_PREC)
            dq = _phi_bwd(q, qf, dqf, sign, FEATURE)
            _write_partial(DQ, DQ_RES, pid_fv, B, T, b, pq, head, offs_d, dq, ok[:, None], H, D, NH * NV, HALF)
        S = _mm(tl.trans(kf), v, S, DOT_PREC)


@launch_cached
@triton.jit
def _adjoint_pass_kernel(
    Q, DO, DSF, GSTATES,
    B, T, SEG_CHUNKS, NUM_CHUNKS, NSEG,
    H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, HG: tl.constexpr,
    NH: tl.constexpr, FEATURE: tl.constexpr, HAS_DSF: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Per (half, value block, batch x kv head, segment 1 .. NSEG - 1): the segment's sum over its
    queries and the group's query heads of phi(q)^T dO into slot NSEG - seg of GSTATES
    [NSEG, B, HKV, F, D]; segment NSEG - 1 also writes dS_final (zeros without HAS_DSF) into slot
    0. An inclusive cumsum over the slots then leaves G at the end of segment s (dS_final plus
    every later segment's sum) in slot NSEG - 1 - s. Segment 0's own sum is not needed: it only
    adds up to dS_0, which ``_dkv_kernel`` forms itself."""
    NV: tl.constexpr = D // BV
    F: tl.constexpr = NH * D
    GROUP: tl.constexpr = H // HKV
    pid_fv, pid_bk, grid_seg, half, b, hk, sign, offs_c, offs_d, offs_v, rows = _program(NV, NH, HKV, D, BV, C)
    seg = grid_seg + 1
    G = tl.zeros([D, BV], dtype=tl.float32)
    c_start = seg * SEG_CHUNKS
    c_stop = tl.minimum(c_start + SEG_CHUNKS, NUM_CHUNKS)
    for c in range(c_start, c_stop):
        G = _fold_queries(Q, DO, G, b, hk, c, T, sign, offs_d, offs_v, H, GROUP, HG, C, D, FEATURE, DOT_PREC)
    tl.store(_state_slot(GSTATES, NSEG - seg, B, pid_bk, rows, HKV, F, D), G)
    if seg == NSEG - 1:
        if HAS_DSF:
            end = tl.load(_state_slot(DSF, 0, B, pid_bk, rows, HKV, F, D))
        else:
            end = tl.zeros([D, BV], dtype=tl.float32)
        tl.store(_state_slot(GSTATES, 0, B, pid_bk, rows, HKV, F, D), end)


@launch_cached
@triton.jit
def _dkv_kernel(
    Q, K, V, DO, G_IN, DK, DV, DK_RES, DV_RES, DS0,
    B, T, LAG, SEG_CHUNKS, NUM_CHUNKS, NSEG,
    H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, HG: tl.constexpr,
    NH: tl.constexpr, FEATURE: tl.constexpr, G_IN_MODE: tl.constexpr, STORE_DS0: tl.constexpr,
    DOT_PREC: tl.constexpr, HALF: tl.constexpr,
):
    """dk, dv of one segment, chunks in reverse, for one kv head (summed over its query heads).

    With G = sum over later queries (all heads of the group) of phi(q_i)^T dO_i (the adjoint state):
        dv'_j    = phi(k'_j)^T G + sum_h sum_{i in chunk, i >= j} (phi(q_ih) . phi(k'_j)) dO_ih
        dphi(k') = v'_j G^T       + sum_h sum_{i in chunk, i >= j} (dO_ih . v'_j) phi(q_ih)
    G_IN_MODE: 0 zeros, 1 dS_final [B, HKV, F, D], 2 stored [NSEG, B, HKV, F, D] (G at the end of
    segment s in slot NSEG - 1 - s, see ``_adjoint_pass_kernel``). DK, DV: [B, T, HKV, D] sums of
    one partial per (half, value block) and per half (see ``_write_partial``); rows of keys that
    never leave the window are not written. STORE_DS0: G after segment 0 is dS_0.
    """
    NV: tl.constexpr = D // BV
    F: tl.constexpr = NH * D
    GROUP: tl.constexpr = H // HKV
    SLICES: tl.constexpr = (GROUP + HG - 1) // HG
    pid_fv, pid_bk, seg, half, b, hk, sign, offs_c, offs_d, offs_v, rows = _program(NV, NH, HKV, D, BV, C, HALF)
    G = _segment_state(G_IN, NSEG - 1 - seg, B, pid_bk, rows, HKV, F, D, BV, G_IN_MODE)
    later = offs_c[:, None] <= _row_tokens(C, HG)[None, :]  # [key, query row]
    c_start = seg * SEG_CHUNKS
    c_stop = tl.minimum(c_start + SEG_CHUNKS, NUM_CHUNKS)
    for cc in range(c_start, c_stop):
        c = c_stop - 1 - (cc - c_start)
        p = c * C + offs_c
        q_ok = p < T
        j, k_ok, k, v = _lagged_keys(K, V, b, hk, p, q_ok, T, LAG, HKV, D, offs_d, offs_v)
        kf = tl.where(k_ok[:, None], _phi(k.to(tl.float32), sign, FEATURE), 0.0).to(v.dtype)
        g_op = G.to(v.dtype)
        dv = _mm(kf, g_op, tl.zeros([C, BV], dtype=tl.float32), DOT_PREC)
        dkf = _mm(v, tl.trans(g_op), tl.zeros([C, D], dtype=tl.float32), DOT_PREC)
        for s in range(SLICES):  # a loop, not unrolled: one slice of HG heads lives at a time
            _, _, ok, q_off = _query_rows(b, T, c, hk, s, H, GROUP, HG, C, D)
            q = tl.load(Q + q_off[:, None] + offs_d[None, :], mask=ok[:, None], other=0.0)
            do = tl.load(DO + q_off[:, None] + offs_v[None, :], mask=ok[:, None], other=0.0).to(v.dtype)
            qf = tl.where(ok[:, None], _phi(q.to(tl.float32), sign, FEATURE), 0.0).to(v.dtype)
            at = _mm(kf, tl.trans(qf), tl.zeros([C, C * HG], dtype=tl.float32), DOT_PREC)
            at = tl.where(later, at, 0.0).to(v.dtype)
            dv = _mm(at, do, dv, DOT_PREC)
            dat = _mm(v, tl.trans(do), tl.zeros([C, C * HG], dtype=tl.float32), DOT_PREC)
            dat = tl.where(later, dat, 0.0).to(v.dtype)
            dkf = _mm(dat, qf, dkf, DOT_PREC)
            G = _mm(tl.trans(qf), do, G, DOT_PREC)  # after this chunk's keys have read the old G
        # phi(k) again in float32 for its Jacobian (cheaper than keeping the float32 tile live).
        k32 = k.to(tl.float32)
        dk = _phi_bwd(k32, _phi(k32, sign, FEATURE), dkf, sign, FEATURE)
        _write_partial(DK, DK_RES, pid_fv, B, T, b, j, hk, offs_d, dk, k_ok[:, None], HKV, D, NH * NV, HALF)
        _write_partial(DV, DV_RES, half, B, T, b, j, hk, offs_v, dv, k_ok[:, None], HKV, D, NH, HALF)
    if STORE_DS0:
        if seg == 0:
            tl.store(_state_slot(DS0, 0, B, pid_bk, rows, HKV, F, D), G)


# ----------------------------------------------------------------------------------------------
# host side
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Tiling:
    """How one pass's kernels cut the work: value columns per program (block_v), query heads per
    tile (heads_per_tile), both feature halves in one program (fuse: the forward kernel, or the dq
    kernel of the backward) and warps."""

    block_v: int
    heads_per_tile: int
    fuse: bool
    num_warps: int


# Chunks per stored state on CUDA when state_every is None (the fastest, module docstring).
DEFAULT_STATE_EVERY = 16

# CUDA defaults at head_dim 128, chunk 32, 16 query / 4 key-value heads (`python -m hf_hybrid.bench.rattention`
# times the variants; docs/benchmarks/rattention.md). Split programs (one feature half each, whole
# value rows) stack SPLIT_ROWS query rows per tile: the fastest forward + backward at 8K, where
# 128 rows spill more (the dk / dv kernel holds the most live tiles). From FUSE_HALVES_MIN_TOKENS
# tokens per sequence the forward keeps both halves in one program over 64 value columns with
# FUSED_ROWS rows (no partial outputs to zero, add and convert; 40% faster at 32K); the backward
# stays split.
SPLIT_ROWS, FUSED_ROWS = 64, 128
FUSE_HALVES_MIN_TOKENS = 16384

# Whether the split kernels run one launch per feature half (``_write_partial``): the second
# launch adds the first's float32 partial to its own and stores the result, where one launch over
# both halves needs a zeroed float32 buffer, atomics and a conversion pass. Off until timed on the
# GPU against the atomics (`python -m benchmarks.train_ab --compare rla_partials`).
HALF_LAUNCHES = False

# The chunk-parallel path (triton_chunk_parallel.py): whether it runs when chunk_parallel is None
# (off: slower than the segment kernels where measured, docs/benchmarks/rattention.md), its chunk
# length on CUDA (every chunk's state is stored, so a longer chunk stores fewer) and chunks per
# segment of its walks.
CHUNK_PARALLEL_DEFAULT = False
CHUNK_PARALLEL_CHUNK = 64
CHUNK_PARALLEL_STATE_EVERY = 8


def _heads_per_tile(group: int, chunk: int, rows: int) -> int:
    """Query heads of a group stacked into one tile (module docstring): as many as fit ``rows``
    rows with the chunk's tokens, at most the group (rounded up to a power of two)."""
    return max(1, min(triton.next_power_of_2(group), rows // chunk))


def _num_segments(num_chunks: int, state_every: int | None, device: torch.device) -> int:
    """Segments of ``state_every`` chunks; by default DEFAULT_STATE_EVERY on CUDA and one segment
    elsewhere (the interpreter gains nothing from segments)."""
    if state_every is None:
        state_every = DEFAULT_STATE_EVERY if device.type == "cuda" else 0
    return 1 if state_every <= 0 else max(1, math.ceil(num_chunks / state_every))


class _Plan:
    """Shapes and segmentation shared by forward and backward, and each pass's tiling.

    Options left None take the defaults: on CUDA chunk 32 and split programs over whole value rows
    (SPLIT_ROWS query rows per tile), the forward fused over 64 value columns (FUSED_ROWS) from
    FUSE_HALVES_MIN_TOKENS tokens; in the interpreter chunk 16, halves apart and half value rows,
    so short test sequences span several chunks and every partial sum is exercised. An option given
    applies to both passes."""

    def __init__(self, q, k, feature_map, window_size, chunk_size, block_v, state_every, num_warps, fuse_halves,
                 heads_per_tile, chunk_parallel=None, half_launches=None):
        self.batch, self.seq, self.heads, self.dim = q.shape
        self.kv_heads = k.shape[2]
        self.feature = FEATURE_IDS[feature_map]
        self.halves = 1 if feature_map == "identity" else 2
        self.half_launches = self.halves == 2 and bool(HALF_LAUNCHES if half_launches is None else half_launches)
        self.features = self.halves * self.dim
        interpreted = triton_interpreting()
        self.chunk_parallel = bool(CHUNK_PARALLEL_DEFAULT and not interpreted if chunk_parallel is None else chunk_parallel)
        if self.chunk_parallel:
            self.chunk = chunk_size or (16 if interpreted else CHUNK_PARALLEL_CHUNK)
            if state_every is None and q.device.type == "cuda":
                state_every = CHUNK_PARALLEL_STATE_EVERY
        else:
            self.chunk = chunk_size or (16 if interpreted else 32)
        self.lag = window_size + 1
        self.num_chunks = max(1, math.ceil(self.seq / self.chunk))
        self.nseg = _num_segments(self.num_chunks, state_every, q.device)
        self.seg_chunks = math.ceil(self.num_chunks / self.nseg)
        self.nseg = math.ceil(self.num_chunks / self.seg_chunks)
        self.dot_prec = "ieee" if q.dtype == torch.float32 else "tf32"
        # A plain int: under torch.compile's dynamic shapes the head counts may be symbolic (this
        # specialises on them, as the kernels' compile-time H and HKV do anyway).
        self.group = int(self.heads // self.kv_heads)

        def tiling(fuse_default: bool) -> _Tiling:
            fuse = self.halves == 2 and bool(fuse_default if fuse_halves is None else fuse_halves)
            if block_v:
                bv = block_v
            elif interpreted:
                bv = max(16, self.dim // 2)
            else:
                bv = min(self.dim, 64 if fuse else 128)
            hg = heads_per_tile or _heads_per_tile(self.group, self.chunk, FUSED_ROWS if fuse else SPLIT_ROWS)
            state_floats = bv * self.dim * (2 if fuse else 1)
            warps = num_warps or (4 if state_floats < 64 * 128 else 8)
            return _Tiling(bv, hg, fuse, warps)

        self.forward = tiling(not interpreted and self.seq >= FUSE_HALVES_MIN_TOKENS)
        self.backward = tiling(False)
        self.chunk_warps = num_warps or (4 if self.chunk * self.dim < 64 * 128 else 8)

    def chunk_args(self, heads: int, kv_heads: int):
        """Compile-time arguments of the chunk-parallel kernels (one program per chunk and head)."""
        return dict(
            H=heads, HKV=kv_heads, D=self.dim, C=self.chunk, NH=self.halves, FEATURE=self.feature,
            DOT_PREC=self.dot_prec, num_warps=self.chunk_warps, num_stages=2,
        )

    def common(self, tiling: _Tiling, halves: bool = True, queries: bool = True):
        """Compile-time arguments of a kernel run with ``tiling`` (the fused ones take no NH, the
        state pass, which reads no query, no HG)."""
        args = dict(
            D=self.dim, BV=tiling.block_v, C=self.chunk, FEATURE=self.feature,
            DOT_PREC=self.dot_prec, num_warps=tiling.num_warps, num_stages=2,
        )
        if halves:
            args["NH"] = self.halves
        if queries:
            args["HG"] = tiling.heads_per_tile
        return args

    def runtime(self):
        return (self.batch, self.seq, self.lag, self.seg_chunks, self.num_chunks)

    def launches(self, value_blocks: int):
        """(HALF, state blocks per batch x kv head row) of each launch of a split kernel: one launch
        per feature half when ``half_launches``, else one over both halves (HALF = -1)."""
        if self.half_launches:
            return [(0, value_blocks), (1, value_blocks)]
        return [(-1, self.halves * value_blocks)]


def _check_tiling(plan: _Plan) -> None:
    if plan.dim not in HEAD_DIMS:
        raise ValueError(f"residual_linear_attention: the Triton kernel supports head_dim in {HEAD_DIMS}; got {plan.dim}.")
    if plan.chunk not in (16, 32, 64, 128):
        raise ValueError(f"residual_linear_attention: chunk_size must be 16, 32, 64 or 128; got {plan.chunk}.")
    group = plan.group
    for tiling in (plan.forward, plan.backward):
        if tiling.block_v not in (16, 32, 64, 128) or plan.dim % tiling.block_v:
            raise ValueError(
                f"residual_linear_attention: block_v must be a power of two >= 16 dividing head_dim; got {tiling.block_v}."
            )
        if tiling.heads_per_tile not in (1, 2, 4, 8, 16) or tiling.heads_per_tile > triton.next_power_of_2(group):
            raise ValueError(
                "residual_linear_attention: heads_per_tile must be a power of two up to the query heads per key/value "
                f"head ({group}) rounded up to one; got {tiling.heads_per_tile}."
            )


class _Partials:
    """Where a kernel leaves a [B, T, heads, D] result of `parts` partial sums (``_write_partial``):
    ``buf`` (its PTR) and ``res`` (its RES). One part: the result itself, in its dtype. Two parts
    with one launch per half: float32 scratch and the result, which the second launch fills. Two
    parts otherwise: one zeroed float32 buffer the atomics add into. More: a float32 slice each,
    summed here. ``res`` is ``buf`` itself (unused) unless the launches fill it. The last
    `unwritten_rows` tokens, which no program writes, read as zero. ``result()`` after the kernels."""

    def __init__(self, parts: int, shape, dtype, device, half_launches: bool, unwritten_rows: int = 0):
        self.parts, self.dtype = parts, dtype
        if parts == 2 and half_launches:
            self.buf = torch.empty(shape, device=device, dtype=torch.float32)
            self.res = torch.empty(shape, device=device, dtype=dtype)
            target = self.res
        elif parts == 2:
            self.buf = self.res = torch.zeros(shape, device=device, dtype=torch.float32)
            return
        else:
            full = shape if parts == 1 else (parts, *shape)
            self.buf = self.res = torch.empty(full, device=device, dtype=dtype if parts == 1 else torch.float32)
            target = self.buf
        if unwritten_rows:
            target.narrow(-3, shape[1] - unwritten_rows, unwritten_rows).zero_()

    def result(self) -> torch.Tensor:
        if self.res is not self.buf:  # summed by the second launch
            return self.res
        return (self.buf.sum(0) if self.parts > 2 else self.buf).to(self.dtype)


def segment_grid(blocks: int, rows: int, segments: int) -> tuple[int, int]:
    """(batch x kv head x state block, segment): the state blocks (half x value block) fastest on
    axis 0 with the batch x kv head rows, which pass axis 1's limit of 65,535 at large batch; the
    segments (one per DEFAULT_STATE_EVERY chunks of one sequence) stay far below it."""
    return folded(blocks, rows, segments)


def segment_states(k, v, s0, plan: _Plan):
    """(the state at the start of each segment [NSEG, B, HKV, F, D], the final state), both float32,
    from the state pass and a prefix sum; (None, None) for a single segment. s0: S_0 or None."""
    if plan.nseg == 1:
        return None, None
    B, _, HKV, D = k.shape
    # Slot 0: S_0, slot s + 1: segment s's sum; the float32 prefix sum over the slots leaves the
    # state at the start of segment s in slot s and the final state in slot NSEG.
    slots = torch.empty((plan.nseg + 1, B, HKV, plan.features, D), device=k.device, dtype=torch.float32)
    # The state pass takes the backward's tiling (the split one: a fused state pass does not exist).
    nv = D // plan.backward.block_v
    _state_pass_kernel[segment_grid(plan.halves * nv, B * HKV, plan.nseg)](
        k, v, s0 if s0 is not None else slots, slots, *plan.runtime(),
        HKV=HKV, HAS_S0=s0 is not None, **plan.common(plan.backward, queries=False),
    )
    slots.cumsum_(0)
    return slots[: plan.nseg], slots[plan.nseg].clone()  # the final state in its own storage


def segment_adjoints(q, do, dsf, plan: _Plan):
    """The adjoint at the end of each segment, segment s in slot NSEG - 1 - s of [NSEG, B, HKV, F, D]
    float32, from the adjoint pass and a prefix sum; None for a single segment. dsf: dS_final or None."""
    if plan.nseg == 1:
        return None
    B, _, H, D = q.shape
    HKV = plan.kv_heads
    # Slot 0: dS_final, slot NSEG - s: segment s's sum (s >= 1); the float32 prefix sum over the
    # slots leaves the adjoint at the end of segment s in slot NSEG - 1 - s.
    gstates = torch.empty((plan.nseg, B, HKV, plan.features, D), device=q.device, dtype=torch.float32)
    nv = D // plan.backward.block_v
    _adjoint_pass_kernel[segment_grid(plan.halves * nv, B * HKV, plan.nseg - 1)](
        q, do, dsf if dsf is not None else gstates, gstates,
        B, q.shape[1], plan.seg_chunks, plan.num_chunks, plan.nseg,
        H=H, HKV=HKV, HAS_DSF=dsf is not None, **plan.common(plan.backward),
    )
    gstates.cumsum_(0)
    return gstates


def _forward(q, k, v, initial_state, plan: _Plan):
    B, T, H, D = q.shape
    HKV, F = plan.kv_heads, plan.features
    tiling = plan.forward
    nv = D // tiling.block_v
    dev = q.device
    s0 = initial_state.float().contiguous() if initial_state is not None else None
    states, final = segment_states(k, v, s0, plan)
    if states is not None:
        mode, s_in, store_final = 2, states, False
    else:
        final = torch.empty((B, HKV, F, D), device=dev, dtype=torch.float32)
        mode, s_in, store_final = (1, s0, True) if s0 is not None else (0, final, True)
    if tiling.fuse:
        out = torch.empty_like(q)
        _fwd_fused_kernel[segment_grid(nv, B * HKV, plan.nseg)](
            q, k, v, s_in, out, final, *plan.runtime(),
            H=H, HKV=HKV, S_IN_MODE=mode, STORE_FINAL=store_final, **plan.common(tiling, halves=False),
        )
        return out, final, states
    # One partial output per feature half.
    o = _Partials(plan.halves, q.shape, q.dtype, dev, plan.half_launches)
    for half, blocks in plan.launches(nv):
        _fwd_kernel[segment_grid(blocks, B * HKV, plan.nseg)](
            q, k, v, s_in, o.buf, o.res, final, *plan.runtime(),
            H=H, HKV=HKV, S_IN_MODE=mode, STORE_FINAL=store_final, HALF=half, **plan.common(tiling),
        )
    return o.result(), final, states


def _backward(q, k, v, initial_state, states, do, dfinal, plan: _Plan, need_ds0: bool):
    B, T, H, D = q.shape
    HKV, F = plan.kv_heads, plan.features
    tiling = plan.backward
    nv = D // tiling.block_v
    dev = q.device
    do = do.contiguous()
    nq = plan.halves * nv
    nq_dq = nv if tiling.fuse else nq
    dq = _Partials(nq_dq, q.shape, q.dtype, dev, plan.half_launches and not tiling.fuse)
    # Keys j > T - 1 - lag never leave the window: the kernel writes no row for them.
    unread = min(plan.lag, T)
    dk = _Partials(nq, k.shape, k.dtype, dev, plan.half_launches, unread)
    dv = _Partials(plan.halves, v.shape, v.dtype, dev, plan.half_launches, unread)
    ds0 = torch.empty((B, HKV, F, D), device=dev, dtype=torch.float32) if need_ds0 else dk.buf
    s0 = initial_state.float().contiguous() if initial_state is not None else None
    dsf = dfinal.float().contiguous() if dfinal is not None else None

    if plan.nseg > 1:
        s_mode, s_in = 2, states
    else:
        s_mode, s_in = (1, s0) if s0 is not None else (0, dq.buf)
    if tiling.fuse:
        _dq_fused_kernel[segment_grid(nv, B * HKV, plan.nseg)](
            q, k, v, do, s_in, dq.buf, *plan.runtime(), H=H, HKV=HKV, S_IN_MODE=s_mode,
            **plan.common(tiling, halves=False),
        )
    else:
        for half, blocks in plan.launches(nv):
            _dq_kernel[segment_grid(blocks, B * HKV, plan.nseg)](
                q, k, v, do, s_in, dq.buf, dq.res, *plan.runtime(),
                H=H, HKV=HKV, S_IN_MODE=s_mode, HALF=half, **plan.common(tiling),
            )
    gstates = segment_adjoints(q, do, dsf, plan)
    if gstates is not None:
        g_mode, g_in = 2, gstates
    else:
        g_mode, g_in = (1, dsf) if dsf is not None else (0, dk.buf)
    for half, blocks in plan.launches(nv):
        _dkv_kernel[segment_grid(blocks, B * HKV, plan.nseg)](
            q, k, v, do, g_in, dk.buf, dv.buf, dk.res, dv.res, ds0, *plan.runtime(), plan.nseg,
            H=H, HKV=HKV, G_IN_MODE=g_mode, STORE_DS0=need_ds0, HALF=half, **plan.common(tiling),
        )
    return dq.result(), dk.result(), dv.result(), ds0 if need_ds0 else None


def _passes(plan: _Plan):
    """(forward, backward) of the plan's path: the segment kernels here or the chunk-parallel ones."""
    if plan.chunk_parallel:
        from .triton_chunk_parallel import backward, forward  # that module imports this one

        return forward, backward
    return _forward, _backward


class _ResidualLinearAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, initial_state, plan):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        o, final, states = _passes(plan)[0](q, k, v, initial_state, plan)
        ctx.plan = plan
        ctx.has_s0 = initial_state is not None
        ctx.save_for_backward(q, k, v, initial_state if initial_state is not None else None, states)
        return o, final

    @staticmethod
    def backward(ctx, do, dfinal):
        q, k, v, s0, states = ctx.saved_tensors
        need_ds0 = ctx.has_s0 and ctx.needs_input_grad[3]
        dq, dk, dv, ds0 = _passes(ctx.plan)[1](q, k, v, s0, states, do, dfinal, ctx.plan, need_ds0)
        if ds0 is not None:
            ds0 = ds0.to(s0.dtype)
        return dq, dk, dv, ds0, None


def residual_linear_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window_size: int,
    feature_map: str = "softmax",
    initial_state: torch.Tensor | None = None,
    *,
    chunk_size: int | None = None,
    block_v: int | None = None,
    state_every: int | None = None,
    num_warps: int | None = None,
    fuse_halves: bool | None = None,
    heads_per_tile: int | None = None,
    chunk_parallel: bool | None = None,
    half_launches: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked Triton RLA, differentiable in q, k, v and initial_state (and through final_state).

    chunk_size C (16-128; 32 on GPU), block_v BV (value columns per program), state_every m (chunks
    per stored state; None = DEFAULT_STATE_EVERY on CUDA and one segment elsewhere, 0 = one
    sequential segment, nothing stored), num_warps, fuse_halves (both feature halves in one forward
    / dq program), heads_per_tile (query heads of a group per tile), chunk_parallel (every chunk's
    state stored, outputs and gradients in parallel over chunks: triton_chunk_parallel.py),
    half_launches (one launch per feature half, the second summing the partials; HALF_LAUNCHES
    when None): tuning knobs, same result.
    None takes the defaults of ``_Plan``; a value given applies to the forward and the backward.
    """
    plan = _Plan(q, k, feature_map, window_size, chunk_size, block_v, state_every, num_warps, fuse_halves, heads_per_tile,
                 chunk_parallel, half_launches)
    _check_tiling(plan)
    return _ResidualLinearAttention.apply(q, k, v, initial_state, plan)


# ----------------------------------------------------------------------------------------------
# decode step
# ----------------------------------------------------------------------------------------------


@triton.jit
def _phi_vec(x, sign, FEATURE: tl.constexpr):
    """One half of the feature map on one float32 vector x [D]."""
    if FEATURE == 0:
        y = x * sign
        e = tl.exp(y - tl.max(y, 0))
        return e / tl.sum(e, 0)
    elif FEATURE == 1:
        return tl.maximum(x * sign, 0.0)
    else:
        return x


@triton.jit
def _decode_kernel(
    Q, S, S_OUT, KL, VL, LEAVE, O,
    B,
    H: tl.constexpr, HS: tl.constexpr, D: tl.constexpr, BV: tl.constexpr, NH: tl.constexpr,
    FEATURE: tl.constexpr, HAS_LEAVE: tl.constexpr, HAS_MASK: tl.constexpr,
):
    """One token: S <- S + phi(k_leaving) v_leaving^T, then o_h = phi(q_h)^T S for the query heads
    of the state head. One read and (when a token leaves) one write of each [D, BV] state block."""
    NV: tl.constexpr = D // BV
    F: tl.constexpr = NH * D
    GROUP: tl.constexpr = H // HS
    pid_fv, pid_bs = split_program_id(NH * NV)
    half = pid_fv // NV
    vb = pid_fv % NV
    b = pid_bs // HS
    hs = pid_bs % HS
    sign = 1.0 - 2.0 * half.to(tl.float32)
    offs_d = tl.arange(0, D)
    offs_v = vb * BV + tl.arange(0, BV)
    rows = (half * D + offs_d)[:, None] * D + offs_v[None, :]
    base = pid_bs.to(tl.int64) * F * D
    s = tl.load(S + base + rows)
    if HAS_LEAVE:
        k = tl.load(KL + pid_bs.to(tl.int64) * D + offs_d).to(tl.float32)
        v = tl.load(VL + pid_bs.to(tl.int64) * D + offs_v).to(tl.float32)
        kf = _phi_vec(k, sign, FEATURE)
        if HAS_MASK:
            kf = kf * tl.load(LEAVE + b).to(tl.float32)
        s = s + kf[:, None] * v[None, :]
        tl.store(S_OUT + base + rows, s)
    for g in range(GROUP):  # a loop, not unrolled: one head's tiles live at a time
        h = hs * GROUP + g
        q = tl.load(Q + (b * H + h).to(tl.int64) * D + offs_d).to(tl.float32)
        qf = _phi_vec(q, sign, FEATURE)
        o = tl.sum(qf[:, None] * s, 0)
        tl.store(O + ((half * B + b) * H + h).to(tl.int64) * D + offs_v, o.to(O.dtype.element_ty))


def residual_linear_attention_decode_triton(q, state, k_leaving, v_leaving, leaving_mask, feature_map, inplace):
    """Fused decode step; same function as ``reference.residual_linear_attention_decode_reference``.
    ``inplace`` updates ``state`` itself (a cache's own tensor) instead of returning a new one."""
    batch, heads, dim = q.shape
    state_heads = state.shape[1]
    halves = 1 if feature_map == "identity" else 2
    block_v = min(dim, 64)
    has_leave = k_leaving is not None
    if state.dtype != torch.float32 or not state.is_contiguous():
        state, inplace = state.float().contiguous(), True  # a fresh copy: safe to write
    out_state = state if (inplace or not has_leave) else torch.empty_like(state)
    o_buf = torch.empty((halves, batch, heads, dim), device=q.device, dtype=torch.float32 if halves > 1 else q.dtype)
    q = q.contiguous()
    kl = k_leaving.contiguous() if has_leave else q
    vl = v_leaving.contiguous() if has_leave else q
    mask = leaving_mask.contiguous() if leaving_mask is not None else q
    _decode_kernel[folded(halves * (dim // block_v), batch * state_heads)](
        q, state, out_state, kl, vl, mask, o_buf, batch,
        H=heads, HS=state_heads, D=dim, BV=block_v, NH=halves, FEATURE=FEATURE_IDS[feature_map],
        HAS_LEAVE=has_leave, HAS_MASK=leaving_mask is not None, num_warps=4,
    )
    o = o_buf.sum(0).to(q.dtype) if halves > 1 else o_buf[0]
    return o, out_state
