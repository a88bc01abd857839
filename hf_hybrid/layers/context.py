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

It is also the single source of softmax-attention masks, in the form each kernel takes: a dense
boolean ``[batch, 1, seq, keys]`` mask (``attention_mask``), a flex_attention ``BlockMask``
(``block_mask``: blocks outside the band / padding are never computed), or the ``[batch, keys]``
padding mask FlashAttention's varlen path takes (``padding_mask``). Masks are built once per
forward and shared by the layers that ask for the same keys.

When the model is asked for attention probabilities (``output_attentions``), softmax layers hand
theirs to the context (``record_attention_weights``) and the model collects them after each layer.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

_FLEX_BLOCK = 128  # flex_attention's default block size (BlockMask granularity)
# Up to this many cells (rows x queries x keys) a BlockMask is built eagerly: create_block_mask then
# evaluates the mask over the whole grid (at most 4K x 4K, the limit RATTENTION's band mask uses),
# where compiling the builder costs a first use seconds of torch.compile. The same BlockMask either
# way; past it the compiled builder never materialises the grid.
EAGER_MASK_MAX_CELLS = 4096 * 4096


def compiles_mask_builder(cells: int, device) -> bool:
    """Whether a BlockMask over ``cells`` (rows x queries x keys) is built by a compiled builder: on
    CUDA past EAGER_MASK_MAX_CELLS, and never inside torch.compile (the outer compile traces it)."""
    return torch.device(device).type == "cuda" and cells > EAGER_MASK_MAX_CELLS and not torch.compiler.is_compiling()


