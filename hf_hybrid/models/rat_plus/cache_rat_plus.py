"""RatPlusCache: per layer, only what the active sparse pattern needs to decode (RAT+ Sec. 4-5).

Every RAT+ layer keeps the running recurrence state k~, v~ of the last token (float32, un-rotated,
[batch, kv_heads, head_dim]). Its K/V memory depends on the pattern of each group of heads that
share a pattern (``SparseInferenceConfig.layer_groups``); each group keeps its own store, holding
only the kv heads its query heads read:

* dilated (D > 1, window W, I sinks) -> :class:`DilatedStore`: the rotated k~ / v~ of every
  block end (position p with (p + 1) % D == 0), of the last W tokens and of the first I tokens:
  T / D + W + I entries instead of T.
* dense (D = 1) -> :class:`FullStore`: every key and value.
* top-k -> :class:`FullStore` with per-block summaries (Quest min/max or MoBA mean of the keys of
  every complete block), so decoding scores blocks without re-reading their keys.

Everything is indexed by *position* in its row (slot p // D for block ends, slot p for sinks,
explicit positions for the window and full stores, -1 for padding), so left-padded rows, which
reach the same position at different steps, share one tensor.

A cache is tied to the pattern it was filled with: the compact stores cannot serve another one,
so a call with a different ``sparse_config`` on the same cache raises.

Crops (assisted decoding, ``Cache.crop``): while past recording is on, each layer keeps the float32
k~, v~ after each of the last ``crop_window`` tokens, and dilated stores keep the columns added
since the last crop (up to ``crop_window``) beyond their window; see ``RatPlusLayerCache.crop``.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from ...kernels.chunk_attention.rat_plus_decode import StoreLayout, store_decoded_token, visible_sinks
from ...kernels.topk_block_attention import block_summaries
from ...layers.rat_plus_attention import STORED_ARE_VISIBLE, select_kv_heads
from ...sparse import AttentionPattern
from ..cache_layer import CroppableCacheMixin, StateHistoryMixin, TensorMapLayer, restore_into, tokens_to_keep

_FAR = torch.iinfo(torch.int64).max


def _cat(old: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    return new if old is None else torch.cat([old, new], dim=1)


def _grow(x: torch.Tensor, slots: int, fill=0) -> torch.Tensor:
    """Extend dim 1 of x to ``slots`` entries, new ones set to ``fill``."""
    if x.shape[1] >= slots:
        return x
    extra = x.new_full((x.shape[0], slots - x.shape[1], *x.shape[2:]), fill)
    return torch.cat([x, extra], dim=1)


class FullStore:
    """All keys/values of a group's kv heads (dense and top-k patterns), plus block summaries for top-k."""

    tensor_names = ("keys", "values", "positions", "summary", "complete")

    def __init__(self, pattern: AttentionPattern):
        self.pattern = pattern
        self.keys = self.values = self.positions = None
        self.summary = self.complete = None

    def update(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, need_keys: bool = True,
               first_position: int | None = None):
        """Append a segment ([batch, seq, kv, dim], positions [batch, seq], -1 = padding); the
        returned tensors are the store's own (``need_keys`` and ``first_position`` cost nothing here).

        Returns (keys, values, positions, summary) over everything held; summary is None unless top-k.
        """
        self.keys, self.values = _cat(self.keys, keys), _cat(self.values, values)
        self.positions = _cat(self.positions, positions)
        if self.pattern.kind != "topk":
            return self.keys, self.values, self.positions, None
        return self.keys, self.values, self.positions, self._update_summary(keys.shape[1])

    def _update_summary(self, num_new: int):
        """Summarise the blocks the new tokens completed. Their keys lie in the last num_new + B - 1
        columns (padding only precedes a row's first token), so only that tail is read."""
        size, scoring = self.pattern.block_size, self.pattern.block_scoring
        num_blocks = int(self.positions.max() + 1) // size
        tail = min(self.keys.shape[1], num_new + size - 1)
        stats, complete = block_summaries(self.keys[:, -tail:], self.positions[:, -tail:], size, scoring, num_blocks)
        if self.summary is None:
            self.summary, self.complete = stats, complete
        else:
            self.summary = _grow(self.summary, num_blocks)
            self.complete = _grow(self.complete, num_blocks, False)
            fresh = complete & ~self.complete
            self.summary = torch.where(fresh[:, :, None, None, None], stats, self.summary)
            self.complete = self.complete | fresh
        return self.summary, self.complete

    def can_crop(self, keep: int, removed: int) -> bool:
        return True

    def crop(self, keep: int, removed: int) -> None:
        """Keep the first ``keep`` columns (keep >= 1). Blocks completed only by dropped tokens
        lose their summary; it is computed again when they complete."""
        self.keys, self.values, self.positions = self.keys[:, :keep], self.values[:, :keep], self.positions[:, :keep]
        if self.summary is None:
            return
        size = self.pattern.block_size
        row_last = self.positions.amax(dim=1)  # -1 for a row of padding only
        num_blocks = (int(row_last.max()) + 1) // size
        block_last = (torch.arange(num_blocks, device=row_last.device) + 1) * size - 1
        self.summary = self.summary[:, :num_blocks]
        self.complete = self.complete[:, :num_blocks] & (block_last[None] <= row_last[:, None])

    @property
    def num_entries(self) -> int:
        return 0 if self.keys is None else self.keys.shape[1]


