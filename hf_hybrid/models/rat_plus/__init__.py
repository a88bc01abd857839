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


def register() -> None:
    from ..registry import register_architecture

    register_architecture(
        RatPlusConfig, RatPlusModel, RatPlusForCausalLM,
        task_heads=(RatPlusForSequenceClassification, RatPlusForTokenClassification, RatPlusForQuestionAnswering),
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
    "register",
]
