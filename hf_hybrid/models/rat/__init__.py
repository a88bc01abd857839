from .cache_rat import RatCache, RatLayerCache
from .configuration_rat import RatConfig
from .modeling_rat import (
    RatForCausalLM,
    RatForQuestionAnswering,
    RatForSequenceClassification,
    RatForTokenClassification,
    RatModel,
    RatPreTrainedModel,
)

__all__ = [
    "RatCache",
    "RatConfig",
    "RatForCausalLM",
    "RatForQuestionAnswering",
    "RatForSequenceClassification",
    "RatForTokenClassification",
    "RatLayerCache",
    "RatModel",
    "RatPreTrainedModel",
]