class DilatedStore:
    """Block ends, local window and sinks of a group's kv heads (dilated pattern D > 1)."""

    tensor_names = ("sink_keys", "sink_values", "sink_valid", "end_keys", "end_values", "end_valid",
                    "window_keys", "window_values", "window_positions")
    # Columns kept beyond the local window, so that a crop of that many tokens still finds the
    # window it needs (set by the layer cache while past recording is on).
    extra_window = 0

    def __init__(self, pattern: AttentionPattern):
        self.pattern = pattern
        for name in self.tensor_names:
            setattr(self, name, None)

    def _lazy_init(self, keys: torch.Tensor) -> None:
        batch, _, heads, dim = keys.shape
        sinks = self.pattern.num_sink_tokens
        self.sink_keys = keys.new_zeros(batch, sinks, heads, dim)
        self.sink_values = keys.new_zeros(batch, sinks, heads, dim)
        self.sink_valid = torch.zeros(batch, sinks, dtype=torch.bool, device=keys.device)
        self.end_keys = keys.new_zeros(batch, 0, heads, dim)
        self.end_values = keys.new_zeros(batch, 0, heads, dim)
        self.end_valid = torch.zeros(batch, 0, dtype=torch.bool, device=keys.device)
        self.window_keys = keys.new_zeros(batch, 0, heads, dim)
        self.window_values = keys.new_zeros(batch, 0, heads, dim)
        self.window_positions = torch.zeros(batch, 0, dtype=torch.long, device=keys.device)

    def update(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, need_keys: bool = True,
               first_position: int | None = None):
        """Store a segment and return (keys, values, positions, None) for its attention, or None
        when ``need_keys`` is False (a prefill that attends over its own keys: then only the
        window's tail of the segment is copied, not the whole segment twice).

        The returned keys are [sinks; block ends; window + new tokens]. Sinks and block ends that
        also lie in the window/new span, and sinks that are block ends, get position -1 so every key
        appears once; ``dilated_mask`` over these positions then gives exactly the pattern's keys.
        ``first_position``: every row holds positions first_position, first_position + 1, ...
        (no padding), so the sinks and ends to keep are known on the host: strided copies instead
        of nonzero() scatters, whose device-to-host reads stall a prefill (3 per layer).
        """
        if self.sink_keys is None:
            self._lazy_init(keys)
        if first_position is not None:
            self._store_aligned(keys, values, first_position)
        else:
            self._store_scattered(keys, values, positions)
        # Recent span = previous window + this segment; keep its last W columns for the next call.
        window = self.pattern.local_window + self.extra_window
        tail = keys.shape[1] if need_keys else min(window, keys.shape[1])  # what the next window can hold
        new = slice(keys.shape[1] - tail, None)
        recent_keys = torch.cat([self.window_keys, keys[:, new]], dim=1)
        recent_values = torch.cat([self.window_values, values[:, new]], dim=1)
        recent_positions = torch.cat([self.window_positions, positions[:, new]], dim=1)
        keep = recent_keys.shape[1] - min(window, recent_keys.shape[1])
        self.window_keys, self.window_values = recent_keys[:, keep:], recent_values[:, keep:]
        self.window_positions = recent_positions[:, keep:]
        if not need_keys:
            return None

        dilation, sinks = self.pattern.dilation, self.pattern.num_sink_tokens
        first_recent = torch.where(recent_positions >= 0, recent_positions, _FAR).amin(dim=1, keepdim=True)
        sink_pos = torch.arange(sinks, device=keys.device).expand_as(self.sink_valid)
        sink_ok = self.sink_valid & (sink_pos < first_recent) & ((sink_pos + 1) % dilation != 0)
        end_pos = (torch.arange(self.end_valid.shape[1], device=keys.device) * dilation + dilation - 1).expand_as(self.end_valid)
        end_ok = self.end_valid & (end_pos < first_recent)
        all_keys = torch.cat([self.sink_keys, self.end_keys, recent_keys], dim=1)
        all_values = torch.cat([self.sink_values, self.end_values, recent_values], dim=1)
        all_positions = torch.cat(
            [torch.where(sink_ok, sink_pos, -1), torch.where(end_ok, end_pos, -1), recent_positions], dim=1
        )
        return all_keys, all_values, all_positions, None

    def _store_scattered(self, keys, values, positions) -> None:
        dilation, sinks = self.pattern.dilation, self.pattern.num_sink_tokens
        real = positions >= 0
        # Sinks: slot p for positions p < I.
        rows, cols = (real & (positions < sinks)).nonzero(as_tuple=True)
        slots = positions[rows, cols]
        self.sink_keys[rows, slots] = keys[rows, cols]
        self.sink_values[rows, slots] = values[rows, cols]
        self.sink_valid[rows, slots] = True
        # Block ends: slot p // D for positions with (p + 1) % D == 0.
        rows, cols = (real & ((positions + 1) % dilation == 0)).nonzero(as_tuple=True)
        if rows.numel():
            slots = positions[rows, cols] // dilation
            self._grow_ends(int(slots.max()) + 1)
            self.end_keys[rows, slots] = keys[rows, cols]
            self.end_values[rows, slots] = values[rows, cols]
            self.end_valid[rows, slots] = True

    def _store_aligned(self, keys, values, start: int) -> None:
        """_store_scattered for positions start + t in every row (see update)."""
        dilation, sinks, seq = self.pattern.dilation, self.pattern.num_sink_tokens, keys.shape[1]
        stop = min(sinks, start + seq)
        if stop > start:  # sinks: slots start .. stop - 1
            self.sink_keys[:, start:stop] = keys[:, : stop - start]
            self.sink_values[:, start:stop] = values[:, : stop - start]
            self.sink_valid[:, start:stop] = True
        first = (dilation - 1 - start) % dilation  # first token closing a block
        if first < seq:
            slot = (start + first) // dilation
            count = len(range(first, seq, dilation))
            self._grow_ends(slot + count)
            self.end_keys[:, slot : slot + count] = keys[:, first::dilation]
            self.end_values[:, slot : slot + count] = values[:, first::dilation]
            self.end_valid[:, slot : slot + count] = True

    def _grow_ends(self, needed: int) -> None:
        self.end_keys, self.end_values = _grow(self.end_keys, needed), _grow(self.end_values, needed)
        self.end_valid = _grow(self.end_valid, needed, False)

    def trim_window(self) -> None:
        """Back to the last local_window columns (after a crop: later crops reach back only to it)."""
        if self.window_keys is not None and self.window_keys.shape[1] > self.pattern.local_window:
            drop = self.window_keys.shape[1] - self.pattern.local_window
            self.window_keys, self.window_values = self.window_keys[:, drop:], self.window_values[:, drop:]
            self.window_positions = self.window_positions[:, drop:]

    def can_crop(self, keep: int, removed: int) -> bool:
        """Whether the window still holds the last local_window columns after dropping ``removed``."""
        return self.window_keys.shape[1] - removed >= min(self.pattern.local_window, keep)

    def crop(self, keep: int, removed: int) -> None:
        """Drop the last ``removed`` columns (``keep`` >= 1 remain): from the window, and the sinks
        and block ends those tokens were."""
        held = self.window_keys.shape[1] - removed
        self.window_keys, self.window_values = self.window_keys[:, :held], self.window_values[:, :held]
        self.window_positions = self.window_positions[:, :held]
        row_last = self.window_positions.amax(dim=1) if held else torch.full_like(self.sink_valid[:, 0], -1, dtype=torch.long)
        device = row_last.device
        sink_pos = torch.arange(self.sink_valid.shape[1], device=device)
        self.sink_valid = self.sink_valid & (sink_pos[None] <= row_last[:, None])
        end_pos = torch.arange(self.end_valid.shape[1], device=device) * self.pattern.dilation + self.pattern.dilation - 1
        self.end_valid = self.end_valid & (end_pos[None] <= row_last[:, None])

    @property
    def num_entries(self) -> int:
        if self.sink_keys is None:
            return 0
        return self.sink_keys.shape[1] + self.end_keys.shape[1] + self.window_keys.shape[1]


