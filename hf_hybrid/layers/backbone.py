"""The pre-norm decoder block every architecture shares:

    h = x + mixer(RMSNorm(x));  out = h + SwiGLU(RMSNorm(h))

Only the token mixer differs between architectures; parameter names follow Llama
(input_layernorm, self_attn, post_attention_layernorm, mlp) so dense checkpoints map directly.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from .context import SequenceContext
from .mlp import SwiGLUMLP
from .norm import RMSNorm


class DecoderLayer(GradientCheckpointingLayer):
    def __init__(self, hidden_size: int, intermediate_size: int, mixer: nn.Module, rms_norm_eps: float):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, eps=rms_norm_eps)
        self.self_attn = mixer
        self.post_attention_layernorm = RMSNorm(hidden_size, eps=rms_norm_eps)
        self.mlp = SwiGLUMLP(hidden_size, intermediate_size)

    def forward(self, hidden_states: torch.Tensor, context: SequenceContext, cache_layer=None, **mixer_kwargs) -> torch.Tensor:
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states), context, cache_layer, **mixer_kwargs)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
