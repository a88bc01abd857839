"""Cache layers of softmax attention (transformers' layout, [batch, kv_heads, tokens, head_dim]) that
also decode on fixed buffers in generate()'s static step (hf_hybrid/generation/graph_decode.py).

* :class:`FullAttentionCacheLayer` (full attention): transformers' DynamicLayer; for the static step its K/V
  move into buffers of generate()'s capacity, like transformers' StaticLayer. A step writes column
  ``_static_length`` (a device counter) and masks the columns after it.
* :class:`SlidingWindowCacheLayer` (sliding window of w tokens, the token itself included):
  transformers' DynamicSlidingWindowLayer; for the static step its last w - 1 tokens move into a
  ring of w slots, token t in slot t % w. A step writes its slot (from a device counter of cached
  tokens) and attends over the whole ring: before the ring first fills, the slots not written yet
  are masked; after, every slot holds one of the last w tokens. Attention does not depend on the
  order of its keys (RoPE is applied before the keys are cached), so the ring is never rotated.

Either layer leaves the static buffers for the ordinary layout on any other operation (an update
of several tokens, a crop, a batch reorder), so eager steps after static ones stay exact.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer


class FullAttentionCacheLayer(DynamicLayer):
    """All keys/values of a full-attention layer (a transformers DynamicLayer) with a static decode step."""

    def __init__(self, **kwargs):
        super().__init__()
        self._key_buffer = self._value_buffer = self._columns = self._static_length = None
        self._static_used = 0

    # Static decode protocol: keys / values become views of [batch, kv_heads, capacity, head_dim]
    # buffers; any update, reorder or crop replaces them, which ends the static mode by itself.
    @property
    def static_decode_active(self) -> bool:
        """True while keys / values are still the buffers' views and the buffers have room for one more token."""
        return (
            self._key_buffer is not None and self.keys is not None and self.keys.data_ptr() == self._key_buffer.data_ptr()
            and self.keys.shape[2] == self._static_used < self._key_buffer.shape[2]
        )

    def prepare_static_decode(self, capacity: int, config) -> bool:
        if self.static_decode_active and self._key_buffer.shape[2] == capacity:
            return True
        if self._key_buffer is not None and self.keys is not None and self.keys.data_ptr() == self._key_buffer.data_ptr():
            return False  # the buffers are full: the eager update takes over from here
        used = self.get_seq_length()
        if not self.is_initialized or not used or used >= capacity:
            return False

        def buffer(x):
            out = x.new_zeros(*x.shape[:2], capacity, x.shape[3])
            out[:, :, :used] = x
            return out

        self._key_buffer, self._value_buffer = buffer(self.keys), buffer(self.values)
        self._columns = torch.arange(capacity, device=self.keys.device)
        self._static_length = torch.full((1,), used, dtype=torch.long, device=self.keys.device)
        self._static_used = used
        self._refresh_static_views()
        return True

    def _refresh_static_views(self) -> None:
        self.keys = self._key_buffer[:, :, : self._static_used]
        self.values = self._value_buffer[:, :, : self._static_used]

    def static_decode_update(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """One token per row [batch, kv_heads, 1, head_dim] at the device column ``_static_length``.
        Returns (key buffer, value buffer, visible [1, 1, 1, capacity] bool: the columns up to it)."""
        column = self._static_length
        self._key_buffer.index_copy_(2, column, key_states.to(self._key_buffer.dtype))
        self._value_buffer.index_copy_(2, column, value_states.to(self._value_buffer.dtype))
        visible = (self._columns <= column).view(1, 1, 1, -1)
        self._static_length.add_(1)
        self.static_decode_advance()
        return self._key_buffer, self._value_buffer, visible

    def static_decode_advance(self) -> None:
        self._static_used += 1
        self._refresh_static_views()

    def static_decode_length(self) -> torch.Tensor:
        """The device count of filled columns (after this step's update): the keys a decode kernel reads."""
        return self._static_length

    def static_decode_tensors(self) -> tuple[torch.Tensor | None, ...]:
        return self._key_buffer, self._value_buffer, self._static_length


class SlidingWindowCacheLayer(DynamicSlidingWindowLayer):
    """The last ``sliding_window - 1`` keys/values of a sliding-window layer (a transformers
    DynamicSlidingWindowLayer), kept in a ring of ``sliding_window`` slots during static decode
    steps. Meanwhile ``keys`` / ``values`` are the ring buffers themselves (slot order, not token order)."""

    def __init__(self, sliding_window: int, **kwargs):
        super().__init__(sliding_window=sliding_window)
        self._ring_keys = self._ring_values = self._ring_columns = self._ring_position = None
        self._static_capacity = 0

    @property
    def static_decode_active(self) -> bool:
        """True while the ring holds the window and the step's capacity has room for one more token."""
        return self._ring_keys is not None and self.cumulative_length < self._static_capacity

    def prepare_static_decode(self, capacity: int, config) -> bool:
        """Move the window into the ring (once per capacity). False before the prefill, once the
        capacity is used up, or while recording the past for crops (the ring keeps no past)."""
        if self._ring_keys is not None and self._static_capacity == capacity:
            return self.static_decode_active
        used = self.cumulative_length
        if not self.is_initialized or not used or used >= capacity or getattr(self, "record_past", False):
            return False
        self._leave_ring()
        window = self.sliding_window
        held = min(self.keys.shape[2], window - 1)  # the tokens a next query can see
        slots = torch.arange(used - held, used, device=self.keys.device) % window

        def ring(x):
            out = x.new_zeros(*x.shape[:2], window, x.shape[3])
            return out.index_copy_(2, slots, x[:, :, x.shape[2] - held :])

        self._ring_keys, self._ring_values = ring(self.keys), ring(self.values)
        self._ring_columns = torch.arange(window, device=self.keys.device)
        self._ring_position = torch.full((1,), used, dtype=torch.long, device=self.keys.device)
        self._static_capacity = capacity
        self.keys, self.values = self._ring_keys, self._ring_values
        return True

    def static_decode_update(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """One token per row [batch, kv_heads, 1, head_dim] into its ring slot (position % window,
        on the device). Returns (key ring, value ring, visible [1, 1, 1, window] bool: the slots
        written so far, the new token's included)."""
        position = self._ring_position
        slot = position % self.sliding_window
        self._ring_keys.index_copy_(2, slot, key_states.to(self._ring_keys.dtype))
        self._ring_values.index_copy_(2, slot, value_states.to(self._ring_values.dtype))
        visible = (self._ring_columns <= position).view(1, 1, 1, -1)
        self._ring_position.add_(1)
        self.static_decode_advance()
        return self._ring_keys, self._ring_values, visible

    def static_decode_advance(self) -> None:
        """The host part of one static decode step (what a replayed graph does not run)."""
        self.cumulative_length += 1

    def static_decode_length(self) -> torch.Tensor:
        """The device count of tokens written into the ring (after this step's update): slots below
        it are filled, and from ``sliding_window`` on every slot is (a decode kernel reads min(n, slots))."""
        return self._ring_position

    def static_decode_tensors(self) -> tuple[torch.Tensor | None, ...]:
        return self._ring_keys, self._ring_values, self._ring_position

    def _leave_ring(self) -> None:
        """Back to transformers' layout: the last min(length, window - 1) tokens in token order."""
        if self._ring_keys is None:
            return
        used, window = self.cumulative_length, self.sliding_window
        held = min(used, window - 1)
        slots = torch.arange(used - held, used, device=self._ring_keys.device) % window
        self.keys = self._ring_keys.index_select(2, slots)
        self.values = self._ring_values.index_select(2, slots)
        self._ring_keys = self._ring_values = self._ring_columns = self._ring_position = None
        self._static_capacity = 0

    # Every other operation runs on transformers' layout.
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self._leave_ring()
        return super().update(key_states, value_states, *args, **kwargs)

    def crop(self, tokens_to_remove: int) -> None:
        self._leave_ring()
        super().crop(tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._leave_ring()
        super().reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._leave_ring()
        super().batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._leave_ring()
        super().batch_select_indices(indices)

    def offload(self) -> None:
        self._leave_ring()
        super().offload()

    def reset(self) -> None:
        self._ring_keys = self._ring_values = self._ring_columns = self._ring_position = None
        self._static_capacity = 0
        super().reset()
