"""Per-forward sequence bookkeeping shared by every token mixer.

The model builds one :class:`SequenceContext` per forward from ``attention_mask`` and the cache
length, and hands it to each layer. It answers three questions every mixer has:

* where each new token sits in its own row (``positions``; left padding shifts rows apart),
* which keys are real tokens (``key_valid``; None when nothing is padded),
* which absolute sequence index the first new token has (``past_length``).

Index space vs position space: a token's *index* counts every column of the batch (pads too);
its *position* counts only the real tokens of its row. Masks compare indices (all rows share
them), RoPE and chunk boundaries use positions (so a left-padded row computes exactly what the
same row computes alone).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SequenceContext:
    positions: torch.Tensor  # [batch, seq] long: position of each new token within its row
    key_valid: torch.Tensor | None  # [batch, past + seq] bool: True for real tokens; None = no padding
    past_length: int  # number of columns (pads included) already in the cache

    @property
    def uniform_start(self) -> int | None:
        """The shared position of the first new token when every row is unpadded, else None."""
        return self.past_length if self.key_valid is None else None

    @property
    def query_valid(self) -> torch.Tensor | None:
        return None if self.key_valid is None else self.key_valid[:, self.past_length :]

    @classmethod
    def build(
        cls,
        batch_size: int,
        seq_length: int,
        past_length: int,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        device: torch.device,
    ) -> "SequenceContext":
        key_valid = None
        if attention_mask is not None:
            if attention_mask.dim() != 2:
                raise ValueError(
                    "attention_mask must be the 2D [batch, past + seq] padding mask (1 = token, 0 = padding); "
                    f"got shape {tuple(attention_mask.shape)}. These models build their own attention patterns."
                )
            total = past_length + seq_length
            if attention_mask.shape != (batch_size, total):
                raise ValueError(
                    f"attention_mask has shape {tuple(attention_mask.shape)} but the cache holds {past_length} tokens "
                    f"and {seq_length} are new, so it must be [{batch_size}, {total}]."
                )
            if not bool(attention_mask.all()):
                key_valid = attention_mask.to(device=device, dtype=torch.bool)
        if position_ids is None:
            if key_valid is None:
                position_ids = torch.arange(past_length, past_length + seq_length, device=device)
                position_ids = position_ids.expand(batch_size, seq_length)
            else:
                position_ids = (key_valid.long().cumsum(-1) - 1).clamp(min=0)[:, past_length:]
        elif position_ids.shape != (batch_size, seq_length):
            if position_ids.dim() == 2 and position_ids.shape[0] == 1 and position_ids.shape[1] == seq_length:
                position_ids = position_ids.expand(batch_size, seq_length)
            else:
                raise ValueError(
                    f"position_ids must be [batch, seq] = [{batch_size}, {seq_length}], got {tuple(position_ids.shape)}."
                )
        return cls(positions=position_ids.to(device), key_valid=key_valid, past_length=past_length)

    def attention_mask(self, num_keys: int, key_start: int, window: int | None = None) -> torch.Tensor | None:
        """Boolean [batch, 1, seq, num_keys] mask for softmax attention over keys with absolute indices
        key_start .. key_start + num_keys - 1, or None when nothing needs masking beyond plain causal
        attention over the whole sequence (so SDPA can take its flash path).

        Key j is visible to query i iff j <= i, i - j < window (when given; transformers' convention,
        the token itself counts) and j is a real token. The diagonal stays visible so that rows of
        padding queries never become empty (their outputs are ignored).
        """
        seq_length = self.positions.shape[1]
        if self.key_valid is None and (
            (key_start == self.past_length == 0 and num_keys == seq_length and window is None)
            # One new token: every key a cache layer returns is visible (window caches keep only the window).
            or (seq_length == 1 and (window is None or num_keys <= window))
        ):
            return None
        device = self.positions.device
        query_index = torch.arange(self.past_length, self.past_length + seq_length, device=device)[:, None]
        key_index = torch.arange(key_start, key_start + num_keys, device=device)[None, :]
        visible = key_index <= query_index
        if window is not None:
            visible = visible & (query_index - key_index < window)
        visible = visible[None, None]
        if self.key_valid is not None:
            valid = self.key_valid[:, key_start : key_start + num_keys]
            visible = visible & valid[:, None, None, :]
        return visible | (key_index == query_index)[None, None]
