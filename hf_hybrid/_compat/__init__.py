"""Every change this package makes to another library's behaviour, one module each.

Each module names the library versions it was checked against and falls back to the library's
own path on any other version; DESIGN.md ("Patches of other libraries") has the table.

- triton_launch.py: Triton kernels launched through their compiled launcher (private Triton API).
- torch_custom_ops.py: eager calls of this package's custom ops skip torch's dispatcher (the op's
  class is swapped for a subclass of torch's private CustomOpDef).
- transformers_stop_check.py: transformers' DeferredStopCheck.is_supported wrapped on the class.
- gluon_tma.py: the TMA reduce-add of Gluon, as a builtin on the private builder where Triton has
  no public wrapper yet.
- transformers_layer_types.py: transformers' layer-type validator wrapped: configs of our model
  types are checked against their architecture's own kinds (others unchanged).
- glibc_malloc.py: glibc's mmap threshold fixed at 4 MiB for long CPU training steps (mallopt).
- peft_weight_tying.py: peft's LoraModel._check_tied_modules wrapped on the class: HyLoRA configs
  tie embeddings only on models whose embeddings are tied.

Each module imports only its own library (and torch) besides hf_hybrid/options.py: this package sits
at the bottom of the layering with options.py, and kernels/ imports from it.
"""
from __future__ import annotations


def within(version: str, versions: tuple[tuple[int, int], tuple[int, int]]) -> bool:
    """Whether ``version`` ("3.6.0", "2.13.0+cpu") lies in the inclusive (major, minor) range."""
    try:
        major_minor = tuple(int(part) for part in str(version).split("+")[0].split(".")[:2])
    except ValueError:
        return False
    return len(major_minor) == 2 and versions[0] <= major_minor <= versions[-1]
