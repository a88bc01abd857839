"""Reference residual add + RMSNorm (the pre-norm block's add and the norm that reads its result).

Per row x (hidden size N), residual update d (or none), weight w:

    h = x + d                                   in x's dtype, as PyTorch adds two bf16 tensors
    y = (w * (h / sqrt(mean(h^2) + eps))).to(h.dtype)     math in float32 from the rounded h

exactly hf_hybrid.layers.norm.RMSNorm applied to the sum the block computes.
"""
from __future__ import annotations

import torch


def add_rms_norm_reference(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, y) above; delta None means h = x."""
    h = x if delta is None else x + delta
    hf = h.to(torch.float32)
    normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    return h, (weight.to(torch.float32) * normed).to(h.dtype)
