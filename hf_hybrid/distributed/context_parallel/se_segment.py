"""SE attention of one context-parallel segment over the keys it holds: [received blocks ; local
span] (se_hybrid.py), exactly the reference mask's rows (kernels/span_expanded_attention/
reference.py), on two paths:

* ``"sdpa"`` (CUDA, and ``kernel_backend="sdpa"``): :func:`fused_segment_attention` runs the
  one-process layer's fast path (kernels/span_expanded_attention/chunked.py: the own SE chunk on
  cuDNN / FlashAttention-2 runs, the retrieved blocks gathered by block_rows.py's Triton kernels
  into one unmasked call per group, the two merged by log-sum-exp, and the blocks' gradients added
  back by Triton) over a virtual sequence laid out as that path expects. No mask and no
  [queries, keys] scores are built.
* ``"reference"`` (CPU): :func:`segment_attention`, the readable masked softmax
  (:func:`masked_attention`) over blocks of queries (kernels/_query_blocks.py): ``mask_rows(lo,
  hi)`` builds the rows of queries lo .. hi - 1 only, and the backward recomputes one block at a
  time, so memory stays linear in the segment's length (a block's rows within ``SCORE_BUDGET``).

Both compute one softmax per query over the same keys, so they differ only by rounding.
"""
from __future__ import annotations

from collections.abc import Callable

import torch


def segment_backend(kernel_backend: str, device: torch.device) -> str:
    """The SE layer's ``kernel_backend`` ("auto", "sdpa", "reference") -> "sdpa" or "reference":
    "auto" is the fused path on CUDA and the reference elsewhere, as in the one-process layer."""
    if kernel_backend == "reference":
        return "reference"
    if kernel_backend == "sdpa" or device.type == "cuda":
        return "sdpa"
    return "reference"


def segment_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask_rows: Callable[[int, int], torch.Tensor],
    *,
    scale: float | None = None,
    budget: int | None = None,
) -> torch.Tensor:
    """softmax(q k^T scale + log mask) v of a segment, block by block over its queries (the reference).

    q [batch, queries, heads, dim]; keys, values [batch, keys, kv_heads, dim] (kv_heads divides
    heads); ``mask_rows(lo, hi)``: bool [hi - lo, keys] or [batch, heads, hi - lo, keys], which keys
    queries lo .. hi - 1 read (every query reads at least one). ``budget``: elements of one block's
    scores (default ``SCORE_BUDGET``). Differentiable in q, keys and values."""
    from ...kernels._query_blocks import attend_in_query_blocks, query_block_size
    from ...kernels.span_expanded_attention import masked_attention

    if q.shape[2] % keys.shape[2]:
        raise ValueError(f"segment_attention: heads ({q.shape[2]}) must be a multiple of kv_heads ({keys.shape[2]}).")
    block = query_block_size(q.shape[1], keys.shape[1], q.shape[0] * q.shape[2], budget)

    def attend(lo, q_block, k, v):
        return masked_attention(q_block, k, v, mask_rows(lo, lo + q_block.shape[1]), scale)

    return attend_in_query_blocks(attend, [q], [keys, values], block=block)


