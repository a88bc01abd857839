"""Reference inter-chunk attention of RAT (Eq. 3, "Inter-chunk attention").

A query at absolute position p = start_position + t (chunk c = p // L) attends to

* the chunk-end keys/values of every *complete earlier* chunk, ``k_ends[:, i]`` for i < c, and
* its own gated key/value ``k_own[:, t]`` (the running state of its own, still open, chunk),

with one softmax over the union. The official code computes the two parts separately and merges
them by log-sum-exp; here both sit in one explicit softmax, which is the definition.

Shapes: q, k_own, v_own [batch, seq, heads, head_dim]; k_ends, v_ends [batch, chunks, heads,
head_dim] where entry i is the state at the end of chunk i (slots a query cannot see may hold
anything). Scores in float32 (float64 for float64 inputs).
"""
from __future__ import annotations

import torch


def query_chunk_index(batch: int, num_queries: int, chunk_size: int, start_position: int, device) -> torch.Tensor:
    """[batch, num_queries] chunk index of queries at positions start_position + t (no padding)."""
    positions = torch.arange(start_position, start_position + num_queries, device=device)
    return (positions // chunk_size).expand(batch, num_queries)


def chunk_end_mask(query_chunk: torch.Tensor, num_chunks: int) -> torch.Tensor:
    """[batch, num_queries, num_chunks] bool: True where a query may see the end of chunk i (i < its chunk)."""
    return torch.arange(num_chunks, device=query_chunk.device) < query_chunk[..., None]


def chunk_end_attention_reference(
    q: torch.Tensor,
    k_own: torch.Tensor,
    v_own: torch.Tensor,
    k_ends: torch.Tensor,
    v_ends: torch.Tensor,
    query_chunk: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """query_chunk [batch, seq]: chunk index of every query (per row, so left-padded rows work)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    acc = torch.promote_types(q.dtype, torch.float32)  # float64 inputs stay float64
    qf, kf, vf = q.to(acc), k_own.to(acc), v_own.to(acc)
    scores_ends = torch.einsum("bthd,bchd->bhtc", qf, k_ends.to(acc)) * scale
    visible = chunk_end_mask(query_chunk, k_ends.shape[1])[:, None]
    scores_ends = scores_ends.masked_fill(~visible, float("-inf"))
    score_own = torch.einsum("bthd,bthd->bht", qf, kf)[..., None] * scale
    probs = torch.softmax(torch.cat([scores_ends, score_own], dim=-1), dim=-1)
    out = torch.einsum("bhtc,bchd->bthd", probs[..., :-1], v_ends.to(acc))
    out = out + probs[..., -1].permute(0, 2, 1)[..., None] * vf
    return out.to(q.dtype)


def chunk_ends(x: torch.Tensor, chunk_size: int, start_position: int = 0) -> torch.Tensor:
    """The entries of x [batch, seq, ...] that close a chunk: absolute positions p with (p + 1) % L == 0."""
    first = (chunk_size - 1 - start_position) % chunk_size
    return x[:, first::chunk_size]


def block_end_mask(
    num_queries: int,
    num_keys: int,
    block_size: int,
    local_window: int = 0,
    num_sink_tokens: int = 0,
    query_start: int = 0,
    device=None,
) -> torch.Tensor:
    """[num_queries, num_keys] bool mask of the dilated ("block end") pattern, from its definition.

    Query at absolute position i = query_start + t sees key j (absolute position j) iff
    j <= i and ((j + 1) % block_size == 0 or i - j <= local_window or j < num_sink_tokens).
    local_window = 0 still includes the query's own key; block_size = 1 is dense causal attention.
    RAT(L) is block_size = L with no window and no sinks: the chunk ends of earlier chunks plus the
    token itself (a chunk end inside the query's own chunk would lie after it, or be the query).
    """
    i = torch.arange(query_start, query_start + num_queries, device=device)[:, None]
    j = torch.arange(num_keys, device=device)[None, :]
    pattern = ((j + 1) % block_size == 0) | (i - j <= local_window) | (j < num_sink_tokens)
    return (j <= i) & pattern


def block_end_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_size: int,
    local_window: int = 0,
    num_sink_tokens: int = 0,
    scale: float | None = None,
) -> torch.Tensor:
    """Dense masked softmax attention with :func:`block_end_mask`; q, k, v [batch, seq, heads, head_dim].

    The oracle for every block-end kernel (RAT chunk ends, RAT+ dilation/window/sinks). Builds the
    full T x T score matrix, so it is for tests and short sequences only.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    acc = torch.promote_types(q.dtype, torch.float32)  # float64 inputs stay float64
    scores = torch.einsum("bthd,bshd->bhts", q.to(acc), k.to(acc)) * scale
    mask = block_end_mask(q.shape[1], k.shape[1], block_size, local_window, num_sink_tokens, device=q.device)
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.einsum("bhts,bshd->bthd", probs, v.to(acc)).to(q.dtype)
