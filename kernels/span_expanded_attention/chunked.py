"""Fast SE-Attn on fused attention kernels; never builds a T x T score matrix.

Work per mode (T tokens, chunks of M, k retrieved blocks of S tokens, groups of G queries):

* ``full``      one causal SDPA call (the baseline).
* ``se_nomem``  chunks stacked on the batch axis, one causal SDPA call: T x M / 2 scores.
* ``swa``       windows stacked on the batch axis; each attends to [previous window ; itself]
                under a band mask (T x 2W scores, memory-efficient kernel).
* ``se`` / ``se_random``: two fused calls merged by log-sum-exp inside one autograd Function:
    1. own chunk, causal, chunks stacked on the batch axis (cuDNN or FlashAttention-2 on CUDA,
       see lse_attention.py);
    2. each group's G queries against its kS gathered block keys, groups stacked on the batch
       axis, no mask (only slots that hold a real past block are included: chunk i has
       min(k, floor(iM/S)) of them, so chunk 0 skips this call and, when M < kS, a few early
       chunks run it with fewer keys).
  Retrieval itself costs T/S block summaries (S x S each) and a [groups x blocks] score matrix.

Selection is shared with the reference (:func:`reference.selection_for_sequence`), so both paths
retrieve the same blocks and differ only by floating-point rounding.
"""
from __future__ import annotations

import torch
from torch.nn import functional as F

from .lse_attention import attention_with_lse, attention_with_lse_backward
from .reference import RETRIEVAL_MODES, expand_kv_heads, selection_for_sequence


def _pad_to(x: torch.Tensor, length: int) -> torch.Tensor:
    return x if x.shape[1] == length else F.pad(x, (0, 0, 0, 0, 0, length - x.shape[1]))


