"""Registration of hf-hybrid architectures with transformers (Auto classes, layer-type names)."""
from __future__ import annotations

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
from transformers import configuration_utils


def register_layer_types(*names: str) -> None:
    """Let PretrainedConfig's strict validation accept our ``layer_types`` values.

    transformers validates ``config.layer_types`` (at init and at save time) against the module-level
    tuple ALLOWED_ATTN_LAYER_TYPES, read at call time; a plug-in's own layer kinds ("rat", "local",
    "mamba", ...) must be added there or every config with them is rejected.
    """
    missing = tuple(n for n in names if n not in configuration_utils.ALLOWED_ATTN_LAYER_TYPES)
    if missing:
        configuration_utils.ALLOWED_ATTN_LAYER_TYPES = configuration_utils.ALLOWED_ATTN_LAYER_TYPES + missing
        configuration_utils.ALLOWED_LAYER_TYPES = configuration_utils.ALLOWED_LAYER_TYPES + missing


def register_architecture(config_class, model_class, causal_lm_class, layer_types: tuple[str, ...] = ()) -> None:
    """AutoConfig / AutoModel / AutoModelForCausalLM learn ``config_class.model_type`` (idempotent)."""
    register_layer_types(*layer_types)
    AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
    AutoModel.register(config_class, model_class, exist_ok=True)
    AutoModelForCausalLM.register(config_class, causal_lm_class, exist_ok=True)
