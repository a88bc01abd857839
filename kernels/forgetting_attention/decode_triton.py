"""Split-K ("flash-decoding") Triton kernel for one Forgetting Attention query per row.

The math is :func:`.decode.forgetting_attention_decode_reference`: the query sits at key position
n - 1 (n = ``length``, a device tensor, so a CUDA graph replays the same launch at every step) and

    o = sum_j softmax_j(scale q . k_j + c_q - c_k[j]) v_j    over j < n (and key_mask, and the window).

A decode step is bound by reading the cache once; the keys are cut into splits so that small
batches at long context fill the GPU (kernels/_split_decode.py: the two passes and their merge).
Scores and the bias c_q - c_k stay in float32 whatever the inputs' dtype (no rounded bias).
Without c_q / c_k (``GATED=False``) the bias is compiled out: plain softmax attention's decode step
(kernels/window_attention). Forward only: decoding needs no gradients.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._split_decode import combine, empty_state, online_update, plan_splits, store_partial
from .triton import LOG2E  # a constexpr: the kernel may read it

# 128 keys x 4 warps, the key loop software-pipelined over 2 stages (the next tile's loads issued
# before this tile's math), 16 programs per SM: the fastest tile summed over B=8 / 16K, B=32 / 2K and
# the largest batch's B=160 / 4K in `python -m benchmarks.split_decode_sweep`, 93-96% of the copy
# bandwidth there (docs/benchmarks/fox.md). The prefetched tile lives in registers and spills a few
# hundred bytes, which the sweep's timing includes.
BLOCK_N, WARPS, STAGES = 128, 4, 2


@triton.jit
def _partial_kernel(
    Q, K, V, CQ, CK, LEN, MASK, M_OUT, L_OUT, ACC_OUT, O,
    sqb, sqh, skb, skt, skh, svb, svt, svh, scqb, scqh, sckb, sckt, sckh, smb, smt, slb, sob, soh,
    H, GROUP, T, split_len, window, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, HAS_MASK: tl.constexpr, HAS_WINDOW: tl.constexpr, DIRECT: tl.constexpr,
    STAGES: tl.constexpr, GATED: tl.constexpr,
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    b = (pid // H).to(tl.int64)
    h = (pid % H).to(tl.int64)
    kvh = h // GROUP
    dims = tl.arange(0, HEAD_DIM)
    n = tl.minimum(tl.load(LEN + b * slb).to(tl.int32), T)
    lo = split * split_len
    hi = tl.minimum(lo + split_len, n)
    if HAS_WINDOW:  # the query at n - 1 sees j iff n - 1 - j < window
        lo = tl.maximum(lo, n - window)
    q = tl.load(Q + b * sqb + h * sqh + dims).to(tl.float32)
    c_q = 0.0
    if GATED:
        c_q = tl.load(CQ + b * scqb + h * scqh).to(tl.float32)
    k_base = K + b * skb + kvh * skh
    v_base = V + b * svb + kvh * svh
    m_i, l_i, acc = empty_state(HEAD_DIM)
    for start in tl.range(lo, hi, BLOCK, num_stages=STAGES):
        offs = start + tl.arange(0, BLOCK)
        ok = offs < hi
        if HAS_MASK:
            ok = ok & (tl.load(MASK + b * smb + offs.to(tl.int64) * smt, mask=ok, other=0) != 0)
        k = tl.load(k_base + offs.to(tl.int64)[:, None] * skt + dims[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        v = tl.load(v_base + offs.to(tl.int64)[:, None] * svt + dims[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        s = tl.sum(k * q[None, :], 1) * qk_scale
        if GATED:
            c_k = tl.load(CK + b * sckb + offs.to(tl.int64) * sckt + h * sckh, mask=ok, other=0.0).to(tl.float32)
            s = s + (c_q - c_k) * LOG2E
        s = tl.where(ok, s, float("-inf"))
        m_i, l_i, acc = online_update(m_i, l_i, acc, s, v)
    store_partial(M_OUT, L_OUT, ACC_OUT, pid.to(tl.int64) * splits + split, m_i, l_i, acc, dims,
                  O, b * sob + h * soh, Q, 0, HEAD_DIM, DIRECT, False)


def forgetting_attention_decode_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    c_q: torch.Tensor | None,
    c_k: torch.Tensor | None,
    length: torch.Tensor,
    key_mask: torch.Tensor | None = None,
    scale: float | None = None,
    window_size: int | None = None,
) -> torch.Tensor:
    """q [B,1,HQ,D]; k, v [B,T,HKV,D] (any strides with a contiguous last dim: a cache's buffers);
    c_q [B,1,HQ]; c_k [B,T,HQ] (float32), both None for no gate; length int [1] or [B] on q's device
    (keys at columns >= min(length, T) are not read); key_mask [B,T] bool or None. Returns [B,1,HQ,D] in q's dtype. Checks are the
    public op's (kernels/forgetting_attention/__init__.py)."""
    batch, _, heads, dim = q.shape
    keys, kv_heads = k.shape[1], k.shape[2]
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    splits, per_split, stats, partial = plan_splits(batch * heads, keys, BLOCK_N, dim, q.device)
    mask = key_mask if key_mask is not None else length  # unread without a mask
    mask_strides = (key_mask.stride(0), key_mask.stride(1)) if key_mask is not None else (0, 0)
    if mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)
    scale = dim**-0.5 if scale is None else float(scale)
    out = torch.empty(batch, 1, heads, dim, device=q.device, dtype=q.dtype)
    gated = c_q is not None
    if not gated:  # never read: q stands in for the pointers, with q's own strides
        c_q, c_k = q[..., 0], q[..., 0]
    _partial_kernel[(batch * heads, splits)](
        q, k, v, c_q, c_k, length, mask, stats[0], stats[1], partial, out,
        q.stride(0), q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        c_q.stride(0), c_q.stride(2), c_k.stride(0), c_k.stride(1), c_k.stride(2), *mask_strides,
        length.stride(0) if length.numel() > 1 else 0, out.stride(0), out.stride(2),
        heads, heads // kv_heads, keys, per_split, window_size or 0, scale * LOG2E.value,
        HEAD_DIM=dim, BLOCK=BLOCK_N, HAS_MASK=key_mask is not None, HAS_WINDOW=window_size is not None,
        DIRECT=splits == 1, STAGES=STAGES, GATED=gated, num_warps=WARPS,
    )
    return combine(stats, partial, out, heads, splits, WARPS)
