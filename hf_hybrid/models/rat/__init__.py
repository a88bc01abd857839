from .cache_rat import RatCache, RatLayerCache
from .configuration_rat import RAT_LAYER_TYPES, RatConfig
from .modeling_rat import (
    RatForCausalLM,
    RatForQuestionAnswering,
    RatForSequenceClassification,
    RatForTokenClassification,
    RatModel,
    RatPreTrainedModel,
)


def register() -> None:
    from ..registry import register_architecture

    register_architecture(
        RatConfig, RatModel, RatForCausalLM,
        task_heads=(RatForSequenceClassification, RatForTokenClassification, RatForQuestionAnswering),
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
    "register",
]
