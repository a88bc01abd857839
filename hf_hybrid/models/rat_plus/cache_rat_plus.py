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
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from ...kernels.topk_block_attention import block_summaries
from ...sparse import AttentionPattern
from ..cache_layer import TensorMapLayer

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

    def update(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor):
        """Append a segment ([batch, seq, kv, dim], positions [batch, seq], -1 = padding).

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

    @property
    def num_entries(self) -> int:
        return 0 if self.keys is None else self.keys.shape[1]


class DilatedStore:
    """Block ends, local window and sinks of a group's kv heads (dilated pattern D > 1)."""

    tensor_names = ("sink_keys", "sink_values", "sink_valid", "end_keys", "end_values", "end_valid",
                    "window_keys", "window_values", "window_positions")

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

    def update(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor):
        """Store a segment and return (keys, values, positions, None) for its attention.

        The returned keys are [sinks; block ends; window + new tokens]. Sinks and block ends that
        also lie in the window/new span, and sinks that are block ends, get position -1 so every key
        appears once; ``dilated_mask`` over these positions then gives exactly the pattern's keys.
        """
        if self.sink_keys is None:
            self._lazy_init(keys)
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
            needed = int(slots.max()) + 1
            self.end_keys, self.end_values = _grow(self.end_keys, needed), _grow(self.end_values, needed)
            self.end_valid = _grow(self.end_valid, needed, False)
            self.end_keys[rows, slots] = keys[rows, cols]
            self.end_values[rows, slots] = values[rows, cols]
            self.end_valid[rows, slots] = True
        # Recent span = previous window + this segment; keep its last W columns for the next call.
        recent_keys = torch.cat([self.window_keys, keys], dim=1)
        recent_values = torch.cat([self.window_values, values], dim=1)
        recent_positions = torch.cat([self.window_positions, positions], dim=1)
        window = self.pattern.local_window
        keep = recent_keys.shape[1] - min(window, recent_keys.shape[1])
        self.window_keys, self.window_values = recent_keys[:, keep:], recent_values[:, keep:]
        self.window_positions = recent_positions[:, keep:]

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

    @property
    def num_entries(self) -> int:
        if self.sink_keys is None:
            return 0
        return self.sink_keys.shape[1] + self.end_keys.shape[1] + self.window_keys.shape[1]


def make_store(pattern: AttentionPattern) -> FullStore | DilatedStore:
    return DilatedStore(pattern) if pattern.kind == "dilated" else FullStore(pattern)


class RatPlusLayerCache(TensorMapLayer):
    """Cache of one RAT+ layer: recurrence state + one store per head group (see the module docstring)."""

    is_compileable = False
    is_croppable = False

    def __init__(self, **kwargs):  # DynamicCache-style constructors may pass unrelated kwargs
        super().__init__()
        self.cumulative_length = 0
        self.state_key: torch.Tensor | None = None
        self.state_value: torch.Tensor | None = None
        self.groups: list[tuple[AttentionPattern, tuple[int, ...]]] | None = None
        self.stores: list[FullStore | DilatedStore] = []

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
    ) -> list[tuple]:
        """Store a segment for every head group and return, per group, (keys, values, positions, summary).

        key_states / value_states [batch, seq, kv_heads, head_dim]: rotated k~ and v~; positions
        [batch, seq] with -1 for padding; group_kv_heads[g]: the kv heads group g reads;
        state_key / state_value: float32 k~, v~ of the segment's last token.
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
        self.cumulative_length += key_states.shape[1]
        self.state_key, self.state_value = state_key, state_value
        out = []
        for store, kv_heads in zip(self.stores, group_kv_heads):
            index = torch.tensor(kv_heads, device=key_states.device)
            out.append(store.update(key_states.index_select(2, index), value_states.index_select(2, index), positions))
        return out

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
        for owner, name in self._tensors():
            tensor = getattr(owner, name)
            if tensor is not None:
                setattr(owner, name, fn(tensor))

    def reset(self) -> None:
        self.state_key = self.state_value = None
        self.groups, self.stores = None, []
        self.is_initialized = False
        self.cumulative_length = 0

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(
            "RatPlusLayerCache cannot be cropped: the recurrence state cannot be rolled back and dilated stores "
            "drop old tokens. Assisted decoding and other strategies that crop the cache are not supported."
        )


class RatPlusCache(Cache):
    """One :class:`RatPlusLayerCache` per layer of a RAT+ model."""

    def __init__(self, config, **kwargs):
        super().__init__(layers=[RatPlusLayerCache() for _ in range(config.num_hidden_layers)])

    def nbytes_per_layer(self) -> list[int]:
        """Bytes each layer's cache holds now (K/V stores, block summaries, bookkeeping, recurrence state)."""
        return [layer.nbytes() for layer in self.layers]

    def num_entries_per_layer(self) -> list[int]:
        """K/V entries each layer holds per row and kv head (summed over head groups)."""
        return [layer.num_entries for layer in self.layers]
