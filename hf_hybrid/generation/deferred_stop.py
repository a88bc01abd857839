"""generate()'s stop check one step late, for generations on the static decode step.

transformers' sampling loop reads ``unfinished_sequences.max() == 0`` on the host after every
token (``StopCheck``): the host waits for the device each step, so the next step's Python
(input preparation, this package's step dispatch, the graph launch) runs while the GPU idles.
With a replayed CUDA graph that wait is a large share of a token (compare ``--floor``, the graphed
steps in a bare loop, with generate() in `python -m benchmarks.generation`).

transformers ships the fix, ``DeferredStopCheck``: it copies the flag to the host asynchronously,
reads it one step later, and at the end undoes the one extra step it ran (tokens, scores and
logits of that step are dropped). It enables it on Apple's "mps" only. This module extends that
decision to the caches a :class:`~hf_hybrid.generation.graph_decode.DecodeGraphSession` registers
(one generate() of a model of this package whose decode steps run on static buffers, without host
syncs of their own), on CUDA, and only where transformers' own conditions for dropping the extra
step hold without rolling the cache back: not for assistants, and not when the cache outlives
generate() (``return_dict_in_generate`` or a cache the user passed). Every other generation,
transformers' models included, gets transformers' own decision unchanged.

Opt out with ``HF_HYBRID_DEFERRED_STOP=0`` (read per generate()) or ``decode_cuda_graph=False``.
"""
from __future__ import annotations

import contextlib
import weakref

from ..options import get as option
from .._compat.transformers_stop_check import wrap_is_supported

DEVICE_TYPES = ("cuda",)  # where a registered cache defers (tests add "cpu" with a stand-in event)

_registered: weakref.WeakSet = weakref.WeakSet()
_deferred: weakref.WeakSet = weakref.WeakSet()  # registered caches whose generate() did defer
_defer_everything = False  # the benchmark's transparency row (Llama with the same loop)


def enabled() -> bool:
    return option("HF_HYBRID_DEFERRED_STOP")


def _defers(device, cache, cache_is_returned, is_assistant) -> bool:
    """This package's part of the decision (the module docstring); False leaves it to transformers."""
    if not (is_assistant or cache_is_returned) and device.type in DEVICE_TYPES:
        if _is_registered(cache):
            _deferred.add(cache)
            return True
        if _defer_everything:
            return True
    return False


def install() -> bool:
    """Put :func:`_defers` in front of ``DeferredStopCheck.is_supported`` once (idempotent,
    hf_hybrid/_compat/transformers_stop_check.py); False when transformers has none to wrap."""
    return wrap_is_supported(_defers)


def _is_registered(cache) -> bool:
    try:
        return cache is not None and cache in _registered
    except TypeError:  # another library's cache that cannot be weakly referenced or hashed: not ours
        return False


def allow_deferred_stop(cache) -> bool:
    """Let generate() defer its stop check for ``cache`` (the session's new cache). False when off."""
    if not enabled() or not install():
        return False
    _registered.add(cache)
    return True


def stop_was_deferred(cache) -> bool:
    """Whether generate() took the deferred stop check for this registered cache."""
    return cache in _deferred


def withdraw_deferred_stop(cache) -> None:
    _registered.discard(cache)
    _deferred.discard(cache)


@contextlib.contextmanager
def deferred_for_every_generation():
    """Every generation (transformers' own models too) defers its stop check inside this block,
    under the conditions above: the benchmark times Llama with the same loop this way."""
    global _defer_everything
    install()
    previous, _defer_everything = _defer_everything, True
    try:
        yield
    finally:
        _defer_everything = previous
