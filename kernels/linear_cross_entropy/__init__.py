"""Cross-entropy of a linear layer's output without the whole logits (the causal-LM head and its
loss in training); math in reference.py, the chunked kernel in triton.py."""
from __future__ import annotations

import torch

from .._backend import resolve_backend
from .reference import linear_cross_entropy_reference

__all__ = ["linear_cross_entropy", "linear_cross_entropy_reference"]

REDUCTIONS = ("mean", "sum")


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                         reduction: str = "mean", backend: str = "auto") -> torch.Tensor:
    """cross_entropy(hidden @ weight.T, targets) for hidden [N, H], weight [V, H], targets [N]
    (integers; ``ignore_index`` rows are not counted), reduced by "mean" over the counted rows or
    "sum". The Triton backend never holds more than a chunk of the [N, V] logits and does not
    synchronise with the host."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"linear_cross_entropy: hidden must be [N, H] and weight [V, H]; got hidden "
                         f"{tuple(hidden.shape)} and weight {tuple(weight.shape)}.")
    if targets.shape != hidden.shape[:1] or targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError(f"linear_cross_entropy: targets must be integer class indices of shape [{hidden.shape[0]}]; "
                         f"got {targets.dtype} of shape {tuple(targets.shape)}.")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"linear_cross_entropy: hidden ({hidden.dtype}) and weight ({weight.dtype}) must share a dtype; "
                         "cast one of them (e.g. hidden.to(weight.dtype)).")
    if reduction not in REDUCTIONS:
        raise ValueError(f"linear_cross_entropy: reduction={reduction!r} is not one of {REDUCTIONS}.")
    if resolve_backend(backend, hidden.device, "linear_cross_entropy") == "triton":
        from .triton import linear_cross_entropy_triton

        return linear_cross_entropy_triton(hidden, weight, targets.to(hidden.device), ignore_index, reduction)
    return linear_cross_entropy_reference(hidden, weight, targets, ignore_index, reduction)
