"""Tensor helpers that more than one op needs (kept here so that no op imports another's module)."""
from __future__ import annotations

import torch


def expand_groups(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, T, G, D] -> [B, T, heads, D]; head h reads group h % G (RAT's q/k sharing)."""
    batch, seq, groups, dim = x.shape
    return x.unsqueeze(2).expand(batch, seq, heads // groups, groups, dim).reshape(batch, seq, heads, dim)