def make_store(pattern: AttentionPattern) -> FullStore | DilatedStore:
    return DilatedStore(pattern) if pattern.kind == "dilated" else FullStore(pattern)


# ------------------------------------------------------------------ static decode (hf_hybrid/generation)
# generate()'s decode step on fixed buffers, capturable in a CUDA graph: every row is at the same
# position p (no padding), held in a device tensor, and each store writes the new token at a
# column computed from p on the device. Keys carry their positions (-1 = nothing there), so the
# layer's position masks (dilated_mask) select exactly the eager stores' keys.


class StaticFullStore:
    """Dense and top-k patterns: column p holds position p, for generate()'s whole max_length. Top-k
    also keeps its block summaries in slots for every block of that length: each step summarises
    the block of its token again from the block's columns (a block not complete yet gets zeros and
    ``complete`` False, as in the eager store, so it is never scored), which needs no host decision."""

    def __init__(self, store: FullStore, capacity: int):
        used = store.keys.shape[1]
        self.pattern = store.pattern
        self.keys = store.keys.new_zeros(store.keys.shape[0], capacity, *store.keys.shape[2:])
        self.values = torch.zeros_like(self.keys)
        self.positions = store.positions.new_full((store.positions.shape[0], capacity), -1)
        self.keys[:, :used], self.values[:, :used], self.positions[:, :used] = store.keys, store.values, store.positions
        self.layout = StoreLayout.dense(capacity)
        self.summary = self.complete = self.block_offsets = None
        if self.pattern.kind == "topk":
            blocks, held = -(-capacity // self.pattern.block_size), store.summary.shape[1]
            self.summary = store.summary.new_zeros(store.summary.shape[0], blocks, *store.summary.shape[2:])
            self.complete = torch.zeros(self.summary.shape[:2], dtype=torch.bool, device=self.summary.device)
            self.summary[:, :held], self.complete[:, :held] = store.summary, store.complete
            self.block_offsets = torch.arange(self.pattern.block_size, device=self.keys.device)

    def decode(self, keys, values, position):
        """One token per row [batch, 1, kv, dim] at ``position`` ([1] long tensor)."""
        store_decoded_token(self.keys, self.values, self.positions, keys, values, position, self.layout)
        if self.summary is None:
            return self.keys, self.values, self.positions, None
        self._summarise_block_of(position)
        return self.keys, self.values, self.positions, (self.summary, self.complete)

    def _summarise_block_of(self, position: torch.Tensor) -> None:
        """Summary slot of the block holding ``position`` from the block's columns (block_summaries
        over that one block: positions made relative to its start; columns past the capacity count
        as missing)."""
        size, capacity = self.pattern.block_size, self.keys.shape[1]
        block = torch.div(position, size, rounding_mode="floor")
        columns = block * size + self.block_offsets
        inside = columns < capacity
        columns = columns.clamp(max=capacity - 1)
        stored = self.positions.index_select(1, columns)
        relative = torch.where(inside & (stored >= 0), stored - block * size, -1)
        stats, complete = block_summaries(self.keys.index_select(1, columns), relative, size, self.pattern.block_scoring, 1)
        self.summary.index_copy_(1, block, stats)
        self.complete.index_copy_(1, block, complete)

    def step_buffers(self):
        """(keys, values, stored positions, sink flags) of a fused decode step (kernels/chunk_attention/rat_plus_decode.py)."""
        return self.keys, self.values, self.positions, None

    def to_store(self, tokens: int) -> FullStore:
        """Back to the eager layout after ``tokens`` tokens (for a later multi-token update)."""
        store = FullStore(self.pattern)
        store.keys, store.values = self.keys[:, :tokens].clone(), self.values[:, :tokens].clone()
        store.positions = self.positions[:, :tokens].clone()
        if self.summary is not None:  # the complete blocks, as the eager store holds them
            blocks = tokens // self.pattern.block_size
            store.summary, store.complete = self.summary[:, :blocks].clone(), self.complete[:, :blocks].clone()
        return store

    def tensors(self):
        return tuple(t for t in (self.keys, self.values, self.positions, self.summary, self.complete) if t is not None)


class StaticDilatedStore:
    """Dilated pattern as columns [sinks (I) | block ends (capacity // D + 1) | ring of the last W + 1
    tokens]. Ring slot p % (W + 1) holds position p while it is among the last W + 1 tokens (the
    window and the token itself). A block end's K/V go into slot p // D when it is decoded, and a
    sink's stay where the prefill put them, but each gets its position, and so becomes visible,
    only once it has left the ring (which shows it until then); a sink that is also a block end
    only as the block end. So every key counts once and every stored position is a visible key:
    the layer masks with ``positions >= 0`` alone (``decode`` returns ``STORED_ARE_VISIBLE``)
    instead of building the pattern's mask each step."""

    def __init__(self, store: DilatedStore, capacity: int, tokens: int):
        """``tokens``: how many the (unpadded) rows hold; the next decoded token is at that position."""
        pattern = self.pattern = store.pattern
        dilation, window, sinks = pattern.dilation, pattern.local_window, pattern.num_sink_tokens
        batch, _, heads, dim = store.end_keys.shape
        self.ring = window + 1
        self.first_end, self.first_ring = sinks, sinks + capacity // dilation + 1
        columns = self.first_ring + self.ring
        device = store.end_keys.device
        self.keys = store.end_keys.new_zeros(batch, columns, heads, dim)
        self.values = torch.zeros_like(self.keys)
        self.stored = torch.full((batch, columns), -1, dtype=torch.long, device=device)  # visible position, -1: none
        left = tokens - window  # positions below this have left the ring before the next token
        self.keys[:, :sinks], self.values[:, :sinks] = store.sink_keys, store.sink_values
        self.sink_positions = torch.arange(sinks, device=device)  # device constants for the per-step sink update
        self.sink_valid = store.sink_valid.clone()
        self.stored[:, :sinks] = visible_sinks(self.sink_valid, self.sink_positions, left, dilation)
        ends = store.end_keys.shape[1]
        span = slice(self.first_end, self.first_end + ends)
        self.keys[:, span], self.values[:, span] = store.end_keys, store.end_values
        end_pos = torch.arange(ends, device=device) * dilation + dilation - 1
        self.stored[:, span] = torch.where(store.end_valid & (end_pos < left), end_pos, -1)
        held = min(window, store.window_keys.shape[1])  # the store may keep extra columns for crops
        if held:
            positions = store.window_positions[:, -held:]
            cols = self.first_ring + positions % self.ring  # unpadded rows: the same columns in every row
            self.keys[:, cols[0]], self.values[:, cols[0]] = store.window_keys[:, -held:], store.window_values[:, -held:]
            self.stored[:, cols[0]] = positions
        self.layout = StoreLayout(self.first_end, self.first_ring, self.ring, dilation, window, sinks)

    def decode(self, keys, values, position):
        store_decoded_token(self.keys, self.values, self.stored, keys, values, position, self.layout,
                            self.sink_valid, self.sink_positions)
        return self.keys, self.values, self.stored, STORED_ARE_VISIBLE

    def step_buffers(self):
        """(keys, values, stored positions, sink flags) of a fused decode step (kernels/chunk_attention/rat_plus_decode.py)."""
        return self.keys, self.values, self.stored, self.sink_valid

    def to_store(self, tokens: int) -> DilatedStore:
        """Back to the eager layout after ``tokens`` tokens (for a later multi-token update)."""
        pattern, sinks = self.pattern, self.pattern.num_sink_tokens
        store = DilatedStore(pattern)
        store.sink_keys, store.sink_values = self.keys[:, :sinks].clone(), self.values[:, :sinks].clone()
        store.sink_valid = self.sink_valid.clone()
        span = slice(self.first_end, self.first_end + tokens // pattern.dilation)
        store.end_keys, store.end_values = self.keys[:, span].clone(), self.values[:, span].clone()
        ends = store.end_keys.shape[1]
        end_pos = torch.arange(ends, device=self.keys.device) * pattern.dilation + pattern.dilation - 1
        store.end_valid = (end_pos < tokens).expand(self.keys.shape[0], ends).clone()  # every block end decoded so far
        kept = min(pattern.local_window, tokens)
        positions = torch.arange(tokens - kept, tokens, device=self.keys.device)
        cols = self.first_ring + positions % self.ring
        store.window_keys, store.window_values = self.keys[:, cols], self.values[:, cols]
        store.window_positions = positions.expand(self.keys.shape[0], kept).clone()
        return store

    def tensors(self):
        return self.keys, self.values, self.stored, self.sink_valid, self.sink_positions


class RatPlusLayerCache(StateHistoryMixin, TensorMapLayer):
    """Cache of one RAT+ layer: recurrence state + one store per head group (see the module docstring)."""

    is_compileable = False
    is_croppable = True  # while past recording is on (StateHistoryMixin), see crop()

    def __init__(self, **kwargs):  # DynamicCache-style constructors may pass unrelated kwargs
        super().__init__()
        self.cumulative_length = 0
        self.state_key: torch.Tensor | None = None
        self.state_value: torch.Tensor | None = None
        self.groups: list[tuple[AttentionPattern, tuple[int, ...]]] | None = None
        self.stores: list[FullStore | DilatedStore] = []
        self.static_decode_active = False  # stores are StaticFullStore / StaticDilatedStore (generate()'s static step)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def recurrent_state(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """float32 k~, v~ after the last cached token (None before the first update)."""
        return self.state_key, self.state_value

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        positions: torch.Tensor,
        groups: list[tuple[AttentionPattern, tuple[int, ...]]],
        group_kv_heads: list[list[int]],
        state_key: torch.Tensor,
        state_value: torch.Tensor,
        static: bool = False,
        need_keys: list[bool] | None = None,
        first_position: int | None = None,
    ) -> list[tuple]:
        """Store a segment for every head group and return, per group, (keys, values, positions, summary).

        key_states / value_states [batch, seq, kv_heads, head_dim]: rotated k~ and v~; positions
        [batch, seq] with -1 for padding; group_kv_heads[g]: the kv heads group g reads;
        state_key / state_value: float32 k~, v~ of the segment's last token. ``static``: one
        unpadded token per row, which a cache in static decode mode writes into its fixed buffers.
        ``need_keys[g]`` False: group g's caller attends over the segment's own keys, so its store
        returns None instead of building the keys over everything held. ``first_position``: the rows are
        unpadded and hold positions first_position + t (the stores then find what to keep on the host).
        """
        if self.groups is None:
            self.lazy_initialization(key_states, value_states)
            self.groups = list(groups)
            self.stores = [make_store(pattern) for pattern, _ in groups]
        elif self.groups != list(groups):
            raise ValueError(
                "sparse_config differs from the one this cache was filled with; a RAT+ cache only keeps what its "
                "pattern needs. Pass the same sparse_config for every call that shares a cache, or start a new cache."
            )
        if self.static_decode_active:
            if static and self.cumulative_length < self._static_capacity:  # room in the fixed buffers
                return self._static_update(key_states, value_states, positions, group_kv_heads, state_key, state_value)
            self._leave_static_decode()
        self.cumulative_length += key_states.shape[1]
        self.state_key, self.state_value = state_key, state_value
        self._size_windows_for_crops()
        needed = need_keys if need_keys is not None else [True] * len(self.stores)
        return [
            store.update(select_kv_heads(key_states, kv_heads), select_kv_heads(value_states, kv_heads), positions, need,
                         first_position)
            for store, kv_heads, need in zip(self.stores, group_kv_heads, needed)
        ]

    # Static decode protocol (hf_hybrid/generation/graph_decode.py) -------------------------------
    def prepare_static_decode(self, capacity: int, config) -> bool:
        """Move the stores into fixed buffers for ``capacity`` tokens (once): dense, dilated and
        top-k patterns, one store per head group. Caches recording their past for crops keep the
        eager step (False)."""
        if self.static_decode_active:
            if self._static_capacity == capacity:
                return self.cumulative_length < capacity
            self._leave_static_decode()  # another generate() length: new buffers
        if self.groups is None or self.state_key is None or self.record_past or self.cumulative_length >= capacity:
            return False
        if any(pattern.kind == "dilated" and self.cumulative_length < pattern.num_sink_tokens for pattern, _ in self.groups):
            return False
        self.stores = [
            StaticFullStore(store, capacity) if pattern.kind in ("dense", "topk")
            else StaticDilatedStore(store, capacity, self.cumulative_length)
            for (pattern, _), store in zip(self.groups, self.stores)
        ]
        # The kv heads each group's store holds, as device indices made now (a captured step cannot
        # copy an index from the host); None where a group reads every kv head.
        rep = config.num_attention_heads // config.num_key_value_heads
        kv_heads = [sorted({h // rep for h in heads}) for _, heads in self.groups]
        self._static_kv_index = [
            None if heads == list(range(config.num_key_value_heads)) else torch.tensor(heads, device=self.state_key.device)
            for heads in kv_heads
        ]
        self._static_capacity = capacity
        # Own storage for the recurrence state: the step copies the new state into it.
        self.state_key, self.state_value = self.state_key.contiguous().clone(), self.state_value.contiguous().clone()
        self.static_decode_active = True
        return True

    def _leave_static_decode(self) -> None:
        if self.static_decode_active:
            self.stores = [store.to_store(self.cumulative_length) for store in self.stores]
            self.static_decode_active = False

    def _static_update(self, key_states, value_states, positions, group_kv_heads, state_key, state_value) -> list[tuple]:
        self.state_key.copy_(state_key)
        self.state_value.copy_(state_value)
        out = []
        for store, index in zip(self.stores, self._static_kv_index):
            keys = key_states if index is None else key_states.index_select(2, index)
            values = value_states if index is None else value_states.index_select(2, index)
            out.append(store.decode(keys, values, positions[0]))
        self.static_decode_advance()
        return out

    def static_step_store(self, groups) -> StaticFullStore | StaticDilatedStore | None:
        """The fixed store a fused decode step of ``groups`` writes into, when the static step has
        room for one more token (the caller then runs the step and ``static_decode_advance()``);
        None otherwise (the layer takes ``update``, which also reports a changed sparse_config)."""
        if not self.static_decode_active or self.groups != list(groups) or self.cumulative_length >= self._static_capacity:
            return None
        if len(self.groups) != 1 or self.groups[0][0].kind == "topk":  # the fused step: one dense / dilated group
            return None
        return self.stores[0]

    def static_decode_advance(self) -> None:
        """The host part of one decode step (what a replayed graph does not run)."""
        self.cumulative_length += 1

    def static_decode_tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.state_key, self.state_value, *(t for store in self.stores for t in store.tensors()))

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cumulative_length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    @property
    def num_entries(self) -> int:
        """K/V entries held per row and kv head, summed over head groups."""
        return sum(store.num_entries for store in self.stores)

    def _tensors(self):
        yield self, "state_key"
        yield self, "state_value"
        for store in self.stores:
            for name in store.tensor_names:
                yield store, name

    def nbytes(self) -> int:
        """Bytes held now: K/V stores, block summaries, bookkeeping and the recurrence state."""
        total = 0
        for owner, name in self._tensors():
            tensor = getattr(owner, name)
            if tensor is not None:
                total += tensor.numel() * tensor.element_size()
        return total

    def _map_tensors(self, fn) -> None:
        self._leave_static_decode()  # the eager stores' tensors are the ones to map
        for owner, name in self._tensors():
            tensor = getattr(owner, name)
            if tensor is not None:
                setattr(owner, name, fn(tensor))

    def reset(self) -> None:
        self.state_key = self.state_value = None
        self.groups, self.stores = None, []
        self.static_decode_active = False
        self.is_initialized = False
        self.cumulative_length = 0
        self.state_history.reset(0)

    # Crop (assisted decoding) -------------------------------------------------------------------
    def _carried_state(self):
        return None if self.state_key is None else (self.state_key, self.state_value)

    def _recorded_length(self) -> int:
        return self.cumulative_length

    def crop_error(self, removed: int) -> ValueError | None:
        if removed:
            self._leave_static_decode()  # crops work on the eager stores
        error = StateHistoryMixin.crop_error(self, removed)
        keep = self.cumulative_length - removed
        if error is None and removed and keep > 0 and not all(store.can_crop(keep, removed) for store in self.stores):
            error = ValueError(
                f"crop removes {removed} tokens but a dilated store kept only local_window + crop_window={self.crop_window} "
                "columns (the extra columns are kept while past recording is on). Raise it with cache.set_crop_window(n) "
                "before the forward."
            )
        return error

    def _size_windows_for_crops(self) -> None:
        """Dilated stores keep crop_window columns beyond their window while past recording is on."""
        for store in self.stores:
            if isinstance(store, DilatedStore):
                store.extra_window = self.crop_window if self.record_past else 0

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` tokens (negative: remove ``-max_length``), as Cache.crop.

        The float32 recurrence state comes back from the per-token states recorded while past
        recording is on (the last ``crop_window`` tokens); the stores drop the removed columns,
        the sinks, block ends and block summaries those tokens made."""
        keep = tokens_to_keep(max_length, self.cumulative_length)
        removed = self.cumulative_length - keep
        error = self.crop_error(removed)
        if error is not None:
            raise error
        state = self._state_after(keep)
        if keep == 0:
            self.reset()
        elif removed:
            for store in self.stores:
                store.crop(keep, removed)
            self.state_key = restore_into(self.state_key, state[0])
            self.state_value = restore_into(self.state_value, state[1])
            self.cumulative_length = keep
        for store in self.stores:  # the columns kept for crops: only those added from now on
            if isinstance(store, DilatedStore):
                store.trim_window()
        self._forget_state_history(keep)


class RatPlusCache(CroppableCacheMixin, Cache):
    """One :class:`RatPlusLayerCache` per layer of a RAT+ model."""

    def __init__(self, config, **kwargs):
        super().__init__(layers=[RatPlusLayerCache() for _ in range(config.num_hidden_layers)])

    def nbytes_per_layer(self) -> list[int]:
        """Bytes each layer's cache holds now (K/V stores, block summaries, bookkeeping, recurrence state)."""
        return [layer.nbytes() for layer in self.layers]

    def num_entries_per_layer(self) -> list[int]:
        """K/V entries each layer holds per row and kv head (summed over head groups)."""
        return [layer.num_entries for layer in self.layers]
