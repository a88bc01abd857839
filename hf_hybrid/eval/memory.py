"""Measure how many bytes a model's decoding cache really holds (no formulas: run a prefill, count)."""
from __future__ import annotations

import torch

from ..compat import cache_of


def cache_nbytes(cache) -> int:
    """Bytes held by a transformers Cache: every tensor of every layer (K/V, chunk ends, states)."""
    total = 0
    for layer in getattr(cache, "layers", []):
        if hasattr(layer, "nbytes"):
            total += layer.nbytes()
            continue
        seen = set()
        for value in vars(layer).values():
            tensors = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
            for tensor in tensors:
                if isinstance(tensor, torch.Tensor) and id(tensor) not in seen and tensor.dim() > 0:
                    seen.add(id(tensor))
                    total += tensor.numel() * tensor.element_size()
    return total


@torch.no_grad()
def cache_nbytes_at_context(model, context_length: int = 4096, batch_size: int = 1, **forward_kwargs) -> int:
    """Prefill ``context_length`` random tokens with use_cache=True and count the cache's bytes."""
    device = next(model.parameters()).device
    ids = torch.randint(3, model.config.vocab_size, (batch_size, context_length), device=device)
    out = model(ids, use_cache=True, logits_to_keep=1, **forward_kwargs)
    return cache_nbytes(cache_of(out))
