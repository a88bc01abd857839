"""SEHybridCache: what an SE-Attn hybrid needs to decode, per layer.

* ``mamba`` layers: transformers' own ``LinearAttentionLayer`` (the Mamba-2 conv state - the last
  d_conv inputs of conv1d - and the SSM state), which transformers' Bamba mixer reads and writes
  through the Cache API; :class:`SEMambaLayerCache` only adds a link to the whole cache, because
  that mixer addresses its state as ``cache[layer_idx]``.
* ``attention`` layers (:class:`SEAttentionLayerCache`): all keys/values ([batch, seq, kv_heads,
  head_dim], index space, padding included) plus, per row, a
  :class:`~hf_hybrid.layers.span_expanded_attention.SERowState`: the block summaries c_j of every
  complete memory block, the queries of the open block, and the running chunk / group query sums.
  ``full`` decodes with the keys/values alone; ``se`` retrieves from the summaries without
  recomputing them; the state is kept in every mode so the mode may change between calls.
  In generate()'s static decode step the rows' states live stacked in fixed buffers
  (:class:`~hf_hybrid.layers.se_static_decode.SEBatchState`), advanced on the device in every
  mode, and go back to per-row states when any other call comes.

Crops (assisted decoding, ``Cache.crop``): while past recording is on, Mamba layers keep a checkpoint
of the SSM state and the scan inputs since (rescanned on a crop), attention layers a checkpoint of
the row states and the queries since (advanced by the layer's own step); at most ``crop_window``.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, LinearAttentionLayer

from ...kernels.ssd_scan import ssd_scan
from ...layers.se_static_decode import SEBatchState
from ...layers.span_expanded_attention import SERowState
from ..cache_layer import (
    DEFAULT_CROP_WINDOW,
    CroppableCacheMixin,
    ReservedColumnsMixin,
    StaticColumns,
    TokenHistory,
    call_with_accepted,
    crop_limit_error,
    tokens_to_keep,
)
from .configuration_se_hybrid import canonical_layer_type


class SEMambaLayerCache(LinearAttentionLayer):
    """transformers' conv/SSM state layer, plus ``parent`` (the SEHybridCache it belongs to)."""

    def __init__(self, parent: Cache | None = None, **kwargs):
        super().__init__(**kwargs)
        self.parent = parent

    def get_seq_length(self) -> int:
        """The stack's length (a host int; SEHybridCache.get_seq_length)."""
        if self.parent is not None:
            return self.parent.get_seq_length()
        return int(super().get_seq_length()) if hasattr(super(), "get_seq_length") else 0

    # Static decode protocol (hf_hybrid/generation/graph_decode.py): the conv and SSM states already
    # have fixed shapes and the fused decode step updates them in place, so nothing moves per token.
    def prepare_static_decode(self, capacity: int, config) -> bool:
        return bool(self.has_previous_state[0]) and not self.record_past

    def static_decode_advance(self) -> None:
        """No host state changes per token."""

    def static_decode_tensors(self) -> tuple[torch.Tensor | None, ...]:
        return (self.conv_states[0], self.recurrent_states[0])

    # Crop (assisted decoding) -------------------------------------------------------------------
    # transformers' layer crops the conv state (it keeps the conv inputs while past recording is
    # on); the SSM state is rebuilt: a checkpoint of it and the scan inputs (x, dt, B) of the
    # tokens since (the last crop_window; older ones are scanned into the checkpoint), from which
    # a crop scans up to the kept length. The mixer hands the inputs over (record_scan_inputs).
    crop_window = DEFAULT_CROP_WINDOW

    @property
    def is_croppable(self) -> bool:
        return True

    def activate_past_recording(self, **kwargs) -> None:
        # transformers' layer takes the draft length from 5.25 (generate() reads it back)
        call_with_accepted(super().activate_past_recording, **kwargs)
        self._start_scan_record()

    def _start_scan_record(self) -> None:
        state = self.recurrent_states[0]
        self._scan_base = None if state is None else state.clone()
        self._scan_inputs = TokenHistory()

    def record_scan_inputs(self, x, dt, B, *, A, dt_bias, dt_limit) -> None:
        """A segment's SSM inputs before discretisation: x [batch, seq, heads, P], dt [batch, seq,
        heads] (raw, softplus(dt + dt_bias) clamped to dt_limit), B [batch, seq, groups, N], and A."""
        if not self.record_past:
            return
        self._scan_params = dict(A=A, dt_bias=dt_bias, dt_limit=tuple(dt_limit))
        history = self._scan_inputs
        history.append((x, dt, B), end=history.end + x.shape[1], limit=x.shape[1] + len(history))
        overflow = len(history) - self.crop_window
        if overflow > 0:  # beyond what a crop may need: into the checkpoint
            self._scan_base = self._scan(self._scan_base, *(t[:, :overflow] for t in history.tensors))
            history.tensors = tuple(t[:, overflow:].contiguous() for t in history.tensors)
        # The conv inputs transformers keeps while recording: only what a crop may need, and at
        # least the kernel's span (zeros before the first token), which the next conv reads.
        conv, kernel = self.conv_states[0], self.conv_kernel_size[0]
        if conv is not None:
            conv = conv[..., -(kernel + self.crop_window) :]
            if conv.shape[-1] < kernel:
                conv = torch.cat([conv.new_zeros(*conv.shape[:-1], kernel - conv.shape[-1]), conv], dim=-1)
            self.conv_states[0] = conv

    def _scan(self, state, x, dt, B):
        """The SSM state after x, dt, B from ``state`` (zeros when None)."""
        if x.shape[1] == 0:
            return state
        params = self._scan_params
        _, final = ssd_scan(
            x, dt, params["A"], B, torch.zeros_like(B), dt_bias=params["dt_bias"], dt_softplus=True,
            dt_limit=params["dt_limit"], initial_state=state, return_final_state=True,
        )
        return final

    def crop_error(self, removed: int) -> ValueError | None:
        """Why removing the last ``removed`` tokens is impossible now (None when it is possible)."""
        history = getattr(self, "_scan_inputs", None)
        if removed and (not self.record_past or history is None or removed > len(history)):
            return crop_limit_error(self, removed, 0 if history is None else len(history))
        return None

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens (0: none; transformers' convention)."""
        if tokens_to_remove > 0:
            raise ValueError("SEMambaLayerCache.crop takes -n (remove the last n tokens); crop the SEHybridCache instead.")
        removed = -tokens_to_remove
        error = self.crop_error(removed)
        if error is not None:
            raise error
        if not self.record_past:  # nothing removed, nothing recorded
            return
        history, conv = self._scan_inputs, self.conv_states[0]
        if conv is None:  # nothing cached yet
            return
        width = removed + self.conv_kernel_size[0]
        if conv.shape[-1] < width:
            # fewer inputs than the crop and the kernel span: the sequence starts there (zeros before it)
            self.conv_states[0] = torch.cat([conv.new_zeros(*conv.shape[:-1], width - conv.shape[-1]), conv], dim=-1)
        self._crop_transformers_state(removed)
        if removed:
            kept = len(history) - removed
            state = self._scan(self._scan_base, *(t[:, :kept] for t in history.tensors))
            if state is None:  # back to before the first token
                self.recurrent_states[0].zero_()
            else:
                self.recurrent_states[0].copy_(state)
        self._start_scan_record()

    def _crop_transformers_state(self, removed: int) -> None:
        """What transformers' own crop does, but the SSM state: the conv inputs back to the kernel's
        span before the last ``removed`` tokens, and (from 5.25) its token count. Its 5.25 crop also
        restores the SSM state from copies it keeps per update; here the scan rebuilds it."""
        kernel = self.conv_kernel_size[0]
        conv = self.conv_states[0]
        self.conv_states[0] = conv[..., -removed - kernel : -removed] if removed else conv[..., -kernel:]
        if removed and hasattr(self, "cumulative_length_linear"):  # transformers >= 5.25 counts tokens here
            self.cumulative_length_linear.sub_(removed)
        # transformers >= 5.25 also keeps a copy of the state per update while recording, for its own crop:
        # the scan rebuilds the state here, so the copies are dropped at each crop.
        for key in getattr(self, "recurrent_states_history", None) or {}:
            self.recurrent_states_history[key] = []

    def reset(self) -> None:
        super().reset()
        if self.record_past:
            self._start_scan_record()


class SEAttentionLayerCache(ReservedColumnsMixin, CacheLayerMixin):
    """Keys/values of one attention layer and the per-row SE retrieval state."""

    is_sliding = False
    is_compileable = False
    is_croppable = True  # while past recording is on, see crop()
    record_past = False
    crop_window = DEFAULT_CROP_WINDOW

    def __init__(self, **kwargs):
        super().__init__()
        self.cumulative_length = 0
        self._rows: list[SERowState] = []
        self.chunk_size: int | None = None
        self._static: StaticColumns | None = None
        # The rows' retrieval state during static decode steps (``rows`` is rebuilt from it on exit).
        self._static_retrieval: SEBatchState | None = None
        self.static_first_position = 0  # the position of the first step since the state was stacked

    @property
    def rows(self) -> list[SERowState]:
        """The per-row retrieval states (unstacked first after static decode steps)."""
        self._unstack_rows()
        return self._rows

    @rows.setter
    def rows(self, rows: list[SERowState]) -> None:
        self._rows = rows

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, _, heads, dim = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states.new_zeros(batch, 0, heads, dim)
        self.values = value_states.new_zeros(batch, 0, heads, dim)
        self.rows = [SERowState() for _ in range(batch)]
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Append a segment's keys/values [batch, seq, kv_heads, head_dim]; return everything held."""
        self._leave_static_decode()
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.takes_reserved_columns(self.cumulative_length, key_states.shape[1]):
            columns = (key_states.to(self.keys.dtype), value_states.to(self.values.dtype))
            self._static = StaticColumns(columns, self._reserved_capacity)
            self.keys, self.values = self._static.views()
        else:
            self.keys = torch.cat([self.keys, key_states.to(self.keys.dtype)], dim=1)
            self.values = torch.cat([self.values, value_states.to(self.values.dtype)], dim=1)
        self.cumulative_length += key_states.shape[1]
        return self.keys, self.values

    def check_chunk_size(self, chunk_size: int) -> None:
        """Chunk boundaries are baked into the cached state: one chunk size per cache."""
        if self.chunk_size is None:
            self.chunk_size = chunk_size
        elif chunk_size != self.chunk_size:
            raise ValueError(
                f"se_chunk_size {chunk_size} differs from the {self.chunk_size} this cache was filled with; "
                "keep se_chunk_size fixed while decoding (or start a new cache)."
            )

    def row_state(self, row: int) -> SERowState:
        return self.rows[row]

    # Static decode protocol (hf_hybrid/generation/graph_decode.py): like FoX's cache, K/V live in
    # buffers of generate()'s max_length and a step writes the device column (StaticColumns); the
    # rows' retrieval states are stacked into an SEBatchState of the same capacity, which the
    # layer's static step advances on the device (layers/se_static_decode.py).
    @property
    def static_decode_active(self) -> bool:
        return self._static is not None and self._static.has_room and self._static_retrieval is not None

    @property
    def static_retrieval_state(self) -> SEBatchState:
        return self._static_retrieval

    def _unstack_rows(self) -> None:
        """The per-row retrieval states from the stacked ones (which are dropped: the next static
        step stacks them again)."""
        if self._static_retrieval is not None:
            self._rows = self._static_retrieval.to_rows(self.cumulative_length, SERowState)
            self._static_retrieval = None

    def _leave_static_decode(self) -> None:
        self._unstack_rows()
        self._static = None

    def prepare_static_decode(self, capacity: int, config) -> bool:
        """Move K/V into buffers of ``capacity`` columns and stack the rows' retrieval states
        (once). False before the prefill, when full, while recording the past for crops, or when
        the rows are at different lengths (padding)."""
        if self._static is not None and self._static.capacity == capacity and self._static_retrieval is not None:
            return self.static_decode_active
        self._unstack_rows()  # stacked for another capacity: stacked again below
        used = self.cumulative_length
        if not self.is_initialized or not used or used >= capacity or self.record_past:
            return False
        state = SEBatchState.from_rows(self._rows, used, capacity, config.se_block_size)
        if state is None:
            return False
        if self._static is None or self._static.capacity != capacity:
            self._static = StaticColumns((self.keys, self.values), capacity)
            self.keys, self.values = self._static.views()
        self._static_retrieval = state
        self.static_first_position = used  # no later static step's query sits before it
        return True

    def static_decode_update(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """One new token per row [batch, 1, kv_heads, head_dim] written at the device column; returns
        (key buffer, value buffer, filled columns [1]: the counter itself, one past the new token)."""
        self._static.write(key_states, value_states)
        self.static_decode_advance()
        return (*self._static.buffers, self._static.length)

    def static_decode_advance(self) -> None:
        """The host part of one static decode step (what a replayed graph does not run)."""
        self._static.advance()
        self.keys, self.values = self._static.views()
        self.cumulative_length += 1

    def static_decode_tensors(self) -> tuple[torch.Tensor | None, ...]:
        return (*self._static.buffers, self._static.length, *self._static_retrieval.tensors())

    def retrieval_tensors(self) -> list[torch.Tensor]:
        """The tensors of the retrieval state (a size query: stays in the static decode mode)."""
        if self._static_retrieval is not None:
            return list(self._static_retrieval.tensors()[:2])
        return [t for r in self._rows for t in (r.summaries, r.open_queries) if t is not None]

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        return self.cumulative_length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def _select_rows(self, index: torch.Tensor) -> None:
        self._leave_static_decode()
        index = index.to(self.keys.device)
        self.keys, self.values = self.keys[index], self.values[index]
        self.rows = [self.rows[i].map_tensors(lambda t: t) for i in index.tolist()]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            self._select_rows(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._select_rows(torch.arange(self.keys.shape[0]).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._select_rows(indices)

    def reset(self) -> None:
        self._static_retrieval = None
        self._leave_static_decode()
        self.keys = self.values = None
        self.rows, self.chunk_size = [], None
        self.is_initialized = False
        self.cumulative_length = 0

    # Crop (assisted decoding) -------------------------------------------------------------------
    # While past recording is on: a checkpoint of the row states and the queries of the tokens
    # since (the last crop_window; older ones are advanced into the checkpoint). A crop advances
    # the checkpoint over the kept queries with the layer's own row-state step (handed over with
    # the queries), so the retrieval state is exactly what the kept tokens alone would give.
    def activate_past_recording(self) -> None:
        self._leave_static_decode()
        self.record_past = True
        self._start_query_record()

    def _start_query_record(self) -> None:
        self._base_rows = [row.map_tensors(lambda t: t) for row in self.rows]  # tensors are replaced, never written
        self._queries = TokenHistory()
        self._queries.reset(self.cumulative_length)

    def record_queries(self, queries: torch.Tensor, advance_row) -> None:
        """A segment's queries [batch, seq, heads, head_dim], after update() and before the row
        states advance; ``advance_row(state, q, k_row, v_row, mode, chunk_size, compute_output=False)``
        is the layer's step of a row state."""
        if not self.record_past:
            return
        self._advance_row = advance_row
        history = self._queries
        history.append((queries,), end=self.cumulative_length, limit=queries.shape[1] + len(history))
        overflow = len(history) - self.crop_window
        if overflow > 0:  # beyond what a crop may need: into the checkpoint
            self._base_rows = self._advanced_rows(overflow)
            history.tensors = (history.tensors[0][:, overflow:].contiguous(),)

    def _advanced_rows(self, count: int) -> list[SERowState]:
        """The checkpoint's row states advanced over the first ``count`` recorded queries."""
        start = self._queries.start
        bases = self._base_rows or [SERowState() for _ in range(self.keys.shape[0])]  # recording began empty
        rows = []
        for index, base in enumerate(bases):
            row = base.map_tensors(lambda t: t)
            if count:
                if row.length != start:
                    raise ValueError("SEAttentionLayerCache crops rows without padding only (assisted decoding is batch 1).")
                end = start + count
                self._advance_row(row, self._queries.tensors[0][index, :count], self.keys[index, :end], self.values[index, :end],
                                  None, self.chunk_size, compute_output=False)
            rows.append(row)
        return rows

    def crop_error(self, removed: int) -> ValueError | None:
        """Why removing the last ``removed`` tokens is impossible now (None when it is possible)."""
        length = self.cumulative_length
        history = getattr(self, "_queries", None)
        if removed and length - removed > 0 and (not self.record_past or history is None or length - removed < history.start or history.end != length):
            return crop_limit_error(self, removed, 0 if history is None else max(length - history.start, 0))
        return None

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` tokens (negative: remove ``-max_length``), as Cache.crop."""
        length = self.cumulative_length
        keep = tokens_to_keep(max_length, length)
        if keep == length:
            if self.record_past:
                self._start_query_record()
            return
        if keep == 0:
            self.reset()
            if self.record_past:
                self._start_query_record()
            return
        error = self.crop_error(length - keep)
        if error is not None:
            raise error
        history = self._queries
        self.rows = self._advanced_rows(keep - history.start)
        self.keys, self.values = self.keys[:, :keep], self.values[:, :keep]
        self.cumulative_length = keep
        self._start_query_record()


class SEHybridCache(CroppableCacheMixin, Cache):
    """Per-layer caches for an SE hybrid stack, built from ``config.layer_types``."""

    def __init__(self, config, **kwargs):
        # transformers may rename config.layer_types in place (mamba -> linear_attention) when validating.
        kinds = [canonical_layer_type(t) for t in config.layer_types]
        layers = [SEMambaLayerCache(parent=self) if kind == "mamba" else SEAttentionLayerCache() for kind in kinds]
        super().__init__(layers=layers)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens cached, as an attention layer counts them: a Mamba layer's index answers for the
        first attention layer (transformers < 5.25 did the same; from 5.25 a Mamba layer counts only
        the tokens that pass its update methods, and the decode step writes its states in place)."""
        if layer_idx >= len(self.layers):
            return 0
        if isinstance(self.layers[layer_idx], SEMambaLayerCache):
            attention = [layer for layer in self.layers if isinstance(layer, SEAttentionLayerCache)]
            if not attention:
                raise ValueError("get_seq_length needs an attention layer: this SE hybrid cache holds Mamba layers only.")
            return attention[0].get_seq_length()
        return self.layers[layer_idx].get_seq_length()

    def nbytes_per_layer(self) -> list[int]:
        """Bytes each layer's cache holds now (K/V + summaries, or conv + SSM states)."""
        sizes = []
        for layer in self.layers:
            tensors = []
            if isinstance(layer, SEAttentionLayerCache) and layer.is_initialized:
                tensors = [layer.keys, layer.values] + layer.retrieval_tensors()
            elif isinstance(layer, SEMambaLayerCache):
                tensors = [t for t in list(layer.conv_states.values()) + list(layer.recurrent_states.values()) if t is not None]
            sizes.append(sum(t.numel() * t.element_size() for t in tensors))
        return sizes
