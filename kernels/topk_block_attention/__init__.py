"""Top-k block attention with Quest (min/max) or MoBA (mean) block scoring, optionally || dilation.

See reference.py for the math. Only the PyTorch reference exists: ``backend="auto"`` runs it on
any device, and ``backend="triton"`` raises instead of silently falling back.
"""
from __future__ import annotations

import torch

from .._backend import resolve_backend
from .reference import (
    SCORINGS,
    block_scores,
    block_summaries,
    default_positions,
    dilated_mask,
    masked_attention_reference,
    select_blocks,
    topk_block_attention_reference,
    topk_block_mask,
)

__all__ = [
    "SCORINGS",
    "block_scores",
    "block_summaries",
    "default_positions",
    "dilated_mask",
    "masked_attention_reference",
    "select_blocks",
    "topk_block_attention",
    "topk_block_attention_reference",
    "topk_block_mask",
]


def topk_block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_size: int,
    top_k: int,
    scoring: str = "quest",
    dilation: int = 1,
    local_window: int = 0,
    num_sink_tokens: int = 0,
    query_positions: torch.Tensor | None = None,
    key_positions: torch.Tensor | None = None,
    summary: tuple[torch.Tensor, torch.Tensor] | None = None,
    scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """q [batch, q_len, heads, head_dim]; k, v [batch, k_len, kv_heads, head_dim] (kv_heads divides heads).

    Each query attends to its own block and the top_k - 1 best earlier blocks of ``block_size``
    positions (scored by ``scoring``: "quest" or "moba"), plus sinks, a local window and, with
    dilation > 1, every dilation-block end. Without positions, queries are the last q_len of k_len
    consecutive positions starting at 0. Returns [batch, q_len, heads, head_dim] in q's dtype.
    """
    op = "topk_block_attention"
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(
            f"{op}: q must be [batch, q_len, heads, head_dim] and k, v equal [batch, k_len, kv_heads, head_dim]; "
            f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}."
        )
    if k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3] or q.shape[2] % k.shape[2]:
        raise ValueError(
            f"{op}: k/v {tuple(k.shape)} must match q {tuple(q.shape)} in batch and head_dim, and kv_heads must divide heads."
        )
    if block_size < 1:
        raise ValueError(f"{op}: block_size must be >= 1, got {block_size}.")
    if top_k < 1:
        raise ValueError(f"{op}: top_k must be >= 1 (the query's own block counts as one), got {top_k}.")
    if scoring not in SCORINGS:
        raise ValueError(f"{op}: scoring must be one of {SCORINGS}, got {scoring!r}.")
    if dilation < 1 or local_window < 0 or num_sink_tokens < 0:
        raise ValueError(
            f"{op}: need dilation >= 1, local_window >= 0, num_sink_tokens >= 0; got {dilation}, {local_window}, {num_sink_tokens}."
        )
    if (query_positions is None) != (key_positions is None):
        raise ValueError(f"{op}: pass both query_positions and key_positions, or neither.")
    if query_positions is not None and (
        query_positions.shape != q.shape[:2] or key_positions.shape != k.shape[:2]
    ):
        raise ValueError(
            f"{op}: query_positions must be [batch, q_len] = {tuple(q.shape[:2])} and key_positions "
            f"[batch, k_len] = {tuple(k.shape[:2])}; got {tuple(query_positions.shape)}, {tuple(key_positions.shape)}."
        )
    impl = resolve_backend("reference" if backend == "auto" else backend, q.device, op)
    if impl == "triton":
        raise ValueError(f"{op}: there is no Triton kernel for this op yet; pass backend='auto' or 'reference'.")
    return topk_block_attention_reference(
        q, k, v, block_size, top_k, scoring, dilation, local_window, num_sink_tokens,
        query_positions, key_positions, summary, scale,
    )
