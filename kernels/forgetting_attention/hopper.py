"""Forgetting Attention forward through TMA tensor descriptors (Hopper, sm_90): an opt-in
experiment towards issue 21's warp-specialised kernels, not the default path.

The same function and outputs (o, and the log-sum-exp the backward reads) as
``triton._fwd_kernel``, whose design notes apply (log2 units, the per-block reference c_ref).
What differs:

* K, V and the cumulative log forget c reach shared memory through TMA tensor descriptors: the
  copy engine moves whole tiles, no per-thread address arithmetic or bounds masks (rows past a
  sequence's end are other sequences' keys, hidden by the mask; rows past the tensor are zeros).
  c is laid out one row per (head, sequence) so that every tile starts 16-byte aligned.
* One key loop with the causal mask applied on every tile, a straight-line body and no early
  return: the shape Triton 3.6's Hopper warp-specialisation pass (``tl.range(...,
  warp_specialize=True)``, 4 warps: a producer and two consumer warpgroups) accepts. A second loop
  for the diagonal, a branch in the body or an early return fail to compile or leave the loop
  unspecialised (checked with ``hf_hybrid.bench.sm90``-style compiles).
* The output is stored with a masked pointer store (a TMA store of a query block that runs past
  its sequence would overwrite the next sequence's rows).

Measured on an H100 (2026-11-25, docs/benchmarks_fox.md): the unspecialised configs are exact and
as fast as the portable kernel (10.53 vs 10.36 ms at B=4, T=16K, 16 heads x 128); every
warp-specialised config compiles but never finishes (a deadlock in Triton 3.6's generated
producer/consumer code, also at T=1024). So the autotuning table holds unspecialised configs only,
and the public op uses this kernel only with ``HF_HYBRID_FOX_HOPPER=1``;
``hf_hybrid.bench.fox_hopper_probe`` reruns every config, warp-specialised ones included, each in
its own process with a time limit.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .._backend import triton_interpreting
from .._triton_dot import dot

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)

try:  # Triton >= 3.3
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: no Hopper path
    TensorDescriptor = None


def _set_block_shapes(nargs):
    """Autotuning pre-hook: the descriptors' tile shapes follow the config being tried."""
    d = nargs["HEAD_DIM"]
    nargs["desc_q"].block_shape = [nargs["BLOCK_M"], d]
    nargs["desc_k"].block_shape = [nargs["BLOCK_N"], d]
    nargs["desc_v"].block_shape = [nargs["BLOCK_N"], d]
    nargs["desc_c"].block_shape = [1, nargs["BLOCK_N"]]


def _configs():
    if triton_interpreting():
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 16, "WARP_SPECIALIZE": False}, num_warps=4,
                              num_stages=1, pre_hook=_set_block_shapes)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "WARP_SPECIALIZE": ws}, num_warps=w, num_stages=s,
                          pre_hook=_set_block_shapes) for m, n, w, s, ws in TUNED_CONFIGS]


# (BLOCK_M, BLOCK_N, warps, stages, warp-specialised). Triton 3.6 specialises Hopper loops at 4
# warps only (8 warps compile unspecialised), and those configs deadlock (module docstring).
TUNED_CONFIGS = [(128, 64, 8, 3, False), (128, 128, 8, 2, False)]
WARP_SPECIALIZED_CONFIGS = [(128, 64, 4, 2, True), (128, 64, 4, 3, True), (128, 128, 4, 2, True), (128, 64, 4, 4, True)]


def _len_bucket(max_len: int) -> int:
    return max(int(max_len), 1).bit_length()


