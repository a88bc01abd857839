from .cache_rattention import RattentionCache, RattentionGlobalLayerCache, RattentionLocalLayerCache
from .configuration_rattention import RattentionConfig
from .modeling_rattention import (
    RattentionForCausalLM,
    RattentionForQuestionAnswering,
    RattentionForSequenceClassification,
    RattentionForTokenClassification,
    RattentionModel,
    RattentionPreTrainedModel,
)

__all__ = [
    "RattentionCache",
    "RattentionConfig",
    "RattentionForCausalLM",
    "RattentionForQuestionAnswering",
    "RattentionForSequenceClassification",
    "RattentionForTokenClassification",
    "RattentionGlobalLayerCache",
    "RattentionLocalLayerCache",
    "RattentionModel",
    "RattentionPreTrainedModel",
]
