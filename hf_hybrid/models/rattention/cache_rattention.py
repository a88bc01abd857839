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

    def lazy_initialization(self, key_states: torch.Tensor | None, value_states: torch.Tensor) -> None:
        self.dtype, self.device = value_states.dtype, value_states.device
        self.is_initialized = True

    def window(self):
        """(keys, values, raw_keys, state) held now; window tensors have <= w + 1 tokens."""
        return self.keys, self.values, self.raw_keys, self.state

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

        def tail(x):
            if x is None:
                return None
            start = max(x.shape[1] - capacity, 0)
            # Copy when the rest is long (a prefill), so a view never pins the whole sequence;
            # a decode step's view keeps only one token beyond the window alive.
            return x[:, start:].clone() if start > 1 else x[:, start:]

        self.keys, self.values, self.raw_keys = tail(key_states), tail(value_states), tail(raw_keys)
        self.state = state
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
