"""SEHybridCache: what an SE-Attn hybrid needs to decode, per layer.

* ``mamba`` layers: transformers' own ``LinearAttentionLayer`` (the Mamba-2 conv state - the last
  d_conv inputs of conv1d - and the SSM state), which transformers' Bamba mixer reads and writes
  through the Cache API; :class:`SEMambaLayerCache` only adds a link to the whole cache, because
  that mixer addresses its state as ``cache[layer_idx]``.
* ``attention`` layers (:class:`SEAttentionLayerCache`): all keys/values ([batch, seq, kv_heads,
  head_dim], index space, padding included) plus, per row, a
  :class:`~hf_hybrid.layers.span_expanded_attention.SERowState`: the block summaries c_j of every
  complete memory block, the queries of the open block, and the running chunk / group query sums.
  ``full`` decodes with the keys/values alone; ``se`` retrieves from the summaries without
  recomputing them; the state is kept in every mode so the mode may change between calls.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, LinearAttentionLayer

from ...layers.span_expanded_attention import SERowState
from .configuration_se_hybrid import canonical_layer_type


class SEMambaLayerCache(LinearAttentionLayer):
    """transformers' conv/SSM state layer, plus ``parent`` (the SEHybridCache it belongs to)."""

    def __init__(self, parent: Cache | None = None, **kwargs):
        super().__init__(**kwargs)
        self.parent = parent


class SEAttentionLayerCache(CacheLayerMixin):
    """Keys/values of one attention layer and the per-row SE retrieval state."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, **kwargs):
        super().__init__()
        self.cumulative_length = 0
        self.rows: list[SERowState] = []
        self.chunk_size: int | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, _, heads, dim = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states.new_zeros(batch, 0, heads, dim)
        self.values = value_states.new_zeros(batch, 0, heads, dim)
        self.rows = [SERowState() for _ in range(batch)]
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Append a segment's keys/values [batch, seq, kv_heads, head_dim]; return everything held."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys = torch.cat([self.keys, key_states.to(self.keys.dtype)], dim=1)
        self.values = torch.cat([self.values, value_states.to(self.values.dtype)], dim=1)
        self.cumulative_length += key_states.shape[1]
        return self.keys, self.values

    def check_chunk_size(self, chunk_size: int) -> None:
        """Chunk boundaries are baked into the cached state: one chunk size per cache."""
        if self.chunk_size is None:
            self.chunk_size = chunk_size
        elif chunk_size != self.chunk_size:
            raise ValueError(
                f"se_chunk_size {chunk_size} differs from the {self.chunk_size} this cache was filled with; "
                "keep se_chunk_size fixed while decoding (or start a new cache)."
            )

    def row_state(self, row: int) -> SERowState:
        return self.rows[row]

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        return self.cumulative_length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def _select_rows(self, index: torch.Tensor) -> None:
        index = index.to(self.keys.device)
        self.keys, self.values = self.keys[index], self.values[index]
        self.rows = [self.rows[i].map_tensors(lambda t: t) for i in index.tolist()]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            self._select_rows(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._select_rows(torch.arange(self.keys.shape[0]).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._select_rows(indices)

    def reset(self) -> None:
        self.keys = self.values = None
        self.rows, self.chunk_size = [], None
        self.is_initialized = False
        self.cumulative_length = 0

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("SEAttentionLayerCache cannot be cropped (the Mamba-2 state cannot be rolled back either).")


class SEHybridCache(Cache):
    """Per-layer caches for an SE hybrid stack, built from ``config.layer_types``."""

    def __init__(self, config, **kwargs):
        # transformers may rename config.layer_types in place (mamba -> linear_attention) when validating.
        kinds = [canonical_layer_type(t) for t in config.layer_types]
        layers = [SEMambaLayerCache(parent=self) if kind == "mamba" else SEAttentionLayerCache() for kind in kinds]
        super().__init__(layers=layers)

    def nbytes_per_layer(self) -> list[int]:
        """Bytes each layer's cache holds now (K/V + summaries, or conv + SSM states)."""
        sizes = []
        for layer in self.layers:
            tensors = []
            if isinstance(layer, SEAttentionLayerCache) and layer.is_initialized:
                tensors = [layer.keys, layer.values] + [t for r in layer.rows for t in (r.summaries, r.open_queries) if t is not None]
            elif isinstance(layer, SEMambaLayerCache):
                tensors = [t for t in list(layer.conv_states.values()) + list(layer.recurrent_states.values()) if t is not None]
            sizes.append(sum(t.numel() * t.element_size() for t in tensors))
        return sizes
