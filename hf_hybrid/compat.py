"""The cache's name across transformers versions: 5.24 renamed ``past_key_values`` to ``cache``
throughout generate() (prepare_inputs_for_generation passes ``cache=`` to forward(), generate()
reads ``outputs.cache`` back, and the output dataclasses declare a ``cache`` field).

hf-hybrid runs on both sides of the rename from the same code:

* every model forward keeps its ``past_key_values`` parameter and takes ``cache=`` as well, on every
  version (the wrapper each forward gets in hf_hybrid/models/common.py calls :func:`rename_cache_kwarg`);
  generate() takes either spelling too (hf_hybrid/generation/graph_decode.py);
* outputs are built with :func:`cache_field` and read with :func:`cache_of`, under ``CACHE_NAME``,
  the name the installed transformers uses, so its generate() finds the cache where it looks.

On transformers 5.17-5.23 ``CACHE_NAME`` is ``"past_key_values"`` and nothing changes.
"""
from __future__ import annotations

from dataclasses import fields

from transformers.modeling_outputs import CausalLMOutputWithPast

# Read off the installed output classes rather than the version number: the field, the keyword
# generate() passes and the key it reads back were renamed together.
CACHE_NAME = "cache" if "cache" in {f.name for f in fields(CausalLMOutputWithPast)} else "past_key_values"
# Both spellings, for lists of keyword names (accelerate's device placement must skip either).
CACHE_KWARGS = ("past_key_values", "cache")


def rename_cache_kwarg(kwargs: dict, name: str) -> dict:
    """Move the cache keyword of ``kwargs`` to ``name`` (in place), whichever spelling it came as."""
    other = "cache" if name == "past_key_values" else "past_key_values"
    if other in kwargs:
        value = kwargs.pop(other)
        if value is not None:
            if kwargs.get(name) is not None and kwargs[name] is not value:
                raise ValueError("Pass the cache once: as cache= or as past_key_values=, not both.")
            kwargs[name] = value
    return kwargs


def cache_field(cache) -> dict:
    """``{CACHE_NAME: cache}``, to build a ModelOutput: ``CausalLMOutputWithPast(logits=..., **cache_field(cache))``."""
    return {CACHE_NAME: cache}


def cache_of(outputs):
    """The cache a model output carries (None when it has none)."""
    return getattr(outputs, CACHE_NAME)
