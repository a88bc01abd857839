"""Split-K ("flash-decoding") Triton kernel for one Forgetting Attention query per row.

The math is :func:`.decode.forgetting_attention_decode_reference`: the query sits at key position
n - 1 (n = ``length``, a device tensor, so a CUDA graph replays the same launch at every step) and

    o = sum_j softmax_j(scale q . k_j + c_q - c_k[j]) v_j    over j < n (and key_mask, and the window).

A decode step is bound by reading the cache once. One program per (row, head) walking all n keys
leaves most of the GPU idle at small batch and long context (B=8 x 16 heads = 128 programs on 132
SMs, each streaming 16K keys), so the keys are cut into splits: pass 1 gives each (row, head,
split) its running max, softmax sum and unnormalised output (float32); pass 2 combines the splits.
Scores and the bias c_q - c_k stay in float32 whatever the inputs' dtype (no rounded bias).
Forward only: decoding needs no gradients.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
BLOCK_N, WARPS = 64, 4
PROGRAMS_PER_SM = 4  # splits are chosen so that about this many programs share each SM

_SM_COUNT: dict[int, int] = {}


def split_count(rows_heads: int, keys: int, device: torch.device) -> tuple[int, int]:
    """(splits, keys per split, a multiple of BLOCK_N) for this shape: a host-side decision on shapes
    only, so a captured graph keeps it for every step."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in _SM_COUNT:
            _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
        sms = _SM_COUNT[index]
    else:  # Triton's CPU interpreter: a few splits, so the combine pass is exercised
        sms = 2
    blocks = triton.cdiv(max(keys, 1), BLOCK_N)
    wanted = triton.cdiv(PROGRAMS_PER_SM * sms, max(rows_heads, 1))
    splits = max(1, min(wanted, blocks))
    per_split = triton.cdiv(blocks, splits) * BLOCK_N
    return triton.cdiv(max(keys, 1), per_split), per_split


@triton.jit
def _partial_kernel(
    Q, K, V, CQ, CK, LEN, MASK, M_OUT, L_OUT, ACC_OUT,
    sqb, sqh, skb, skt, skh, svb, svt, svh, scqb, scqh, sckb, sckt, sckh, smb, smt, slb,
    H, GROUP, T, split_len, window, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, HAS_MASK: tl.constexpr, HAS_WINDOW: tl.constexpr,
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
    c_q = tl.load(CQ + b * scqb + h * scqh).to(tl.float32)
    k_base = K + b * skb + kvh * skh
    v_base = V + b * svb + kvh * svh
    m_i = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), 0)
    l_i = tl.sum(tl.zeros([BLOCK], dtype=tl.float32), 0)
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ok = offs < hi
        if HAS_MASK:
            ok = ok & (tl.load(MASK + b * smb + offs * smt, mask=ok, other=0) != 0)
        k = tl.load(k_base + offs[:, None] * skt + dims[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        v = tl.load(v_base + offs[:, None] * svt + dims[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        c_k = tl.load(CK + b * sckb + offs * sckt + h * sckh, mask=ok, other=0.0).to(tl.float32)
        s = tl.sum(k * q[None, :], 1) * qk_scale + (c_q - c_k) * LOG2E
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a fully masked block so far: weights 0
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(s - m_safe)
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        m_i = m_new
    slot = pid.to(tl.int64) * splits + split
    tl.store(M_OUT + slot, m_i)
    tl.store(L_OUT + slot, l_i)
    tl.store(ACC_OUT + slot * HEAD_DIM + dims, acc)


@triton.jit
def _combine_kernel(
    M_IN, L_IN, ACC_IN, O, sob, soh, H, splits,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
):
    pid = tl.program_id(0)
    b = (pid // H).to(tl.int64)
    h = (pid % H).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM)
    idx = tl.arange(0, BLOCK_S)
    ok = idx < splits
    base = pid.to(tl.int64) * splits
    m = tl.load(M_IN + base + idx, mask=ok, other=float("-inf"))
    m_max = tl.max(m, 0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.math.exp2(m - m_safe)  # splits that saw no key: weight 0
    total = tl.sum(w * tl.load(L_IN + base + idx, mask=ok, other=0.0), 0)
    acc = tl.load(ACC_IN + (base + idx[:, None]) * HEAD_DIM + dims[None, :], mask=ok[:, None], other=0.0)
    out = tl.sum(w[:, None] * acc, 0) / tl.where(total > 0.0, total, 1.0)  # no visible key: 0
    tl.store(O + b * sob + h * soh + dims, out.to(O.dtype.element_ty))


def forgetting_attention_decode_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    c_q: torch.Tensor,
    c_k: torch.Tensor,
    length: torch.Tensor,
    key_mask: torch.Tensor | None = None,
    scale: float | None = None,
    window_size: int | None = None,
) -> torch.Tensor:
    """q [B,1,HQ,D]; k, v [B,T,HKV,D] (any strides with a contiguous last dim: a cache's buffers);
    c_q [B,1,HQ]; c_k [B,T,HQ] (float32); length int [1] or [B] on q's device (keys at columns >= it
    are not read); key_mask [B,T] bool or None. Returns [B,1,HQ,D] in q's dtype. Checks are the
    public op's (kernels/forgetting_attention/__init__.py)."""
    batch, _, heads, dim = q.shape
    keys, kv_heads = k.shape[1], k.shape[2]
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    splits, per_split = split_count(batch * heads, keys, q.device)
    stats = torch.empty(2, batch * heads * splits, device=q.device, dtype=torch.float32)
    partial = torch.empty(batch * heads * splits, dim, device=q.device, dtype=torch.float32)
    mask = key_mask if key_mask is not None else length  # unread without a mask
    mask_strides = (key_mask.stride(0), key_mask.stride(1)) if key_mask is not None else (0, 0)
    if mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)
    scale = dim**-0.5 if scale is None else float(scale)
    _partial_kernel[(batch * heads, splits)](
        q, k, v, c_q, c_k, length, mask, stats[0], stats[1], partial,
        q.stride(0), q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        c_q.stride(0), c_q.stride(2), c_k.stride(0), c_k.stride(1), c_k.stride(2), *mask_strides,
        length.stride(0) if length.numel() > 1 else 0,
        heads, heads // kv_heads, keys, per_split, window_size or 0, scale * LOG2E,
        HEAD_DIM=dim, BLOCK=BLOCK_N, HAS_MASK=key_mask is not None, HAS_WINDOW=window_size is not None,
        num_warps=WARPS,
    )
    out = torch.empty(batch, 1, heads, dim, device=q.device, dtype=q.dtype)
    _combine_kernel[(batch * heads,)](
        stats[0], stats[1], partial, out, out.stride(0), out.stride(2), heads, splits,
        HEAD_DIM=dim, BLOCK_S=max(triton.next_power_of_2(splits), 2), num_warps=WARPS,
    )
    return out
