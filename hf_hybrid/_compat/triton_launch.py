"""Triton launches without Triton's per-call Python: the compiled kernel is looked up by a key of
the arguments' specialisation and started through its own C launcher.

Patch of Triton's behaviour (DESIGN.md, "Patches of other libraries"): it reads Triton internals
(``CompiledKernel.run``'s argument order, ``function`` / ``packed_metadata``, the launch hooks in
``triton.knobs``, ``JITFunction.params`` and ``device_caches``). Checked against Triton
TRITON_VERSIONS (on the H100 / H200 with Triton 3.6); on any other version :func:`launch_cached`
returns the JIT function unchanged, so every launch takes Triton's own path.

Why: ``kernel[grid](...)`` binds and specialises every argument, builds a cache key string, checks
the kernel's globals, builds launch metadata and calls empty launch hooks, all in Python, on every
call: several times what the compiled kernel's own launcher takes, and enough to make a training
step at 8K wait on the host (`python -m benchmarks.launch_cost MODELS`).

How: :func:`launch_cached` wraps a ``@triton.jit`` kernel. A call ``kernel[grid](*args, **kwargs)``
computes a key holding everything Triton specialises a compiled kernel on (Triton 3.x,
``specialize_impl``): per tensor its dtype and whether its address is 16-byte aligned; per int
whether it is 1, whether it is divisible by 16 and which of i32 / i64 / u64 holds it; the values of
constexpr arguments and of every keyword (constexprs and launch options); the device. The key is a
superset of Triton's (a value it ignores only splits the cache), so a hit is the kernel Triton
would pick. The first call of a key goes through Triton (compiling if needed) and keeps its
compiled kernel; later calls launch it directly. Triton's own path runs instead whenever a launch
hook is installed (profilers such as proton), a pre-run hook or debug mode is on, an argument is
of another type (tuples, descriptors), the grid is a function, and always in the CPU interpreter.
What the fast path does not repeat: Triton's check that the globals a kernel read at compile time
still hold the same values (kernels here read module constants only).
"""
from __future__ import annotations

import torch

from ..options import get as option
from . import within

try:
    from triton import knobs  # Triton >= 3.4: launch hooks and debug mode live here
except ImportError:  # pragma: no cover - older Triton: every launch takes Triton's path
    knobs = None

TRITON_VERSIONS = ((3, 4), (3, 6))  # first and last (major, minor) checked, inclusive
MAX_KEYS = 256  # per kernel: past this, calls of new keys take Triton's path without being kept

_SIMPLE = (bool, str, type(None), torch.dtype)


class _Unsupported(Exception):
    pass


def _arg_key(arg):
    """What Triton specialises a non-constexpr argument on (a superset)."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() & 15 == 0
    if type(arg) is int:
        return arg == 1, arg & 15 == 0, -2147483648 <= arg <= 2147483647, arg >= 9223372036854775808
    if type(arg) is float:
        return float  # fp32, never specialised on its value (constexprs are keyed by value separately)
    if isinstance(arg, _SIMPLE):
        return type(arg), arg
    raise _Unsupported


def _args_key(args: tuple) -> tuple:
    """tuple(map(_arg_key, args)), with ints and plain tensors (most arguments) inlined: this runs on
    every launch, and a function call per argument was a third of its cost."""
    key = []
    for arg in args:
        kind = type(arg)
        if kind is int:
            key.append((arg == 1, arg & 15 == 0, -2147483648 <= arg <= 2147483647, arg >= 9223372036854775808))
        elif kind is torch.Tensor:
            key.append((arg.dtype, arg.data_ptr() & 15 == 0))
        else:
            key.append(_arg_key(arg))
    return tuple(key)


def _enabled() -> bool:
    return option("HF_HYBRID_TRITON_FAST_LAUNCH")


def triton_checked(version: str | None = None) -> bool:
    """Whether this Triton (or ``version``) is one the fast path was checked against."""
    if version is None:
        import triton

        version = triton.__version__
    return within(version, TRITON_VERSIONS)


class CachedLaunchKernel:
    """A ``@triton.jit`` kernel launched through :func:`launch_cached` (see the module docstring);
    every other attribute is the JIT function's."""

    def __init__(self, jit_function):
        self.jit_function = jit_function
        self._compiled: dict = {}
        params = getattr(jit_function, "params", ())
        self._param_names = tuple(p.name for p in params)
        self._constexpr_positions = tuple(i for i, p in enumerate(params) if p.is_constexpr)
        self._defaults = tuple(p.default for p in params)

    def __getattr__(self, name):
        return getattr(self.jit_function, name)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid, args: tuple, kwargs: dict):
        if callable(grid) or not _fast_path_open(self.jit_function):
            return self.jit_function[grid](*args, **kwargs)
        try:
            device = torch.cuda.current_device()
            key = (device, _args_key(args), tuple(args[i] for i in self._constexpr_positions if i < len(args)),
                   tuple(kwargs.items()))
            entry = self._compiled.get(key)
        except (_Unsupported, TypeError):  # TypeError: an unhashable keyword value
            return self.jit_function[grid](*args, **kwargs)
        if entry is None:
            kernel = self.jit_function[grid](*args, **kwargs)
            if hasattr(kernel, "result"):  # an asynchronous compile
                kernel = kernel.result()
            if kernel is not None and len(self._compiled) < MAX_KEYS:
                self._compiled[key] = (kernel, self._tail(len(args)))
            return kernel
        kernel, tail = entry
        full = args + tuple(kwargs.get(name, default) for name, default in tail)
        size = len(grid)
        kernel.run(grid[0], grid[1] if size > 1 else 1, grid[2] if size > 2 else 1,
                   torch._C._cuda_getCurrentRawStream(device), kernel.function, kernel.packed_metadata,
                   None, None, None, *full)
        return kernel

    def _tail(self, n_positional: int) -> tuple:
        """(name, default) of the parameters after the positional ones, in signature order: the
        launcher takes every parameter (constexprs too), as Triton's bound arguments hold them."""
        return tuple(zip(self._param_names[n_positional:], self._defaults[n_positional:]))


def _fast_path_open(jit_function) -> bool:
    if knobs is None:
        return False
    runtime = knobs.runtime
    hooks = (runtime.launch_enter_hook, runtime.launch_exit_hook)
    if any(h is not None and getattr(h, "calls", True) for h in hooks):
        return False
    return not (runtime.debug or getattr(jit_function, "debug", False) or getattr(jit_function, "pre_run_hooks", None))


def launch_cached(jit_function):
    """Decorator over ``@triton.jit``: launches through :class:`CachedLaunchKernel` on a GPU; the
    JIT function itself in Triton's CPU interpreter (no compiled kernels there), on a Triton
    version outside TRITON_VERSIONS, or when turned off with ``HF_HYBRID_TRITON_FAST_LAUNCH=0``."""
    from triton.runtime.jit import JITFunction

    if not isinstance(jit_function, JITFunction) or not _enabled() or not triton_checked():
        return jit_function
    return CachedLaunchKernel(jit_function)
