"""Sparse inference patterns for RAT+ (paper Sec. 4-5, Tables 5, 17-19), chosen per forward call.

A :class:`SparseInferenceConfig` says, for every layer and head, which keys a query attends to.
One head's pattern is an :class:`AttentionPattern`:

* dilated (``dilation`` D >= 1, ``local_window`` W >= 0, ``num_sink_tokens`` I >= 0): query i sees
  key j iff j <= i and ((j + 1) % D == 0 or i - j <= W or j < I) (official RAT+ mask). D = 1 is
  dense causal attention; W = 0 still includes the query's own (recurrent) key.
* top-k block (``top_k`` K, ``block_size``, ``block_scoring`` "quest" = min/max key statistics,
  "moba" = mean key): the query's own block plus the K - 1 best-scoring earlier blocks, together
  with the sinks and the window. With D > 1 as well, the block ends of the dilated pattern are
  added (dilation || top-k, Table 19); with D = 1 top-k has no dilated part.

Hybrids: ``layer_overrides`` {layer: overrides} and ``head_overrides`` {head: overrides} change
some fields for some layers/heads. ``overrides`` is a dict of the fields above (only those that
change) or the string "dense". Precedence, most specific wins:

* a head's pattern in a layer *without* a layer override is default <- head_overrides[head];
* a layer *with* an override uses default <- layer_overrides[layer] for every head, refined only
  by that override's own "head_overrides" entry (the top-level head_overrides do not apply there).

So ``layer_overrides={0: "dense", 12: "dense"}`` keeps layers 0 and 12 dense, and
``head_overrides={0: "dense", 1: "dense"}`` with ``dilation=16`` gives dense first two heads and
D = 16 elsewhere. The config is plain data: ``to_dict`` / ``from_dict`` round-trip through JSON so
it can sit in a model config as the default pattern and be replaced per call.

:class:`RowPatterns` gives each row of one batch its own config (RAT+'s joint training objective
runs its patterns as row groups of one forward).
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

SCORINGS = ("quest", "moba")
_NAME = "SparseInferenceConfig"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class AttentionPattern:
    """The keys one head of one layer attends to (see the module docstring)."""

    dilation: int = 1
    local_window: int = 0
    num_sink_tokens: int = 4
    top_k: int | None = None
    block_size: int = 64
    block_scoring: str = "quest"

    def validate(self, where: str = _NAME) -> None:
        """Raise ValueError naming the offending field (prefixed by ``where``)."""
        if not _is_int(self.dilation) or self.dilation < 1:
            raise ValueError(f"{where}.dilation must be an integer >= 1 (1 = dense), got {self.dilation!r}.")
        if not _is_int(self.local_window) or self.local_window < 0:
            raise ValueError(f"{where}.local_window must be an integer >= 0, got {self.local_window!r}.")
        if not _is_int(self.num_sink_tokens) or self.num_sink_tokens < 0:
            raise ValueError(f"{where}.num_sink_tokens must be an integer >= 0, got {self.num_sink_tokens!r}.")
        if not _is_int(self.block_size) or self.block_size < 1:
            raise ValueError(f"{where}.block_size must be an integer >= 1, got {self.block_size!r}.")
        if self.top_k is not None and (not _is_int(self.top_k) or self.top_k < 1):
            raise ValueError(
                f"{where}.top_k must be None (no top-k) or an integer >= 1 (the query's own block counts), got {self.top_k!r}."
            )
        if self.block_scoring not in SCORINGS:
            raise ValueError(f"{where}.block_scoring must be one of {SCORINGS}, got {self.block_scoring!r}.")

    @property
    def kind(self) -> str:
        """"dense", "dilated" or "topk": which cache layout and attention path the pattern needs."""
        if self.top_k is not None:
            return "topk"
        return "dense" if self.dilation == 1 else "dilated"

    def cache_entries(self, num_tokens: int) -> int:
        """K/V entries a cache needs after ``num_tokens`` tokens (recurrence state and block summaries
        not included): T for dense and top-k; block ends + window + sinks for dilated."""
        if self.kind != "dilated":
            return num_tokens
        return num_tokens // self.dilation + min(self.local_window, num_tokens) + min(self.num_sink_tokens, num_tokens)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


PATTERN_FIELDS = tuple(f.name for f in dataclasses.fields(AttentionPattern))
DENSE_OVERRIDE = {"dilation": 1, "top_k": None}


def _normalise_override(value: Any, where: str, allow_heads: bool) -> dict[str, Any]:
    """An override as a dict of pattern fields (plus "head_overrides" for layer overrides)."""
    if value == "dense":
        return dict(DENSE_OVERRIDE)
    if isinstance(value, AttentionPattern):
        return value.to_dict()
    if isinstance(value, SparseInferenceConfig):
        if value.layer_overrides or value.head_overrides:
            raise ValueError(f"{where}: a SparseInferenceConfig used as an override must not have overrides itself.")
        return value.pattern().to_dict()
    if not isinstance(value, Mapping):
        raise ValueError(
            f"{where} must be a dict of pattern fields {PATTERN_FIELDS}, an AttentionPattern or \"dense\"; got {value!r}."
        )
    allowed = PATTERN_FIELDS + (("head_overrides",) if allow_heads else ())
    out = {}
    for key, item in value.items():
        if key not in allowed:
            raise ValueError(f"{where} has unknown field {key!r}; allowed fields: {allowed}.")
        out[key] = _normalise_overrides(item, f"{where}.head_overrides", False) if key == "head_overrides" else item
    return out


def _normalise_overrides(value: Any, where: str, allow_heads: bool) -> dict[int, dict[str, Any]]:
    """{index: override}; JSON turns int keys into strings, so digit strings are accepted."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"{where} must be a dict {{index: override}}, got {type(value).__name__}.")
    out = {}
    for key, item in value.items():
        index = int(key) if isinstance(key, str) and key.lstrip("-").isdigit() else key
        if not _is_int(index) or index < 0:
            raise ValueError(f"{where} keys must be non-negative integer indices, got {key!r}.")
        out[index] = _normalise_override(item, f"{where}[{index}]", allow_heads)
    return dict(sorted(out.items()))


