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
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from ..cache_layer import TensorMapLayer

_TENSORS = ("keys", "values", "raw_keys", "state")


class RattentionLocalLayerCache(TensorMapLayer):
    """Window K/V (last w + 1 tokens) + RLA state of one local layer; ``keys`` / ``values`` are
    [batch, tokens, kv_heads, head_dim] (``keys`` is None without the SWA branch, ``raw_keys`` and
    ``state`` are None without the RLA branch)."""

    _layer_type = "local"  # lets DynamicCache(config=...) build it from config.layer_types
    is_sliding = True
    is_compileable = False
    is_croppable = False

    def __init__(self, **kwargs):  # DynamicCache(config=...) passes kwargs meant for other layer types
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
        for held, new in ((self.keys, key_states), (self.values, value_states), (self.raw_keys, raw_keys)):
            if held is not None:
                held.index_copy_(1, slot, new.to(held.dtype))
        self.state = state
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

        self.keys, self.values, self.raw_keys = tail(key_states), tail(value_states), tail(raw_keys)
        self.state = state
        if self.is_full():  # a fill kernel with the value as argument: no host-to-device copy
            self._next_column = torch.full((1,), self.cumulative_length, dtype=torch.long, device=self.values.device)
        return self.keys, self.values

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

    def crop(self, max_length: int) -> None:
        raise NotImplementedError(
            "RattentionLocalLayerCache cannot be cropped: tokens that left the window are summed into the RLA state "
            "and cannot be taken out again. Assisted decoding and other strategies that crop the cache are not supported."
        )


class RattentionGlobalLayerCache(DynamicLayer):
    """All keys/values of a global layer (transformers' DynamicLayer under the layer type "global")."""

    _layer_type = "global"

    def __init__(self, **kwargs):
        super().__init__()

    def nbytes(self) -> int:
        if not self.is_initialized or self.keys is None:
            return 0
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()


class RattentionCache(Cache):
    """One cache layer per entry of ``config.layer_types`` ("local" or "global")."""

    def __init__(self, config, **kwargs):
        layers = [RattentionLocalLayerCache() if t == "local" else RattentionGlobalLayerCache() for t in config.layer_types]
        super().__init__(layers=layers)

    def nbytes_per_layer(self) -> list[int]:
        """Bytes each layer's cache holds now (window K/V + RLA state, or all K/V)."""
        return [layer.nbytes() for layer in self.layers]
