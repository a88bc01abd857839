"""Sigmoid output gate: out = sigmoid(z) * y (RAT's z-gate, RAT paper Eq. 3: o = W_o (z * y)).

Float32 math, one rounding to y's dtype (op by op, PyTorch rounds sigmoid(z) first, then the
product: the fused kernel's result is the exact product rounded once).
"""
from __future__ import annotations

import torch


def sigmoid_gate_reference(z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (torch.sigmoid(z.float()) * y.float()).to(y.dtype)
