"""HyLoRA (Expansion Span, Sec. 3.4): LoRA+ for hybrid SSM models, as a PEFT ``LoraConfig``.

HyLoRA = LoRA on the attention projections (q/k/v/o) + the LoRA+ recipe of LongLoRA (embeddings
and every normalisation layer fully trainable) + the SSM layers' depthwise ``conv1d`` fully
trainable. The paper's setting is r=32, alpha=64 (alpha/r = 2, Appendix B).

How it maps onto peft (read from peft 0.21's and 0.22's ``LoraConfig`` / ``_set_trainable``):

* ``target_modules`` = q_proj, k_proj, v_proj, o_proj - matched as the last name component, so
  only attention projections get adapters (Mamba's in_proj/out_proj stay frozen, as in the paper).
* ``modules_to_save`` = embed_tokens, conv1d and the normalisation layers by name
  (:data:`HYLORA_NORM_NAMES`). peft wraps each module matched by one of these in a
  ``ModulesToSaveWrapper``: a trainable copy that ``save_pretrained`` stores with the adapter and
  ``merge_and_unload`` swaps in. peft <= 0.21 matched an entry against the end of a module's
  qualified name (so "norm" alone caught input_layernorm too); peft >= 0.22 matches whole name
  components, so every norm name is listed: those of every hf-hybrid model (incl. QK-norms, the
  RATTENTION branch norms and the Mamba-2 mixer's gated norm) and of transformers' Llama-family and
  Mamba-2 hybrid models. Together they are LongLoRA's "every parameter whose name contains norm".
  For a model whose norms have other names, :meth:`HyLoraConfig.for_model` reads them from the model.
  Architectures without ``conv1d`` simply get LoRA+.
* ``ensure_weight_tying=True``: when input and output embeddings are tied, the trained embedding
  copy is shared with ``lm_head`` so logits, merging and reloading stay consistent. An untied
  model (every hf-hybrid architecture by default) has nothing to tie. Neither fixed value of the
  flag suits both kinds of model: with ``False`` a tied model's trained embedding copy would leave
  ``lm_head`` behind (peft then warns), and with ``True`` peft notes on every untied model that
  nothing is tied. The config cannot see the model, so the default is ``True`` and peft's
  tied-module check, which sees it, turns it off for an untied model
  (hf_hybrid/_compat/peft_weight_tying.py, installed by :func:`register_peft_defaults`).

The class only sets defaults of ``LoraConfig`` fields, so a saved adapter_config.json is an
ordinary LoRA config and ``PeftModel.from_pretrained`` reloads it without hf_hybrid.

Plain peft without ``target_modules`` (``get_peft_model(model, LoraConfig(r=8))``): peft looks the
targets up by ``config.model_type`` in its ``TRANSFORMERS_MODELS_TO_<METHOD>_TARGET_MODULES_MAPPING``
tables, which know no hf-hybrid model. :func:`register_peft_defaults` (run by ``import hf_hybrid``)
adds :data:`PEFT_TARGET_MODULES` to the weight-adapter tables (LoRA, LoHa, LoKr, AdaLoRA, VeRA, ...)
and matching entries to IA3's, LN-tuning's, BEFT's and OSF's.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from peft import LoraConfig
from torch import nn

from ._compat.peft_weight_tying import untie_where_nothing_is_tied
from .architectures import ARCHITECTURES

HYLORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
# Normalisation layers by the names hf-hybrid's models (the first line) and transformers' decoder LMs
# (Llama family, Gemma, OLMo 2, Qwen3, Bamba, Jamba, Zamba, Falcon-H1, NemotronH, LFM2) give them.
HYLORA_NORM_NAMES = (
    "norm", "input_layernorm", "post_attention_layernorm", "q_norm", "k_norm", "o_norm", "rla_norm", "swa_norm",
    "pre_ff_layernorm", "final_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm", "norm_f",
    "dt_layernorm", "b_layernorm", "c_layernorm", "q_layernorm", "k_layernorm", "operator_norm", "ffn_norm",
    "embedding_norm",
)
HYLORA_MODULES_TO_SAVE = ("embed_tokens", "conv1d", *HYLORA_NORM_NAMES)

# Default adapter targets per model_type (hf_hybrid/architectures.py): the attention projections plus
# each mixer's own full-width projections. Left out on purpose: per-head scalar gates (FoX's f_proj,
# KV-shift's k_shift.proj / v_shift.proj: [hidden -> heads], where a rank-8 adapter would be larger
# than the weight) and the SwiGLU MLP (as peft's defaults for Llama).
PEFT_TARGET_MODULES: dict[str, tuple[str, ...]] = {arch.model_type: arch.peft_targets for arch in ARCHITECTURES}
_MLP = ("gate_proj", "up_proj", "down_proj")

# peft tables whose entries mean something else than "the linear layers that get a weight adapter",
# by the <METHOD> part of TRANSFORMERS_MODELS_TO_<METHOD>_MODULES_MAPPING.
_SPECIAL_TABLES = {
    "IA3_TARGET": lambda targets: ("k_proj", "v_proj", "down_proj"),  # as peft's Llama entry
    "IA3_FEEDFORWARD": lambda targets: ("down_proj",),  # must be a subset of IA3's targets
    "LNTUNING_TARGET": lambda targets: ("input_layernorm", "post_attention_layernorm", "norm"),
    "BEFT_TARGET": lambda targets: ("v_proj",),  # as peft's Llama entry
    "OSF_TARGET": lambda targets: targets + _MLP,  # peft's Llama entry adds the MLP too
}


def register_peft_defaults() -> None:
    """Teach peft's default-target tables every hf-hybrid model_type, and resolve HyLoRA's
    ``ensure_weight_tying`` against each model (idempotent; run on import)."""
    from peft.utils import constants

    untie_where_nothing_is_tied(lambda config: isinstance(config, HyLoraConfig))

    prefix, suffix = "TRANSFORMERS_MODELS_TO_", "_MODULES_MAPPING"
    for name in dir(constants):
        table = getattr(constants, name)
        if not (name.startswith(prefix) and name.endswith(suffix) and isinstance(table, dict)):
            continue  # e.g. the prefix-tuning post-processing table
        special = _SPECIAL_TABLES.get(name[len(prefix) : -len(suffix)])
        for model_type, targets in PEFT_TARGET_MODULES.items():
            table[model_type] = list(special(targets) if special is not None else targets)


def norm_names(model: nn.Module) -> set[str]:
    """The last name component of each module of ``model`` that holds parameters of its own and whose
    name contains "norm" (LongLoRA's rule for what HyLoRA trains in full)."""
    return {name.rsplit(".", 1)[-1] for name, module in model.named_modules()
            if "norm" in name.rsplit(".", 1)[-1] and any(True for _ in module.parameters(recurse=False))}


@dataclass
class HyLoraConfig(LoraConfig):
    """``HyLoraConfig(r=32, lora_alpha=64, ...)``; any other ``LoraConfig`` argument may be passed.

    Pass ``modules_to_save=[...]`` to change what is fully trained (e.g. drop "conv1d" for LoRA+),
    or ``target_modules`` for models whose attention projections are named differently.
    """

    r: int = field(default=32, metadata={"help": "LoRA rank (paper: 32)."})
    lora_alpha: int = field(default=64, metadata={"help": "LoRA alpha (paper: 64, alpha/r = 2)."})
    target_modules: list[str] | str | None = field(
        default_factory=lambda: list(HYLORA_TARGET_MODULES),
        metadata={"help": "Attention projections that receive LoRA adapters."},
    )
    modules_to_save: list[str] | None = field(
        default_factory=lambda: list(HYLORA_MODULES_TO_SAVE),
        metadata={"help": "Names of modules trained in full: embeddings, norms, SSM conv1d."},
    )
    ensure_weight_tying: bool = field(
        default=True,
        metadata={"help": "Keep tied input/output embeddings tied (turned off by get_peft_model on an untied model)."},
    )
    task_type: str | None = field(default="CAUSAL_LM", metadata={"help": "peft task type."})

    @classmethod
    def for_model(cls, model: nn.Module, **kwargs) -> HyLoraConfig:
        """HyLoRA for ``model`` with its own norm names: ``modules_to_save`` = embed_tokens, conv1d and
        the name of every module that holds parameters and whose name contains "norm" (LongLoRA's
        rule), for models whose norms :data:`HYLORA_NORM_NAMES` does not know."""
        if "modules_to_save" in kwargs:
            raise ValueError(
                "HyLoraConfig.for_model: modules_to_save is what it derives; pass it to HyLoraConfig(...) instead."
            )
        return cls(modules_to_save=["embed_tokens", "conv1d", *sorted(norm_names(model))], **kwargs)

    def __post_init__(self):
        if self.r < 1:
            raise ValueError(f"HyLoraConfig: r must be >= 1, got {self.r}.")
        super().__post_init__()


__all__ = ["HYLORA_MODULES_TO_SAVE", "HYLORA_NORM_NAMES", "HYLORA_TARGET_MODULES", "PEFT_TARGET_MODULES", "HyLoraConfig",
           "norm_names", "register_peft_defaults"]