def _to_runs(x: torch.Tensor, run: int) -> torch.Tensor:
    """[b, t, h, ...] -> [b * (t // run), h, run, ...]: runs of ``run`` positions on the batch axis
    (a view when x is contiguous, which is the layout FlashAttention/cuDNN read directly)."""
    b, t, h = x.shape[:3]
    return x.view(b, t // run, run, h, *x.shape[3:]).transpose(2, 3).reshape(-1, h, run, *x.shape[3:])


def _from_runs(x: torch.Tensor, batch: int) -> torch.Tensor:
    """Inverse of :func:`_to_runs`: [b * n, h, run, ...] -> [b, n * run, h, ...]."""
    n, h, run = x.shape[0] // batch, x.shape[1], x.shape[2]
    return x.view(batch, n, h, run, *x.shape[3:]).transpose(2, 3).reshape(batch, n * run, h, *x.shape[3:])


def _rows(x: torch.Tensor, first: int, last: int, run: int) -> torch.Tensor:
    """Groups [first, last) of x [b, t, h, ...] as [b, groups, run, h, ...] (a view)."""
    return x[:, first * run:last * run].unflatten(1, (last - first, run))


def _rows_as_runs(x: torch.Tensor, first: int, last: int, run: int) -> torch.Tensor:
    """Groups [first, last) of x [b, t, h, d] as attention batch entries [b * groups, h, run, d]."""
    rows = _rows(x, first, last, run)
    return rows.transpose(2, 3).reshape(-1, x.shape[2], run, x.shape[3])


def _retrieved(kr: torch.Tensor, first: int, last: int, slots: int) -> torch.Tensor:
    """kr [b, groups, h, k, S, d] -> [b * (last - first), h, slots * S, d] for groups [first, last)."""
    part = kr[:, first:last, :, :slots]
    return part.reshape(-1, part.shape[2], slots * part.shape[4], part.shape[5])


class _MergedChunkAttention(torch.autograd.Function):
    """One softmax over [retrieved blocks of the query's group ; own chunk causally].

    q, k, v [b, T', h, d] contiguous (T' a multiple of M, heads already expanded); kr, vr
    [b, groups, h, k, S, d]; parts: ((slots, first group, last group), ...) - contiguous runs of
    groups that retrieve the same number of valid blocks (it only grows with the chunk index).
    """

    @staticmethod
    def forward(ctx, q, k, v, kr, vr, chunk_size, select_every, parts, scale):
        batch, _, heads, dim = q.shape
        G = select_every
        out1, lse1, saved1 = attention_with_lse(_to_runs(q, chunk_size), _to_runs(k, chunk_size), _to_runs(v, chunk_size), True, scale)
        out = _from_runs(out1, batch)  # [b, T', h, d]; merged into in place below
        lse = _from_runs(lse1[..., None], batch)[..., 0].contiguous()  # [b, T', h]
        saved2 = []
        for slots, first, last in parts:
            out2, lse2, saved = attention_with_lse(
                _rows_as_runs(q, first, last, G), _retrieved(kr, first, last, slots), _retrieved(vr, first, last, slots), False, scale
            )
            saved2.append(saved)
            out2 = out2.view(batch, last - first, heads, G, dim).transpose(2, 3)
            lse2 = lse2.view(batch, last - first, heads, G).transpose(2, 3)
            lse_rows = _rows(lse, first, last, G)
            # softmax over the union: out = out1 + sigmoid(lse2 - lse1) * (out2 - out1).
            weight = torch.sigmoid(lse2 - lse_rows).to(out.dtype)[..., None]
            _rows(out, first, last, G).lerp_(out2, weight)
            lse_rows.copy_(torch.logaddexp(lse_rows, lse2))
        ctx.save_for_backward(q, k, v, kr, vr, out, lse)
        ctx.meta = (chunk_size, select_every, parts, scale, saved1, saved2)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, kr, vr, out, lse = ctx.saved_tensors
        chunk_size, G, parts, scale, saved1, saved2 = ctx.meta
        batch, _, heads, dim = q.shape
        grad_out = grad_out.contiguous()
        lse = lse[..., None]
        dq1, dk1, dv1 = attention_with_lse_backward(
            _to_runs(grad_out, chunk_size), _to_runs(q, chunk_size), _to_runs(k, chunk_size), _to_runs(v, chunk_size),
            _to_runs(out, chunk_size), _to_runs(lse, chunk_size)[..., 0], saved1, True, scale,
        )
        dq, dk, dv = (_from_runs(x, batch) for x in (dq1, dk1, dv1))
        dkr, dvr = torch.zeros_like(kr), torch.zeros_like(vr)
        for (slots, first, last), saved in zip(parts, saved2):
            dq2, dk2, dv2 = attention_with_lse_backward(
                _rows_as_runs(grad_out, first, last, G), _rows_as_runs(q, first, last, G),
                _retrieved(kr, first, last, slots), _retrieved(vr, first, last, slots),
                _rows_as_runs(out, first, last, G), _rows_as_runs(lse, first, last, G)[..., 0], saved, False, scale,
            )
            _rows(dq, first, last, G).add_(dq2.reshape(batch, last - first, heads, G, dim).transpose(2, 3))
            block_shape = (batch, last - first, heads, slots, kr.shape[4], dim)
            dkr[:, first:last, :, :slots] = dk2.reshape(block_shape)
            dvr[:, first:last, :, :slots] = dv2.reshape(block_shape)
        return dq, dk, dv, dkr, dvr, None, None, None, None


def _gather_blocks(x: torch.Tensor, indices: torch.Tensor, block_size: int) -> torch.Tensor:
    """x [b, t, h, d], indices [b, h, groups, k] -> [b, groups, h, k, S, d] (differentiable gather)."""
    batch, _, heads, dim = x.shape
    num_blocks = x.shape[1] // block_size
    blocks = x[:, : num_blocks * block_size].view(batch, num_blocks, block_size, heads, dim)
    rows = torch.arange(batch, device=x.device)[:, None, None, None]
    head = torch.arange(heads, device=x.device)[None, None, :, None]
    return blocks[rows, indices.permute(0, 2, 1, 3), :, head]


def _retrieval_parts(valid: torch.Tensor) -> tuple:
    """Contiguous runs of groups with the same number of valid slots (> 0): ((slots, first, last), ...)."""
    per_group = valid[0, 0].sum(-1).tolist()
    parts = []
    for group, slots in enumerate(per_group):
        if slots == 0:
            continue
        if parts and parts[-1][0] == slots and parts[-1][2] == group:
            parts[-1][2] = group + 1
        else:
            parts.append([slots, group, group + 1])
    return tuple(tuple(p) for p in parts)


def span_expanded_attention_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mode: str,
    chunk_size: int,
    block_size: int,
    top_k: int,
    select_every: int,
    window: int | None,
    seed: int,
    scale: float | None,
) -> torch.Tensor:
    """Same function as :func:`reference.span_expanded_attention_reference`; inputs already checked."""
    batch, seq, heads, dim = q.shape
    scale = dim**-0.5 if scale is None else scale
    k_full, v_full = expand_kv_heads(k, heads), expand_kv_heads(v, heads)
    if mode == "full":
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k_full.transpose(1, 2), v_full.transpose(1, 2), is_causal=True, scale=scale)
        return out.transpose(1, 2)
    if mode == "swa":
        return _sliding_window(q, k_full, v_full, window, scale)
    padded = -(-seq // chunk_size) * chunk_size
    qp, kp, vp = (_pad_to(x, padded).contiguous() for x in (q, k_full, v_full))
    parts = ()
    if mode in RETRIEVAL_MODES:
        indices, valid, _ = selection_for_sequence(
            q, k, v, mode=mode, chunk_size=chunk_size, block_size=block_size, top_k=top_k,
            select_every=select_every, seed=seed, scale=scale,
        )
        parts = _retrieval_parts(valid) if indices.shape[-1] else ()
    if not parts:  # se_nomem, or nothing to retrieve yet
        out = F.scaled_dot_product_attention(*(_to_runs(x, chunk_size) for x in (qp, kp, vp)), is_causal=True, scale=scale)
        return _from_runs(out, batch)[:, :seq]
    kr, vr = _gather_blocks(k_full, indices, block_size), _gather_blocks(v_full, indices, block_size)
    out = _MergedChunkAttention.apply(qp, kp, vp, kr, vr, chunk_size, select_every, parts, scale)
    return out[:, :seq]


def _sliding_window(q, k, v, window, scale):
    """Each window of W queries attends to [previous window ; own window] with p - W < s <= p."""
    batch, seq, heads, dim = q.shape
    padded = -(-seq // window) * window
    qp, kp, vp = (_pad_to(x, padded) for x in (q, k, v))
    runs = padded // window

    def with_previous(x):
        prev = F.pad(x, (0, 0, 0, 0, window, 0))[:, :padded]
        return torch.cat([_to_runs(prev, window), _to_runs(x, window)], dim=2)

    rel_q = torch.arange(window, device=q.device)[:, None]
    rel_k = torch.arange(-window, window, device=q.device)[None, :]
    band = (rel_k <= rel_q) & (rel_k > rel_q - window)
    first = band & (rel_k >= 0)  # the first window has no previous one
    mask = torch.stack([first] + [band] * (runs - 1))[:, None]  # [runs, 1, W, 2W]
    mask = mask.repeat(batch, 1, 1, 1)
    out = F.scaled_dot_product_attention(_to_runs(qp, window), with_previous(kp), with_previous(vp), attn_mask=mask, scale=scale)
    return _from_runs(out, batch)[:, :seq]
