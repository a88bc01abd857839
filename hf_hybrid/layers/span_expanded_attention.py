"""Attention layer of SE-Attn hybrids: Llama-style q/k/v/o (GQA, optionally partial RoPE) whose
attention runs in one of five modes - ``full``, ``se``, ``swa``, ``se_nomem``, ``se_random`` - from
``hf_hybrid.kernels.span_expanded_attention`` (the math and our causal reading of the paper's
retrieval live in its reference.py).

``full`` mode is plain causal softmax attention and goes through transformers' attention interface
(``config._attn_implementation``, read per call; hf_hybrid/layers/attention.py), padded batches and
caches included (with a cache, each row's retrieval state still advances). The other modes take
three paths:

* no cache: the whole segment goes through the SE-Attn op. Left-padded rows
  are run one by one on their real tokens, so chunk and block boundaries follow each row's own
  positions and a padded row computes exactly what it computes alone.
* cache, nothing cached yet for a row (prefill): the same op, then the row's retrieval state is built.
* cache, continuing a row (decode, chunked prefill): per row, new queries attend over the row's cached
  keys under the mode's visibility mask; ``se`` retrieves with the block summaries and the running
  chunk-query sums kept in the cache (:class:`SERowState`), never recomputing old summaries.
* generate()'s static decode step (hf_hybrid/generation), every mode: one token per row, all rows
  at one position, on fixed-capacity K/V buffers and the rows' retrieval state stacked in fixed
  buffers (se_static_decode.py); block closing, top-k retrieval and the key mask are decided on
  the device, and the state converts back to the per-row one exactly for the paths above.

The retrieval state is maintained in every mode, so a cache filled in one mode can decode in another.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from ..kernels.span_expanded_attention import (
    MODES,
    RETRIEVAL_MODES,
    block_summaries,
    masked_attention,
    retrieved_block_table,
    select_blocks,
    span_expanded_attention,
    span_expanded_mask,
)
from .attention import softmax_attention
from .context import SequenceContext
from .se_static_decode import advance_batch_state, attention_operands, first_visible_column
from .rotary import apply_rotary, build_rotary, rotary_tables


@dataclass
class SESettings:
    """The SE-Attn hyper-parameters of a layer (from the model config)."""

    mode: str = "full"
    chunk_sizes: tuple[int, ...] = (2048, 4096)
    eval_chunk_size: int = 4096
    block_size: int = 32
    top_k: int = 8
    select_every: int = 128
    window: int = 4096
    seed: int = 0
    backend: str = "auto"


@dataclass
class SERowState:
    """What one batch row needs to continue SE-Attn incrementally (kept by the model's cache).

    length: real tokens seen; summaries [blocks, heads, head_dim] (float32) of its complete blocks;
    open_queries [< S, heads, head_dim]: queries of the block still open (needed for its summary);
    chunk_sum [heads, head_dim]: sum of the queries of the current chunk so far; group_sum: the
    chunk's query sum through the first query of the current selection group (what it ranks with).
    """

    length: int = 0
    summaries: torch.Tensor | None = None
    open_queries: torch.Tensor | None = None
    chunk_sum: torch.Tensor | None = None
    group_sum: torch.Tensor | None = None

    def map_tensors(self, fn) -> "SERowState":
        def apply(t):
            return None if t is None else fn(t)

        return SERowState(self.length, apply(self.summaries), apply(self.open_queries), apply(self.chunk_sum), apply(self.group_sum))


class SpanExpandedAttention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rope_theta: float | None,
        settings: SESettings,
        partial_rotary_factor: float = 1.0,
        attention_bias: bool = False,
        *,
        config=None,
        layer_idx: int | None = None,
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        # Read by transformers' attention functions in `full` mode (config: the implementation).
        self.config, self.layer_idx = config, layer_idx
        self.is_causal = True
        self.num_key_value_groups = num_heads // num_kv_heads
        self.settings = settings
        self.rotary_dim = int(head_dim * partial_rotary_factor)
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=attention_bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=attention_bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=attention_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=attention_bias)
        self.rotary = build_rotary(self.rotary_dim, rope_theta)

    # ------------------------------------------------------------------ projections

    def _rotate(self, x: torch.Tensor, cos_sin) -> torch.Tensor:
        if self.rotary_dim == self.head_dim:
            return apply_rotary(x, cos_sin)
        return torch.cat([apply_rotary(x[..., : self.rotary_dim], cos_sin), x[..., self.rotary_dim :]], dim=-1)

    def forward(
        self,
        hidden_states: torch.Tensor,
        context: SequenceContext,
        cache_layer=None,
        attention_mode: str | None = None,
        se_chunk_size: int | None = None,
        **unused,
    ) -> torch.Tensor:
        mode = self.settings.mode if attention_mode is None else attention_mode
        if mode not in MODES:
            raise ValueError(f"attention_mode={mode!r} is not one of {MODES}.")
        batch, seq, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(batch, seq, self.num_heads, self.head_dim)
        k = self.k_proj(hidden_states).view(batch, seq, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden_states).view(batch, seq, self.num_kv_heads, self.head_dim)
        cos_sin = rotary_tables(self.rotary, context)
        q, k = self._rotate(q, cos_sin), self._rotate(k, cos_sin)
        chunk_size = self._chunk_size(se_chunk_size, mode, cached=cache_layer is not None)
        if cache_layer is None:
            out = self._full(q, k, v, context) if mode == "full" else self._attend_rows(q, k, v, context, mode, chunk_size)
        elif seq == 1 and context.key_valid is None and getattr(cache_layer, "static_decode_active", False):
            out = self._static_decode(q, k, v, cache_layer, mode, chunk_size)  # generate()'s static step (hf_hybrid/generation)
        else:
            out = self._attend_cached(q, k, v, context, cache_layer, mode, chunk_size)
        return self.o_proj(out.reshape(batch, seq, -1))

    def _static_decode(self, q, k, v, cache_layer, mode: str, chunk_size: int) -> torch.Tensor:
        """One token per row, every row at the same position, against the cache's fixed-capacity
        buffers: K/V written at the device column, the retrieval state advanced in place, then one
        SDPA over what the mode lets the query see (se_static_decode.attention_operands; the query
        heads of a group share the query axis, so SDPA needs no GQA expansion)."""
        s, batch = self.settings, q.shape[0]
        cache_layer.check_chunk_size(chunk_size)
        start = first_visible_column(mode, cache_layer.static_first_position, chunk_size=chunk_size, window=s.window)
        keys, values, length = cache_layer.static_decode_update(k, v)
        position = length - 1
        state = cache_layer.static_retrieval_state
        advance_batch_state(state, q[:, 0], keys, values, position, chunk_size=chunk_size, select_every=s.select_every)
        keys, values, mask = attention_operands(
            state, keys, values, position, start, mode=mode, chunk_size=chunk_size, block_size=s.block_size,
            top_k=s.top_k, num_heads=self.num_heads, window=s.window, seed=s.seed,
        )
        qg = q.view(batch, self.num_kv_heads, self.num_key_value_groups, self.head_dim)
        out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask)
        return out.reshape(batch, 1, self.num_heads, self.head_dim)

    def _full(self, q, k, v, context: SequenceContext) -> torch.Tensor:
        """`full` mode: causal attention of [B, T, H, D] queries over [B, S, H_kv, D] keys (the last T
        of them are the new tokens) through transformers' attention interface."""
        key_start = context.past_length + q.shape[1] - k.shape[1]
        return softmax_attention(self, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), context, key_start=key_start)

    def _chunk_size(self, requested: int | None, mode: str, cached: bool) -> int:
        if requested is not None:
            if requested < 1 or requested % self.settings.select_every:
                raise ValueError(
                    f"se_chunk_size ({requested}) must be >= 1 and a multiple of se_select_every ({self.settings.select_every})."
                )
            return requested
        if self._draws_chunk_size(requested, mode, cached):
            return self._drawn_chunk_size()
        return self.settings.eval_chunk_size

    def _drawn_chunk_size(self) -> int:
        sizes = self.settings.chunk_sizes
        return sizes[int(torch.randint(len(sizes), ()).item())]  # drawn per layer and forward (Sec. 4.2)

    def _draws_chunk_size(self, requested: int | None, mode: str, cached: bool) -> bool:
        return (requested is None and self.training and not cached and len(self.settings.chunk_sizes) > 1
                and mode in ("se", "se_nomem", "se_random"))

    def training_graph_kwargs(self, attention_mode: str | None = None, se_chunk_size: int | None = None, **kwargs) -> dict:
        """This layer's keywords with the chunk size a training forward would draw drawn now (the same
        draw) and passed as ``se_chunk_size``: a captured training forward (hf_hybrid/training/
        layer_graphs.py) keys by it, where a draw inside the capture would stay its draw for good."""
        mode = self.settings.mode if attention_mode is None else attention_mode
        if self._draws_chunk_size(se_chunk_size, mode, cached=False):
            se_chunk_size = self._drawn_chunk_size()
        if attention_mode is not None:
            kwargs["attention_mode"] = attention_mode
        if se_chunk_size is not None:
            kwargs["se_chunk_size"] = se_chunk_size
        return kwargs

    # ------------------------------------------------------------------ whole segments

    def _op(self, q, k, v, mode: str, chunk_size: int) -> torch.Tensor:
        s = self.settings
        return span_expanded_attention(
            q, k, v, mode=mode, chunk_size=chunk_size, block_size=s.block_size, top_k=s.top_k,
            select_every=s.select_every, window=s.window, seed=s.seed, backend=s.backend,
        )

    def _attend_rows(self, q, k, v, context: SequenceContext, mode: str, chunk_size: int) -> torch.Tensor:
        if context.key_valid is None:
            return self._op(q, k, v, mode, chunk_size)
        out = torch.zeros_like(q)  # padding queries' outputs are ignored downstream
        for row in range(q.shape[0]):
            real = context.key_valid[row].nonzero()[:, 0]
            if real.numel():
                out[row, real] = self._op(q[row, real][None], k[row, real][None], v[row, real][None], mode, chunk_size)[0]
        return out

    # ------------------------------------------------------------------ with a cache

    def _attend_cached(self, q, k, v, context: SequenceContext, cache_layer, mode: str, chunk_size: int) -> torch.Tensor:
        cache_layer.check_chunk_size(chunk_size)
        keys, values = cache_layer.update(k, v)  # [batch, past + seq, kv_heads, head_dim], index space
        past, full = context.past_length, mode == "full"
        cache_layer.record_queries(q, self._extend_row)  # kept only while a crop may need them
        out = torch.zeros_like(q)
        for row in range(q.shape[0]):
            if context.key_valid is None:
                real_keys = torch.arange(keys.shape[1], device=q.device)
                new = torch.arange(q.shape[1], device=q.device)
            else:
                real_keys = context.key_valid[row].nonzero()[:, 0]
                new = context.key_valid[row, past:].nonzero()[:, 0]
            if not new.numel():
                continue
            state = cache_layer.row_state(row)
            q_new, k_row, v_row = q[row, new], keys[row, real_keys], values[row, real_keys]
            if state.length + new.numel() != real_keys.numel():
                raise RuntimeError("SE cache out of sync with attention_mask: every cached real token must stay a real token.")
            row_out = self._extend_row(state, q_new, k_row, v_row, mode, chunk_size, compute_output=not full)
            if not full:
                out[row, new] = row_out
        # `full` attends over all rows at once (the rows above only advanced their retrieval state).
        return self._full(q, keys, values, context) if full else out

    def _extend_row(
        self, state: SERowState, q_new, k_row, v_row, mode: str, chunk_size: int, compute_output: bool = True
    ) -> torch.Tensor | None:
        """Outputs of a row's new queries (positions state.length ...; None unless compute_output),
        then advance its state."""
        s = self.settings
        start, count = state.length, q_new.shape[0]
        _extend_summaries(state, q_new, k_row, v_row, s.block_size)
        prefix = q_new.to(_acc(q_new)).cumsum(dim=0)
        positions = torch.arange(start, start + count, device=q_new.device)
        group_first = (positions // chunk_size) * chunk_size + ((positions % chunk_size) // s.select_every) * s.select_every
        firsts = torch.unique_consecutive(group_first)
        group_sums = torch.stack([_group_sum(state, prefix, start, int(f), chunk_size) for f in firsts])
        if not compute_output:
            out = None
        elif start == 0:
            out = self._op(q_new[None], k_row[None], v_row[None], mode, chunk_size)[0]
        else:
            out = self._attend_continuation(state, q_new, k_row, v_row, mode, chunk_size, firsts, group_first, group_sums)
        last = start + count - 1
        chunk_start = (last // chunk_size) * chunk_size
        state.chunk_sum = _prefix_sum(state.chunk_sum if chunk_start < start else None, prefix, start, max(chunk_start, start), last)
        state.group_sum = group_sums[-1]
        state.length = start + count
        return out

    def _attend_continuation(self, state, q_new, k_row, v_row, mode, chunk_size, firsts, group_first, group_sums):
        s = self.settings
        start, count, num_keys = state.length, q_new.shape[0], k_row.shape[0]
        common = dict(query_start=start, chunk_size=chunk_size, block_size=s.block_size, select_every=s.select_every, window=s.window)
        if mode not in RETRIEVAL_MODES:
            mask = span_expanded_mask(mode, count, num_keys, **common).to(q_new.device)
            return masked_attention(q_new[None], k_row[None], v_row[None], mask)[0]
        chunk_index = firsts // chunk_size
        summaries = state.summaries[None]
        indices, valid = select_blocks(
            group_sums[None] if mode == "se" else None, summaries, chunk_index, mode=mode, chunk_size=chunk_size,
            block_size=s.block_size, top_k=s.top_k, num_heads=self.num_heads, seed=s.seed,
        )
        table = retrieved_block_table(indices, valid, summaries.shape[1])[0]  # [heads, groups, blocks]
        per_query = table[:, torch.searchsorted(firsts, group_first)]  # [heads, count, blocks]
        block_of_key = torch.arange(num_keys, device=q_new.device) // s.block_size
        in_span = F.pad(per_query, (0, 1))[..., block_of_key.clamp(max=summaries.shape[1])]  # [heads, count, keys]
        own = span_expanded_mask("se_nomem", count, num_keys, **common).to(q_new.device)
        return masked_attention(q_new[None], k_row[None], v_row[None], (own | in_span)[None])[0]


# ---------------------------------------------------------------------- row-state arithmetic


def _acc(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _prefix_sum(base, prefix, start: int, first: int, last: int) -> torch.Tensor:
    """base + sum of new queries at positions first..last (first >= start), from their prefix sums."""
    total = prefix[last - start] - (prefix[first - start - 1] if first > start else 0)
    return total if base is None else base + total


def _group_sum(state: SERowState, prefix, start: int, first: int, chunk_size: int) -> torch.Tensor:
    """The chunk's query sum through position ``first`` (a group's first query)."""
    if first < start:  # the group began before this segment: its sum is cached
        return state.group_sum
    chunk_start = (first // chunk_size) * chunk_size
    base = state.chunk_sum if chunk_start < start else None
    return _prefix_sum(base, prefix, start, max(chunk_start, start), first)


def _extend_summaries(state: SERowState, q_new, k_row, v_row, block_size: int) -> None:
    """Summarise every block the new tokens complete; keep the queries of the block left open."""
    heads, dim = q_new.shape[1:]
    if state.summaries is None:
        state.summaries = q_new.new_zeros(0, heads, dim, dtype=_acc(q_new))
        state.open_queries = q_new[:0]
    done = state.summaries.shape[0]
    total = state.length + q_new.shape[0]
    complete = total // block_size
    queries = torch.cat([state.open_queries, q_new])  # positions done * S .. total - 1
    if complete > done:
        span = slice(done * block_size, complete * block_size)
        fresh = block_summaries(queries[None, : (complete - done) * block_size], k_row[None, span], v_row[None, span], block_size)
        state.summaries = torch.cat([state.summaries, fresh[0]])
    state.open_queries = queries[(complete - done) * block_size :]


__all__ = ["SERowState", "SESettings", "SpanExpandedAttention"]
