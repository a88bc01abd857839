"""Backend selection shared by every op in ``hf_hybrid.kernels``.

Each public op takes ``backend=`` with one of:

* ``"auto"``      - Triton when the inputs live on CUDA and Triton imports, else the reference.
* ``"reference"`` - the plain PyTorch oracle (readable, any device, slow).
* ``"triton"``    - the Triton kernel; needs CUDA inputs, or CPU inputs under ``TRITON_INTERPRET=1``.
* op-specific extras such as ``"flex"`` or ``"sdpa"`` where an op offers them.
"""
from __future__ import annotations

import os

import torch

BACKENDS = ("auto", "reference", "triton")


_TRITON_IMPORTS: list[bool] = []  # filled on the first call


@torch.compiler.assume_constant_result  # fixed per process: torch.compile takes the value, traces nothing
def triton_available() -> bool:
    if not _TRITON_IMPORTS:
        try:
            import triton  # noqa: F401
            import triton.language  # noqa: F401

            _TRITON_IMPORTS.append(True)
        except Exception:  # ImportError, or a broken driver probe on exotic machines
            _TRITON_IMPORTS.append(False)
    return _TRITON_IMPORTS[0]


def _interpreter_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# Triton picks its interpreter when a kernel is defined (at import), so the answer is fixed per
# process; reading it once also keeps an environment lookup off every kernel call.
_INTERPRETING = _interpreter_requested()


def triton_interpreting() -> bool:
    return _INTERPRETING


def resolve_backend(backend: str, device: torch.device, op: str, extra: tuple[str, ...] = ()) -> str:
    """Turn a user-facing backend name into the implementation that will run.

    Raises a ValueError for unknown names and a RuntimeError when ``"triton"`` is asked for
    where it cannot run, naming the argument and the fix instead of silently falling back.
    """
    allowed = BACKENDS + tuple(extra)
    if backend not in allowed:
        raise ValueError(f"{op}: backend={backend!r} is not one of {allowed}.")
    on_cuda = device.type == "cuda"
    if backend == "auto":
        return "triton" if on_cuda and triton_available() else "reference"
    if backend == "triton":
        if not triton_available():
            raise RuntimeError(f"{op}: backend='triton' needs the `triton` package; install it or pass backend='reference'.")
        if not on_cuda and not _interpreter_requested():
            raise RuntimeError(
                f"{op}: backend='triton' needs CUDA tensors (got device {device}); move the inputs to a GPU, "
                "set TRITON_INTERPRET=1 to run the kernel in Triton's CPU interpreter, or pass backend='reference'."
            )
    return backend


def check_same_shape(op: str, **tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"{op}: expected equal shapes, got {shapes}.")