def fused_segment_attention(q, keys, values, *, mode: str, start: int, first: int, settings, chunk_size: int,
                            scale: float, remote=None, selection=None) -> torch.Tensor:
    """A segment's SE attention on the one-process layer's fused path (kernels/span_expanded_attention/
    chunked.py: FlashAttention/cuDNN calls, and for ``se`` the retrieved blocks moved by
    block_rows.py's Triton kernels), run over a *virtual sequence* laid out as that path expects.

    q [batch, queries, heads, dim] at positions start .. start + queries - 1; keys, values [batch,
    keys, kv_heads, dim], the local span from position ``first``. ``se`` also takes ``remote``
    (keys, values [batch, n S, kv_heads, dim] and block ids [batch, kv_heads, n], -1 padding: the
    received blocks) and ``selection`` (indices, valid [batch, heads, groups of the segment, k']:
    each group's top-k blocks, from ``select_blocks``).

    The virtual sequence holds the received blocks first (slot i at virtual block i), then the
    local span from virtual position P, P a multiple of the block size with P = first (mod M):
    blocks stay whole and SE chunks start on multiples of M, as in one process. Queries before
    ``start`` are zeros whose outputs are dropped (with a zero output gradient they add nothing to
    any gradient); ``swa`` and ``se_nomem`` put the local span at virtual 0 (their masks are
    relative to the chunk or window). Extra work: the queries of the halo (and for ``se`` the
    received blocks' rows and up to lcm(S, M) padding) run through the own-chunk call."""
    from ...kernels.span_expanded_attention.chunked import (
        _MergedChunkAttention, _Plan, _retrieved_blocks, _use_block_kernels, span_expanded_attention_chunked,
    )
    from ...kernels.span_expanded_attention.reference import expand_kv_heads

    batch, count, heads, dim = q.shape
    held = start - first
    if mode in ("swa", "se_nomem"):
        qv = torch.cat([q.new_zeros(batch, held, heads, dim), q], 1)
        out = span_expanded_attention_chunked(
            qv, keys, values, mode=mode, chunk_size=chunk_size, block_size=settings.block_size, top_k=settings.top_k,
            select_every=settings.select_every, window=settings.window, seed=settings.seed, scale=scale,
        )
        return out[:, held:]
    if mode != "se":
        raise ValueError(f"fused_segment_attention: mode={mode!r} is not one of ('se', 'se_nomem', 'swa').")
    M, S, G = chunk_size, settings.block_size, settings.select_every
    k_remote, v_remote, ids = remote
    indices, valid = selection
    R = k_remote.shape[1]
    P = -(-R // S) * S
    while P % M != first % M:  # a solution below R + lcm(S, M) exists: first is a multiple of S
        P += S
    end = P + keys.shape[1]
    padded = -(-end // M) * M

    def virtual(remote_part, local):
        return torch.cat([remote_part, local.new_zeros(batch, P - R, *local.shape[2:]), local,
                          local.new_zeros(batch, padded - end, *local.shape[2:])], 1)

    q_start = P + held
    qv = torch.cat([q.new_zeros(batch, q_start, heads, dim), q, q.new_zeros(batch, padded - q_start - count, heads, dim)], 1)
    kv, vv = (expand_kv_heads(virtual(r, x), heads).contiguous() for r, x in ((k_remote, keys), (v_remote, values)))
    slots = indices.shape[-1]
    if slots == 0:
        return span_expanded_attention_chunked(
            qv, kv, vv, mode="se_nomem", chunk_size=M, block_size=S, top_k=0, select_every=G, window=None, seed=0, scale=scale,
        )[:, q_start:q_start + count]
    # Where each selected block lies in the virtual sequence: a received slot, or in the local span.
    first_block = first // S
    kv_heads = ids.shape[1]
    # slot of each block before the span per (row, key head); other ids land in a spare last column
    target = torch.where((ids >= 0) & (ids < first_block), ids, first_block)
    slot_of = torch.arange(ids.shape[-1], device=q.device).expand_as(ids)
    lookup = torch.zeros(batch, kv_heads, first_block + 1, dtype=torch.long, device=q.device).scatter_(-1, target, slot_of)
    lookup = lookup.repeat_interleave(heads // kv_heads, 1)  # [batch, heads, blocks before the span + 1]
    received = torch.gather(lookup, -1, indices.clamp(max=lookup.shape[-1] - 1).flatten(2)).view_as(indices)
    blocks = torch.where(indices < first_block, received, indices - first_block + P // S)
    blocks = torch.where(valid, blocks, 0)  # invalid slots lie past each part's count: never read
    groups = qv.shape[1] // G
    every_group = torch.zeros(batch, heads, groups, slots, dtype=torch.long, device=q.device)
    every_group[:, :, q_start // G:q_start // G + indices.shape[2]] = blocks
    # Chunks holding the segment's queries, with the valid slots of their true chunk index.
    parts = []
    for chunk in range(q_start // M, -(-(q_start + count) // M)):
        count_valid = min(slots, ((chunk * M - P + first) // M) * M // S)
        if count_valid == 0:
            continue
        if parts and parts[-1][0] == count_valid and parts[-1][2] == chunk:
            parts[-1][2] = chunk + 1
        else:
            parts.append([count_valid, chunk, chunk + 1])
    if not parts:
        return span_expanded_attention_chunked(
            qv, kv, vv, mode="se_nomem", chunk_size=M, block_size=S, top_k=0, select_every=G, window=None, seed=0, scale=scale,
        )[:, q_start:q_start + count]
    plan = _Plan(M, G, S, slots, tuple(tuple(p) for p in parts), scale, _use_block_kernels(q.device))
    out = _MergedChunkAttention.apply(qv.contiguous(), kv, vv, _retrieved_blocks(every_group, plan.first_group), plan)
    return out[:, q_start:q_start + count]
