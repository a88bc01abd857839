"""Batch and device operations shared by the architectures' cache layers.

A cache layer names its tensors once (``_map_tensors``); beam reordering, batch expansion and
selection, and offload/prefetch are then the same map over them, whatever the layer stores.
Below: what the croppable layers share (assisted decoding crops rejected draft tokens).
"""
from __future__ import annotations

import inspect

import torch
from transformers.cache_utils import CacheLayerMixin


class TensorMapLayer(CacheLayerMixin):
    """Subclasses implement ``_map_tensors(fn)``: replace each held tensor t by fn(t), batch dim 0."""

    def _map_tensors(self, fn) -> None:
        raise NotImplementedError

    def _map_crop_tensors(self, fn) -> None:
        """Map what a croppable subclass keeps for crops (nothing here)."""

    def _map_all(self, fn) -> None:
        self._map_tensors(fn)
        self._map_crop_tensors(fn)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_all(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_all(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_all(lambda t: t[indices, ...])

    def offload(self) -> None:
        self._map_all(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self) -> None:
        if self.is_initialized:  # moving a tensor to the device it is on is free
            self._map_all(lambda t: t.to(self.device, non_blocking=True))


# ----------------------------------------------------------------------------- cropping
# transformers' assisted (speculative) decoding runs the model over a window of draft tokens and then
# crops the rejected ones off the cache (Cache.crop). Recurrent states cannot be run backwards, so a
# croppable layer keeps, while past recording is on (Cache.activate_past_recording(), which generate()
# calls for assisted decoding), what rebuilding its state needs for the last ``crop_window`` tokens,
# and forgets it at every crop (a crop never goes back past the previous one).

DEFAULT_CROP_WINDOW = 256


def tokens_to_keep(max_length: int, seq_length: int) -> int:
    """Tokens a ``crop(max_length)`` keeps: transformers >= 5.17 passes ``-n`` (remove the last n,
    0 = remove none); older callers pass the length to keep (a positive number). transformers'
    assisted decoding passes a 0-d tensor (its count of rejected draft tokens): taken as a host int,
    so that cache lengths stay ints and positions are not computed from a device counter."""
    max_length = int(max_length)
    keep = seq_length + max_length if max_length <= 0 else min(max_length, seq_length)
    if keep < 0:
        raise ValueError(f"crop({max_length}) removes more tokens than the {seq_length} the cache holds.")
    return keep


def call_with_accepted(method, **kwargs):
    """``method(**kwargs)`` without the keywords it does not take (transformers' cache methods gain
    keywords between releases: ``activate_past_recording(recurrent_states_to_keep=)`` from 5.25)."""
    parameters = inspect.signature(method).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        kwargs = {name: value for name, value in kwargs.items() if name in parameters}
    return method(**kwargs)


def widen_crop_window(layer, tokens: int | None) -> None:
    """transformers >= 5.25 passes ``activate_past_recording(recurrent_states_to_keep=n)``: the most
    tokens its next crop may remove (the draft length). A layer with a crop window keeps at least that many."""
    if tokens is not None and hasattr(layer, "crop_window") and int(tokens) > layer.crop_window:
        layer.crop_window = int(tokens)


def crop_limit_error(layer, removed: int, removable: int) -> ValueError:
    """The error of a crop of ``removed`` tokens where ``layer`` can only remove ``removable``."""
    if not getattr(layer, "record_past", False):
        return ValueError(
            f"{type(layer).__name__} can only be cropped while it records past states: call "
            "cache.activate_past_recording() before the forward whose tokens may be cropped (generate() does "
            "this for assisted decoding)."
        )
    return ValueError(
        f"crop removes {removed} tokens but {type(layer).__name__} can remove at most {removable} now (it keeps "
        f"what a crop needs for the last crop_window={layer.crop_window} tokens since the previous crop). Raise it "
        "with cache.set_crop_window(n) before the forward (generate() sets it to max(max_new_tokens, "
        f"{DEFAULT_CROP_WINDOW}))."
    )


class TokenHistory:
    """Per-token tensors [batch, tokens, ...] of the token indices [start, end), the last ``limit`` only."""

    def __init__(self):
        self.tensors: tuple[torch.Tensor, ...] | None = None
        self.end = 0

    def __len__(self) -> int:
        return 0 if self.tensors is None else self.tensors[0].shape[1]

    @property
    def start(self) -> int:
        return self.end - len(self)

    def reset(self, end: int) -> None:
        self.tensors, self.end = None, end

    def append(self, tensors: tuple[torch.Tensor, ...], end: int, limit: int) -> None:
        """Add the tokens end - n .. end - 1 (n = tensors[i].shape[1]); a gap before them restarts the history."""
        count = tensors[0].shape[1]
        if self.tensors is None or self.end != end - count:
            self.tensors = None
        tensors = tuple(t[:, -limit:].detach() for t in tensors)
        if self.tensors is not None:
            tensors = tuple(torch.cat([old, new], dim=1)[:, -limit:] for old, new in zip(self.tensors, tensors))
        # Own storage: the mixer may write its state in place later, and a view would pin the
        # whole segment (a long prefill) in memory.
        self.tensors = tuple(t.clone() for t in tensors)
        self.end = end

    def at(self, index: int) -> tuple[torch.Tensor, ...]:
        """The tensors of token ``index`` ([batch, ...] each); start <= index < end."""
        return tuple(t[:, index - self.start] for t in self.tensors)

    def truncate(self, end: int, keep: int) -> None:
        """Drop the tokens from ``end`` on, then all but the last ``keep``."""
        if self.tensors is not None:
            stop = end - self.start
            kept = tuple(t[:, max(stop - keep, 0) : max(stop, 0)].clone() for t in self.tensors)
            self.tensors = kept if kept[0].shape[1] else None
        self.end = end

    def map(self, fn) -> None:
        if self.tensors is not None:
            self.tensors = tuple(fn(t) for t in self.tensors)


class CroppableCacheMixin:
    """For a Cache whose layers crop: ``set_crop_window`` and a ``crop`` that takes both conventions
    (transformers' own layers only take ``-n``)."""

    def set_crop_window(self, tokens: int) -> None:
        """Let a crop remove up to ``tokens`` tokens (kept while past recording is on)."""
        if not isinstance(tokens, int) or tokens < 1:
            raise ValueError(f"crop window must be a positive int, got {tokens!r}.")
        for layer in self.layers:
            if hasattr(layer, "crop_window"):
                layer.crop_window = tokens

    def activate_past_recording(self, **kwargs) -> None:
        """Every layer records its past for a later crop. ``recurrent_states_to_keep=n`` (what
        transformers >= 5.25 passes: its draft length) makes each of our layers keep at least n
        tokens to crop; any transformers release takes the call."""
        for layer in self.layers:
            widen_crop_window(layer, kwargs.get("recurrent_states_to_keep"))
            if hasattr(layer, "activate_past_recording"):
                call_with_accepted(layer.activate_past_recording, **kwargs)

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` tokens (negative: remove ``-max_length`` from the end).
        Layers that record their past then drop what only a deeper crop would have needed."""
        seq_length = self.get_seq_length()
        remove = seq_length - tokens_to_keep(max_length, seq_length)
        for layer in self.layers:  # all or nothing: no layer is cut when one cannot be
            error = layer.crop_error(remove) if hasattr(layer, "crop_error") else None
            if error is not None:
                raise error
        for layer in self.layers:
            layer.crop(-remove)


class StateHistoryMixin:
    """Crop support for a layer that carries a state after each token (a tuple of [batch, ...]
    tensors; the one held is the last token's): while past recording is on, the layer's mixer hands
    the state after every new token to :meth:`record_token_states` before the cache update, and a
    crop to length p restores the state after token p - 1. Subclasses define ``_carried_state()``
    and ``_recorded_length()``; decode steps that write the state in place call
    :meth:`_record_carried_state` first."""

    is_croppable = True
    record_past = False
    crop_window = DEFAULT_CROP_WINDOW

    def activate_past_recording(self) -> None:
        self.record_past = True

    @property
    def state_history(self) -> TokenHistory:
        if "_state_history" not in self.__dict__:
            self._state_history = TokenHistory()
        return self._state_history

    def _carried_state(self) -> tuple[torch.Tensor, ...] | None:
        raise NotImplementedError

    def _recorded_length(self) -> int:
        raise NotImplementedError

    def _record_carried_state(self) -> None:
        """Have the history reach the cache length: add the held state (the last token's) when it
        lags by one, as after a decode step. Call before a decode step overwrites the state."""
        if not self.record_past:
            return
        history, length, state = self.state_history, self._recorded_length(), self._carried_state()
        if history.end == length or state is None or any(t is None for t in state):
            return
        if history.end != length - 1:
            history.reset(length - 1)
        history.append(tuple(t[:, None] for t in state), end=length, limit=self.crop_window + 1)

    def record_token_states(self, *states: torch.Tensor) -> None:
        """The state after each of a segment's new tokens ([batch, seq, ...] each), before update()."""
        if not self.record_past:
            return
        self._record_carried_state()
        end = self._recorded_length() + states[0].shape[1]
        self.state_history.append(states, end=end, limit=self.crop_window + 1)

    def crop_error(self, removed: int) -> ValueError | None:
        """Why removing the last ``removed`` tokens is impossible now (None when it is possible)."""
        length = self._recorded_length()
        keep = length - removed
        if removed == 0 or keep <= 0:
            return None
        self._record_carried_state()
        history = self.state_history
        if not history.start <= keep - 1 < history.end:
            return crop_limit_error(self, removed, length - history.start - 1 if len(history) else 0)
        return None

    def _state_after(self, keep: int) -> tuple[torch.Tensor, ...] | None:
        """The state after token keep - 1 (None for keep = 0), for a crop to ``keep`` tokens."""
        length = self._recorded_length()
        if keep == 0 or keep == length:
            return self._carried_state() if keep else None
        error = self.crop_error(length - keep)
        if error is not None:
            raise error
        return self.state_history.at(keep - 1)

    def _forget_state_history(self, keep: int) -> None:
        """After a crop to ``keep``: only the state after token keep - 1 stays (a later crop may
        remove everything added after this one)."""
        self.state_history.truncate(keep, keep=1)

    def _map_crop_tensors(self, fn) -> None:
        self.state_history.map(fn)


def restore_into(held: torch.Tensor | None, value: torch.Tensor | None) -> torch.Tensor | None:
    """``value`` written into ``held`` in place when the shapes agree (a captured decode graph keeps
    reading the same storage), else a copy of it."""
    if value is None:
        return None
    if held is not None and held.shape == value.shape and held.dtype == value.dtype and held.device == value.device:
        return held.copy_(value)
    return value.clone()


class ReservedColumnsMixin:
    """For layers that decode on :class:`StaticColumns`: generate() reserves the static step's
    capacity before the prefill (``reserve_static_capacity``), and the prefill's columns go straight
    into buffers of that capacity instead of into a tensor that the first decode step would copy
    (for a full K/V cache at a 16K prompt, both copies were alive at once)."""

    _reserved_capacity = 0

    def reserve_static_capacity(self, capacity: int) -> None:
        self._reserved_capacity = capacity

    def takes_reserved_columns(self, cached: int, new: int) -> bool:
        """Whether a segment of ``new`` columns onto ``cached`` ones goes into the reserved buffers."""
        return cached == 0 and 0 < new < self._reserved_capacity and not getattr(self, "record_past", False)

    def continues_reserved_columns(self, static, new: int) -> bool:
        """Whether a segment of ``new`` columns continues in the layer's StaticColumns ``static``
        (a prefill in slices: the first went into the reserved buffers)."""
        return static is not None and new > 1 and static.fits(new) and not getattr(self, "record_past", False)


class StaticColumns:
    """Cached tensors that grow along dim 1 ([batch, tokens, ...]), moved into buffers of ``capacity``
    columns for generate()'s static decode step (hf_hybrid/generation/graph_decode.py), like
    transformers' StaticCache. ``length`` [1] is the device counter of filled columns that a captured
    step reads and advances (:meth:`write`); ``used`` is its host mirror, advanced by :meth:`advance`
    (the host part of a step, which a replayed graph does not run)."""

    def __init__(self, tensors: tuple[torch.Tensor, ...], capacity: int):
        self.used = tensors[0].shape[1]
        self.buffers = []
        for x in tensors:
            buffer = x.new_zeros(x.shape[0], capacity, *x.shape[2:])
            buffer[:, : self.used] = x
            self.buffers.append(buffer)
        self.length = torch.full((1,), self.used, dtype=torch.long, device=tensors[0].device)

    @property
    def capacity(self) -> int:
        return self.buffers[0].shape[1]

    @property
    def has_room(self) -> bool:
        return self.used < self.capacity

    def views(self) -> tuple[torch.Tensor, ...]:
        """The filled columns of every buffer (what the layer's ordinary attributes hold meanwhile)."""
        return tuple(buffer[:, : self.used] for buffer in self.buffers)

    def fits(self, new: int) -> bool:
        """Whether ``new`` more columns fit (a prefill continuing in slices, sliced_prefill.py)."""
        return self.used + new <= self.capacity

    def extend(self, *columns: torch.Tensor) -> None:
        """A segment of columns per buffer ([batch, n, ...], in buffer order) after the filled ones:
        a prefill continuing in slices stays in the buffers (no copy of the filled columns)."""
        new = columns[0].shape[1]
        for buffer, column in zip(self.buffers, columns):
            buffer[:, self.used : self.used + new] = column
        self.used += new
        self.length.fill_(self.used)

    def write(self, *columns: torch.Tensor) -> None:
        """One new column per buffer ([batch, 1, ...], in buffer order) at the device counter, which
        then moves one on."""
        for buffer, column in zip(self.buffers, columns):
            buffer.index_copy_(1, self.length, column.to(buffer.dtype))
        self.length.add_(1)

    def advance(self) -> None:
        self.used += 1
