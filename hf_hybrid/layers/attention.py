"""Softmax self-attention (full or sliding window), GQA, RoPE by token position.

Used as the `full_attention` / `sliding_attention` layers of hybrid stacks (RAT-SWA, Attention
baselines) and as the dense layer other architectures build on. Parameter names follow Llama
(q_proj, k_proj, v_proj, o_proj) so Llama checkpoints and LoRA target lists carry over.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .context import SequenceContext
from .rotary import apply_rotary, build_rotary


class SoftmaxAttention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rope_theta: float | None,
        sliding_window: int | None = None,
        attention_bias: bool = False,
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.sliding_window = sliding_window
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=attention_bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=attention_bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=attention_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        self.rotary = build_rotary(head_dim, rope_theta)

    def forward(self, hidden_states: torch.Tensor, context: SequenceContext, cache_layer=None) -> torch.Tensor:
        batch, seq, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(batch, seq, self.num_heads, self.head_dim)
        k = self.k_proj(hidden_states).view(batch, seq, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden_states).view(batch, seq, self.num_kv_heads, self.head_dim)
        cos_sin = self.rotary(context.positions) if self.rotary is not None else None
        q, k = apply_rotary(q, cos_sin), apply_rotary(k, cos_sin)
        # transformers' cache layers store [batch, heads, seq, head_dim].
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if cache_layer is not None:
            k, v = cache_layer.update(k, v)
        key_start = context.past_length + seq - k.shape[2]
        mask = context.attention_mask(k.shape[2], key_start, self.sliding_window)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None and seq > 1,
            enable_gqa=self.num_kv_heads != self.num_heads,
        )
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))
