"""Span-Expanded Attention (SE-Attn) and its ablation modes; the math is in reference.py."""
from __future__ import annotations

import torch

from .._backend import resolve_backend
from .._query_blocks import attend_in_query_blocks, query_block_size
from .chunked import span_expanded_attention_chunked
from .reference import (
    MODES,
    RETRIEVAL_MODES,
    allowed_blocks,
    block_summaries,
    expand_kv_heads,
    group_relevancy_queries,
    masked_attention,
    retrieved_block_table,
    retrieved_blocks_of_sequence,
    select_blocks,
    selection_for_sequence,
    span_expanded_attention_reference,
    span_expanded_mask,
)

__all__ = [
    "MODES",
    "RETRIEVAL_MODES",
    "allowed_blocks",
    "block_summaries",
    "check_se_arguments",
    "expand_kv_heads",
    "group_relevancy_queries",
    "masked_attention",
    "retrieved_block_table",
    "select_blocks",
    "selection_for_sequence",
    "span_expanded_attention",
    "span_expanded_attention_query_blocks",
    "span_expanded_attention_reference",
    "span_expanded_mask",
]

_OP = "span_expanded_attention"


def check_se_arguments(mode: str, chunk_size: int, block_size: int, top_k: int, select_every: int, window: int | None) -> None:
    """Raise a ValueError naming the offending argument (shared with the model config)."""
    if mode not in MODES:
        raise ValueError(f"{_OP}: mode={mode!r} is not one of {MODES}.")
    if mode == "swa":
        if window is None or window < 1:
            raise ValueError(f"{_OP}: mode='swa' needs window >= 1 (the number of keys each query sees), got {window}.")
        return
    if mode == "full":
        return
    if chunk_size < 1:
        raise ValueError(f"{_OP}: chunk_size must be >= 1, got {chunk_size}.")
    if mode in RETRIEVAL_MODES:
        if block_size < 1:
            raise ValueError(f"{_OP}: block_size must be >= 1, got {block_size}.")
        if top_k < 0:
            raise ValueError(f"{_OP}: top_k must be >= 0, got {top_k}.")
        if select_every < 1 or chunk_size % select_every:
            raise ValueError(
                f"{_OP}: select_every ({select_every}) must be >= 1 and divide chunk_size ({chunk_size}); "
                f"e.g. select_every={chunk_size} gives one retrieval per chunk."
            )


def span_expanded_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mode: str = "se",
    chunk_size: int = 2048,
    block_size: int = 32,
    top_k: int = 8,
    select_every: int = 128,
    window: int | None = None,
    seed: int = 0,
    scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Causal attention of a whole sequence (positions 0..T-1) in one of :data:`MODES`.

    q [batch, seq, heads, head_dim]; k, v [batch, seq, kv_heads, head_dim] (heads % kv_heads == 0).
    chunk_size M, block_size S, top_k k and select_every G configure ``se``/``se_random``/
    ``se_nomem``; ``window`` configures ``swa``; ``seed`` fixes ``se_random``'s draw.
    backend: ``"reference"`` (the dense oracle's math, run over blocks of queries when T x T would be
    large: memory linear in T), ``"sdpa"`` (fused kernels, chunked, never T x T; any device), or
    ``"auto"`` (``"sdpa"`` on CUDA, the reference elsewhere).
    """
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"{_OP}: q must be [batch, seq, heads, head_dim] and k, v [batch, seq, kv_heads, head_dim] with equal "
            f"batch/seq/head_dim; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}."
        )
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"{_OP}: heads ({q.shape[2]}) must be a multiple of kv_heads ({k.shape[2]}).")
    check_se_arguments(mode, chunk_size, block_size, top_k, select_every, window)
    if backend == "triton":
        raise ValueError(
            f"{_OP}: there is no hand-written Triton kernel for this op; backend='sdpa' runs it on fused "
            "(FlashAttention) kernels without materialising T x T. Use 'auto', 'sdpa' or 'reference'."
        )
    impl = resolve_backend(backend, q.device, _OP, extra=("sdpa",))
    kwargs = dict(
        mode=mode, chunk_size=chunk_size, block_size=block_size, top_k=top_k, select_every=select_every,
        window=window, seed=seed, scale=scale,
    )
    if impl == "reference":
        return span_expanded_attention_query_blocks(q, k, v, **kwargs)
    return span_expanded_attention_chunked(q, k, v, **kwargs)


def span_expanded_attention_query_blocks(q, k, v, *, mode, chunk_size, block_size, top_k, select_every, window, seed,
                                         scale, query_block: int | None = None) -> torch.Tensor:
    """The reference's math over blocks of ``query_block`` queries (default: a block's scores within
    _query_blocks.SCORE_BUDGET): the same retrieval for the whole sequence, then per block the rows
    of :func:`span_expanded_mask` and :func:`masked_attention` over the keys up to the block's end."""
    seq = q.shape[1]
    block = query_block_size(seq, seq, q.shape[0] * q.shape[2]) if query_block is None else query_block
    if block >= seq:
        return span_expanded_attention_reference(
            q, k, v, mode=mode, chunk_size=chunk_size, block_size=block_size, top_k=top_k,
            select_every=select_every, window=window, seed=seed, scale=scale,
        )
    retrieved = retrieved_blocks_of_sequence(q, k, v, mode, chunk_size, block_size, top_k, select_every, seed, scale)

    def attend(start, q_block, k_seen, v_seen):
        mask = span_expanded_mask(
            mode, q_block.shape[1], k_seen.shape[1], query_start=start, chunk_size=chunk_size, block_size=block_size,
            select_every=select_every, window=window, retrieved=retrieved,
        ).to(q.device)
        return masked_attention(q_block, k_seen, v_seen, mask, scale)

    return attend_in_query_blocks(attend, [q], [k, v], block=block, causal=True)
