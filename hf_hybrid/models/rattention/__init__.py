from .cache_rattention import RattentionCache, RattentionGlobalLayerCache, RattentionLocalLayerCache
from .configuration_rattention import RATTENTION_LAYER_TYPES, RattentionConfig
from .modeling_rattention import RattentionForCausalLM, RattentionModel, RattentionPreTrainedModel


def register() -> None:
    from ..registry import register_architecture

    register_architecture(RattentionConfig, RattentionModel, RattentionForCausalLM, layer_types=RATTENTION_LAYER_TYPES)


__all__ = [
    "RattentionCache",
    "RattentionConfig",
    "RattentionForCausalLM",
    "RattentionGlobalLayerCache",
    "RattentionLocalLayerCache",
    "RattentionModel",
    "RattentionPreTrainedModel",
    "register",
]
