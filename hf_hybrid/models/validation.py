"""Config checks shared by every architecture; each error names the field and the fix."""
from __future__ import annotations

from collections.abc import Sequence


def check_positive(name: str, value, allow_zero: bool = False) -> None:
    ok = isinstance(value, int) and (value >= 0 if allow_zero else value >= 1)
    if not ok:
        bound = ">= 0" if allow_zero else ">= 1"
        raise ValueError(f"{name} must be an integer {bound}, got {value!r}.")


def resolve_head_dim(hidden_size: int, num_attention_heads: int, head_dim: int | None) -> int:
    check_positive("hidden_size", hidden_size)
    check_positive("num_attention_heads", num_attention_heads)
    if head_dim is None:
        if hidden_size % num_attention_heads:
            raise ValueError(
                f"hidden_size ({hidden_size}) is not divisible by num_attention_heads ({num_attention_heads}); "
                "change one of them or set head_dim explicitly."
            )
        return hidden_size // num_attention_heads
    check_positive("head_dim", head_dim)
    return head_dim


def check_kv_heads(num_attention_heads: int, num_key_value_heads: int) -> None:
    check_positive("num_key_value_heads", num_key_value_heads)
    if num_attention_heads % num_key_value_heads:
        raise ValueError(
            f"num_key_value_heads ({num_key_value_heads}) must divide num_attention_heads ({num_attention_heads})."
        )


def check_layer_types(layer_types: Sequence[str], allowed: Sequence[str], num_hidden_layers: int) -> list[str]:
    layer_types = list(layer_types)
    unknown = sorted({t for t in layer_types if t not in allowed})
    if unknown:
        raise ValueError(f"layer_types contains unknown value(s) {unknown}; allowed values are {list(allowed)}.")
    if len(layer_types) != num_hidden_layers:
        raise ValueError(
            f"layer_types has {len(layer_types)} entries but num_hidden_layers is {num_hidden_layers}; give one per layer."
        )
    return layer_types


class ArchitectureLayerTypes:
    """Config mixin: ``layer_types`` are checked against the architecture's own kinds
    (``allowed_layer_types``), not against transformers' module-level list, which names only
    transformers' own kinds. Extending that list would change what every other model accepts (a
    Llama config with "rat" or "local" would pass), so hf-hybrid leaves it alone; transformers'
    other validators still run."""

    allowed_layer_types: tuple[str, ...] = ()

    def __init__(self, **kwargs):
        # transformers validates at the end of its __init__ (its own validate, not this class's):
        # the config's own __init__ has checked layer_types already, so they stay out of sight there.
        layer_types = self.__dict__.pop("layer_types", None)
        try:
            super().__init__(**kwargs)
        finally:
            if layer_types is not None:
                self.layer_types = layer_types

    def validate(self) -> None:
        layer_types = getattr(self, "layer_types", None)
        if layer_types is None:
            return super().validate()
        check_layer_types(layer_types, self.allowed_layer_types, self.num_hidden_layers)
        self.layer_types = None  # transformers' own layer-type validator skips a config without them
        try:
            super().validate()
        finally:
            self.layer_types = layer_types
