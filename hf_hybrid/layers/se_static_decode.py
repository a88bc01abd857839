"""SE-Attn's decode step on fixed buffers, for generate()'s static step (hf_hybrid/generation/graph_decode.py):
every row at the same position, the retrieval state of all rows in preallocated tensors, and every
choice (which block closes, which blocks are retrieved, which keys are visible) made on the device
from the position counter, so the step is one fixed sequence of kernels a CUDA graph can replay.

:class:`SEBatchState` is :class:`~hf_hybrid.layers.span_expanded_attention.SERowState` of every row
stacked into buffers sized for generate()'s capacity; it converts from and back to the per-row
states exactly, so eager calls (several tokens, another mode, padded rows) continue from it.

One step at position p (:func:`advance_batch_state`, then :func:`batch_visibility`), the same arithmetic as the
row-by-row step (``SpanExpandedAttention._extend_row``):

* the query goes to slot p % S of the open block's queries; the summary of block p // S is
  computed from them and the block's cached keys and written to its slot *every* step: it is only
  correct once the block's last token is in, but a block is never retrieved before then (retrieval
  reads blocks wholly before the chunk start, and p // S is at or after it), so the early writes
  are never read and need no host decision;
* chunk_sum restarts at a chunk start, group_sum takes chunk_sum at a selection group's first query;
* ``se`` / ``se_random`` rank all summary slots with :func:`select_blocks` (slots at or after the
  chunk start's block are masked to -inf there, the written-but-incomplete one included), top-k on
  fixed shapes, and the retrieved blocks become a per-head mask over the cached keys: the attention
  then reads the K/V buffers in place (no gather), like the ``full`` step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.span_expanded_attention import RETRIEVAL_MODES, block_summaries, retrieved_block_table, select_blocks


@dataclass
class SEBatchState:
    """The retrieval state of ``batch`` rows at one shared length, in fixed buffers.

    summaries [batch, blocks, heads, head_dim] (float32, float64 for float64 queries): slot j holds
    c_j once block j is complete (blocks = enough for ``capacity`` tokens); open_queries [batch,
    block_size, heads, head_dim]: the open block's queries by position % block_size; chunk_sum,
    group_sum [batch, heads, head_dim]: as in SERowState.
    """

    summaries: torch.Tensor
    open_queries: torch.Tensor
    chunk_sum: torch.Tensor
    group_sum: torch.Tensor

    @classmethod
    def from_rows(cls, rows: list, length: int, capacity: int, block_size: int) -> "SEBatchState | None":
        """The stacked state of ``rows`` (SERowState, each ``length`` tokens long), or None when
        the rows are at different lengths or have no state yet (nothing to stack)."""
        if not rows or any(r.length != length or r.summaries is None or r.chunk_sum is None for r in rows):
            return None
        first = rows[0]
        blocks = -(-capacity // block_size)
        summaries = first.summaries.new_zeros(len(rows), blocks, *first.summaries.shape[1:])
        open_queries = first.open_queries.new_zeros(len(rows), block_size, *first.open_queries.shape[1:])
        done, held = length // block_size, length % block_size
        for index, row in enumerate(rows):
            summaries[index, :done] = row.summaries[:done]
            open_queries[index, :held] = row.open_queries[:held]
        stack = lambda name: torch.stack([getattr(r, name) for r in rows]).to(summaries.dtype)  # noqa: E731
        return cls(summaries, open_queries, stack("chunk_sum"), stack("group_sum"))

    def to_rows(self, length: int, row_class) -> list:
        """Per-row states (``row_class``: SERowState) after ``length`` tokens, in their own storage
        (the buffers keep changing)."""
        block_size = self.open_queries.shape[1]
        done, held = length // block_size, length % block_size
        return [
            row_class(length, self.summaries[i, :done].clone(), self.open_queries[i, :held].clone(),
                       self.chunk_sum[i].clone(), self.group_sum[i].clone())
            for i in range(self.summaries.shape[0])
        ]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.summaries, self.open_queries, self.chunk_sum, self.group_sum

    def map(self, fn) -> "SEBatchState":
        return SEBatchState(*(fn(t) for t in self.tensors()))


@torch.no_grad()
def advance_batch_state(state: SEBatchState, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor,
            *, chunk_size: int, select_every: int) -> None:
    """Advance ``state`` in place by the token at ``position`` ([1] long, on the device): q [batch,
    heads, head_dim] its query, keys / values [batch, capacity, kv_heads, head_dim] the cache's
    buffers with its key/value already written."""
    block_size = state.open_queries.shape[1]
    state.open_queries.index_copy_(1, position % block_size, q[:, None].to(state.open_queries.dtype))
    # The block's key columns (clamped: a block cut by the capacity never completes, so never counts).
    start = position - position % block_size
    columns = (start + torch.arange(block_size, device=keys.device)).clamp(max=keys.shape[1] - 1)
    summary = block_summaries(state.open_queries, keys.index_select(1, columns), values.index_select(1, columns), block_size)
    state.summaries.index_copy_(1, position // block_size, summary)
    q_acc = q.to(state.chunk_sum.dtype)
    state.chunk_sum.copy_(torch.where(position % chunk_size == 0, q_acc, state.chunk_sum + q_acc))
    state.group_sum.copy_(torch.where(position % select_every == 0, state.chunk_sum, state.group_sum))


@torch.no_grad()
def batch_visibility(state: SEBatchState, position: torch.Tensor, num_keys: int, *, mode: str, chunk_size: int,
                 block_size: int, top_k: int, num_heads: int, window: int | None, seed: int) -> torch.Tensor:
    """Which of the ``num_keys`` cached columns the query at ``position`` sees in ``mode``:
    [batch, heads, 1, num_keys] bool for the retrieval modes, [1, 1, 1, num_keys] otherwise
    (kernels/span_expanded_attention/reference.py's span_expanded_mask for one query)."""
    columns = torch.arange(num_keys, device=position.device)
    causal = columns <= position
    chunk_start = position - position % chunk_size
    if mode == "full":
        return causal.view(1, 1, 1, -1)
    if mode == "swa":
        return (causal & (columns > position - window)).view(1, 1, 1, -1)
    own_chunk = (causal & (columns >= chunk_start)).view(1, 1, 1, -1)
    if mode not in RETRIEVAL_MODES:  # se_nomem
        return own_chunk
    indices, valid = select_blocks(
        state.group_sum[:, None] if mode == "se" else None, state.summaries, position // chunk_size, mode=mode,
        chunk_size=chunk_size, block_size=block_size, top_k=top_k, num_heads=num_heads, seed=seed,
    )
    table = retrieved_block_table(indices, valid, state.summaries.shape[1])  # [batch, heads, 1, blocks]
    in_span = table[..., columns // block_size]  # [batch, heads, 1, keys]; retrieved blocks lie before the chunk start
    return own_chunk | in_span
