"""Reference inter-chunk attention of RAT (Eq. 3, "Inter-chunk attention").

A query at absolute position p = start_position + t (chunk c = p // L) attends to

* the chunk-end keys/values of every *complete earlier* chunk, ``k_ends[:, i]`` for i < c, and
* its own gated key/value ``k_own[:, t]`` (the running state of its own, still open, chunk),

with one softmax over the union. The official code computes the two parts separately and merges
them by log-sum-exp; here both sit in one explicit softmax, which is the definition.

Shapes: q, k_own, v_own [batch, seq, heads, head_dim]; k_ends, v_ends [batch, chunks, heads,
head_dim] where entry i is the state at the end of chunk i. Scores in float32.
"""
from __future__ import annotations

import torch


def chunk_end_mask(num_queries: int, num_chunks: int, chunk_size: int, start_position: int, device) -> torch.Tensor:
    """[num_queries, num_chunks] bool: True where query t may see the end of chunk i (i < its chunk)."""
    query_chunk = torch.arange(start_position, start_position + num_queries, device=device) // chunk_size
    return torch.arange(num_chunks, device=device)[None, :] < query_chunk[:, None]


def chunk_end_attention_reference(
    q: torch.Tensor,
    k_own: torch.Tensor,
    v_own: torch.Tensor,
    k_ends: torch.Tensor,
    v_ends: torch.Tensor,
    chunk_size: int,
    start_position: int = 0,
    scale: float | None = None,
) -> torch.Tensor:
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qf, kf, vf = q.float(), k_own.float(), v_own.float()
    scores_ends = torch.einsum("bthd,bchd->bhtc", qf, k_ends.float()) * scale
    visible = chunk_end_mask(q.shape[1], k_ends.shape[1], chunk_size, start_position, q.device)
    scores_ends = scores_ends.masked_fill(~visible, float("-inf"))
    score_own = torch.einsum("bthd,bthd->bht", qf, kf)[..., None] * scale
    probs = torch.softmax(torch.cat([scores_ends, score_own], dim=-1), dim=-1)
    out = torch.einsum("bhtc,bchd->bthd", probs[..., :-1], v_ends.float())
    out = out + probs[..., -1].permute(0, 2, 1)[..., None] * vf
    return out.to(q.dtype)


def chunk_ends(x: torch.Tensor, chunk_size: int, start_position: int = 0) -> torch.Tensor:
    """The entries of x [batch, seq, ...] that close a chunk: absolute positions p with (p + 1) % L == 0."""
    first = (chunk_size - 1 - start_position) % chunk_size
    return x[:, first::chunk_size]
