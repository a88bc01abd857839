from .cache_rat import RatCache, RatLayerCache
from .configuration_rat import RAT_LAYER_TYPES, RatConfig
from .modeling_rat import RatForCausalLM, RatModel, RatPreTrainedModel


def register() -> None:
    from ..registry import register_architecture

    register_architecture(RatConfig, RatModel, RatForCausalLM, layer_types=RAT_LAYER_TYPES)


__all__ = ["RatCache", "RatConfig", "RatForCausalLM", "RatLayerCache", "RatModel", "RatPreTrainedModel", "register"]
