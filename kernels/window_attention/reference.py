"""Reference causal sliding-window softmax attention, the oracle for the kernels.

Per batch row and query head h (GQA: h reads key/value head h // (HQ // HKV)):
    o_i = sum_j softmax_j(scale q_i . k_j) v_j   over the keys j with 0 <= i - j < W,
where W (``window_size``) counts the token itself, like transformers' ``sliding_window``. With
``cu_seqlens`` (packed sequences, batch 1) a key of another sequence is never visible. This is
Forgetting Attention (kernels/forgetting_attention) with the forget gate at 1 (log f = 0).
"""
from __future__ import annotations

import torch

from ..forgetting_attention.decode import decode_visibility
from ..forgetting_attention.reference import masked_softmax_attention, visibility_mask


def window_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window_size: int,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B,T,HQ,D], k/v [B,T,HKV,D] -> o [B,T,HQ,D] (q's dtype), softmax in float32. Builds the
    T x T scores: for tests and short sequences only."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    visible = visibility_mask(q.shape[1], k.shape[1], 0, window_size, cu_seqlens, q.device)
    bias = torch.zeros((), dtype=torch.float32, device=q.device)
    return masked_softmax_attention(q, k, v, bias, visible, scale)


def window_attention_decode_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    length: torch.Tensor,
    scale: float | None = None,
    window_size: int | None = None,
) -> torch.Tensor:
    """One query per row against fixed-capacity key buffers (a decode step): the query sits at key
    position n - 1 (n = length per row, [1] or [B]) and sees the keys j < n (with ``window_size`` W
    also n - 1 - j < W). q [B,1,HQ,D]; k, v [B,T,HKV,D] -> [B,1,HQ,D] in q's dtype. A buffer used as
    a ring (a sliding window's slots in any order) passes n >= T: every slot is then seen."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    visible = decode_visibility(length, k.shape[1], None, window_size)
    bias = torch.zeros((), dtype=torch.float32, device=q.device)
    return masked_softmax_attention(q, k, v, bias, visible, scale)
