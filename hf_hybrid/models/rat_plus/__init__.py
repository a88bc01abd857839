from .cache_rat_plus import DilatedStore, FullStore, RatPlusCache, RatPlusLayerCache
from .configuration_rat_plus import RatPlusConfig
from .modeling_rat_plus import (
    RatPlusCausalLMOutput,
    RatPlusForCausalLM,
    RatPlusForQuestionAnswering,
    RatPlusForSequenceClassification,
    RatPlusForTokenClassification,
    RatPlusModel,
    RatPlusPreTrainedModel,
)

__all__ = [
    "DilatedStore",
    "FullStore",
    "RatPlusCache",
    "RatPlusCausalLMOutput",
    "RatPlusConfig",
    "RatPlusForCausalLM",
    "RatPlusForQuestionAnswering",
    "RatPlusForSequenceClassification",
    "RatPlusForTokenClassification",
    "RatPlusLayerCache",
    "RatPlusModel",
    "RatPlusPreTrainedModel",
]
