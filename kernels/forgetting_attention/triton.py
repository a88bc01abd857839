"""Triton Forgetting Attention: FlashAttention-2 style forward and backward (FoX Appendix E).

Same function as ``reference.forgetting_attention_reference`` on the cumulative log forget c
(float32). Design notes (why the code looks the way it does):

* Everything works on the packed token axis: a dense batch [B, T] is B sequences of length T
  with cu_seqlens = [0, T, 2T, ...], so dense and varlen inputs share one code path.
* Scores live in log2 units (exp2 is the fast path): t_ij = log2(e) (scale q.k + c_i - c_j).
  c is large in magnitude deep into a sequence (it only decreases), so inside a tile we never add
  raw c values to q.k. The forward subtracts a per-block reference c_ref from the keys' c and
  folds the query part (c_i - c_ref) into the row's log-sum-exp, which keeps every float32 sum
  near the size of the score itself; the backward does the same around each key block.
* The stored log-sum-exp is that of the true logits t_ij, which are small for nearby keys.
* Gradient of c: dc_i = sum_j dS_ij (as a query, dQ kernel) - sum_j dS_ji (as a key, dK/dV
  kernel), no atomics. The row sums vanish in exact arithmetic (sum_j P_ij = 1 and
  sum_j P_ij dP_ij = rowsum(dO o O)), but they are kept: rowsum(dO o O) is computed from the
  rounded bf16 output, and the row sums cancel that rounding in d log f = reverse cumsum(dc)
  (dropping them left a 3e-2 relative error in bf16 against the float32 reference).
* Backward = dK/dV/dc kernel (one key block, loops over query blocks and over the query heads of
  its GQA group) + dQ kernel (one query block, loops over key blocks); no atomics, deterministic.
  On Hopper (unless deterministic algorithms are on), one Gluon kernel does both with dQ added by
  TMA reduce-add (hopper_backward.py).
* Key blocks are split into three phases per query block: window edge (masked), interior
  (no mask), diagonal (masked), so the hot loop carries no mask arithmetic.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._backend import triton_interpreting
from ...options import get as option
from .._grid import folded, split_program_id
from ..._compat.triton_launch import launch_cached
from .._triton_dot import dot as _mm
from .hopper import forward as hopper_forward
from .hopper import hopper_forward_applies
from .hopper_backward import backward as hopper_backward
from .hopper_backward import hopper_backward_applies
from .reference import row_boundaries

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


# (BLOCK_M, BLOCK_N, warps, stages); forward and dQ need BLOCK_M % BLOCK_N == 0, dK/dV needs
# BLOCK_N % BLOCK_M == 0 (diagonal blocks line up with the other side). Float32 accumulators of
# 128 x 128 tiles need 8 warps to stay in registers. Forward: the four fastest of a 30-config sweep
# at T = 4K and 64K (python -m hf_hybrid.bench.forgetting_attention --sweep-forward). The autotuner
# (HF_HYBRID_AUTOTUNE=1) times these; by default each launch takes the tile of ``portable_tile``.
CANDIDATES = {
    "fwd": [(128, 64, 8, 3), (128, 32, 4, 3), (128, 32, 4, 4), (128, 128, 8, 3)],
    "dkdv": [(32, 128, 8, 3), (64, 128, 8, 2), (32, 64, 4, 3), (64, 64, 4, 3)],
    "dq": [(128, 64, 8, 3), (128, 32, 8, 3), (64, 64, 4, 3), (128, 64, 8, 2)],
}
# Tiny blocks under the interpreter so CPU tests cover several blocks, the diagonal and ragged ends
# at T <= 40.
INTERPRETER_TILES = {"fwd": (32, 16, 4, 1), "dkdv": (16, 32, 4, 1), "dq": (32, 16, 4, 1)}
# float32 inputs (tests) and head_dim 256 get one small tile that fits shared memory.
FLOAT32_TILE = (32, 32, 4, 2)
HEAD_DIM_256_TILE = (64, 64, 4, 2)
# The forward's tile by length: 4 warps x 32-key tiles win the sweep at 4K, 8 warps x 64 at 64K;
# lengths up to SHORT_FORWARD_MAX_LEN take the short tile.
SHORT_FORWARD_TILE, LONG_FORWARD_TILE = (128, 32, 4, 3), (128, 64, 8, 3)
SHORT_FORWARD_MAX_LEN = 8192


def _config(tile) -> triton.Config:
    m, n, w, s = tile
    return triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)


def _configs(kind: str):
    if triton_interpreting():
        return [_config(INTERPRETER_TILES[kind])]
    return [_config(tile) for tile in CANDIDATES[kind]]


def portable_tile(kind: str, max_len: int, head_dim: int, dtype: torch.dtype) -> triton.Config:
    """The tile a portable kernel (``kind``: "fwd", "dkdv" or "dq") launches with when it is not
    autotuned: one compiled variant per kernel at a first use instead of four compiled and timed.
    The forward's by length (the sweep's winners at 4K and 64K); dK/dV's and dQ's the first of
    their candidates; float32 and head_dim 256 the one tile the autotuner keeps for them."""
    if triton_interpreting():
        return _config(INTERPRETER_TILES[kind])
    if dtype == torch.float32:
        return _config(FLOAT32_TILE)
    if head_dim == 256:
        return _config(HEAD_DIM_256_TILE)
    if kind == "fwd":
        return _config(SHORT_FORWARD_TILE if max_len <= SHORT_FORWARD_MAX_LEN else LONG_FORWARD_TILE)
    return _config(CANDIDATES[kind][0])


def _prune(configs, named_args, **kwargs):
    """float32 inputs (tests) and head_dim 256 get one small config that fits shared memory;
    tuning them would only cost compile time."""
    if triton_interpreting():
        return configs
    if named_args["Q"].dtype == torch.float32:
        return [_config(FLOAT32_TILE)]
    if kwargs.get("HEAD_DIM", named_args.get("HEAD_DIM")) == 256:
        return [_config(HEAD_DIM_256_TILE)]
    return configs


_PRUNE = {"early_config_prune": _prune}
# The best tiles depend on the sequence length (4 warps x 32-key tiles win at 4K, 8 warps x 64 at
# 64K), so the autotuner tunes each power-of-two length bucket once.
_TUNE_KEY = ["HEAD_DIM", "GROUP", "HAS_WINDOW", "GATED", "len_bucket"]


def _len_bucket(max_len: int) -> int:
    return max(int(max_len), 1).bit_length()


_CACHED_LAUNCH: dict = {}  # autotuned kernel -> its JIT function through launch_cached


def _launch(kernel, kind: str, config: triton.Config | None, max_len: int, q: torch.Tensor):
    """``kernel`` (an autotuned kernel) and the launch options of one call: ``config`` when given (a
    test of one variant), else the autotuner under HF_HYBRID_AUTOTUNE=1, else ``portable_tile``'s.
    A fixed tile launches through ``launch_cached`` (no Triton per-call Python; these kernels are on
    the window layers' training path), given a grid tuple (:func:`_grid`)."""
    if config is None:
        if option("HF_HYBRID_AUTOTUNE"):
            return kernel, {}
        config = portable_tile(kind, max_len, q.shape[-1], q.dtype)
    if kernel not in _CACHED_LAUNCH:
        _CACHED_LAUNCH[kernel] = launch_cached(kernel.fn)
    return _CACHED_LAUNCH[kernel], dict(config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages)


def _grid(grid, extra: dict):
    """The launch grid: a tuple for a fixed tile (``extra`` holds its block sizes; the cached
    launcher takes tuples only), the function of the tile for the autotuner."""
    return grid(extra) if extra else grid


# ----------------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------------
@triton.jit
def _fwd_tiles(acc, l_i, m_i, q, offs_m, K_ptr, V_ptr, C_ptr, c_ref, stride_kt, stride_vt,
               lo, hi, seq_len, window, scale2,
               HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr,
               HAS_WINDOW: tl.constexpr, GATED: tl.constexpr, DOT_PREC: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in range(lo, hi, BLOCK_N):
        kn = start_n + offs_n
        if MASK:
            k_ok = kn < seq_len
            k = tl.load(K_ptr + kn.to(tl.int64)[:, None] * stride_kt + offs_d[None, :], mask=k_ok[:, None], other=0.0)
        else:
            k = tl.load(K_ptr + kn.to(tl.int64)[:, None] * stride_kt + offs_d[None, :])
        qk = _mm(q, tl.trans(k), None, DOT_PREC)
        s = qk * scale2
        if GATED:
            # log2-unit score minus the row constant (c_i - c_ref), which the LSE adds back.
            if MASK:
                ck = tl.load(C_ptr + kn, mask=k_ok, other=0.0) * LOG2E
            else:
                ck = tl.load(C_ptr + kn) * LOG2E
            s = s - (ck - c_ref)[None, :]
        if MASK:
            visible = (offs_m[:, None] >= kn[None, :]) & (kn[None, :] < seq_len)
            if HAS_WINDOW:
                visible = visible & (offs_m[:, None] - kn[None, :] < window)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = m_new
        if MASK:
            # A row that has seen nothing yet keeps m = -inf; exponentiate against 0 meanwhile.
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if MASK:
            v = tl.load(V_ptr + kn.to(tl.int64)[:, None] * stride_vt + offs_d[None, :], mask=k_ok[:, None], other=0.0)
        else:
            v = tl.load(V_ptr + kn.to(tl.int64)[:, None] * stride_vt + offs_d[None, :])
        acc = _mm(p.to(v.dtype), v, acc, DOT_PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.autotune(configs=_configs("fwd"), key=_TUNE_KEY, prune_configs_by=_PRUNE)
@triton.jit(do_not_specialize=["max_len"])  # only sizes the grid's blocks: no recompile per length class
def _fwd_kernel(Q, K, V, C, O, LSE, CU, scale2, window, len_bucket, max_len,
                stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                stride_ot, stride_oh, stride_ch,
                GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_WINDOW: tl.constexpr, GATED: tl.constexpr,
                DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # Heaviest (last) query blocks first: better tail balance under the causal mask.
    block, seq = split_program_id(tl.cdiv(max_len, BLOCK_M))
    pid_m = tl.cdiv(max_len, BLOCK_M) - 1 - block
    h = tl.program_id(1)
    seq_start = tl.load(CU + seq)
    seq_len = tl.load(CU + seq + 1) - seq_start
    start_m = pid_m * BLOCK_M
    if start_m >= seq_len:
        return
    kvh = h // GROUP
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    m_ok = offs_m < seq_len
    tok0 = seq_start.to(tl.int64)
    q = tl.load(Q + (tok0 + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=m_ok[:, None], other=0.0)
    C_ptr = C + h * stride_ch + tok0
    cq = tl.zeros([BLOCK_M], tl.float32)
    c_ref = 0.0
    if GATED:
        cq = tl.load(C_ptr + offs_m, mask=m_ok, other=0.0) * LOG2E
        c_ref = tl.load(C_ptr + start_m) * LOG2E
    K_ptr = K + tok0 * stride_kt + kvh * stride_kh
    V_ptr = V + tok0 * stride_vt + kvh * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    diag_hi = tl.minimum(start_m + BLOCK_M, seq_len)
    lo = 0
    inner_lo = 0
    if HAS_WINDOW:
        # Keys below start_m + BLOCK_M - window are invisible to some query in this block.
        first = tl.maximum(start_m - window + 1, 0)
        lo = (first // BLOCK_N) * BLOCK_N
        edge = tl.maximum(start_m + BLOCK_M - window, 0)
        inner_lo = tl.minimum(tl.maximum(((edge + BLOCK_N - 1) // BLOCK_N) * BLOCK_N, lo), start_m)
        acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, offs_m, K_ptr, V_ptr, C_ptr, c_ref, stride_kt, stride_vt,
                                   lo, inner_lo, seq_len, window, scale2,
                                   HEAD_DIM, BLOCK_N, True, HAS_WINDOW, GATED, DOT_PREC)
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, offs_m, K_ptr, V_ptr, C_ptr, c_ref, stride_kt, stride_vt,
                               inner_lo, start_m, seq_len, window, scale2,
                               HEAD_DIM, BLOCK_N, False, HAS_WINDOW, GATED, DOT_PREC)
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, offs_m, K_ptr, V_ptr, C_ptr, c_ref, stride_kt, stride_vt,
                               start_m, diag_hi, seq_len, window, scale2,
                               HEAD_DIM, BLOCK_N, True, HAS_WINDOW, GATED, DOT_PREC)
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = m_i + tl.math.log2(l_safe) + (cq - c_ref)
    tl.store(O + (tok0 + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=m_ok[:, None])
    tl.store(LSE + h * stride_ch + tok0 + offs_m, lse, mask=m_ok)


# ----------------------------------------------------------------------------------------------
# backward
# ----------------------------------------------------------------------------------------------
@launch_cached
@triton.jit
def _delta_kernel(O, DO, DELTA, total, stride_ot, stride_oh, stride_dt, stride_dh, stride_ch,
                  HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    """DELTA[h, t] = sum_d O[t, h, d] dO[t, h, d] (float32)."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    h = tl.program_id(1)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = rows < total
    r64 = rows.to(tl.int64)
    o = tl.load(O + r64[:, None] * stride_ot + h * stride_oh + offs_d[None, :], mask=ok[:, None], other=0.0)
    do = tl.load(DO + r64[:, None] * stride_dt + h * stride_dh + offs_d[None, :], mask=ok[:, None], other=0.0)
    tl.store(DELTA + h * stride_ch + r64, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=ok)


@triton.jit
def _dkdv_tiles(dk, dv, dc, k, v, kn, kb, Q_ptr, DO_ptr, C_ptr, LSE_ptr, DELTA_ptr, c_ref,
                stride_qt, stride_dot, lo, hi, seq_len, window, scale2,
                HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, MASK: tl.constexpr,
                HAS_WINDOW: tl.constexpr, GATED: tl.constexpr, DOT_PREC: tl.constexpr):
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    for start_m in range(lo, hi, BLOCK_M):
        qm = start_m + offs_m
        if MASK:
            q_ok = qm < seq_len
            q = tl.load(Q_ptr + qm.to(tl.int64)[:, None] * stride_qt + offs_d[None, :], mask=q_ok[:, None], other=0.0)
            do = tl.load(DO_ptr + qm.to(tl.int64)[:, None] * stride_dot + offs_d[None, :], mask=q_ok[:, None], other=0.0)
            lse = tl.load(LSE_ptr + qm, mask=q_ok, other=float("inf"))  # P = 0 past the end
            delta = tl.load(DELTA_ptr + qm, mask=q_ok, other=0.0)
        else:
            q = tl.load(Q_ptr + qm.to(tl.int64)[:, None] * stride_qt + offs_d[None, :])
            do = tl.load(DO_ptr + qm.to(tl.int64)[:, None] * stride_dot + offs_d[None, :])
            lse = tl.load(LSE_ptr + qm)
            delta = tl.load(DELTA_ptr + qm)
        row = -lse
        if GATED:
            if MASK:
                cq = tl.load(C_ptr + qm, mask=q_ok, other=0.0) * LOG2E
            else:
                cq = tl.load(C_ptr + qm) * LOG2E
            row = cq - c_ref - lse
        # Transposed tile [BLOCK_N keys, BLOCK_M queries].
        qk_t = _mm(k, tl.trans(q), None, DOT_PREC)
        p_t = tl.math.exp2(qk_t * scale2 - kb[:, None] + row[None, :])
        if MASK:
            visible = (qm[None, :] >= kn[:, None]) & (qm[None, :] < seq_len)
            if HAS_WINDOW:
                visible = visible & (qm[None, :] - kn[:, None] < window)
            p_t = tl.where(visible, p_t, 0.0)
        dv = _mm(p_t.to(do.dtype), do, dv, DOT_PREC)
        dp_t = _mm(v, tl.trans(do), None, DOT_PREC)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = _mm(ds_t.to(q.dtype), q, dk, DOT_PREC)
        if GATED:
            dc += tl.sum(ds_t, 1)
    return dk, dv, dc


@triton.autotune(configs=_configs("dkdv"), key=_TUNE_KEY, prune_configs_by=_PRUNE)
@triton.jit(do_not_specialize=["max_len"])  # only sizes the grid's blocks: no recompile per length class
def _dkdv_kernel(Q, K, V, C, LSE, DELTA, DO, DK, DV, DC, CU, scale, scale2, window, len_bucket, max_len,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                 stride_dot, stride_doh, stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_ch,
                 GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_WINDOW: tl.constexpr, GATED: tl.constexpr,
                 DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # BLOCK_N keys per program; the loop walks BLOCK_M queries at a time.
    block, seq = split_program_id(tl.cdiv(max_len, BLOCK_N))
    pid_n = tl.cdiv(max_len, BLOCK_N) - 1 - block
    kvh = tl.program_id(1)
    seq_start = tl.load(CU + seq)
    seq_len = tl.load(CU + seq + 1) - seq_start
    start_n = pid_n * BLOCK_N
    if start_n >= seq_len:
        return
    tok0 = seq_start.to(tl.int64)
    kn = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    k_ok = kn < seq_len
    k = tl.load(K + (tok0 + kn)[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :], mask=k_ok[:, None], other=0.0)
    v = tl.load(V + (tok0 + kn)[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :], mask=k_ok[:, None], other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)

    # Query ranges: diagonal [start_n, start_n + BLOCK_N) masked; interior unmasked; then the
    # ragged end / window edge masked.
    q_hi = seq_len
    if HAS_WINDOW:
        q_hi = tl.minimum(seq_len, start_n + BLOCK_N - 1 + window)
    diag_hi = tl.minimum(start_n + BLOCK_N, q_hi)
    inner_hi = (seq_len // BLOCK_M) * BLOCK_M
    if HAS_WINDOW:
        last_full = tl.maximum(start_n + window - BLOCK_M, -BLOCK_M) + BLOCK_M
        inner_hi = tl.minimum(inner_hi, (last_full // BLOCK_M) * BLOCK_M)
    inner_hi = tl.maximum(inner_hi, start_n + BLOCK_N)

    for g in range(GROUP):
        h = kvh * GROUP + g
        C_ptr = C + h * stride_ch + tok0
        kb = tl.zeros([BLOCK_N], tl.float32)
        c_ref = 0.0
        if GATED:
            ck = tl.load(C_ptr + kn, mask=k_ok, other=0.0) * LOG2E
            c_ref = tl.load(C_ptr + start_n) * LOG2E
            kb = ck - c_ref
        dc = tl.zeros([BLOCK_N], tl.float32)
        Q_ptr = Q + tok0 * stride_qt + h * stride_qh
        DO_ptr = DO + tok0 * stride_dot + h * stride_doh
        LSE_ptr = LSE + h * stride_ch + tok0
        DELTA_ptr = DELTA + h * stride_ch + tok0
        dk, dv, dc = _dkdv_tiles(dk, dv, dc, k, v, kn, kb, Q_ptr, DO_ptr, C_ptr, LSE_ptr, DELTA_ptr, c_ref,
                                 stride_qt, stride_dot, start_n, diag_hi, seq_len, window, scale2,
                                 HEAD_DIM, BLOCK_M, True, HAS_WINDOW, GATED, DOT_PREC)
        dk, dv, dc = _dkdv_tiles(dk, dv, dc, k, v, kn, kb, Q_ptr, DO_ptr, C_ptr, LSE_ptr, DELTA_ptr, c_ref,
                                 stride_qt, stride_dot, start_n + BLOCK_N, inner_hi, seq_len, window, scale2,
                                 HEAD_DIM, BLOCK_M, False, HAS_WINDOW, GATED, DOT_PREC)
        dk, dv, dc = _dkdv_tiles(dk, dv, dc, k, v, kn, kb, Q_ptr, DO_ptr, C_ptr, LSE_ptr, DELTA_ptr, c_ref,
                                 stride_qt, stride_dot, inner_hi, q_hi, seq_len, window, scale2,
                                 HEAD_DIM, BLOCK_M, True, HAS_WINDOW, GATED, DOT_PREC)
        if GATED:
            tl.store(DC + h * stride_ch + tok0 + kn, -dc, mask=k_ok)
    tl.store(DK + (tok0 + kn)[:, None] * stride_dkt + kvh * stride_dkh + offs_d[None, :],
             (dk * scale).to(DK.dtype.element_ty), mask=k_ok[:, None])
    tl.store(DV + (tok0 + kn)[:, None] * stride_dvt + kvh * stride_dvh + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=k_ok[:, None])


@triton.jit
def _dq_tiles(dq, dcq, q, do, row, delta, offs_m, K_ptr, V_ptr, C_ptr, c_ref, stride_kt, stride_vt,
              lo, hi, seq_len, window, scale2,
              HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr,
              HAS_WINDOW: tl.constexpr, GATED: tl.constexpr, DOT_PREC: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in range(lo, hi, BLOCK_N):
        kn = start_n + offs_n
        if MASK:
            k_ok = kn < seq_len
            k = tl.load(K_ptr + kn.to(tl.int64)[:, None] * stride_kt + offs_d[None, :], mask=k_ok[:, None], other=0.0)
            v = tl.load(V_ptr + kn.to(tl.int64)[:, None] * stride_vt + offs_d[None, :], mask=k_ok[:, None], other=0.0)
        else:
            k = tl.load(K_ptr + kn.to(tl.int64)[:, None] * stride_kt + offs_d[None, :])
            v = tl.load(V_ptr + kn.to(tl.int64)[:, None] * stride_vt + offs_d[None, :])
        qk = _mm(q, tl.trans(k), None, DOT_PREC)
        if GATED:
            if MASK:
                ck = tl.load(C_ptr + kn, mask=k_ok, other=0.0) * LOG2E
            else:
                ck = tl.load(C_ptr + kn) * LOG2E
            p = tl.math.exp2(qk * scale2 + row[:, None] - (ck - c_ref)[None, :])
        else:
            p = tl.math.exp2(qk * scale2 + row[:, None])
        if MASK:
            visible = (offs_m[:, None] >= kn[None, :]) & (kn[None, :] < seq_len)
            if HAS_WINDOW:
                visible = visible & (offs_m[:, None] - kn[None, :] < window)
            p = tl.where(visible, p, 0.0)
        dp = _mm(do, tl.trans(v), None, DOT_PREC)
        ds = p * (dp - delta[:, None])
        dq = _mm(ds.to(k.dtype), k, dq, DOT_PREC)
        if GATED:
            dcq += tl.sum(ds, 1)
    return dq, dcq


@triton.autotune(configs=_configs("dq"), key=_TUNE_KEY, prune_configs_by=_PRUNE)
@triton.jit(do_not_specialize=["max_len"])  # only sizes the grid's blocks: no recompile per length class
def _dq_kernel(Q, K, V, C, LSE, DELTA, DO, DQ, DCQ, CU, scale, scale2, window, len_bucket, max_len,
               stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
               stride_dot, stride_doh, stride_dqt, stride_dqh, stride_ch,
               GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_WINDOW: tl.constexpr, GATED: tl.constexpr,
               DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    block, seq = split_program_id(tl.cdiv(max_len, BLOCK_M))
    pid_m = tl.cdiv(max_len, BLOCK_M) - 1 - block
    h = tl.program_id(1)
    seq_start = tl.load(CU + seq)
    seq_len = tl.load(CU + seq + 1) - seq_start
    start_m = pid_m * BLOCK_M
    if start_m >= seq_len:
        return
    kvh = h // GROUP
    tok0 = seq_start.to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    m_ok = offs_m < seq_len
    q = tl.load(Q + (tok0 + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=m_ok[:, None], other=0.0)
    do = tl.load(DO + (tok0 + offs_m)[:, None] * stride_dot + h * stride_doh + offs_d[None, :], mask=m_ok[:, None], other=0.0)
    C_ptr = C + h * stride_ch + tok0
    lse = tl.load(LSE + h * stride_ch + tok0 + offs_m, mask=m_ok, other=float("inf"))
    delta = tl.load(DELTA + h * stride_ch + tok0 + offs_m, mask=m_ok, other=0.0)
    c_ref = 0.0
    row = -lse
    if GATED:
        cq = tl.load(C_ptr + offs_m, mask=m_ok, other=0.0) * LOG2E
        c_ref = tl.load(C_ptr + start_m) * LOG2E
        row = cq - c_ref - lse
    K_ptr = K + tok0 * stride_kt + kvh * stride_kh
    V_ptr = V + tok0 * stride_vt + kvh * stride_vh
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    dcq = tl.zeros([BLOCK_M], tl.float32)

    diag_hi = tl.minimum(start_m + BLOCK_M, seq_len)
    inner_lo = 0
    if HAS_WINDOW:
        first = tl.maximum(start_m - window + 1, 0)
        lo = (first // BLOCK_N) * BLOCK_N
        edge = tl.maximum(start_m + BLOCK_M - window, 0)
        inner_lo = tl.minimum(tl.maximum(((edge + BLOCK_N - 1) // BLOCK_N) * BLOCK_N, lo), start_m)
        dq, dcq = _dq_tiles(dq, dcq, q, do, row, delta, offs_m, K_ptr, V_ptr, C_ptr, c_ref, stride_kt, stride_vt,
                       lo, inner_lo, seq_len, window, scale2, HEAD_DIM, BLOCK_N, True, HAS_WINDOW, GATED, DOT_PREC)
    dq, dcq = _dq_tiles(dq, dcq, q, do, row, delta, offs_m, K_ptr, V_ptr, C_ptr, c_ref, stride_kt, stride_vt,
                   inner_lo, start_m, seq_len, window, scale2, HEAD_DIM, BLOCK_N, False, HAS_WINDOW, GATED, DOT_PREC)
    dq, dcq = _dq_tiles(dq, dcq, q, do, row, delta, offs_m, K_ptr, V_ptr, C_ptr, c_ref, stride_kt, stride_vt,
                   start_m, diag_hi, seq_len, window, scale2, HEAD_DIM, BLOCK_N, True, HAS_WINDOW, GATED, DOT_PREC)
    if GATED:
        tl.store(DCQ + h * stride_ch + tok0 + offs_m, dcq, mask=m_ok)
    tl.store(DQ + (tok0 + offs_m)[:, None] * stride_dqt + h * stride_dqh + offs_d[None, :],
             (dq * scale).to(DQ.dtype.element_ty), mask=m_ok[:, None])


# ----------------------------------------------------------------------------------------------
# host side
# ----------------------------------------------------------------------------------------------
def _dot_precision(dtype: torch.dtype) -> str:
    # float32 inputs get exact float32 products (tests); bf16/fp16 ignore the setting.
    return "ieee" if dtype == torch.float32 else "tf32"


def blocks_grid(max_len: int, block: int, sequences: int, heads: int) -> tuple[int, int]:
    """(sequence x block of ``block`` tokens, head): the blocks fastest, with the sequences on
    grid axis 0 (a packed batch may hold more than axis 2's 65,535); heads on axis 1."""
    return folded(triton.cdiv(max_len, block), sequences, heads)


def delta_grid(total: int, block: int, heads: int) -> tuple[int, int]:
    """(blocks of ``block`` tokens, head)."""
    return triton.cdiv(total, block), heads


def _forward(q, k, v, c_t, cu, max_len, scale, window, config: triton.Config | None = None):
    """q [N_tok, HQ, D], k/v [N_tok, HKV, D], c_t [HQ, N_tok] float32 -> (o, lse [HQ, N_tok]).
    ``c_t`` None: no forget gate (plain softmax attention; the kernels drop the bias at compile time).
    Causal gated 16-bit inputs on a Hopper GPU take the warp-specialised Gluon kernel (hopper.py).
    ``config`` bypasses it and the autotuner (tests of one specific variant of this portable kernel)."""
    if config is None and c_t is not None and hopper_forward_applies(q, window):
        return hopper_forward(q, k, v, c_t, cu, max_len, scale)
    total, hq, d = q.shape
    o = torch.empty_like(q)
    lse = torch.empty((hq, total), device=q.device, dtype=torch.float32)
    nseq = cu.numel() - 1
    gated = c_t is not None
    c_t = c_t if gated else lse  # never read without the gate; lse has c_t's shape and strides

    def grid(meta):
        return blocks_grid(max_len, meta["BLOCK_M"], nseq, hq)

    kernel, extra = _launch(_fwd_kernel, "fwd", config, max_len, q)
    kernel[_grid(grid, extra)](
        q, k, v, c_t, o, lse, cu, scale * 1.4426950408889634, window or 0, _len_bucket(max_len), max_len,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        o.stride(0), o.stride(1), c_t.stride(0),
        GROUP=hq // k.shape[1], HEAD_DIM=d, HAS_WINDOW=window is not None, GATED=gated,
        DOT_PREC=_dot_precision(q.dtype), **extra,
    )
    return o, lse


def _backward(do, q, k, v, c_t, o, lse, cu, max_len, scale, window):
    total, hq, d = q.shape
    hkv = k.shape[1]
    nseq = cu.numel() - 1
    delta = torch.empty_like(lse)
    block = 64 if not triton_interpreting() else 16
    _delta_kernel[delta_grid(total, block, hq)](
        o, do, delta, total, o.stride(0), o.stride(1), do.stride(0), do.stride(1), delta.stride(0),
        HEAD_DIM=d, BLOCK=block,
    )
    gated = c_t is not None
    if gated and hopper_backward_applies(q, window):
        return hopper_backward(do, q, k, v, c_t, o, lse, delta, cu, max_len, scale)
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    # Without the gate C, DC and DCQ are never touched: lse stands in for their pointers.
    c_t = c_t if gated else lse
    dc = torch.empty_like(c_t) if gated else lse
    dcq = torch.empty_like(c_t) if gated else lse
    common = dict(GROUP=hq // hkv, HEAD_DIM=d, HAS_WINDOW=window is not None, GATED=gated,
                  DOT_PREC=_dot_precision(q.dtype))
    scale2 = scale * 1.4426950408889634

    def grid_kv(meta):
        return blocks_grid(max_len, meta["BLOCK_N"], nseq, hkv)

    kernel, extra = _launch(_dkdv_kernel, "dkdv", None, max_len, q)
    kernel[_grid(grid_kv, extra)](
        q, k, v, c_t, lse, delta, do, dk, dv, dc, cu, scale, scale2, window or 0, _len_bucket(max_len), max_len,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        do.stride(0), do.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), c_t.stride(0),
        **common, **extra,
    )

    def grid_q(meta):
        return blocks_grid(max_len, meta["BLOCK_M"], nseq, hq)

    kernel, extra = _launch(_dq_kernel, "dq", None, max_len, q)
    kernel[_grid(grid_q, extra)](
        q, k, v, c_t, lse, delta, do, dq, dcq, cu, scale, scale2, window or 0, _len_bucket(max_len), max_len,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        do.stride(0), do.stride(1), dq.stride(0), dq.stride(1), c_t.stride(0),
        **common, **extra,
    )
    return dq, dk, dv, (dc + dcq if gated else None)


class _ForgettingAttention(torch.autograd.Function):
    """Autograd over (q, k, v, c_t); c_t is the cumulative log forget [HQ, B*T] in float32."""

    @staticmethod
    def forward(ctx, q, k, v, c_t, scale, window, cu, max_len):
        b, t, hq, d = q.shape
        hkv = k.shape[2]
        q2 = q.reshape(b * t, hq, d)
        k2 = k.reshape(b * t, hkv, d)
        v2 = v.reshape(b * t, hkv, d)
        o, lse = _forward(q2, k2, v2, c_t, cu, max_len, scale, window)
        ctx.save_for_backward(q2, k2, v2, c_t, o, lse, cu)
        ctx.meta = (b, t, scale, window, max_len)
        return o.view(b, t, hq, d)

    @staticmethod
    def backward(ctx, do):
        q2, k2, v2, c_t, o, lse, cu = ctx.saved_tensors
        b, t, scale, window, max_len = ctx.meta
        do2 = do.reshape(q2.shape).contiguous()
        dq, dk, dv, dc = _backward(do2, q2, k2, v2, c_t, o, lse, cu, max_len, scale, window)
        hq, hkv, d = q2.shape[1], k2.shape[1], q2.shape[2]
        return (dq.view(b, t, hq, d), dk.view(b, t, hkv, d), dv.view(b, t, hkv, d),
                dc, None, None, None, None)


def forgetting_attention_triton(q, k, v, c_by_head, scale, window_size=None, cu_seqlens=None):
    """q [B,T,HQ,D], k/v [B,T,HKV,D] (contiguous), c_by_head [HQ, B*T] float32 cumulative log
    forget (``reference.cumulative_log_forget_by_head``).

    Dense batches become B packed sequences of length T; with cu_seqlens (B == 1) the given
    boundaries are used. Differentiable in q, k, v and c_by_head.
    """
    b, t = q.shape[:2]
    if cu_seqlens is None:
        cu = row_boundaries(b, t, q.device)
        max_len = t
    else:
        cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
        max_len = int((cu[1:] - cu[:-1]).max().item()) if cu.numel() > 1 else 0
    return _ForgettingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), c_by_head.contiguous(),
                                      scale, window_size, cu, max_len)
