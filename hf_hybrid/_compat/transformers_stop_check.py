"""generate()'s stop check one step late for this package's caches: transformers'
``DeferredStopCheck.is_supported`` (a static method deciding whether generate() may read the stop
flag one step late) is replaced on the class by a wrapper that asks hf_hybrid first
(hf_hybrid/generation/deferred_stop.py says when) and otherwise returns transformers' own decision.

Patch of transformers' behaviour (DESIGN.md, "Patches of other libraries"). Checked against
transformers TRANSFORMERS_VERSIONS; on any other version, or where ``is_supported`` is missing or
takes other arguments, nothing is replaced and every generation keeps transformers' decision.
"""
from __future__ import annotations

import inspect
from typing import Callable

from . import within

TRANSFORMERS_VERSIONS = ((5, 17), (5, 24))  # first and last (major, minor) checked, inclusive
_PARAMETERS = ["device", "cache", "cache_is_returned", "is_assistant"]


def transformers_checked(version: str | None = None) -> bool:
    """Whether this transformers (or ``version``) is one the wrapper was checked against."""
    if version is None:
        import transformers

        version = transformers.__version__
    return within(version, TRANSFORMERS_VERSIONS)


def deferred_stop_check_class():
    """transformers' ``DeferredStopCheck`` where it has the ``is_supported`` this wraps, else None."""
    try:
        from transformers.generation.utils import DeferredStopCheck
    except ImportError:  # a transformers without it: the stop check stays synchronous
        return None
    decision = DeferredStopCheck.__dict__.get("is_supported")
    if not isinstance(decision, staticmethod) or not transformers_checked():
        return None
    if list(inspect.signature(decision.__func__).parameters) != _PARAMETERS:
        return None
    return DeferredStopCheck


def wrap_is_supported(ours: Callable) -> bool:
    """Install ``ours(device, cache, cache_is_returned, is_assistant) -> True | None`` in front of
    transformers' decision, once (idempotent). False where the class is missing or unchecked."""
    cls = deferred_stop_check_class()
    if cls is None:
        return False
    transformers_decision = cls.__dict__["is_supported"].__func__
    if getattr(transformers_decision, "_hf_hybrid", False):
        return True

    def is_supported(device, cache, cache_is_returned, is_assistant):
        if ours(device, cache, cache_is_returned, is_assistant):
            return True
        return transformers_decision(device, cache, cache_is_returned, is_assistant)

    is_supported._hf_hybrid = True
    is_supported.__doc__ = transformers_decision.__doc__
    cls.is_supported = staticmethod(is_supported)
    return True
