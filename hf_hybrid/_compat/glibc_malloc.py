"""glibc's mmap threshold fixed for long CPU training steps.

glibc serves allocations below its mmap threshold from the heap, and raises the threshold (up to
32 MiB) whenever a larger mmapped block is freed. A long CPU training step frees many blocks of
16-32 MiB (activations of T = 16K tokens), after which same-sized activations land in the heap and
stay resident once freed: 0.5-2 GB more peak RSS at T = 16K on small models. Blocks from 4 MiB up
therefore stay mmapped (returned to the system when freed); smaller ones are unaffected. Set once
per process, the first time attention runs over query blocks on CPU (kernels/_query_blocks.py) or a
decoder layer runs a long CPU training forward (layers/backbone.py).

Change of the C library's behaviour for the whole process (DESIGN.md, "Patches of other libraries"):
glibc on Linux only (musl and others have no ``mallopt``: nothing is done);
``HF_HYBRID_CPU_MALLOC_TRIM=0`` (hf_hybrid/options.py) leaves malloc as it is.
"""
from __future__ import annotations

import ctypes
import sys

from ..options import get

_MMAP_THRESHOLD = 4 << 20
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
_MALLOC_SET: list[bool] = []


def keep_large_blocks_out_of_the_heap() -> None:
    """Fix glibc's mmap threshold at 4 MiB (see above); a no-op elsewhere, or after the first call."""
    if _MALLOC_SET:
        return
    _MALLOC_SET.append(True)
    if not get("HF_HYBRID_CPU_MALLOC_TRIM") or not sys.platform.startswith("linux"):
        return
    try:
        mallopt = ctypes.CDLL(None).mallopt  # glibc; musl and others have none
    except (OSError, AttributeError):
        return
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)
