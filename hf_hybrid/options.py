"""Every runtime switch of hf-hybrid, in one place: environment variables read through :func:`get`.

Each switch trades something for a default that suits most runs; README.md ("Runtime switches") has
the same table. A switch is read where the note says: "per call" switches take effect at once,
"at import" ones must be set before ``import hf_hybrid`` (or use the function named).

This module imports only the standard library: it sits below everything else, so ``kernels/``
(installed as ``hf_hybrid.kernels``) reads its switches here too.

    from hf_hybrid import options
    options.get("HF_HYBRID_RECOMPUTE")            # True / False, or a choice's string
    with options.override(HF_HYBRID_RECOMPUTE="0"):
        ...                                       # the environment as given, restored afterwards
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Iterator

_OFF = ("0", "false", "off", "no")
_ON = ("1", "true", "on", "yes")


@dataclass(frozen=True)
class Switch:
    name: str  # the environment variable
    default: str
    choices: tuple[str, ...]  # () for an on/off switch
    trades: str  # what the non-default value buys and costs
    read: str  # when it is read
    former: str | None = None  # the variable's earlier name, still read when the new one is unset


SWITCHES: dict[str, Switch] = {s.name: s for s in (
    Switch("HF_HYBRID_FUSED_BACKBONE", "1", (), read="at import (or set_backbone_fusion())",
           trades="the fused LM head + loss, RMSNorm and SwiGLU (this package's kernels) in the shared "
                  "backbone on CUDA; 0 keeps PyTorch's modules (more memory and time)",
           former="HF_HYBRID_LIGER"),
    Switch("HF_HYBRID_FUSED_DECODE", "1", (), read="at import (or set_backbone_fusion(fused_decode=))",
           trades="the fused norm / residual kernels inside generate()'s graphed decode step; 0 keeps them "
                  "out of that step only (slower decode, the plain modules' numerics)"),
    Switch("HF_HYBRID_RECOMPUTE", "1", (), read="per training forward",
           trades="RAT's, RATTENTION's and the SE hybrid's mixers rebuild a few cheap activations in the backward "
                  "(gradients bit-equal); 0 keeps them (more activation memory, a little less compute)"),
    Switch("HF_HYBRID_TRITON_FAST_LAUNCH", "1", (), read="when a kernel module is imported",
           trades="Triton kernels start through their compiled launcher (hf_hybrid/_compat/triton_launch.py, "
                  "~6 us instead of 40-77 us of host time); 0 gives every launch Triton's own path"),
    Switch("HF_HYBRID_DEFERRED_STOP", "1", (), read="per generate()",
           trades="generate()'s stop check reads the previous step's flag without waiting for the GPU; "
                  "0 keeps transformers' own decision (one host sync per step)"),
    Switch("HF_HYBRID_CPU_MALLOC_TRIM", "1", (), read="once, at the first long CPU training forward",
           trades="glibc's mmap threshold fixed at 4 MiB (hf_hybrid/_compat/glibc_malloc.py), so freed activations "
                  "of long CPU steps return to the system (0.5-2 GB less peak RSS at 16K tokens); 0 leaves "
                  "malloc as it is for the whole process"),
    Switch("HF_HYBRID_AUTOTUNE", "0", (), read="per call",
           trades="Triton kernels with autotuning candidates (FoX's portable attention: off Hopper, windows, "
                  "deterministic algorithms) launch with a fixed tile chosen by shape, one compile each at first use; "
                  "1 compiles and times every candidate per length class instead (a slower first use, the "
                  "measured fastest tile for the GPU at hand)"),
    Switch("HF_HYBRID_BLOCK_ENDS", "auto", ("auto", "triton", "sdpa"), read="per call",
           trades="RAT's chunk-end attention on CUDA: auto takes one cuDNN call from 1024 chunk ends; "
                  "triton keeps the Triton kernels, sdpa takes cuDNN from any length"),
    Switch("HF_HYBRID_FOX_ATTENTION", "auto", ("auto", "triton", "sdpa"), read="per call",
           trades="Forgetting Attention's inference forward on CUDA: auto takes cuDNN with the forget bias "
                  "as extra head dimensions where faster; triton keeps the Triton kernels, sdpa takes cuDNN "
                  "from any length"),
)}


def _switch(name: str) -> Switch:
    try:
        return SWITCHES[name]
    except KeyError:
        raise KeyError(f"{name} is not a switch of hf-hybrid; the switches are {', '.join(SWITCHES)}.") from None


def _parse(switch: Switch, value: str, variable: str | None = None):
    """``variable``: the name the value was read under (the switch's, or its former name)."""
    variable = variable or switch.name
    value = value.strip().lower()
    if not switch.choices:
        if value in _ON or value == "":
            return True
        if value in _OFF:
            return False
        raise ValueError(f"{variable}={value!r}: set it to 1 or 0 (or unset it: {switch.default}).")
    if value == "":
        return switch.default
    if value not in switch.choices:
        raise ValueError(f"{variable}={value!r}: set it to one of {', '.join(switch.choices)}, "
                         f"or leave it unset ({switch.default}).")
    return value


def get(name: str):
    """The switch's value now: a bool for an on/off switch, else one of its choices. A value it
    does not know raises ValueError naming the variable and what it accepts."""
    switch = _switch(name)
    if name not in os.environ and switch.former is not None and switch.former in os.environ:
        return _parse(switch, os.environ[switch.former], switch.former)
    return _parse(switch, os.environ.get(name, switch.default))


@contextlib.contextmanager
def override(**values: str) -> Iterator[None]:
    """Sets switches (their environment variables) for the block and restores them afterwards;
    None unsets one. Values are checked at once. Switches read at import are not re-read."""
    for name, value in values.items():
        if value is not None:
            _parse(_switch(name), str(value))
        else:
            _switch(name)
    saved = {name: os.environ.get(name) for name in values}
    try:
        for name, value in values.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = str(value)
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def table() -> str:
    """The switches as a Markdown table (README.md's copy is checked against it)."""
    rows = ["| variable | default | what it trades | read |", "|---|---|---|---|"]
    for s in SWITCHES.values():
        default = s.default if not s.choices else f"{s.default} ({' / '.join(s.choices)})"
        name = f"`{s.name}`" + (f" (formerly `{s.former}`)" if s.former else "")
        rows.append(f"| {name} | {default} | {s.trades} | {s.read} |")
    return "\n".join(rows)
