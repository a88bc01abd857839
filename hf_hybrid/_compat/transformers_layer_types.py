"""transformers' layer-type validation accepts an hf-hybrid architecture's own kinds, for its configs only.

transformers checks every config's ``layer_types`` against one module-level list of its own kinds
(``PreTrainedConfig.validate_layer_type``). Our config classes check theirs themselves
(models/validation.py), but a config of ours read through transformers' generic class is refused:
``Trainer(resume_from_checkpoint=...)`` does exactly that (``PreTrainedConfig.from_json_file``) to
read the checkpoint's transformers version. The validator is wrapped so that a config whose
``model_type`` is an hf-hybrid architecture is checked against that architecture's kinds (and transformers' own); every
other config (a Llama config carrying "rat" or "local" included) goes to transformers' own check,
unchanged. transformers' list itself is left alone.

Patch of transformers' behaviour (DESIGN.md, "Patches of other libraries"). Checked against
transformers TRANSFORMERS_VERSIONS (strict dataclass validators in ``__class_validators__``); on any
other version nothing is replaced and a generic read of our config.json is refused as before.
"""
from __future__ import annotations

from . import within

TRANSFORMERS_VERSIONS = ((5, 17), (5, 25))  # first and last (major, minor) checked, inclusive
_KINDS: dict[str, tuple[str, ...]] = {}  # model_type -> the layer kinds of that architecture


def allow_architecture_layer_types(kinds_by_model_type: dict[str, tuple[str, ...]]) -> bool:
    """Accept ``kinds_by_model_type[config.model_type]`` in transformers' validation of configs of
    those model types (idempotent). Returns whether the wrapper is in place."""
    import transformers
    from transformers import configuration_utils
    from transformers.configuration_utils import PreTrainedConfig

    _KINDS.update(kinds_by_model_type)
    validators = getattr(PreTrainedConfig, "__class_validators__", None)
    original = PreTrainedConfig.__dict__.get("validate_layer_type")
    if getattr(original, "_hf_hybrid_wrapper", False):
        return True
    if not within(transformers.__version__, TRANSFORMERS_VERSIONS) or original is None or not isinstance(validators, list):
        return False
    position = [i for i, v in enumerate(validators) if v is original]
    if len(position) != 1:
        return False

    def validate_layer_type(self):
        kinds = _KINDS.get(getattr(self, "model_type", None))
        layer_types = getattr(self, "layer_types", None)
        if kinds is not None and layer_types is not None:
            # transformers' own kinds too: it renames some legacy hybrid names (mamba -> linear_attention)
            unknown = sorted({t for t in layer_types if t not in kinds and t not in configuration_utils.ALLOWED_LAYER_TYPES})
            if unknown:
                raise ValueError(f"layer_types contains {unknown}, not kinds of model_type {self.model_type!r}: {list(kinds)}.")
            return None
        return original(self)

    validate_layer_type._hf_hybrid_wrapper = True
    validate_layer_type.__wrapped__ = original
    PreTrainedConfig.validate_layer_type = validate_layer_type
    validators[position[0]] = validate_layer_type
    return True
