"""RatCache: what RAT needs to decode, per layer (RAT paper Listing 2).

* ``rat`` layers (:class:`RatLayerCache`): the running recurrent state k~, v~ of the open chunk
  (un-rotated, [batch, heads, head_dim]) and one key/value per *completed* chunk (the chunk-end
  k~ rotated by its chunk index, and v~), i.e. T / L entries instead of T.
* ``sliding_attention`` layers: transformers' DynamicSlidingWindowLayer (the last window of K/V),
  a ring of the window in generate()'s static decode step (``SlidingWindowCacheLayer``).
* ``full_attention`` layers: transformers' DynamicLayer (all K/V), buffers of generate()'s
  capacity in its static decode step (``FullAttentionCacheLayer``); both in ``models/attention_cache.py``.

Chunk ends are stored by slot = chunk index, per row: with left padding, rows close chunks at
different steps, and a query of chunk c only ever reads slots < c, which are all complete.

Crops (assisted decoding, ``Cache.crop``): while past recording is on, RAT layers keep k~, v~ after
each of the last ``crop_window`` tokens (handed over by the layer) and restore the open chunk's
state from them; see ``models/cache_layer.py``.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..attention_cache import FullAttentionCacheLayer, SlidingWindowCacheLayer
from ..cache_layer import CroppableCacheMixin, StateHistoryMixin, TensorMapLayer, restore_into, tokens_to_keep


class RatLayerCache(StateHistoryMixin, TensorMapLayer):
    """Cache of one RAT layer. ``keys`` / ``values`` hold the chunk ends, [batch, chunks, heads, head_dim]."""

    is_sliding = False
    is_compileable = False
    is_croppable = True  # while past recording is on (StateHistoryMixin), see crop()
    chunk_size: int | None = None  # set by RatCache; lets a crop drop the chunk ends it removes

    def __init__(self, **kwargs):
        super().__init__()
        self.cumulative_length = 0
        self.num_slots = 0
        self.state_key: torch.Tensor | None = None
        self.state_value: torch.Tensor | None = None
        # Chunk ends live in buffers that grow by doubling; keys / values are views of the used slots.
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None
        # Slots reserved for a generation (reserve()): what the fused decode step may read.
        self._reserved_slots = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, _, heads, dim = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self._key_buffer = key_states.new_zeros(batch, 0, heads, dim)
        self._value_buffer = value_states.new_zeros(batch, 0, heads, dim)
        self._refresh_views()
        self.is_initialized = True

    def _refresh_views(self) -> None:
        self.keys = self._key_buffer[:, : self.num_slots]
        self.values = self._value_buffer[:, : self.num_slots]

    def _grow(self, slots: int) -> None:
        """Buffers for at least ``slots`` chunk ends (doubling, so appends stay amortised O(1))."""
        capacity = self._key_buffer.shape[1]
        if slots > capacity:
            grown = max(slots, 2 * capacity)
            pad = lambda b: torch.cat([b, b.new_zeros(b.shape[0], grown - capacity, *b.shape[2:])], dim=1)
            self._key_buffer, self._value_buffer = pad(self._key_buffer), pad(self._value_buffer)

    def _reserve(self, slots: int) -> None:
        self._grow(slots)
        self.num_slots = max(self.num_slots, slots)
        self._refresh_views()

    def reserve(self, tokens: int, chunk_size: int) -> None:
        """Room for the chunk ends of ``tokens`` tokens now, so that decoding up to there never
        reallocates (a CUDA graph captured over the decode step needs fixed buffers)."""
        slots = -(-tokens // chunk_size) + 1
        self._grow(slots)
        self._reserved_slots = max(self._reserved_slots, slots)

    def decode_step(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        slot: torch.Tensor,
        state_key: torch.Tensor,
        state_value: torch.Tensor,
        chunk_size: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One new token per row, all rows at the same position: write its rotated k~ / v~
        [batch, 1, heads, head_dim] to ``slot`` (a [1] long tensor: the token's own chunk) and keep
        the recurrent state in place. The slot holds the chunk's end once the chunk closes; queries
        only read the slots of earlier chunks, so writing the open chunk's slot every step is
        harmless and needs no host decision. Returns the whole buffers (the attention masks by
        each query's chunk index), which stay put between steps unless they have to grow."""
        self._advance_one_token(chunk_size)
        self._key_buffer.index_copy_(1, slot, key_states.to(self._key_buffer.dtype))
        self._value_buffer.index_copy_(1, slot, value_states.to(self._value_buffer.dtype))
        in_place = not torch.is_grad_enabled() and self.state_key is not None and self.state_key.shape == state_key.shape
        if in_place:
            self.state_key.copy_(state_key)
            self.state_value.copy_(state_value)
        else:
            self.state_key, self.state_value = state_key, state_value
        return self._key_buffer, self._value_buffer

    def _advance_one_token(self, chunk_size: int) -> None:
        """Bookkeeping of one decoded token (all rows at the same position): room for its chunk's
        slot, the slot counted once the token closes the chunk, the length advanced."""
        self._record_carried_state()  # the previous token's state, before the step overwrites it
        position = self.cumulative_length
        self._grow(position // chunk_size + 1)
        if (position + 1) % chunk_size == 0:
            self.num_slots = max(self.num_slots, position // chunk_size + 1)
        self._refresh_views()
        self.cumulative_length += 1

    def fused_decode_buffers(self, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """For a kernel that does :meth:`decode_step`'s writes itself (kernels/chunk_attention/rat_decode.py):
        advance the bookkeeping by one token and return (key_buffer, value_buffer, state_key,
        state_value), which it updates in place. The buffers are cut to the slots the step may
        read: the kernel plans its splits over them, and the buffer behind grows by doubling (at 16K
        with 64 new tokens, 2048 slots for 1029 used: half the splits had nothing to read, and the
        chunk-end stream ran at 2/3 of the speed of RAT+'s same-sized one). The cut is fixed for a
        generation that reserved its slots (a captured step replays the same plan)."""
        readable = max(self._reserved_slots, self.cumulative_length // chunk_size + 1)
        self._advance_one_token(chunk_size)
        return (self._key_buffer[:, :readable], self._value_buffer[:, :readable], self.state_key,
                self.state_value)

    def recurrent_state(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """k~, v~ after the last cached token (None before the first update)."""
        return self.state_key, self.state_value

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        chunk_index: torch.Tensor,
        closes_chunk: torch.Tensor,
        state_key: torch.Tensor,
        state_value: torch.Tensor,
        start_position: int | None = None,
        chunk_size: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the chunk ends of a new segment and the recurrent state after it.

        key_states / value_states [batch, seq, heads, head_dim]: rotated k~ and v~ of the segment;
        chunk_index / closes_chunk [batch, seq]: each token's chunk and whether it ends it;
        state_key / state_value [batch, heads, head_dim]: un-rotated k~, v~ of the segment's last token.
        When every row shares its positions (``start_position`` and ``chunk_size`` given), the slots
        are worked out on the host: no device-to-host sync per decoding step.
        Returns all chunk ends held, for the segment's attention.
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        seq = key_states.shape[1]
        self.cumulative_length += seq
        # Own contiguous copies, not views of the segment's last token: the one-kernel decode step
        # updates them in place (a CUDA graph captured over it then replays on fixed tensors).
        # (clone: at batch 1 the last token's slice is already contiguous, and a view would keep
        # the whole segment's k~ / v~ alive with the cache)
        self.state_key = state_key.clone(memory_format=torch.contiguous_format)
        self.state_value = state_value.clone(memory_format=torch.contiguous_format)
        if start_position is not None:
            first = (chunk_size - 1 - start_position) % chunk_size  # offset of the first token closing a chunk
            if first < seq:
                first_slot = (start_position + first) // chunk_size
                count = len(range(first, seq, chunk_size))
                self._reserve(first_slot + count)
                self._key_buffer[:, first_slot : first_slot + count] = key_states[:, first::chunk_size]
                self._value_buffer[:, first_slot : first_slot + count] = value_states[:, first::chunk_size]
            return self.keys, self.values
        rows, cols = closes_chunk.nonzero(as_tuple=True)
        if rows.numel():
            slots = chunk_index[rows, cols]
            self._reserve(int(slots.max()) + 1)
            self._key_buffer[rows, slots] = key_states[rows, cols].to(self._key_buffer.dtype)
            self._value_buffer[rows, slots] = value_states[rows, cols].to(self._value_buffer.dtype)
        return self.keys, self.values

    # Static decode protocol (hf_hybrid/generation/graph_decode.py): the decode step above already
    # runs on fixed buffers with the slot and chunk restart taken from the device position, so a
    # CUDA graph of it only needs the buffers reserved up front and the host bookkeeping replayed.
    def prepare_static_decode(self, capacity: int, config) -> bool:
        """Reserve chunk-end slots for ``capacity`` tokens (a no-op once done). False before the prefill."""
        if not self.is_initialized or self.state_key is None:
            return False
        self._static_chunk_size = config.chunk_size
        self.reserve(capacity, config.chunk_size)
        return True

    def static_decode_advance(self) -> None:
        """The host part of one decode step (what a replayed graph does not run)."""
        self._advance_one_token(self._static_chunk_size)

    def static_decode_tensors(self) -> tuple[torch.Tensor, ...]:
        return self._key_buffer, self._value_buffer, self.state_key, self.state_value

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cumulative_length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    @property
    def num_entries(self) -> int:
        """Key/value entries held per row and head: one per completed chunk."""
        return self.num_slots

    def nbytes(self) -> int:
        """Bytes allocated: chunk-end buffers (capacity, not just used slots) and recurrent states."""
        tensors = (self._key_buffer, self._value_buffer, self.state_key, self.state_value)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def _map_tensors(self, fn) -> None:
        for name in ("_key_buffer", "_value_buffer", "state_key", "state_value"):
            tensor = getattr(self, name)
            if tensor is not None:
                setattr(self, name, fn(tensor))
        if self._key_buffer is not None:
            self._refresh_views()

    def reset(self) -> None:
        self.keys = self.values = self.state_key = self.state_value = None
        self._key_buffer = self._value_buffer = None
        self.is_initialized = False
        self.cumulative_length = self.num_slots = self._reserved_slots = 0
        self.state_history.reset(0)

    # Crop (assisted decoding) -------------------------------------------------------------------
    def _carried_state(self):
        return None if self.state_key is None else (self.state_key, self.state_value)

    def _recorded_length(self) -> int:
        return self.cumulative_length

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` tokens (negative: remove ``-max_length``), as Cache.crop.

        The open chunk's recurrent state becomes k~, v~ after the last kept token, from the states
        the layer recorded while past recording is on (the last ``crop_window`` tokens); chunk ends
        of chunks the kept tokens do not close are dropped (their slots are rewritten when the
        chunk closes again, and no query reads a slot of its own or a later chunk meanwhile)."""
        keep = tokens_to_keep(max_length, self.cumulative_length)
        state = self._state_after(keep)
        if keep == 0:
            self.reset()
        elif keep < self.cumulative_length:
            self.state_key = restore_into(self.state_key, state[0])
            self.state_value = restore_into(self.state_value, state[1])
            if self.chunk_size is not None:
                self.num_slots = min(self.num_slots, keep // self.chunk_size)
                self._refresh_views()
            self.cumulative_length = keep
        self._forget_state_history(keep)


def rat_cache_layer(config, layer_type: str) -> CacheLayerMixin:
    if layer_type == "rat":
        layer = RatLayerCache()
        layer.chunk_size = config.chunk_size
        return layer
    if layer_type == "sliding_attention":
        return SlidingWindowCacheLayer(sliding_window=config.sliding_window)
    return FullAttentionCacheLayer()


class RatCache(CroppableCacheMixin, Cache):
    """Per-layer caches for a RAT / RAT-SWA / attention stack, built from ``config.layer_types``."""

    def __init__(self, config, **kwargs):
        super().__init__(layers=[rat_cache_layer(config, t) for t in config.layer_types])

    def nbytes_per_layer(self) -> list[int]:
        """Bytes each layer's cache holds now (keys, values, recurrent states)."""
        sizes = []
        for layer in self.layers:
            if isinstance(layer, RatLayerCache):
                sizes.append(layer.nbytes())
            elif layer.is_initialized and layer.keys is not None:
                sizes.append(layer.keys.numel() * layer.keys.element_size() * 2)
            else:
                sizes.append(0)
        return sizes
