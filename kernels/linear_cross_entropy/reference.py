"""Cross-entropy of a linear layer's output (the causal-LM head and its loss), stated plainly:

    logits = hidden @ weight.T                        (in the inputs' dtype, as nn.Linear gives them)
    loss_i = logsumexp_v(logits_i) - logits_i[target_i]      (float32; 0 where target_i == ignore_index)
    loss   = sum_i loss_i / #{i : target_i != ignore_index}   (reduction "mean"), or sum_i loss_i ("sum")

transformers' ForCausalLMLoss computes the same from float32 logits (``logits.float()``); a mean
over no counted target is 0 / 0 = nan there and here.
"""
from __future__ import annotations

import torch
from torch.nn import functional as F


def linear_cross_entropy_reference(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                   ignore_index: int = -100, reduction: str = "mean") -> torch.Tensor:
    logits = F.linear(hidden, weight).float()
    return F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction=reduction)
