"""HyLoRA's ``ensure_weight_tying`` decided per model: peft's ``LoraModel._check_tied_modules`` (which
sees the model and the adapter config before anything is wrapped) is wrapped on the class, so that a
config the caller picks out (hf_hybrid/peft.py: every HyLoraConfig) gets ``ensure_weight_tying=False``
on a model whose embeddings are not tied. Every other config, and every tied model, gets peft's own
check unchanged; the adapter_config.json saved later says what was done.

Patch of peft's behaviour (DESIGN.md, "Patches of other libraries"). Checked against peft
PEFT_VERSIONS; on any other version, or where the method is missing or takes other arguments,
nothing is replaced (peft then notes on an untied model that nothing is tied: harmless).
"""
from __future__ import annotations

import functools
import inspect
from typing import Callable

from . import within

PEFT_VERSIONS = ((0, 21), (0, 22))  # first and last (major, minor) checked, inclusive
_PARAMETERS = ["self", "model", "peft_config"]


def peft_checked(version: str | None = None) -> bool:
    """Whether this peft (or ``version``) is one the wrapper was checked against."""
    if version is None:
        import peft

        version = peft.__version__
    return within(version, PEFT_VERSIONS)


def _has_tied_embeddings(tuner) -> bool:
    """peft's own answer: the modules tied to the input embeddings (none when tie_word_embeddings is off)."""
    return bool(tuner._get_module_names_tied_with_embedding())


def untie_where_nothing_is_tied(picks: Callable[[object], bool]) -> bool:
    """Wrap the check once, for the configs ``picks`` accepts; returns whether the wrapper is in place."""
    from peft.tuners.lora import LoraModel

    check = getattr(LoraModel, "_check_tied_modules", None)
    if getattr(check, "_hf_hybrid_picks", None) is not None:
        return True
    if (check is None or not peft_checked() or not hasattr(LoraModel, "_get_module_names_tied_with_embedding")
            or list(inspect.signature(check).parameters) != _PARAMETERS):
        return False

    @functools.wraps(check)
    def check_tied_modules(self, model, peft_config):
        if picks(peft_config) and getattr(peft_config, "ensure_weight_tying", False) and not _has_tied_embeddings(self):
            peft_config.ensure_weight_tying = False
        return check(self, model, peft_config)

    check_tied_modules._hf_hybrid_picks = picks
    LoraModel._check_tied_modules = check_tied_modules
    return True
