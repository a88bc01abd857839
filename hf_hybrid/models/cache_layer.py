"""Batch and device operations shared by the architectures' cache layers.

A cache layer names its tensors once (``_map_tensors``); beam reordering, batch expansion and
selection, and offload/prefetch are then the same map over them, whatever the layer stores.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin


class TensorMapLayer(CacheLayerMixin):
    """Subclasses implement ``_map_tensors(fn)``: replace each held tensor t by fn(t), batch dim 0."""

    def _map_tensors(self, fn) -> None:
        raise NotImplementedError

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_tensors(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_tensors(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_tensors(lambda t: t[indices, ...])

    def offload(self) -> None:
        self._map_tensors(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self) -> None:
        if self.is_initialized:  # moving a tensor to the device it is on is free
            self._map_tensors(lambda t: t.to(self.device, non_blocking=True))
