"""Rotary position embedding (RoPE) with explicit positions.

Positions are passed per token, so the same module serves token-index RoPE (position = token
index), RAT's inter-chunk RoPE (position = chunk index = token index // L) and left-padded batches
(per-row positions). ``theta=None`` in a config means NoPE: use :class:`NoPositionalEmbedding`.
"""
from __future__ import annotations

import torch
from torch import nn

from ..kernels.fused_norm import rotary


class RotaryEmbedding(nn.Module):
    """cos/sin tables for rotate-half RoPE: x_rot = x * cos + rotate_half(x) * sin.

    The frequencies are recomputed per call (head_dim / 2 numbers) instead of living in a
    non-persistent buffer, which from_pretrained's meta-device loading would leave uninitialised.
    """

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {head_dim}; set rope_theta=None for NoPE.")
        self.head_dim, self.theta = head_dim, float(theta)

    @torch.no_grad()
    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [batch, seq] -> (cos, sin), each [batch, seq, 1, head_dim] in float32."""
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=positions.device) / self.head_dim
        inv_freq = 1.0 / (self.theta**exponents)
        freqs = positions.to(torch.float32)[..., None] * inv_freq
        angles = torch.cat([freqs, freqs], dim=-1)[:, :, None, :]
        return angles.cos(), angles.sin()

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta}"


def apply_rotary(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """x [batch, seq, heads, head_dim]; ``cos_sin`` None means NoPE (identity). Float32 math, one
    rounding to x's dtype (kernels/fused_norm's ``rotary``: the statement is its reference; on CUDA
    one Triton pass each way instead of PyTorch's chain of float32 element-wise kernels, a
    concatenation among them)."""
    return rotary(x, cos_sin)


def rotary_tables(rotary: RotaryEmbedding | None, context, positions: torch.Tensor | None = None, tag="positions"):
    """cos/sin of ``positions`` (default: the context's token positions; ``tag`` names any other
    positions, e.g. RAT's chunk indices) for ``rotary``, built once per forward and shared by the
    layers of the stack (SequenceContext.shared_table). None for NoPE."""
    if rotary is None:
        return None
    positions = context.positions if positions is None else positions
    key = ("rotary", tag, rotary.head_dim, rotary.theta, tuple(positions.shape), positions.device)
    return context.shared_table(key, lambda: rotary(positions))


def build_rotary(head_dim: int, theta: float | None) -> RotaryEmbedding | None:
    """RoPE module for ``theta``, or None for NoPE."""
    return None if theta is None else RotaryEmbedding(head_dim, theta)
