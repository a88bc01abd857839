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
]
