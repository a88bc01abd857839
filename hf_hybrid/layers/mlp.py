"""The backbone's feed-forward blocks, with Llama's parameter names (so Llama weights map one to one).

    gated ("gated", SwiGLU with act = silu):  down_proj(act(gate_proj(x)) * up_proj(x))
    plain ("plain"):                           down_proj(act(up_proj(x)))

The plain block is the two-layer MLP of the RAT and RAT+ authors' models (GELU, 4 x hidden, no
bias). ``build_mlp`` picks one from a config's ``mlp_type`` / ``hidden_act`` / ``mlp_bias``.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from transformers.activations import ACT2FN

from .backbone_fusion import fused_layer_applies, fused_silu_mul
from .projections import project_few_rows


class SwiGLUMLP(nn.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)); act is SiLU (SwiGLU) unless ``hidden_act`` says
    otherwise. For SwiGLU on CUDA the SiLU and the product are one kernel (backbone_fusion.py); a decode step's few rows go through the few-row projection kernel
    (projections.py)."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu", bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.hidden_act = hidden_act
        self.act_fn = ACT2FN[hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A decode step's few rows: one launch for gate and up (layers/projections.py; plain Linears only).
        gate, up = project_few_rows(x, (self.gate_proj, self.up_proj))
        if self.hidden_act == "silu":
            hidden = fused_silu_mul(gate, up) if fused_layer_applies(x) else F.silu(gate) * up
        else:
            hidden = self.act_fn(gate) * up
        return self.down_proj(hidden)


class PlainMLP(nn.Module):
    """down_proj(act(up_proj(x))), the two-layer feed-forward block (torch ops: the fused product is
    SwiGLU's). The RAT / RAT+ authors' models use it with exact GELU, 4 x hidden and no bias."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "gelu", bias: bool = False):
        super().__init__()
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.hidden_act = hidden_act
        self.act_fn = ACT2FN[hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.up_proj(x)))


def build_mlp(hidden_size: int, intermediate_size: int, mlp_type: str = "gated", hidden_act: str = "silu",
              bias: bool = False) -> nn.Module:
    """The feed-forward block a config asks for (``HybridBackboneConfig.mlp_type`` etc.)."""
    if mlp_type == "gated":
        return SwiGLUMLP(hidden_size, intermediate_size, hidden_act, bias)
    if mlp_type == "plain":
        return PlainMLP(hidden_size, intermediate_size, hidden_act, bias)
    raise ValueError(f"mlp_type must be 'gated' or 'plain', got {mlp_type!r}.")
