"""Reference of the few-row linear: what F.linear computes, one weight at a time.

For x [..., K] with M rows in all (the leading dims flattened) and weights W_i [N_i, K]:

    out_i = x @ W_i^T        [..., N_i], float32 accumulation, rounded once to x's dtype
"""
from __future__ import annotations

import torch
from torch.nn import functional as F


def few_row_linear_reference(x: torch.Tensor, weights: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(F.linear(x, w) for w in weights)
