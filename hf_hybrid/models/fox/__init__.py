from .cache_fox import FoxCache, FoxLayerCache
from .configuration_fox import FoxConfig
from .modeling_fox import (
    FoxForCausalLM,
    FoxForQuestionAnswering,
    FoxForSequenceClassification,
    FoxForTokenClassification,
    FoxModel,
    FoxPreTrainedModel,
)


def register() -> None:
    from ..registry import register_architecture

    register_architecture(
        FoxConfig, FoxModel, FoxForCausalLM,
        task_heads=(FoxForSequenceClassification, FoxForTokenClassification, FoxForQuestionAnswering),
    )


__all__ = [
    "FoxCache",
    "FoxConfig",
    "FoxForCausalLM",
    "FoxForQuestionAnswering",
    "FoxForSequenceClassification",
    "FoxForTokenClassification",
    "FoxLayerCache",
    "FoxModel",
    "FoxPreTrainedModel",
    "register",
]
