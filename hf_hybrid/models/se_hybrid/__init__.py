from .cache_se_hybrid import SEAttentionLayerCache, SEHybridCache, SEMambaLayerCache
from .configuration_se_hybrid import SEHybridConfig
from .modeling_se_hybrid import (
    SEHybridForCausalLM,
    SEHybridForQuestionAnswering,
    SEHybridForSequenceClassification,
    SEHybridForTokenClassification,
    SEHybridModel,
    SEHybridPreTrainedModel,
    SEMambaMixer,
)

__all__ = [
    "SEAttentionLayerCache",
    "SEHybridCache",
    "SEHybridConfig",
    "SEHybridForCausalLM",
    "SEHybridForQuestionAnswering",
    "SEHybridForSequenceClassification",
    "SEHybridForTokenClassification",
    "SEHybridModel",
    "SEHybridPreTrainedModel",
    "SEMambaLayerCache",
    "SEMambaMixer",
]
