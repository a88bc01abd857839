"""Gluon's TMA reduce-add (a tile added into global memory by the TMA unit) for FoX's Hopper backward.

Triton >= 3.7 exposes it as ``tma.async_atomic_add``. Triton 3.6 (the GPU image) has the operation
in its IR builder but no Python wrapper: there it is defined here as a Gluon ``@builtin`` on the
private ``_semantic`` / ``ir`` API (a patch of Gluon, DESIGN.md "Patches of other libraries").
Checked against Triton BUILTIN_VERSIONS; on other versions without the public wrapper
:func:`tma_reduce_add` returns None and the backward takes the portable kernels.
"""
from __future__ import annotations

from . import within

BUILTIN_VERSIONS = ((3, 6), (3, 6))  # where the private builder call was checked (inclusive)


def tma_reduce_add():
    """The reduce-add for @gluon.jit kernels: ``(tensor_desc, coord, src)``; None where unavailable."""
    try:
        import triton
        from triton.experimental.gluon.language.nvidia.hopper import tma
    except ImportError:
        return None
    if hasattr(tma, "async_atomic_add"):  # Triton >= 3.7
        return tma.async_atomic_add
    if not within(triton.__version__, BUILTIN_VERSIONS):
        return None
    from triton.experimental.gluon.language._core import builtin

    @builtin
    def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
        from triton._C.libtriton import ir

        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)

    return _tma_reduce_add
