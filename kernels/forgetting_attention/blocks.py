"""Forgetting Attention one block pair at a time: the unit of ring attention (context parallelism).

A sequence cut into blocks of S tokens: the queries of block r attend to the keys of blocks
0 .. r. For one pair (queries of block r, keys of block j <= r), per batch row and query head:

    s_ij   = scale q_i . k_j + c_q[i] - c_k[j]       (c the cumulative log forget, whole sequence)
    lse_i  = log sum_j exp(s_ij)                     over the block's visible keys
    o_i    = sum_j exp(s_ij - lse_i) v_j

with every key visible when j < r and the causal mask (key <= query) on the diagonal block j = r
(there the queries and keys are the same tokens: c_k is not read, c_q serves both). The blocks' outputs merge by their log-sum-exps:
lse = log sum_b exp(lse_b), o = sum_b exp(lse_b - lse) o_b. The backward of one block needs
only the merged lse and delta_i = rowsum(dO_i * O_i) of the merged output O:

    P = exp(s - lse),  dV = P^T dO,  dS = P (dO V^T - delta),  dQ = scale dS K,  dK = scale dS^T Q,
    dc_q[i] = sum_j dS_ij,  dc_k[j] = -sum_i dS_ij

each block's exact share of the gradient of the whole softmax. Grouped queries: query head h reads
key/value head h // (HQ // HKV); c is per query head.

Backends: "reference" (PyTorch, float32 scores of the whole block pair) and "triton" (the
diagonal block on the causal kernels of triton.py, the others on blocks_triton.py).
Shapes: q [B,S,HQ,D], k/v [B,S,HKV,D], c_q/c_k [B,S,HQ] float32; lse and delta [B,HQ,S] float32.
"""
from __future__ import annotations

import torch

from .._backend import resolve_backend
from .reference import _expand_kv

_OP = "forgetting_block_attention"
_TRITON_HEAD_DIMS = (16, 32, 64, 128, 256)
LOG2E = 1.4426950408889634  # the Triton kernels keep lse in log2 units


def block_backend(backend: str, q: torch.Tensor) -> str:
    """The backend a block pair runs on: Triton where it can run (CUDA, or the interpreter when asked
    for), for head_dim 16 .. 256; the reference elsewhere."""
    impl = resolve_backend(backend if backend in ("auto", "reference", "triton") else "auto", q.device, _OP)
    if impl == "triton" and q.shape[-1] not in _TRITON_HEAD_DIMS:
        if backend == "triton":
            raise ValueError(f"{_OP}: the Triton kernels take head_dim in {_TRITON_HEAD_DIMS}; got {q.shape[-1]}.")
        return "reference"
    return impl


def forgetting_block_attention(q, k, v, c_q, c_k, *, causal: bool, scale: float, backend: str = "auto"):
    """(o [B,S,HQ,D] float32 or q's dtype, lse [B,HQ,S] float32) of one block pair (module docstring)."""
    _check(q, k, v, c_q, c_k)
    if block_backend(backend, q) == "reference":
        scores = _scores(q, k, c_q, c_k, causal, scale)
        lse = scores.logsumexp(dim=-1)
        o = torch.einsum("bhts,bshd->bthd", torch.exp(scores - lse[..., None]), _expand_kv(v, q.shape[2]).to(scores.dtype))
        return o, lse
    batch, seq, hq, d = q.shape
    flat = _flat(q, k, v)
    if causal:
        from .triton import _forward

        o, lse2 = _forward(*flat, _by_head(c_q), _rows(batch, seq, q.device), seq, scale, None)
    else:
        from .blocks_triton import full_block_forward

        o, lse2 = full_block_forward(*flat, _by_head(c_q), _by_head(c_k), batch, scale)
    return o.view(batch, seq, hq, d), lse2.view(hq, batch, seq).transpose(0, 1) / LOG2E


