from .cache_se_hybrid import SEAttentionLayerCache, SEHybridCache, SEMambaLayerCache
from .configuration_se_hybrid import SE_HYBRID_LAYER_TYPES, SEHybridConfig
from .modeling_se_hybrid import (
    SEHybridForCausalLM,
    SEHybridForQuestionAnswering,
    SEHybridForSequenceClassification,
    SEHybridForTokenClassification,
    SEHybridModel,
    SEHybridPreTrainedModel,
    SEMambaMixer,
)


def register() -> None:
    from ..registry import register_architecture

    register_architecture(
        SEHybridConfig, SEHybridModel, SEHybridForCausalLM,
        task_heads=(SEHybridForSequenceClassification, SEHybridForTokenClassification, SEHybridForQuestionAnswering),
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
    "register",
]
