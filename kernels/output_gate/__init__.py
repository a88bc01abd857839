"""Sigmoid output gate out = sigmoid(z) * y in one pass (RAT's output gate); math in reference.py."""
from __future__ import annotations

import torch

from .._backend import resolve_backend
from .reference import sigmoid_gate_reference

__all__ = ["sigmoid_gate", "sigmoid_gate_reference"]


def sigmoid_gate(z: torch.Tensor, y: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """sigmoid(z) * y for z, y of one shape (any), float32 math, result in y's dtype."""
    if not isinstance(z, torch.Tensor) or not isinstance(y, torch.Tensor) or z.shape != y.shape:
        shapes = tuple(getattr(z, "shape", ())), tuple(getattr(y, "shape", ()))
        raise ValueError(f"sigmoid_gate: z and y must be tensors of one shape; got {shapes[0]} and {shapes[1]}.")
    if resolve_backend(backend, y.device, "sigmoid_gate") == "triton":
        from .triton import sigmoid_gate_triton

        return sigmoid_gate_triton(z, y)
    return sigmoid_gate_reference(z, y)
