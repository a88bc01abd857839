"""FoxCache: what Forgetting Attention needs to decode exactly, per layer.

* keys / values [batch, tokens, kv_heads, head_dim]: every cached token's k and v as attended
  (after KV-shift, QK-norm and optional RoPE), one column per input column (padding included, so
  column indices match the attention mask);
* cum_log_forget [batch, tokens, heads] float32: c_t = sum_{l <= t} log f_l per query head, so a
  new query at t sees key j with bias c_t - c_j;
* shift_key / shift_value [batch, kv_heads, head_dim]: the un-shifted k~, v~ of the last token,
  the "previous token" of KV-shift for the next segment (None without KV-shift).

Any number of new tokens can follow (decode or chunked prefill).
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from ..cache_layer import TensorMapLayer


class FoxLayerCache(TensorMapLayer):
    _layer_type = "fox"
    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, **kwargs):  # DynamicCache(config=...) passes kwargs meant for other layer types
        super().__init__()
        self.cum_log_forget: torch.Tensor | None = None
        self.shift_key: torch.Tensor | None = None
        self.shift_value: torch.Tensor | None = None

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
        last = (
            self.cum_log_forget[:, -1:]
            if self.cum_log_forget is not None and self.cum_log_forget.shape[1]
            else log_forget.new_zeros(log_forget.shape[0], 1, log_forget.shape[2], dtype=torch.float32)
        )
        c_new = last + torch.cumsum(log_forget.float(), dim=1)
        self.keys = torch.cat([self.keys, key_states.to(self.keys.dtype)], dim=1)
        self.values = torch.cat([self.values, value_states.to(self.values.dtype)], dim=1)
        self.cum_log_forget = c_new if self.cum_log_forget is None else torch.cat([self.cum_log_forget, c_new], dim=1)
        self.shift_key, self.shift_value = shift_key, shift_value
        return self.keys, self.values, self.cum_log_forget

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
        for name in ("keys", "values", "cum_log_forget", "shift_key", "shift_value"):
            tensor = getattr(self, name)
            if tensor is not None:
                setattr(self, name, fn(tensor))

    def reset(self) -> None:
        self.keys = self.values = self.cum_log_forget = self.shift_key = self.shift_value = None
        self.is_initialized = False

    def crop(self, max_length: int) -> None:
        raise NotImplementedError(
            "FoxLayerCache cannot be cropped: KV-shift needs the un-shifted key of the new last token, which "
            "the cache does not keep. Assisted decoding and other strategies that crop the cache are not supported."
        )


class FoxCache(Cache):
    """One :class:`FoxLayerCache` per layer of a FoX model."""

    def __init__(self, config, **kwargs):
        super().__init__(layers=[FoxLayerCache() for _ in range(config.num_hidden_layers)])

    def nbytes_per_layer(self) -> list[int]:
        return [layer.nbytes() for layer in self.layers]
