"""The architectures hf-hybrid ships, as data: one :class:`Architecture` entry each, in ``ARCHITECTURES``.

Everything that enumerates architectures reads this table rather than listing them again: the
Auto-class registration and the package's exports (``hf_hybrid/__init__.py``), peft's default
adapter targets (``peft.py``), the ``hf-hybrid reproduce`` choices, the demo's and the model
bench's rows, and the tests' tiny fixtures. ``tests/test_architecture_checklist.py`` checks that
every entry has what DESIGN.md's "Adding an architecture" checklist asks for.

The table names classes and modules as strings and imports nothing of the package, so it sits at
the bottom of the import graph: the CLI and the tests read it without importing torch.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field

# Every task head a model gets: transformers' generic heads, named "<Prefix>For<Task>".
TASK_HEADS = ("SequenceClassification", "TokenClassification", "QuestionAnswering")
# The attention projections every architecture's adapters wrap (Llama's names, layers/backbone.py).
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
# The size every tiny fixture shares: one forward of ~20 tokens takes milliseconds on a CPU.
TINY_SHAPE = dict(vocab_size=61, hidden_size=32, intermediate_size=64, num_attention_heads=4, pad_token_id=0)


@dataclass(frozen=True)
class Architecture:
    """One architecture: where its code lives and what each consumer needs to know about it.

    Class names follow ``class_prefix``: ``<Prefix>Config``, ``<Prefix>Model``,
    ``<Prefix>ForCausalLM``, ``<Prefix>For<Task>`` for each of :data:`TASK_HEADS` and
    ``<Prefix>Cache``, all exported by ``hf_hybrid.models.<model_type>``.
    """

    model_type: str
    class_prefix: str
    # Layer kinds of config.layer_types that transformers does not know (its allowed layer types
    # learn them on registration); () when the architecture uses only transformers' own kinds.
    layer_types: tuple[str, ...]
    # Mixer modules of hf_hybrid/layers/ it builds, and the ops (kernels/<op>/) they run, each
    # with a reference.py stating the math.
    mixer_modules: tuple[str, ...]
    reference_ops: tuple[str, ...]
    # peft's default adapter targets besides ATTENTION_PROJECTIONS: the mixer's own full-width
    # projections (per-head scalar gates and the MLP are left out, see peft.py).
    peft_extra_targets: tuple[str, ...]
    reproduction: str  # hf-hybrid reproduce NAME (hf_hybrid/reproduce/<name>.py)
    demo_key: str  # its contestant key in the demo (hf_hybrid/demo/setup.py)
    bench_row: str  # its row name in the model bench (hf_hybrid/bench/models.py)
    # Config keywords of its tiny test fixture on top of TINY_SHAPE; ``tiny_layer_pattern`` repeats
    # over the layers (so a 2-layer fixture holds each layer kind), None keeps the config's default.
    tiny_settings: dict = field(default_factory=dict)
    tiny_layer_pattern: tuple[str, ...] | None = None

    @property
    def module(self) -> str:
        return f"hf_hybrid.models.{self.model_type}"

    @property
    def config_class_name(self) -> str:
        return f"{self.class_prefix}Config"

    @property
    def model_class_name(self) -> str:
        return f"{self.class_prefix}Model"

    @property
    def causal_lm_class_name(self) -> str:
        return f"{self.class_prefix}ForCausalLM"

    @property
    def head_class_names(self) -> tuple[str, ...]:
        return tuple(f"{self.class_prefix}For{task}" for task in TASK_HEADS)

    @property
    def cache_class_name(self) -> str:
        return f"{self.class_prefix}Cache"

    @property
    def exported_names(self) -> tuple[str, ...]:
        """What ``hf_hybrid`` exports of it: cache, config, model, causal LM and task heads."""
        return (self.cache_class_name, self.config_class_name, self.model_class_name, self.causal_lm_class_name,
                *self.head_class_names)

    @property
    def model_card(self) -> str:
        """Its model card template, a file of the ``hf_hybrid.model_cards`` package (hub.py fills it)."""
        return f"{self.model_type}.md"

    @property
    def peft_targets(self) -> tuple[str, ...]:
        return ATTENTION_PROJECTIONS + self.peft_extra_targets

    def load(self, name: str):
        """The object ``name`` of its package (imports the model code)."""
        return getattr(importlib.import_module(self.module), name)

    def tiny_config_kwargs(self, num_hidden_layers: int = 2) -> dict:
        """Keywords of a tiny CPU config with ``num_hidden_layers`` layers (tests, quick examples)."""
        kwargs = dict(TINY_SHAPE, num_hidden_layers=num_hidden_layers, **self.tiny_settings)
        if self.tiny_layer_pattern is not None:
            pattern = self.tiny_layer_pattern
            kwargs["layer_types"] = [pattern[i % len(pattern)] for i in range(num_hidden_layers)]
        return kwargs


ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture(
        model_type="rat",
        class_prefix="Rat",
        layer_types=("rat", "sliding_attention", "full_attention"),
        mixer_modules=("rat_attention", "attention"),
        reference_ops=("chunk_attention", "gated_recurrence", "output_gate", "fused_norm"),
        peft_extra_targets=("g_proj", "z_proj"),  # recurrence gate, output gate
        reproduction="rat",
        demo_key="rat",
        bench_row="RAT",
        tiny_settings=dict(chunk_size=4, sliding_window=6),
    ),
    Architecture(
        model_type="rat_plus",
        class_prefix="RatPlus",
        layer_types=(),
        mixer_modules=("rat_plus_attention",),
        reference_ops=("chunk_attention", "gated_recurrence", "output_gate", "topk_block_attention"),
        peft_extra_targets=("g_proj", "z_proj"),  # recurrence gate, output gate
        reproduction="rat_plus",
        demo_key="rat_plus",
        bench_row="RAT+",
        tiny_settings=dict(num_key_value_heads=2, training_dilations=[1, 8]),
    ),
    Architecture(
        model_type="fox",
        class_prefix="Fox",
        layer_types=(),
        mixer_modules=("forgetting_attention",),
        reference_ops=("forgetting_attention", "kv_shift", "output_gate"),
        peft_extra_targets=("g_proj",),  # the Pro block's output gate
        reproduction="fox",
        demo_key="fox",
        bench_row="FoX (llama)",
        tiny_settings=dict(num_key_value_heads=2),
    ),
    Architecture(
        model_type="rattention",
        class_prefix="Rattention",
        layer_types=("local", "global"),
        mixer_modules=("residual_linear_attention",),
        reference_ops=("residual_linear_attention",),
        peft_extra_targets=(),  # the RLA branch reuses q/k/v: no projection of its own
        reproduction="rattention",
        demo_key="rattention",
        bench_row="RATTENTION",
        tiny_settings=dict(num_key_value_heads=2, window_size=3),
        tiny_layer_pattern=("local", "global"),
    ),
    Architecture(
        model_type="se_hybrid",
        class_prefix="SEHybrid",
        layer_types=("mamba", "attention"),
        mixer_modules=("span_expanded_attention",),
        reference_ops=("span_expanded_attention", "causal_conv1d", "ssd_scan", "gated_rms_norm"),
        peft_extra_targets=("in_proj", "out_proj"),  # the Mamba-2 mixer's in/out projections
        reproduction="se",
        demo_key="se_hybrid",
        bench_row="SE hybrid",
        # SE mode with one training chunk size: training draws nothing at random, so two training
        # forwards (with and without checkpointing) see the same chunking.
        tiny_settings=dict(
            num_key_value_heads=2, mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=8, attention_mode="se",
            se_chunk_sizes=[8], se_eval_chunk_size=8, se_block_size=2, se_top_k=2, se_select_every=4, sliding_window=6,
        ),
        tiny_layer_pattern=("mamba", "attention"),
    ),
)

MODEL_TYPES: tuple[str, ...] = tuple(arch.model_type for arch in ARCHITECTURES)


def architecture(model_type: str) -> Architecture:
    """The entry of ``model_type``; a clear error for a model_type hf-hybrid does not ship."""
    for arch in ARCHITECTURES:
        if arch.model_type == model_type:
            return arch
    raise KeyError(f"model_type {model_type!r} is not an hf-hybrid architecture; known: {list(MODEL_TYPES)}.")


__all__ = ["ARCHITECTURES", "ATTENTION_PROJECTIONS", "MODEL_TYPES", "TASK_HEADS", "TINY_SHAPE", "Architecture", "architecture"]
