"""generate()'s stop check one step late, for generations on the static decode step.

transformers' sampling loop reads ``unfinished_sequences.max() == 0`` on the host after every
token (``StopCheck``): the host waits for the device each step, so the next step's Python
(input preparation, this package's step dispatch, the graph launch) runs while the GPU idles.
With a replayed CUDA graph that wait is a large share of a token (compare ``--floor``, the graphed
steps in a bare loop, with generate() in `python -m benchmarks.generation.benchmark`).

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
import os
import weakref

DEVICE_TYPES = ("cuda",)  # where a registered cache defers (tests add "cpu" with a stand-in event)

_registered: weakref.WeakSet = weakref.WeakSet()
_deferred: weakref.WeakSet = weakref.WeakSet()  # registered caches whose generate() did defer
_defer_everything = False  # the benchmark's transparency row (Llama with the same loop)


def enabled() -> bool:
    return os.environ.get("HF_HYBRID_DEFERRED_STOP", "1") != "0"


def _deferred_stop_check_class():
    try:
        from transformers.generation.utils import DeferredStopCheck
    except ImportError:  # a transformers without it: the stop check stays synchronous
        return None
    return DeferredStopCheck if hasattr(DeferredStopCheck, "is_supported") else None


def install() -> bool:
    """Wrap ``DeferredStopCheck.is_supported`` once (idempotent); False when transformers has none."""
    cls = _deferred_stop_check_class()
    if cls is None:
        return False
    transformers_decision = cls.__dict__["is_supported"].__func__
    if getattr(transformers_decision, "_hf_hybrid", False):
        return True

    def is_supported(device, cache, cache_is_returned, is_assistant):
        if not (is_assistant or cache_is_returned) and device.type in DEVICE_TYPES:
            if _is_registered(cache):
                _deferred.add(cache)
                return True
            if _defer_everything:
                return True
        return transformers_decision(device, cache, cache_is_returned, is_assistant)

    is_supported._hf_hybrid = True
    is_supported.__doc__ = transformers_decision.__doc__
    cls.is_supported = staticmethod(is_supported)
    return True


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
