from .cache_fox import FoxCache, FoxLayerCache
from .configuration_fox import FoxConfig
from .modeling_fox import FoxForCausalLM, FoxModel, FoxPreTrainedModel


def register() -> None:
    from ..registry import register_architecture

    register_architecture(FoxConfig, FoxModel, FoxForCausalLM)


__all__ = ["FoxCache", "FoxConfig", "FoxForCausalLM", "FoxLayerCache", "FoxModel", "FoxPreTrainedModel", "register"]
