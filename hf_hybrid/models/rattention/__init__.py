from .cache_rattention import RattentionCache, RattentionGlobalLayerCache, RattentionLocalLayerCache
from .configuration_rattention import RATTENTION_LAYER_TYPES, RattentionConfig
from .modeling_rattention import (
    RattentionForCausalLM,
    RattentionForQuestionAnswering,
    RattentionForSequenceClassification,
    RattentionForTokenClassification,
    RattentionModel,
    RattentionPreTrainedModel,
)


def register() -> None:
    from ..registry import register_architecture

    register_architecture(
        RattentionConfig, RattentionModel, RattentionForCausalLM,
        task_heads=(RattentionForSequenceClassification, RattentionForTokenClassification, RattentionForQuestionAnswering),
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
    "register",
]
