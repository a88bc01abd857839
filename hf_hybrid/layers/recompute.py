"""Keep cheap activations out of a training step's memory: rebuild them when the backward needs them.

A training step keeps every tensor an op saves for its backward until that backward runs. Some are
cheap to make again from tensors that stay in memory anyway: the Mamba-2 mixer's conv output (from
the conv's input, which the conv keeps) and its gated norm's output (from the scan output and the
gate, which the norm keeps). At T = 32K those two are ~17 KB per token and layer, 3.3 GB for the
SE hybrid's six Mamba-2 layers.

:class:`RecomputedActivations` is a pair of saved-tensor hooks. While it is active, a save of a
registered tensor, or of a view of it, keeps only the view's geometry; the backward gets the tensor
back from the registered function, run without gradients (once for all the views one backward
unpacks). Other saves pass through untouched. It steps aside (:func:`recompute_applies` is False)
under torch.compile, which plans its own recomputation, and when other saved-tensor hooks are
already active (activation checkpointing, CPU offload), which manage these tensors themselves.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch


def recompute_applies() -> bool:
    """Whether a forward running now may use RecomputedActivations (see the module docstring)."""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return False
    top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top_hooks is not None and top_hooks(False) is None


@dataclass
class _Source:
    tensor: torch.Tensor | None  # held while the context is active: its storage cannot be reused then
    rebuild: Callable[[], torch.Tensor]
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
class RecomputedActivations:
    sources: list[_Source] = field(default_factory=list)

    def register(self, tensor: torch.Tensor, rebuild: Callable[[], torch.Tensor], *inputs: torch.Tensor) -> None:
        """Saves of ``tensor`` (or views of it) from now on are rebuilt by ``rebuild()``, which reads
        ``inputs`` and must return a tensor equal to ``tensor`` with its layout. Only whole,
        contiguous tensors are registered; others stay saved as usual."""
        whole = tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
        if tensor.is_contiguous() and whole:
            versions = tuple(t._version for t in inputs)
            self.sources.append(_Source(tensor, rebuild, inputs, versions, tensor.untyped_storage().data_ptr()))

    def _pack(self, tensor: torch.Tensor):
        storage = tensor.untyped_storage().data_ptr()
        for source in self.sources:
            if source.storage == storage:
                source.pending += 1
                return _Saved(source, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset())
        return tensor

    @staticmethod
    def _unpack(saved):
        if not isinstance(saved, _Saved):
            return saved
        source = saved.source
        if tuple(t._version for t in source.inputs) != source.versions:
            raise RuntimeError(
                "A tensor that the backward rebuilds an activation from was modified in place after the forward "
                "(hf_hybrid.layers.recompute); do not modify the mixer's inputs or parameters before backward()."
            )
        if source.rebuilt is None:
            with torch.no_grad():
                source.rebuilt = source.rebuild()
        view = source.rebuilt.as_strided(saved.size, saved.stride, saved.offset)
        source.pending -= 1
        if source.pending <= 0:  # the last view of this backward: free the rebuilt tensor with it
            source.rebuilt = None
        return view

    @contextlib.contextmanager
    def active(self):
        """The hooks, for the forward region that creates and consumes the registered tensors. On
        exit the registered tensors are let go (nothing is packed after it, so a freed storage
        reused by another tensor can never be taken for one of them)."""
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield self
        finally:
            for source in self.sources:
                source.tensor = None
