"""Keep cheap activations out of a training step's memory: rebuild them when the backward needs them.

A training step keeps every tensor an op saves for its backward until that backward runs. Some are
cheap to make again from tensors that stay in memory anyway: the Mamba-2 mixer's conv output (from
the conv's input, which the conv keeps) and its gated norm's output (from the scan output and the
gate, which the norm keeps). At T = 32K those two are ~17 KB per token and layer, 3.3 GB for the
SE hybrid's six Mamba-2 layers.

:class:`RecomputedActivations` is a pair of saved-tensor hooks. While it is active, a save of a
registered tensor, or of a view of it, keeps only the view's geometry; the backward gets the tensor
back from the registered function, run without gradients (once for all the views one backward
unpacks). Saves made in the active region before the tensor was registered count too: an op that
saves its own output (RAT's fused keys/values kernel) has saved it by the time the caller can
register it. Other saves pass through untouched. It steps aside (:func:`recompute_applies` is
False) under torch.compile, which plans its own recomputation, and when other saved-tensor hooks are
already active (activation checkpointing, CPU offload), which manage these tensors themselves;
hooks that only observe (their pack function has ``observes_only = True``: the saved-bytes
accounting, benchmarks/saved_tensors.py) stay below it and get every save it passes through.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..options import get as option


def _observer_hooks():
    """(pack, unpack) of the active saved-tensor hooks when they only observe, else None."""
    top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    hooks = top_hooks(False) if top_hooks is not None else None
    return hooks if hooks is not None and getattr(hooks[0], "observes_only", False) else None


def recompute_applies() -> bool:
    """Whether a forward running now may use RecomputedActivations (see the module docstring).
    ``HF_HYBRID_RECOMPUTE=0`` turns it off (memory / time A/B runs)."""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling() or not option("HF_HYBRID_RECOMPUTE"):
        return False
    top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top_hooks is not None and (top_hooks(False) is None or _observer_hooks() is not None)


@dataclass
class _Source:
    tensor: torch.Tensor | None  # held while the context is active: its storage cannot be reused then
    rebuild: Callable[[], torch.Tensor] | None  # None once every saved view was unpacked
    inputs: tuple[torch.Tensor, ...]  # what rebuild reads: their versions must not change before the backward
    versions: tuple[int, ...]
    storage: int  # data_ptr of the registered tensor's storage
    pending: int = 0  # saved views not unpacked yet
    rebuilt: torch.Tensor | None = None


@dataclass
class _Saved:
    source: _Source
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass
class _Kept:
    """A save passed through (``packed``: the tensor, or what observing hooks below made of it),
    until a later register() of its storage turns it into ``rebuilt_as``. ``version``: the tensor's
    version when saved; autograd checks none under saved-tensor hooks, so the unpack does."""

    packed: object
    storage: int
    geometry: tuple[tuple[int, ...], tuple[int, ...], int]
    version: int
    rebuilt_as: _Saved | None = None


def _check_versions(source: _Source) -> None:
    if tuple(t._version for t in source.inputs) != source.versions:
        raise RuntimeError(
            "A tensor that the backward rebuilds an activation from was modified in place after the forward "
            "(hf_hybrid.layers.recompute); do not modify the mixer's inputs or parameters before backward()."
        )


def _geometry(tensor: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    return tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset()


@dataclass
class RecomputedActivations:
    sources: list[_Source] = field(default_factory=list)
    kept: list[_Kept] = field(default_factory=list)  # this region's pass-through saves; emptied on exit
    observer: tuple | None = None  # observing hooks below these (see the module docstring)

    def register(self, tensor: torch.Tensor, rebuild: Callable[[], torch.Tensor], *inputs: torch.Tensor) -> _Source | None:
        """Saves of ``tensor`` (or views of it) in the active region, earlier ones included, are
        rebuilt by ``rebuild()``, which reads ``inputs`` and must return a tensor equal to ``tensor``
        with its layout. Only whole, contiguous tensors are registered (the source is returned, for
        :meth:`value`); others stay saved as usual (None)."""
        whole = tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
        if not (tensor.is_contiguous() and whole):
            return None
        versions = tuple(t._version for t in inputs)
        source = _Source(tensor, rebuild, inputs, versions, tensor.untyped_storage().data_ptr())
        self.sources.append(source)
        for kept in self.kept:  # saved before it was registered: let those go too
            if kept.storage == source.storage and kept.rebuilt_as is None:
                source.pending += 1
                kept.rebuilt_as, kept.packed = _Saved(source, *kept.geometry), None
        return source

    @staticmethod
    def value(source: _Source) -> torch.Tensor:
        """A registered tensor for another rebuild that reads it (RAT's k~ and v~ read the gate
        logits): rebuilt if need be and, while saved views of it wait for their unpack, shared with
        them, so it is rebuilt once per backward. Hold no reference to the tensor itself in such a
        rebuild: that would keep it in memory."""
        if source.rebuilt is not None:
            return source.rebuilt
        _check_versions(source)
        with torch.no_grad():
            rebuilt = source.rebuild()
        if source.pending > 0:
            source.rebuilt = rebuilt
        return rebuilt

    def _pack(self, tensor: torch.Tensor):
        storage = tensor.untyped_storage().data_ptr()
        for source in self.sources:
            if source.storage == storage:
                source.pending += 1
                return _Saved(source, *_geometry(tensor))
        kept = _Kept(tensor if self.observer is None else self.observer[0](tensor), storage, _geometry(tensor), tensor._version)
        self.kept.append(kept)
        return kept

    def _unpack(self, saved):
        if isinstance(saved, _Kept):
            if saved.rebuilt_as is None:
                if self.observer is not None:
                    return self.observer[1](saved.packed)
                if saved.packed._version != saved.version:
                    raise RuntimeError(
                        "one of the variables needed for gradient computation has been modified by an inplace "
                        f"operation: a tensor of shape {list(saved.packed.shape)} saved at version {saved.version} "
                        f"is at version {saved.packed._version} (hf_hybrid.layers.recompute)."
                    )
                return saved.packed
            saved = saved.rebuilt_as
        source = saved.source
        if source.rebuilt is None:
            _check_versions(source)
            with torch.no_grad():
                source.rebuilt = source.rebuild()
        view = source.rebuilt.as_strided(saved.size, saved.stride, saved.offset)
        source.pending -= 1
        if source.pending <= 0:  # the last view of this backward: free the rebuilt tensor with it,
            # and the rebuild's closure (it holds the inputs; any reference cycle through it ends here).
            source.rebuilt, source.rebuild, source.inputs, source.versions = None, None, (), ()
        return view

    @contextlib.contextmanager
    def active(self):
        """The hooks, for the forward region that creates and consumes the registered tensors. On
        exit the registered tensors are let go (nothing is packed after it, so a freed storage
        reused by another tensor can never be taken for one of them)."""
        self.observer = _observer_hooks()
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield self
        finally:
            self.kept = []
            for source in self.sources:
                source.tensor = None