@dataclass(frozen=True)
class SparseInferenceConfig:
    """Per-call sparse attention pattern of a RAT+ model (see the module docstring).

    >>> SparseInferenceConfig(dilation=16, local_window=256)                 # D=16, W=256, 4 sinks
    >>> SparseInferenceConfig(dilation=16, layer_overrides={0: "dense", 12: "dense"})
    >>> SparseInferenceConfig(dilation=16, head_overrides={0: "dense", 1: "dense"})
    >>> SparseInferenceConfig(top_k=8, block_size=64, block_scoring="moba")    # MoBA top-k
    >>> SparseInferenceConfig(dilation=64, top_k=8, block_size=64)            # dilation || top-k
    """

    dilation: int = 1
    local_window: int = 0
    num_sink_tokens: int = 4
    top_k: int | None = None
    block_size: int = 64
    block_scoring: str = "quest"
    layer_overrides: dict = field(default_factory=dict)
    head_overrides: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_overrides", _normalise_overrides(self.layer_overrides, f"{_NAME}.layer_overrides", True))
        object.__setattr__(self, "head_overrides", _normalise_overrides(self.head_overrides, f"{_NAME}.head_overrides", False))
        self.pattern().validate(_NAME)
        # Validate every override's merged pattern now, so errors surface at construction.
        for head in self.head_overrides:
            self._head_pattern(self.head_overrides, self.pattern(), head).validate(f"{_NAME}.head_overrides[{head}]")
        for layer, override in self.layer_overrides.items():
            base = self._layer_base(layer)
            base.validate(f"{_NAME}.layer_overrides[{layer}]")
            for head in override.get("head_overrides", {}):
                self._head_pattern(override["head_overrides"], base, head).validate(
                    f"{_NAME}.layer_overrides[{layer}].head_overrides[{head}]"
                )

    # ----------------------------------------------------------------- resolution
    def pattern(self) -> AttentionPattern:
        """The default pattern (no overrides applied)."""
        return AttentionPattern(**{name: getattr(self, name) for name in PATTERN_FIELDS})

    def _layer_base(self, layer: int) -> AttentionPattern:
        override = {k: v for k, v in self.layer_overrides.get(layer, {}).items() if k != "head_overrides"}
        return dataclasses.replace(self.pattern(), **override)

    @staticmethod
    def _head_pattern(head_overrides: dict, base: AttentionPattern, head: int) -> AttentionPattern:
        return dataclasses.replace(base, **head_overrides.get(head, {}))

    def pattern_for(self, layer: int, head: int) -> AttentionPattern:
        """The pattern of one head of one layer (precedence in the module docstring)."""
        base = self._layer_base(layer)
        if layer in self.layer_overrides:
            return self._head_pattern(self.layer_overrides[layer].get("head_overrides", {}), base, head)
        return self._head_pattern(self.head_overrides, base, head)

    def layer_groups(self, layer: int, num_heads: int) -> list[tuple[AttentionPattern, tuple[int, ...]]]:
        """The heads of ``layer`` grouped by pattern: [(pattern, heads)], ordered by first head."""
        groups: dict[AttentionPattern, list[int]] = {}
        for head in range(num_heads):
            groups.setdefault(self.pattern_for(layer, head), []).append(head)
        return [(pattern, tuple(heads)) for pattern, heads in groups.items()]

    @property
    def is_dense(self) -> bool:
        """True when no layer or head is sparse (then the model runs plain causal attention)."""
        patterns = [self.pattern()]
        patterns += [self._layer_base(layer) for layer in self.layer_overrides]
        patterns += [self._head_pattern(self.head_overrides, self.pattern(), h) for h in self.head_overrides]
        for layer, override in self.layer_overrides.items():
            heads = override.get("head_overrides", {})
            patterns += [self._head_pattern(heads, self._layer_base(layer), h) for h in heads]
        return all(p.kind == "dense" for p in patterns)

    # ----------------------------------------------------------------- model binding
    def validate_for_model(self, num_hidden_layers: int, num_attention_heads: int, max_position_embeddings: int | None = None) -> None:
        """Check the config against a model: override indices exist, top_k fits the context."""
        for layer, override in self.layer_overrides.items():
            if layer >= num_hidden_layers:
                raise ValueError(
                    f"{_NAME}.layer_overrides[{layer}]: the model has {num_hidden_layers} layers "
                    f"(indices 0..{num_hidden_layers - 1}); remove or renumber this override."
                )
            for head in override.get("head_overrides", {}):
                if head >= num_attention_heads:
                    raise ValueError(
                        f"{_NAME}.layer_overrides[{layer}].head_overrides[{head}]: the model has {num_attention_heads} "
                        f"attention heads (indices 0..{num_attention_heads - 1})."
                    )
        for head in self.head_overrides:
            if head >= num_attention_heads:
                raise ValueError(
                    f"{_NAME}.head_overrides[{head}]: the model has {num_attention_heads} attention heads "
                    f"(indices 0..{num_attention_heads - 1}); remove or renumber this override."
                )
        if max_position_embeddings is None:
            return
        for layer in range(num_hidden_layers):
            for pattern, _ in self.layer_groups(layer, num_attention_heads):
                if pattern.top_k is None:
                    continue
                num_blocks = math.ceil(max_position_embeddings / pattern.block_size)
                if pattern.top_k > num_blocks:
                    raise ValueError(
                        f"{_NAME}.top_k={pattern.top_k} (layer {layer}) is larger than the number of blocks: "
                        f"max_position_embeddings {max_position_embeddings} / block_size {pattern.block_size} = "
                        f"{num_blocks} blocks; lower top_k or block_size."
                    )

    # ----------------------------------------------------------------- serialisation
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json_string(self) -> str:
        """Canonical JSON (sorted keys): equal configs give equal strings (used as cache signature)."""
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "SparseInferenceConfig":
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"{_NAME}: unknown field(s) {sorted(unknown)}.")
        return cls(**data)

    @classmethod
    def coerce(cls, value: Any) -> "SparseInferenceConfig":
        """Accept a config, a dict (e.g. from a JSON model config) or None (= dense)."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, AttentionPattern):
            return cls(**value.to_dict())
        if isinstance(value, Mapping):
            return cls.from_dict(value)
        raise TypeError(f"sparse_config must be a SparseInferenceConfig, a dict or None; got {type(value).__name__}.")


@dataclass(frozen=True)
class RowPatterns:
    """A sparse pattern per row of one batch: row r attends under ``patterns[row_pattern[r]]``.

    RAT+'s joint objective stacks the same batch once per training pattern along the rows and runs
    ONE forward (``RowPatterns.stacked``): projections, norms, MLPs and the LM head see every row
    once, only the attention of each row group follows its pattern. The row assignment is plain
    host data, so packed rows (whose documents become the rows of document batches) take the
    entries of their documents' rows with :meth:`select_rows`.
    """

    patterns: tuple[SparseInferenceConfig, ...]
    row_pattern: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "patterns", tuple(SparseInferenceConfig.coerce(p) for p in self.patterns))
        object.__setattr__(self, "row_pattern", tuple(self.row_pattern))
        if not self.patterns:
            raise ValueError("RowPatterns.patterns must hold at least one pattern.")
        if not all(_is_int(i) and 0 <= i < len(self.patterns) for i in self.row_pattern):
            raise ValueError(
                f"RowPatterns.row_pattern must hold, per row, an index into patterns (0..{len(self.patterns) - 1}); "
                f"got {list(self.row_pattern)[:16]}."
            )

    @classmethod
    def stacked(cls, patterns, rows_per_pattern: int) -> "RowPatterns":
        """Rows [0:B] under patterns[0], [B:2B] under patterns[1], ... (B = ``rows_per_pattern``)."""
        return cls(tuple(patterns), tuple(i for i in range(len(patterns)) for _ in range(rows_per_pattern)))

    def select_rows(self, rows) -> "RowPatterns":
        """The patterns of the given rows, in that order (rows of a new batch taken from this one)."""
        return RowPatterns(self.patterns, tuple(self.row_pattern[r] for r in rows))

    def row_groups(self) -> list[tuple[SparseInferenceConfig, tuple[int, ...]]]:
        """[(pattern, its rows)] for every pattern that has rows, in the order of ``patterns``."""
        rows: dict[int, list[int]] = {}
        for row, index in enumerate(self.row_pattern):
            rows.setdefault(index, []).append(row)
        return [(self.patterns[i], tuple(rows[i])) for i in sorted(rows)]

    def validate_for_model(self, num_hidden_layers: int, num_attention_heads: int, max_position_embeddings: int | None = None) -> None:
        for pattern in self.patterns:
            pattern.validate_for_model(num_hidden_layers, num_attention_heads, max_position_embeddings)
