"""Registration of hf-hybrid architectures with transformers' Auto classes.

Nothing here changes what transformers accepts for its own models: layer-type names are checked by
each config itself (validation.ArchitectureLayerTypes) and cache layers are not registered under
layer-type names, so a Llama config carrying "local" or "rat" behaves as without hf_hybrid.

One table per architecture says which Auto class loads which model class; the Auto registration
and the ``config.auto_map`` of saved checkpoints (remote_code.py) both read it.
"""
from __future__ import annotations

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)
from transformers.modeling_layers import (
    GenericForQuestionAnswering,
    GenericForSequenceClassification,
    GenericForTokenClassification,
)

# The Auto class of a task head, told by the transformers generic head it builds on.
_HEAD_AUTO_CLASSES = (
    (GenericForSequenceClassification, AutoModelForSequenceClassification),
    (GenericForTokenClassification, AutoModelForTokenClassification),
    (GenericForQuestionAnswering, AutoModelForQuestionAnswering),
)

# model_type -> {"AutoModel": class, "AutoModelForCausalLM": class, ...}
_ARCHITECTURE_CLASSES: dict[str, dict[str, type]] = {}


def _head_auto_class(head_class: type):
    for generic, auto_class in _HEAD_AUTO_CLASSES:
        if issubclass(head_class, generic):
            return auto_class
    raise TypeError(
        f"{head_class.__name__} is not a task head: it must subclass one of "
        f"{[generic.__name__ for generic, _ in _HEAD_AUTO_CLASSES]} (see hf_hybrid/models/heads.py)."
    )


def register_architecture(
    config_class, model_class, causal_lm_class, task_heads: tuple[type, ...] = ()
) -> None:
    """AutoConfig, AutoModel, AutoModelForCausalLM and, for each task head, its Auto class learn
    ``config_class.model_type`` (idempotent)."""
    AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
    classes = {AutoModel: model_class, AutoModelForCausalLM: causal_lm_class}
    classes.update({_head_auto_class(head): head for head in task_heads})
    for auto_class, model in classes.items():
        auto_class.register(config_class, model, exist_ok=True)
    _ARCHITECTURE_CLASSES[config_class.model_type] = {auto.__name__: model for auto, model in classes.items()}


def architecture_classes(model_type: str) -> dict[str, type]:
    """{Auto class name: model class} of a registered architecture (what ``config.auto_map`` names)."""
    if model_type not in _ARCHITECTURE_CLASSES:
        raise KeyError(f"model_type {model_type!r} is not an hf-hybrid architecture; known: {sorted(_ARCHITECTURE_CLASSES)}.")
    return dict(_ARCHITECTURE_CLASSES[model_type])