@triton.autotune(configs=_configs(), key=["HEAD_DIM", "GROUP", "len_bucket"])
@triton.jit
def _fwd_kernel(desc_q, desc_k, desc_v, desc_c, C, O, LSE, CU, scale2, len_bucket,
                stride_ot, stride_oh, stride_ch,
                GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    # Heaviest (last) query blocks first: better tail balance under the causal mask.
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    h = tl.program_id(1)
    seq = tl.program_id(2)
    seq_start = tl.load(CU + seq)
    seq_len = tl.load(CU + seq + 1) - seq_start
    start_m = pid_m * BLOCK_M
    # Blocks past a short sequence's end run an empty key range and store nothing (an early
    # return breaks Triton's warp-specialisation pass).
    live = start_m < seq_len
    kvh = h // GROUP
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    m_ok = offs_m < seq_len
    q = desc_q.load([seq_start + start_m, h * HEAD_DIM])
    C_ptr = C + h * stride_ch + seq_start.to(tl.int64)
    cq = tl.load(C_ptr + offs_m, mask=m_ok, other=0.0) * LOG2E
    c_ref = tl.load(C_ptr + start_m, mask=live, other=0.0) * LOG2E
    # Key j is visible to row i iff j <= min(i, seq_len - 1): one compare per score.
    last_key = tl.minimum(offs_m, seq_len - 1)
    col = kvh * HEAD_DIM
    c_row = h * tl.num_programs(2) + seq

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    hi = tl.where(live, tl.minimum(start_m + BLOCK_M, seq_len), 0)
    # One loop over every key tile with the mask always applied: Triton 3.6's Hopper
    # warp-specialisation pass takes a single loop with a straight-line body only (a second loop
    # for the diagonal, or a branch inside, fails to compile or leaves the loop unspecialised).
    # Every row sees key 0 in the first tile, so the running max is finite from there on.
    for start_n in tl.range(0, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k = desc_k.load([seq_start + start_n, col])
        ck = desc_c.load([c_row, start_n]).reshape([BLOCK_N])
        qk = dot(q, k.T, None, "tf32")
        # log2-unit score minus the row constant (c_i - c_ref), which the LSE adds back.
        s = qk * scale2 - (ck * LOG2E - c_ref)[None, :]
        s = tl.where(last_key[:, None] >= (start_n + offs_n)[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = desc_v.load([seq_start + start_n, col])
        acc = dot(p.to(v.dtype), v, acc, "tf32")
        m_i = m_new
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = m_i + tl.math.log2(l_safe) + (cq - c_ref)
    offs_d = tl.arange(0, HEAD_DIM)
    tok = seq_start.to(tl.int64) + offs_m
    tl.store(O + tok[:, None] * stride_ot + h * stride_oh + offs_d[None, :], out.to(O.dtype.element_ty),
             mask=m_ok[:, None])
    tl.store(LSE + h * stride_ch + tok, lse, mask=m_ok)


def hopper_forward_applies(q: torch.Tensor, window_size) -> bool:
    """Whether the forward takes this path: asked for (``HF_HYBRID_FOX_HOPPER=1``), causal (no
    window), 16-bit inputs on a Hopper GPU. Everything else keeps the portable kernel; so does the
    interpreter (CPU tests call :func:`forward` directly)."""
    if TensorDescriptor is None or window_size is not None or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    if triton_interpreting() or os.environ.get("HF_HYBRID_FOX_HOPPER", "0") != "1":
        return False
    return q.is_cuda and torch.cuda.get_device_capability(q.device)[0] == 9


def _descriptor(x: torch.Tensor) -> "TensorDescriptor":
    """A 2-D descriptor over [tokens, heads * head_dim]; one tile is [rows, head_dim] of one head
    (rows set per config by the pre-hook)."""
    total, heads, d = x.shape
    return TensorDescriptor(x, [total, heads * d], [heads * d, 1], [16, d])


def _c_descriptor(c_t: torch.Tensor, cu: torch.Tensor, max_len: int, dense: bool) -> "TensorDescriptor":
    """The cumulative log forget as rows of [heads * sequences, max_len] float32 (tile = one row,
    BLOCK_N keys). TMA needs 16-byte row strides and 16-byte aligned tile starts in the inner
    dimension, so each sequence gets its own row starting at key 0 (a tile starts at a multiple of
    BLOCK_N); a dense batch whose length is a multiple of 4 is a view, other inputs are copied."""
    heads, total = c_t.shape
    nseq = cu.numel() - 1
    padded = (max_len + 3) // 4 * 4
    if dense and padded == max_len:
        rows = c_t.view(heads * nseq, max_len)
    else:
        rows = c_t.new_zeros(heads, nseq, padded)
        if dense:
            rows[:, :, :max_len] = c_t.view(heads, nseq, max_len)
        else:
            lengths = cu[1:] - cu[:-1]
            seq_id = torch.repeat_interleave(torch.arange(nseq, device=cu.device), lengths, output_size=total)
            position = torch.arange(total, device=cu.device) - cu[seq_id]
            rows[:, seq_id, position] = c_t
        rows = rows.view(heads * nseq, padded)
    return TensorDescriptor(rows, [heads * nseq, max_len], [padded, 1], [1, 16])


def forward(q, k, v, c_t, cu, max_len, scale, dense: bool = False):
    """q [N_tok, HQ, D], k/v [N_tok, HKV, D] contiguous 16-bit, c_t [HQ, N_tok] float32
    -> (o [N_tok, HQ, D], lse [HQ, N_tok] float32), as ``triton._forward`` without a window.
    dense: every sequence has length max_len (cu = 0, T, 2T, ...), so c needs no re-layout."""
    total, hq, d = q.shape
    o = torch.empty_like(q)
    lse = torch.empty((hq, total), device=q.device, dtype=torch.float32)
    nseq = cu.numel() - 1

    def grid(meta):
        return (triton.cdiv(max_len, meta["BLOCK_M"]), hq, nseq)

    _fwd_kernel[grid](
        _descriptor(q), _descriptor(k), _descriptor(v), _c_descriptor(c_t, cu, max_len, dense), c_t, o, lse, cu,
        scale * 1.4426950408889634, _len_bucket(max_len), o.stride(0), o.stride(1), c_t.stride(0),
        GROUP=hq // k.shape[1], HEAD_DIM=d,
    )
    return o, lse
