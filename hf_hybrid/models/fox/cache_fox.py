"""FoxCache: what Forgetting Attention needs to decode exactly, per layer.

* keys / values [batch, tokens, kv_heads, head_dim]: every cached token's k and v as attended
  (after KV-shift, QK-norm and optional RoPE), one column per input column (padding included, so
  column indices match the attention mask);
* cum_log_forget [batch, tokens, heads] float32: c_t = sum_{l <= t} log f_l per query head, so a
  new query at t sees key j with bias c_t - c_j;
* shift_key / shift_value [batch, kv_heads, head_dim]: the un-shifted k~, v~ of the last token,
  the "previous token" of KV-shift for the next segment (None without KV-shift).

Any number of new tokens can follow (decode or chunked prefill). Crops (assisted decoding): while
past recording is on, the un-shifted k~, v~ of the last ``crop_window`` tokens are kept for KV-shift.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from ...kernels.forgetting_attention import cumulative_log_forget
from ..cache_layer import (
    CroppableCacheMixin,
    ReservedColumnsMixin,
    StateHistoryMixin,
    StaticColumns,
    TensorMapLayer,
    restore_into,
    tokens_to_keep,
)


class FoxLayerCache(ReservedColumnsMixin, StateHistoryMixin, TensorMapLayer):
    is_sliding = False
    is_compileable = False
    is_croppable = True  # while past recording is on (StateHistoryMixin), see crop()

    def __init__(self, **kwargs):
        super().__init__()
        self.cum_log_forget: torch.Tensor | None = None
        self.shift_key: torch.Tensor | None = None
        self.shift_value: torch.Tensor | None = None
        self._leave_static_decode()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states[:, :0]
        self.values = value_states[:, :0]
        self.is_initialized = True

    def shift_state(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Un-shifted k~, v~ of the last cached token (None before the first update)."""
        return self.shift_key, self.shift_value

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        log_forget: torch.Tensor,
        shift_key: torch.Tensor | None = None,
        shift_value: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Append a segment. key_states / value_states [batch, seq, kv_heads, head_dim], log_forget
        [batch, seq, heads]; shift_* the un-shifted k~, v~ of the segment's last token.
        Returns (keys, values, cum_log_forget) over all cached tokens, the segment included."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        static = self._static if self.continues_reserved_columns(self._static, key_states.shape[1]) else None
        self._leave_static_decode()  # keys / values below become ordinary tensors again
        last = (
            self.cum_log_forget[:, -1:]
            if self.cum_log_forget is not None and self.cum_log_forget.shape[1]
            else log_forget.new_zeros(log_forget.shape[0], 1, log_forget.shape[2], dtype=torch.float32)
        )
        # The running sum along the contiguous axis ([heads, batch, seq]): torch's scan over the strided
        # seq axis of [batch, seq, heads] gives each (row, head) one thread, slower at a long prefill
        # than the layer's attention.
        c_new = (last + cumulative_log_forget(log_forget)).contiguous()
        if self.takes_reserved_columns(self.get_seq_length(), key_states.shape[1]):
            columns = (key_states.to(self.keys.dtype), value_states.to(self.values.dtype), c_new)
            self._start_static(columns, self._reserved_capacity, shift_key, shift_value)
            return self.keys, self.values, self.cum_log_forget
        if static is not None:  # a later slice of a sliced prefill: into the same buffers
            static.extend(key_states, value_states, c_new)
            self._start_static_views(static, shift_key, shift_value)
            return self.keys, self.values, self.cum_log_forget
        self.keys = torch.cat([self.keys, key_states.to(self.keys.dtype)], dim=1)
        self.values = torch.cat([self.values, value_states.to(self.values.dtype)], dim=1)
        self.cum_log_forget = c_new if self.cum_log_forget is None else torch.cat([self.cum_log_forget, c_new], dim=1)
        # Own copies: a view of the segment's last token would keep its whole raw K/V alive.
        self.shift_key = None if shift_key is None else shift_key.clone()
        self.shift_value = None if shift_value is None else shift_value.clone()
        return self.keys, self.values, self.cum_log_forget

    # Static decode protocol (hf_hybrid/generation/graph_decode.py): K/V and the cumulative log forget
    # live in buffers of generate()'s max_length (StaticColumns); a decode step writes the device
    # column and attends over the whole buffer up to the filled length, so the step has the same
    # shapes at every position.
    @property
    def static_decode_active(self) -> bool:
        """True while the cache decodes into its fixed buffers and has room for one more token."""
        return self._static is not None and self._static.has_room

    def _leave_static_decode(self) -> None:
        self._static: StaticColumns | None = None

    def prepare_static_decode(self, capacity: int, config) -> bool:
        """Move the cache into buffers of ``capacity`` columns (once). False before the prefill or when full."""
        if self._static is not None and self._static.capacity == capacity:
            return self.static_decode_active
        used = self.get_seq_length()
        if not used or used >= capacity:
            return False
        self._start_static((self.keys, self.values, self.cum_log_forget), capacity, self.shift_key, self.shift_value)
        return True

    def _start_static(self, columns: tuple[torch.Tensor, ...], capacity: int, shift_key, shift_value) -> None:
        """K/V and c into StaticColumns of ``capacity``; the KV-shift state into its own storage,
        which the static step updates in place."""
        self._start_static_views(StaticColumns(columns, capacity), shift_key, shift_value)

    def _start_static_views(self, static: StaticColumns, shift_key, shift_value) -> None:
        self._static = static
        self.shift_key = None if shift_key is None else shift_key.clone()
        self.shift_value = None if shift_value is None else shift_value.clone()
        self._refresh_static_views()

    def _refresh_static_views(self) -> None:
        self.keys, self.values, self.cum_log_forget = self._static.views()

    def static_decode_update(self, key_states, value_states, log_forget, shift_key=None, shift_value=None):
        """One new token per row [batch, 1, ...], written at the device column. Returns (key buffer,
        value buffer, c of the new token [batch, 1, heads], c buffer, filled columns [1]: the device
        counter itself, now one past the new token's column)."""
        static = self._static
        key_buffer, value_buffer, cum_buffer = static.buffers
        c_new = cum_buffer.index_select(1, static.length - 1) + log_forget.float()
        static.write(key_states, value_states, c_new)
        for held, new in ((self.shift_key, shift_key), (self.shift_value, shift_value)):
            if held is not None and new is not None:
                held.copy_(new)
        self.static_decode_advance()
        return key_buffer, value_buffer, c_new, cum_buffer, static.length

    def static_decode_advance(self) -> None:
        """The host part of one decode step (what a replayed graph does not run)."""
        self._static.advance()
        self._refresh_static_views()

    def static_decode_tensors(self) -> tuple[torch.Tensor | None, ...]:
        return (*self._static.buffers, self._static.length, self.shift_key, self.shift_value)

    def get_seq_length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[1]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def nbytes(self) -> int:
        tensors = (self.keys, self.values, self.cum_log_forget, self.shift_key, self.shift_value)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def _map_tensors(self, fn) -> None:
        self._leave_static_decode()  # the mapped tensors below replace the buffers' views
        for name in ("keys", "values", "cum_log_forget", "shift_key", "shift_value"):
            tensor = getattr(self, name)
            if tensor is not None:
                setattr(self, name, fn(tensor))

    def reset(self) -> None:
        self.keys = self.values = self.cum_log_forget = self.shift_key = self.shift_value = None
        self.is_initialized = False
        self._leave_static_decode()
        self.state_history.reset(0)

    # Crop (assisted decoding) -------------------------------------------------------------------
    def _carried_state(self):
        return None if self.shift_key is None else (self.shift_key, self.shift_value)

    def _recorded_length(self) -> int:
        return self.get_seq_length()

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` tokens (negative: remove ``-max_length``), as Cache.crop:
        K/V and the cumulative log forget are cut; KV-shift's "previous token" becomes the last kept
        token's un-shifted k~, v~, recorded while past recording is on (the last ``crop_window``)."""
        length = self.get_seq_length()
        keep = tokens_to_keep(max_length, length)
        state = self._state_after(keep)
        if keep == 0:
            self.reset()
        elif keep < length:
            if self.static_decode_active:
                self._leave_static_decode()
            self.keys, self.values = self.keys[:, :keep], self.values[:, :keep]
            self.cum_log_forget = self.cum_log_forget[:, :keep]
            if state is not None:
                self.shift_key = restore_into(self.shift_key, state[0])
                self.shift_value = restore_into(self.shift_value, state[1])
        self._forget_state_history(keep)


class FoxCache(CroppableCacheMixin, Cache):
    """One :class:`FoxLayerCache` per layer of a FoX model."""

    def __init__(self, config, **kwargs):
        super().__init__(layers=[FoxLayerCache() for _ in range(config.num_hidden_layers)])

    def nbytes_per_layer(self) -> list[int]:
        return [layer.nbytes() for layer in self.layers]
