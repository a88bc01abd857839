"""RMSNorm: y = x / sqrt(mean(x^2) + eps) * weight, computed in float32."""
from __future__ import annotations

import torch
from torch import nn

from .backbone_fusion import fused_layer_applies, fused_rms_norm


class RMSNorm(nn.Module):
    """RMS normalisation over the last dimension.

    ``shape`` is the weight's shape: ``hidden_size`` for the usual pre-norm, or ``(heads, head_dim)``
    for per-head norms applied to ``[..., heads, head_dim]`` tensors (normalised over head_dim).
    A 1-D weight on CUDA runs one fused kernel each way (kernels/residual_norm; backbone_fusion.py);
    the PyTorch lines below are the path everywhere else and compute the same thing.
    """

    def __init__(self, shape: int | tuple[int, ...], eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(shape))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dim() == 1 and fused_layer_applies(x):
            return fused_rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.to(torch.float32) * x).to(dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
