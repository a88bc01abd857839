"""SwiGLU feed-forward block with Llama's parameter names (so Llama weights map one to one)."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .backbone_fusion import fused_layer_applies, fused_silu_mul
from .projections import project_few_rows


class SwiGLUMLP(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)), no biases. On CUDA with Liger installed the
    SiLU and the product are one kernel (backbone_fusion.py); a decode step's few rows go through
    the few-row projection kernel (projections.py)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A decode step's few rows: one launch for gate and up (layers/projections.py).
        gate, up = project_few_rows(x, (self.gate_proj, self.up_proj))
        hidden = fused_silu_mul(gate, up) if fused_layer_applies(x) else F.silu(gate) * up
        return self.down_proj(hidden)
