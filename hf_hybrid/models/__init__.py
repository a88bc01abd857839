"""The architectures of hf-hybrid: one subpackage each, listed in hf_hybrid/architectures.py."""
from __future__ import annotations

from .._compat.transformers_layer_types import allow_architecture_layer_types
from ..architectures import ARCHITECTURES
from .registry import register_architecture


def register_all() -> None:
    """Register every architecture of the table with transformers' Auto classes, and let
    transformers' generic config class read our configs' layer kinds (idempotent)."""
    allow_architecture_layer_types({arch.model_type: tuple(arch.layer_types) for arch in ARCHITECTURES if arch.layer_types})
    for arch in ARCHITECTURES:
        register_architecture(
            arch.load(arch.config_class_name),
            arch.load(arch.model_class_name),
            arch.load(arch.causal_lm_class_name),
            task_heads=tuple(arch.load(name) for name in arch.head_class_names),
        )