def forgetting_block_attention_backward(do, q, k, v, c_q, c_k, o, lse, delta, *, causal: bool, scale: float,
                                        backend: str = "auto"):
    """(dq, dk, dv, dc_q, dc_k) of one block pair given the merged output ``o``, its log-sum-exp
    ``lse`` and ``delta`` = rowsum(dO * o) (module docstring). On the diagonal (``causal``) c_q and c_k
    are one (c_k is not read): dc_q holds its whole gradient and dc_k is None."""
    if block_backend(backend, q) == "reference":
        return _reference_backward(do, q, k, v, c_q, c_k, lse, delta, causal, scale)
    batch, seq, hq, d = q.shape
    hkv = k.shape[2]
    flat = _flat(q, k, v)
    lse2 = (lse.transpose(0, 1) * LOG2E).reshape(hq, batch * seq).contiguous()
    do2 = do.reshape(batch * seq, hq, d).contiguous()
    if causal:
        from .triton import _backward

        o2 = o.reshape(batch * seq, hq, d).to(q.dtype).contiguous()
        dq, dk, dv, dc = _backward(do2, *flat, _by_head(c_q), o2, lse2, _rows(batch, seq, q.device), seq, scale, None)
        dc_q, dc_k = _from_by_head(dc, batch, seq), None
    else:
        from .blocks_triton import full_block_backward

        delta2 = delta.transpose(0, 1).reshape(hq, batch * seq).contiguous()
        dq, dk, dv, dcq, dck = full_block_backward(do2, *flat, _by_head(c_q), _by_head(c_k), lse2, delta2, batch, scale)
        dc_q, dc_k = _from_by_head(dcq, batch, seq), _from_by_head(dck, batch, seq)
    return dq.view(batch, seq, hq, d), dk.view(batch, seq, hkv, d), dv.view(batch, seq, hkv, d), dc_q, dc_k


# ------------------------------------------------------------------------------------ reference


def _scores(q, k, c_q, c_k, causal, scale):
    """[B, HQ, S, S] float32 (float64 for float64 q) scores s_ij, -inf where invisible."""
    acc = torch.promote_types(q.dtype, torch.float32)
    c_k = c_q if causal else c_k
    scores = torch.einsum("bthd,bshd->bhts", q.to(acc), _expand_kv(k, q.shape[2]).to(acc)) * scale
    scores = scores + c_q.to(acc).permute(0, 2, 1)[..., :, None] - c_k.to(acc).permute(0, 2, 1)[..., None, :]
    if causal:
        seq = q.shape[1]
        keep = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    return scores


def _reference_backward(do, q, k, v, c_q, c_k, lse, delta, causal, scale):
    hq, hkv = q.shape[2], k.shape[2]
    scores = _scores(q, k, c_q, c_k, causal, scale)
    acc = scores.dtype
    probs = torch.exp(scores - lse.to(acc)[..., None])
    do_acc = do.to(acc)
    dv = torch.einsum("bhts,bthd->bshd", probs, do_acc)
    dp = torch.einsum("bthd,bshd->bhts", do_acc, _expand_kv(v, hq).to(acc))
    ds = probs * (dp - delta.to(acc)[..., None])
    dq = torch.einsum("bhts,bshd->bthd", ds, _expand_kv(k, hq).to(acc)) * scale
    dk = torch.einsum("bhts,bthd->bshd", ds, q.to(acc)) * scale
    if hq != hkv:  # sum the query heads of each group
        dk, dv = (g.unflatten(2, (hkv, hq // hkv)).sum(3) for g in (dk, dv))
    dc_q = ds.sum(-1).transpose(1, 2)
    dc_k = -ds.sum(-2).transpose(1, 2)
    if causal:
        return dq, dk, dv, dc_q + dc_k, None
    return dq, dk, dv, dc_q, dc_k


# ------------------------------------------------------------------------------------- plumbing


def _check(q, k, v, c_q, c_k):
    if q.dim() != 4 or k.shape != v.shape or k.shape[:2] != q.shape[:2] or q.shape[2] % k.shape[2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"{_OP}: q [B,S,HQ,D] and k, v [B,S,HKV,D] with HQ a multiple of HKV; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}.")
    if c_q.shape != q.shape[:3] or c_k.shape != q.shape[:3]:
        raise ValueError(f"{_OP}: c_q and c_k must be [B,S,HQ] = {tuple(q.shape[:3])}; got {tuple(c_q.shape)}, {tuple(c_k.shape)}.")


def _flat(q, k, v):
    batch, seq = q.shape[:2]
    return tuple(t.reshape(batch * seq, t.shape[2], t.shape[3]).contiguous() for t in (q, k, v))


def _by_head(c):
    """[B,S,HQ] -> [HQ, B*S] float32 contiguous (the Triton kernels' layout)."""
    return c.float().permute(2, 0, 1).reshape(c.shape[2], -1).contiguous()


def _from_by_head(c, batch, seq):
    return c.view(c.shape[0], batch, seq).permute(1, 2, 0)


def _rows(batch, seq, device):
    from .reference import row_boundaries

    return row_boundaries(batch, seq, device)