@dataclass
class SequenceContext:
    positions: torch.Tensor  # [batch, seq] long: position of each new token within its row
    key_valid: torch.Tensor | None  # [batch, past + seq] bool: True for real tokens; None = no padding
    past_length: int  # number of columns (pads included) already in the cache
    output_attentions: bool = False  # softmax layers that can (eager) record their probabilities
    _masks: dict = field(default_factory=dict, repr=False, compare=False)
    _attention_weights: torch.Tensor | None = field(default=None, repr=False, compare=False)
    # Copies on other devices (see ``to``), kept by the context the model built, and a copy's origin.
    _device_copies: dict = field(default_factory=dict, repr=False, compare=False)
    _origin: SequenceContext | None = field(default=None, repr=False, compare=False)
    _tables: dict = field(default_factory=dict, repr=False, compare=False)  # shared_table's memo

    def to(self, device, non_blocking: bool = False) -> SequenceContext:
        """The context with its tensors on ``device``. accelerate's hooks call this on a layer's
        arguments when device_map puts the layer on another device than the embeddings (layers
        over several GPUs); one copy per device is built and shared by that device's layers, and
        attention weights a copy records reach the context the model reads them from."""
        device = torch.device(device)
        origin = self._origin or self
        if origin.positions.device == device:
            return origin
        if device not in origin._device_copies:
            origin._device_copies[device] = replace(
                origin,
                positions=origin.positions.to(device, non_blocking=non_blocking),
                key_valid=None if origin.key_valid is None else origin.key_valid.to(device, non_blocking=non_blocking),
                _masks={}, _attention_weights=None, _device_copies={}, _origin=origin, _tables={},
            )
        return origin._device_copies[device]

    def shared_table(self, key, make):
        """``make()`` once per forward for every layer that asks with the same ``key`` (RoPE tables:
        each layer would otherwise rebuild them, about ten kernels per layer and token in a decode
        step). Under torch.compile each caller builds its own (the memo is not traced)."""
        if torch.compiler.is_compiling():
            return make()
        if key not in self._tables:
            self._tables[key] = make()
        return self._tables[key]

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
        output_attentions: bool = False,
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
            # Whether anything is padded is a host-side decision on the mask's data: under
            # torch.compile take the padded path (exact for unpadded rows too) instead of syncing.
            if torch.compiler.is_compiling() or not bool(attention_mask.all()):
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
        return cls(
            positions=position_ids.to(device), key_valid=key_valid, past_length=past_length,
            output_attentions=output_attentions,
        )

    # ------------------------------------------------------------------ softmax-attention masks

    def effective_window(self, num_keys: int, key_start: int, window: int | None) -> int | None:
        """``window``, or None when it cannot hide any of the keys (every key is within it)."""
        if window is None:
            return None
        last_query = self.past_length + self.positions.shape[1] - 1
        return None if last_query - key_start < window else window

    def needs_mask(self, num_keys: int, key_start: int, window: int | None = None) -> bool:
        """False when plain causal attention over the keys is exact: nothing padded, no window that
        hides a key, and either the keys are exactly the new tokens (prefill from empty: is_causal)
        or there is one new token that sees every key a cache layer returns (decode)."""
        if self.key_valid is not None:
            return True
        window = self.effective_window(num_keys, key_start, window)
        seq_length = self.positions.shape[1]
        if seq_length == 1:
            # One new token: every key a cache layer returns is visible (window caches keep only the window).
            return window is not None and num_keys > window
        return not (key_start == self.past_length == 0 and num_keys == seq_length and window is None)

    def attention_mask(self, num_keys: int, key_start: int, window: int | None = None) -> torch.Tensor | None:
        """Boolean [batch, 1, seq, num_keys] mask for softmax attention over keys with absolute indices
        key_start .. key_start + num_keys - 1, or None when ``needs_mask`` is False (plain causal
        attention over the whole sequence, or one query seeing every key: SDPA's flash path).

        Key j is visible to query i iff j <= i, i - j < window (when given; transformers' convention,
        the token itself counts) and j is a real token. The diagonal stays visible so that rows of
        padding queries never become empty (their outputs are ignored).
        """
        if not self.needs_mask(num_keys, key_start, window):
            return None
        return self.dense_mask(num_keys, key_start, window)

    def dense_mask(self, num_keys: int, key_start: int, window: int | None = None) -> torch.Tensor:
        """The boolean [batch or 1, 1, seq, num_keys] mask of ``attention_mask``, always built (eager
        attention needs the causal part spelled out too)."""
        window = self.effective_window(num_keys, key_start, window)
        key = ("dense", num_keys, key_start, window)
        if key not in self._masks:
            self._masks[key] = self.mask_rows(num_keys, key_start, window, 0, self.positions.shape[1])
        return self._masks[key]

    def mask_rows(self, num_keys: int, key_start: int, window: int | None, row_start: int, row_end: int,
                  key_lo: int = 0, key_hi: int | None = None) -> torch.Tensor:
        """Rows [row_start, row_end) and key columns [key_lo, key_hi) of ``dense_mask`` (not memoised):
        what attention over blocks of queries builds instead of the whole [seq, num_keys] mask."""
        window = self.effective_window(num_keys, key_start, window)
        key_hi = num_keys if key_hi is None else key_hi
        device = self.positions.device
        query_index = torch.arange(self.past_length + row_start, self.past_length + row_end, device=device)[:, None]
        key_index = torch.arange(key_start + key_lo, key_start + key_hi, device=device)[None, :]
        visible = key_index <= query_index
        if window is not None:
            visible = visible & (query_index - key_index < window)
        visible = visible[None, None]
        if self.key_valid is not None:
            valid = self.key_valid[:, key_start + key_lo : key_start + key_hi]
            visible = visible & valid[:, None, None, :]
        return visible | (key_index == query_index)[None, None]

    def block_mask(self, num_keys: int, key_start: int, window: int | None = None):
        """The same visibility as a flex_attention ``BlockMask`` (blocks of 128 x 128; blocks entirely
        outside the causal band, the window or a row's padding are skipped by the kernel). Built
        eagerly up to EAGER_MASK_MAX_CELLS, past it by a compiled builder on CUDA, so no large
        [seq, num_keys] tensor is materialised (``compiles_mask_builder``)."""
        from torch.nn.attention.flex_attention import create_block_mask

        window = self.effective_window(num_keys, key_start, window)
        key = ("block", num_keys, key_start, window)
        if key not in self._masks:
            query_offset, key_valid = self.past_length, None
            if self.key_valid is not None:
                # The keys' validity, padded to whole blocks so the kernel never reads past its end.
                key_valid = self.key_valid[:, key_start : key_start + num_keys]
                key_valid = torch.nn.functional.pad(key_valid, (0, -num_keys % _FLEX_BLOCK + _FLEX_BLOCK))

            def visible(batch, head, q_idx, kv_idx):
                query, key_index = q_idx + query_offset, kv_idx + key_start
                allowed = key_index <= query
                if window is not None:
                    allowed = allowed & (query - key_index < window)
                if key_valid is not None:
                    allowed = allowed & key_valid[batch, kv_idx]
                return allowed | (key_index == query)

            device, seq = self.positions.device, self.positions.shape[1]
            batch = None if key_valid is None else key_valid.shape[0]
            cells = (batch or 1) * seq * num_keys
            self._masks[key] = create_block_mask(
                visible, batch, None, seq, num_keys, device=device,
                BLOCK_SIZE=_FLEX_BLOCK, _compile=compiles_mask_builder(cells, device),
            )
        return self._masks[key]

    def padding_mask(self, num_keys: int, key_start: int) -> torch.Tensor | None:
        """[batch, num_keys] int mask (1 = real token) of the keys, None when nothing is padded: the
        form FlashAttention's varlen path takes (the queries are the last ``seq`` keys)."""
        if self.key_valid is None:
            return None
        return self.key_valid[:, key_start : key_start + num_keys].to(torch.int32)

    # ------------------------------------------------------------------ output_attentions

    def record_attention_weights(self, weights: torch.Tensor | None) -> None:
        """Called by a softmax layer with its [batch, heads, seq, keys] probabilities."""
        if self.output_attentions:
            (self._origin or self)._attention_weights = weights

    def take_attention_weights(self) -> torch.Tensor | None:
        """The probabilities the layer that just ran recorded (None if it has none); clears them."""
        weights, self._attention_weights = self._attention_weights, None
        return weights
