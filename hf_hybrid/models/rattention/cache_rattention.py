"""RattentionCache: what RATTENTION needs to decode exactly, per layer.

* ``local`` layers (:class:`RattentionLocalLayerCache`): the last w + 1 tokens' keys as the SWA
  reads them (QK-normed, rotated), their values, their raw keys (the RLA folds phi(raw key) v^T
  into its state when a token leaves the window), and the RLA state S [batch, kv_heads, F,
  head_dim] in float32. Memory is constant in the sequence length: a token's key/value is
  dropped from the window exactly when it enters S. (The official decoder keeps the full K/V
  history for the SWA; this cache keeps only the window, which that code's TODO asks for.)
* ``global`` layers (:class:`RattentionGlobalLayerCache`): all keys/values, as transformers'
  DynamicLayer ([batch, kv_heads, tokens, head_dim]).

One column per input column (padding included, with zeroed values), so column indices match
the attention mask. Any number of new tokens can follow (decode or chunked prefill).

Once a local window is full it is a ring: column c sits at slot c % (w + 1). A decode step then
reads the leaving token from its slot and overwrites it in place (``read_slot`` / ``write_slot``,
device-side slot index) instead of concatenating and re-slicing the window, so the step is a
fixed set of kernels on fixed buffers (CUDA-graph capturable); ``window()`` returns the tokens
oldest first for the paths that need the order (padding masks, several new tokens).

Crops (assisted decoding, ``Cache.crop``): while past recording is on, a local layer keeps a
checkpoint of S and the tokens that left the window since (at most ``crop_window``); a crop
rebuilds the window and folds the tokens before it into S (``RattentionLocalLayerCache.crop``).
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from ...kernels.residual_linear_attention import feature_map_fn
from ..attention_cache import FullAttentionCacheLayer
from ..cache_layer import (
    DEFAULT_CROP_WINDOW,
    CroppableCacheMixin,
    TensorMapLayer,
    TokenHistory,
    crop_limit_error,
    tokens_to_keep,
)

_TENSORS = ("keys", "values", "raw_keys", "state")


class RattentionLocalLayerCache(TensorMapLayer):
    """Window K/V (last w + 1 tokens) + RLA state of one local layer; ``keys`` / ``values`` are
    [batch, tokens, kv_heads, head_dim] (``keys`` is None without the SWA branch, ``raw_keys`` and
    ``state`` are None without the RLA branch)."""

    is_sliding = True
    is_compileable = False
    is_croppable = True  # while past recording is on, see crop()
    record_past = False
    crop_window = DEFAULT_CROP_WINDOW
    feature_map = "softmax"  # the RLA's phi (set by RattentionCache): a crop folds tokens into S with it

    def __init__(self, **kwargs):
        super().__init__()
        self.raw_keys: torch.Tensor | None = None
        self.state: torch.Tensor | None = None
        self.cumulative_length = 0
        self.capacity = 0
        self._next_column: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor | None, value_states: torch.Tensor) -> None:
        self.dtype, self.device = value_states.dtype, value_states.device
        self.is_initialized = True

    def window(self):
        """(keys, values, raw_keys, state) held now, window tokens oldest first (<= w + 1 of them)."""
        if not self.is_full():
            return self.keys, self.values, self.raw_keys, self.state
        oldest = self.cumulative_length % self.capacity  # slot of column cumulative_length - capacity

        def ordered(x):
            return None if x is None else torch.roll(x, -oldest, dims=1)

        return ordered(self.keys), ordered(self.values), ordered(self.raw_keys), self.state

    def is_full(self) -> bool:
        """True once the window holds w + 1 tokens (it is then a ring, see the module docstring)."""
        return self.capacity > 0 and self.values is not None and self.values.shape[1] == self.capacity

    def ring_slot(self) -> torch.Tensor:
        """[1] long tensor on the cache's device: the slot of the oldest token, which the next
        token replaces (its column modulo w + 1). Kept on the device so a decode step needs no
        host value (and a captured CUDA graph advances it on every replay)."""
        return torch.remainder(self._next_column, self.capacity)

    def read_slot(self, slot: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(raw key, value) [batch, kv_heads, head_dim] at ring slot ``slot`` (a [1] long tensor)."""
        raw = None if self.raw_keys is None else self.raw_keys.index_select(1, slot)[:, 0]
        return raw, self.values.index_select(1, slot)[:, 0]

    def write_slot(self, slot: torch.Tensor, key_states, value_states, raw_keys, state) -> None:
        """Overwrite ring slot ``slot`` with one new token [batch, 1, kv_heads, head_dim] (in place)."""
        if self.record_past:  # the token in the slot leaves the window (into S)
            self._record_leaving(*(None if x is None else x.index_select(1, slot) for x in (self.keys, self.values, self.raw_keys)),
                                 end=self.cumulative_length - self.capacity + 1)
        for held, new in ((self.keys, key_states), (self.values, value_states), (self.raw_keys, raw_keys)):
            if held is not None:
                held.index_copy_(1, slot, new.to(held.dtype))
        self.state = state
        self._next_column.add_(1)
        self.cumulative_length += 1

    def ring_buffers(self):
        """(keys, values, raw_keys, state, next_column) of the full ring, for a fused step that
        does write_slot's reads and writes itself (kernels/residual_linear_attention/ring_decode.py);
        the caller then calls :meth:`advance_ring`."""
        return self.keys, self.values, self.raw_keys, self.state, self._next_column

    def advance_ring(self) -> None:
        """write_slot's bookkeeping after a fused step wrote the slot: the next column, the token count."""
        self._next_column.add_(1)
        self.cumulative_length += 1

    def update(
        self,
        key_states: torch.Tensor | None,
        value_states: torch.Tensor,
        raw_keys: torch.Tensor | None = None,
        state: torch.Tensor | None = None,
        *,
        capacity: int,
        new_tokens: int | None = None,
    ):
        """Keep the last ``capacity`` (= w + 1) tokens of the given window-plus-new tensors
        [batch, tokens, kv_heads, head_dim] and the RLA state after them; ``new_tokens`` of those
        tokens are new (default: all). Returns (keys, values) held."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cumulative_length += value_states.shape[1] if new_tokens is None else new_tokens
        self.capacity = capacity
        # A full window is stored as a ring (column c at slot c % capacity): rotate the tail so.
        shift = self.cumulative_length % capacity if capacity and value_states.shape[1] >= capacity else 0

        def tail(x):
            if x is None:
                return None
            x = x[:, max(x.shape[1] - capacity, 0):]
            # Own storage, so a view never pins the whole prefill and the ring can be written in place.
            return torch.roll(x, shift, dims=1) if shift else x.clone()

        if self.record_past:  # the tokens before the last ``capacity`` leave the window (into S)
            leaving = max(value_states.shape[1] - capacity, 0)
            self._record_leaving(*(None if x is None else x[:, :leaving] for x in (key_states, value_states, raw_keys)),
                                 end=self.cumulative_length - capacity)
        self.keys, self.values, self.raw_keys = tail(key_states), tail(value_states), tail(raw_keys)
        self.state = state
        if self.is_full():  # a fill kernel with the value as argument: no host-to-device copy
            self._next_column = torch.full((1,), self.cumulative_length, dtype=torch.long, device=self.values.device)
        return self.keys, self.values

    # Static decode protocol (hf_hybrid/generation/graph_decode.py): the ring step above already
    # runs on fixed buffers with a device-side slot; a CUDA graph of it needs the window full.
    def prepare_static_decode(self, capacity: int, config) -> bool:
        """True once the window is a full ring (fixed buffers from then on)."""
        return self.is_full() and self.keys is not None and self._next_column is not None

    def static_decode_advance(self) -> None:
        """The host part of one ring decode step (write_slot's token count)."""
        self.cumulative_length += 1

    def static_decode_tensors(self) -> tuple[torch.Tensor | None, ...]:
        return self.keys, self.values, self.raw_keys, self.state, self._next_column

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cumulative_length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (getattr(self, n) for n in _TENSORS) if t is not None)

    def _map_tensors(self, fn) -> None:
        for name in _TENSORS:
            tensor = getattr(self, name)
            if tensor is not None:
                setattr(self, name, fn(tensor))

    def reset(self) -> None:
        self.keys = self.values = self.raw_keys = self.state = None
        self.is_initialized = False
        self.cumulative_length = 0
        self.capacity = 0
        self._next_column = None
        if self.record_past:
            self._start_crop_record()

    # Crop (assisted decoding) -------------------------------------------------------------------
    # While past recording is on, the cache keeps a checkpoint of S (all tokens before
    # ``_left_window.start``) and the tokens that left the window since (the last crop_window of
    # them; older ones are folded into the checkpoint). A crop to p rebuilds the window of p from
    # those tokens and the current window, and S by folding the tokens before that window into the
    # checkpoint: memory stays constant in the sequence length.
    def activate_past_recording(self) -> None:
        self.record_past = True
        self._start_crop_record()

    def _start_crop_record(self) -> None:
        self._crop_base = None if self.state is None else self.state.clone()
        self._left_window = TokenHistory()
        self._left_window.reset(max(self.cumulative_length - self.capacity, 0))

    def _fold(self, state: torch.Tensor | None, raw_keys: torch.Tensor | None, values: torch.Tensor) -> torch.Tensor | None:
        """S + sum_j phi(raw key_j) v_j^T over the given tokens [batch, n, kv_heads, head_dim]."""
        if raw_keys is None or raw_keys.shape[1] == 0:
            return state
        update = torch.einsum("bsnf,bsnd->bnfd", feature_map_fn(raw_keys, self.feature_map), values.float())
        return update if state is None else state + update

    def _record_leaving(self, keys, values, raw_keys, end: int) -> None:
        """Tokens end - n .. end - 1 ([batch, n, ...]; keys / raw_keys None without that branch) left the window."""
        if values.shape[1] == 0:
            return
        history = self._left_window
        if history.end != end - values.shape[1]:
            raise RuntimeError(f"{type(self).__name__}: tokens left the window out of order while recording past states.")
        empty = values[..., :0]  # stands for a branch the layer does not have
        tokens = tuple(empty if x is None else x for x in (keys, values, raw_keys))
        if history.tensors is not None:
            tokens = tuple(torch.cat([old, new], dim=1) for old, new in zip(history.tensors, tokens))
        overflow = tokens[0].shape[1] - self.crop_window
        if overflow > 0:  # beyond what a crop may need: into the checkpoint
            raw = None if raw_keys is None else tokens[2][:, :overflow]
            self._crop_base = self._fold(self._crop_base, raw, tokens[1][:, :overflow])
            tokens = tuple(t[:, overflow:] for t in tokens)
        history.tensors, history.end = tuple(t.contiguous() for t in tokens), end

    def crop_error(self, removed: int) -> ValueError | None:
        """Why removing the last ``removed`` tokens is impossible now (None when it is possible)."""
        keep = self.cumulative_length - removed
        history = getattr(self, "_left_window", None)
        if removed == 0 or keep <= 0:
            return None
        if not self.record_past or history is None or max(keep - self.capacity, 0) < history.start:
            removable = 0 if history is None else self.cumulative_length - history.start - self.capacity
            return crop_limit_error(self, removed, max(removable, 0))
        return None

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` tokens (negative: remove ``-max_length``), as Cache.crop.

        The window becomes the last w + 1 kept tokens and S the fold of every kept token before
        them, from the checkpoint and the tokens recorded while past recording is on."""
        length = self.cumulative_length
        keep = tokens_to_keep(max_length, length)
        if keep == length:
            if self.record_past:
                self._start_crop_record()
            return
        if keep == 0:
            self.reset()
            return
        error = self.crop_error(length - keep)
        if error is not None:
            raise error
        capacity, history = self.capacity, self._left_window
        first = max(keep - capacity, 0)  # the first token of the new window
        window = self.window()[:3]
        empty = self.values[..., :0]
        held = tuple(empty if x is None else x for x in window)
        if history.tensors is not None:
            held = tuple(torch.cat([old, new], dim=1) for old, new in zip(history.tensors, held))
        # held covers the tokens history.start .. length - 1
        lo, hi = first - history.start, keep - history.start
        state = self._fold(self._crop_base, None if self.raw_keys is None else held[2][:, :lo], held[1][:, :lo])
        keys, values, raw_keys = (None if x is None else part[:, lo:hi] for x, part in zip(window, held))
        self.cumulative_length = first
        self.update(keys, values, raw_keys, None if state is None else state.clone(), capacity=capacity)
        self._start_crop_record()

    def _map_crop_tensors(self, fn) -> None:
        if getattr(self, "_left_window", None) is not None:
            self._left_window.map(fn)
        if getattr(self, "_crop_base", None) is not None:
            self._crop_base = fn(self._crop_base)


class RattentionGlobalLayerCache(FullAttentionCacheLayer):
    """All keys/values of a global layer (a transformers DynamicLayer, with the static decode step
    of models/attention_cache.py: K/V in buffers of generate()'s capacity, a device column counter)."""

    def nbytes(self) -> int:
        if not self.is_initialized or self.keys is None:
            return 0
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()


class RattentionCache(CroppableCacheMixin, Cache):
    """One cache layer per entry of ``config.layer_types`` ("local" or "global")."""

    def __init__(self, config, **kwargs):
        layers = [RattentionLocalLayerCache() if t == "local" else RattentionGlobalLayerCache() for t in config.layer_types]
        for layer in layers:
            if isinstance(layer, RattentionLocalLayerCache):
                layer.feature_map = config.feature_map
        super().__init__(layers=layers)

    def nbytes_per_layer(self) -> list[int]:
        """Bytes each layer's cache holds now (window K/V + RLA state, or all K/V)."""
        return [layer.nbytes() for layer in self.layers]
