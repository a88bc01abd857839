"""Output gates: out = act(z) * y with act sigmoid (RAT's z-gate, RAT paper Eq. 3: o = W_o (z * y))
or SiLU (SwiGLU's product: silu(gate) * up).

Float32 math, one rounding to y's dtype (op by op, PyTorch rounds act(z) first, then the product:
the fused kernel's result is the exact product rounded once).
"""
from __future__ import annotations

import torch
from torch.nn import functional as F


def sigmoid_gate_reference(z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (torch.sigmoid(z.float()) * y.float()).to(y.dtype)


def silu_gate_reference(z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (F.silu(z.float()) * y.float()).to(y.dtype)
