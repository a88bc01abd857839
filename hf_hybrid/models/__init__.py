"""The architectures of hf-hybrid: one subpackage each, listed in hf_hybrid/architectures.py."""
from __future__ import annotations

from ..architectures import ARCHITECTURES
from .registry import register_architecture


def register_all() -> None:
    """Register every architecture of the table with transformers' Auto classes (idempotent)."""
    for arch in ARCHITECTURES:
        register_architecture(
            arch.load(arch.config_class_name),
            arch.load(arch.model_class_name),
            arch.load(arch.causal_lm_class_name),
            task_heads=tuple(arch.load(name) for name in arch.head_class_names),
        )
