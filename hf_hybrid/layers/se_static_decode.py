"""SE-Attn's decode step on fixed buffers, for generate()'s static step (hf_hybrid/generation/graph_decode.py):
every row at the same position, the retrieval state of all rows in preallocated tensors, and every
choice (which block closes, which blocks are retrieved, which keys are visible) made on the device
from the position counter, so the step is one fixed sequence of kernels a CUDA graph can replay.

:class:`SEBatchState` is :class:`~hf_hybrid.layers.span_expanded_attention.SERowState` of every row
stacked into buffers sized for generate()'s capacity; it converts from and back to the per-row
states exactly, so eager calls (several tokens, another mode, padded rows) continue from it.

One step at position p (:func:`advance_batch_state`, then :func:`attention_operands`), the same
arithmetic as the row-by-row step (``SpanExpandedAttention._extend_row``):

* the query goes to slot p % S of the open block's queries; the summary of block p // S is
  computed from them and the block's cached keys and written to its slot *every* step: it is only
  correct once the block's last token is in, but a block is never retrieved before then (retrieval
  reads blocks wholly before the chunk start, and p // S is at or after it), so the early writes
  are never read and need no host decision;
* chunk_sum restarts at a chunk start, group_sum takes chunk_sum at a selection group's first query;
* ``se`` / ``se_random`` rank all summary slots with :func:`select_blocks` (slots at or after the
  chunk start's block are masked to -inf there, the written-but-incomplete one included), top-k on
  fixed shapes;
* the attention reads the K/V buffers from the first column a query of this generation can see
  without retrieval (a host int fixed when the state is stacked: the own chunk's start, the window's
  first key), under a mask from the position; retrieved blocks are masked in place when that column
  is 0, else gathered (k blocks per query head) and appended, so a long prompt costs the own chunk
  and k blocks per step, not the whole cache.
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


@torch.no_grad()
def advance_batch_state(state: SEBatchState, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                        position: torch.Tensor, *, chunk_size: int, select_every: int) -> None:
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


def first_visible_column(mode: str, first_position: int, *, chunk_size: int, window: int | None) -> int:
    """The first cached column any query at ``first_position`` or later can see without retrieval
    (a multiple of 16, which keeps the key count aligned for the fused SDPA kernels). A host int,
    fixed while the static step replays: positions only grow."""
    if mode == "full":
        return 0
    if mode == "swa":
        start = max(0, first_position - window + 1)
    else:  # the own chunk of the chunked modes
        start = (first_position // chunk_size) * chunk_size
    return start - start % 16


@torch.no_grad()
def attention_operands(state: SEBatchState, keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor, start: int,
                       *, mode: str, chunk_size: int, block_size: int, top_k: int, num_heads: int, window: int | None,
                       seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the query at ``position`` attends over in ``mode`` (kernels/span_expanded_attention/
    reference.py's span_expanded_mask for one query), from the K/V buffers [batch, capacity,
    kv_heads, head_dim] and ``start`` (:func:`first_visible_column`).

    Returns keys / values [batch, kv_heads, n, head_dim] and a boolean mask [batch or 1, kv_heads or
    1, groups or 1, n] (groups: query heads per kv head, which share the query axis): the buffers'
    columns from ``start`` on (views, no copy) under the mode's causal / window / own-chunk mask,
    and for the retrieval modes the retrieved blocks. With ``start`` 0 those are masked in place;
    past 0 (long prompts: the own chunk far from the beginning) the retrieved blocks are gathered
    and appended to the columns (top_k * block_size keys per query head instead of every column).
    """
    columns = start + torch.arange(keys.shape[1] - start, device=position.device)
    causal = columns <= position
    key_view, value_view = keys[:, start:].transpose(1, 2), values[:, start:].transpose(1, 2)
    if mode == "full":
        return key_view, value_view, causal.view(1, 1, 1, -1)
    if mode == "swa":
        return key_view, value_view, (causal & (columns > position - window)).view(1, 1, 1, -1)
    own_chunk = (causal & (columns >= position - position % chunk_size)).view(1, 1, 1, -1)
    last_chunk_start = ((keys.shape[1] - 1) // chunk_size) * chunk_size
    if mode not in RETRIEVAL_MODES or top_k == 0 or last_chunk_start // block_size == 0:
        # se_nomem, or no step up to the capacity has a complete block before its chunk (a
        # generation inside the first chunk): nothing to retrieve, a mask shared by every head
        return key_view, value_view, own_chunk
    indices, valid = select_blocks(
        state.group_sum[:, None] if mode == "se" else None, state.summaries, position // chunk_size, mode=mode,
        chunk_size=chunk_size, block_size=block_size, top_k=top_k, num_heads=num_heads, seed=seed,
    )
    batch, kv_heads = keys.shape[0], keys.shape[2]
    groups = num_heads // kv_heads
    if start == 0:
        table = retrieved_block_table(indices, valid, state.summaries.shape[1])  # [batch, heads, 1, blocks]
        in_span = table[..., columns // block_size]  # retrieved blocks lie before the chunk start
        return key_view, value_view, (own_chunk | in_span).view(batch, kv_heads, groups, -1)
    gathered_keys, gathered_values, gathered_mask = gather_retrieved(keys, values, indices, valid, block_size, groups)
    mask = torch.cat([own_chunk.expand(batch, kv_heads, groups, -1), gathered_mask], dim=-1)
    return torch.cat([key_view, gathered_keys], dim=2), torch.cat([value_view, gathered_values], dim=2), mask


def gather_retrieved(keys: torch.Tensor, values: torch.Tensor, indices: torch.Tensor, valid: torch.Tensor, block_size: int,
                     groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The K/V of the retrieved blocks, per kv head the blocks of its ``groups`` query heads in a row:
    keys / values [batch, kv_heads, groups * k * block_size, head_dim] and the mask [batch, kv_heads,
    groups, groups * k * block_size] (a query head sees its own blocks' valid slots only).
    indices / valid [batch, heads, 1, k] from select_blocks."""
    batch, capacity, kv_heads, dim = keys.shape
    per_head = indices.shape[-1] * block_size
    offsets = torch.arange(block_size, device=indices.device)
    positions = (indices[:, :, 0, :, None] * block_size + offsets).clamp(max=capacity - 1)  # [batch, heads, k, S]
    index = positions.reshape(batch, kv_heads, groups * per_head, 1).expand(-1, -1, -1, dim)
    gathered_keys = torch.gather(keys.transpose(1, 2), 2, index)
    gathered_values = torch.gather(values.transpose(1, 2), 2, index)
    slot_valid = valid[:, :, 0, :, None].expand(-1, -1, -1, block_size).reshape(batch, kv_heads, 1, groups * per_head)
    owner = torch.arange(groups * per_head, device=indices.device) // per_head
    own_slots = owner[None, :] == torch.arange(groups, device=indices.device)[:, None]  # [groups, groups * k * S]
    return gathered_keys, gathered_values, own_slots & slot_valid
