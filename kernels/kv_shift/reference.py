"""KV-shift (FoX paper, Pro block, Eq. 14): each key (or value) mixed with the one before it.

    out_t = a_t x_{t-1} + (1 - a_t) x_t,    a_t = sigmoid(logits_t)  (one gate per token and head)

x [B, T, H, D]; logits [B, T, H]; x_{-1} = previous [B, H, D], the last x of the tokens before the
segment (zeros when None). Float32 math (float64 for float64 inputs), one rounding to x's dtype
(op by op, PyTorch would round the gate, both products and their sum).
"""
from __future__ import annotations

import torch


def kv_shift_reference(x: torch.Tensor, logits: torch.Tensor, previous: torch.Tensor | None = None) -> torch.Tensor:
    math = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(math)
    first = xf.new_zeros(x.shape[0], 1, *x.shape[2:]) if previous is None else previous.to(math)[:, None]
    shifted = torch.cat([first, xf[:, :-1]], dim=1)
    a = torch.sigmoid(logits.to(math))[..., None]
    return (xf + a * (shifted - xf)).to(x.dtype)
