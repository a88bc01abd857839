"""Existing transformers models -> ``se_hybrid``, so that ``attention_mode="full"`` reproduces them.

Supported sources (the Expansion Span paper adapts a Mamba-2 hybrid and, in Appendix C, Llama):

* **Bamba** (``BambaForCausalLM``, a Mamba-2 + attention hybrid). Our Mamba layers *are* Bamba's
  mixer class, so every weight copies by name: ``mamba.*`` -> ``self_attn.*`` (the backbone's mixer
  slot), ``pre_ff_layernorm`` -> ``post_attention_layernorm``, ``feed_forward`` -> ``mlp``,
  ``final_layernorm`` -> ``norm``. RoPE keeps Bamba's partial rotary factor (0.5).
* **Llama** (``LlamaForCausalLM``): every layer becomes an ``attention`` layer; names already match.

The result is an ordinary SEHybridForCausalLM in ``full`` mode; fine-tune it with
``attention_mode="se"`` and ``hf_hybrid.HyLoraConfig`` (the paper's recipe).
"""
from __future__ import annotations

import torch

from ..models.se_hybrid import SEHybridConfig, SEHybridForCausalLM
from ..models.se_hybrid.configuration_se_hybrid import canonical_layer_type

_COMMON = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
           "num_key_value_heads", "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings",
           "pad_token_id", "bos_token_id", "eos_token_id")


def _rope(config) -> tuple[float, float]:
    """(theta, partial rotary factor) from transformers 5 ``rope_parameters`` or the older attributes."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", scaling.get("rope_type", "default"))
    if rope_type not in (None, "default"):
        raise ValueError(f"rope type {rope_type!r} is not supported by se_hybrid conversion (default RoPE only).")
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    return float(theta), float(partial)


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def config_from_bamba(bamba, **overrides) -> SEHybridConfig:
    if getattr(bamba, "num_experts", 1) not in (None, 1):
        raise ValueError("Bamba checkpoints with mixture-of-experts feed-forward layers are not supported.")
    if getattr(bamba, "mlp_bias", False):
        raise ValueError("Bamba mlp_bias=True is not supported (the shared SwiGLU block has no biases).")
    if bamba.hidden_act != "silu":
        raise ValueError(f"hidden_act={bamba.hidden_act!r}: the shared MLP is SwiGLU (silu); cannot convert.")
    theta, partial = _rope(bamba)
    layer_types = getattr(bamba, "layer_types", None) or getattr(bamba, "layers_block_type")
    settings = {name: getattr(bamba, name) for name in _COMMON}
    settings.update(
        head_dim=_head_dim(bamba), layer_types=[canonical_layer_type(t) for t in layer_types],
        rope_theta=theta, partial_rotary_factor=partial, attention_bias=bamba.attention_bias,
        mamba_n_heads=bamba.mamba_n_heads, mamba_d_head=bamba.mamba_d_head, mamba_d_state=bamba.mamba_d_state,
        mamba_d_conv=bamba.mamba_d_conv, mamba_expand=bamba.mamba_expand, mamba_n_groups=bamba.mamba_n_groups,
        mamba_chunk_size=bamba.mamba_chunk_size, mamba_conv_bias=bamba.mamba_conv_bias,
        mamba_proj_bias=bamba.mamba_proj_bias, time_step_limit=bamba.time_step_limit, hidden_act=bamba.hidden_act,
    )
    settings.update(overrides)
    return SEHybridConfig(**settings)


def config_from_llama(llama, **overrides) -> SEHybridConfig:
    if getattr(llama, "mlp_bias", False):
        raise ValueError("Llama mlp_bias=True is not supported (the shared SwiGLU block has no biases).")
    if llama.hidden_act != "silu":
        raise ValueError(f"hidden_act={llama.hidden_act!r}: the shared MLP is SwiGLU (silu); cannot convert.")
    theta, partial = _rope(llama)
    settings = {name: getattr(llama, name) for name in _COMMON}
    settings.update(
        head_dim=_head_dim(llama), layer_types=["attention"] * llama.num_hidden_layers, rope_theta=theta,
        partial_rotary_factor=partial, attention_bias=llama.attention_bias,
    )
    settings.update(overrides)
    return SEHybridConfig(**settings)


def _bamba_name(name: str) -> str:
    for old, new in ((".mamba.", ".self_attn."), (".pre_ff_layernorm.", ".post_attention_layernorm."),
                     (".feed_forward.", ".mlp."), ("model.final_layernorm.", "model.norm.")):
        name = name.replace(old, new)
    return name


_SOURCES = {
    "bamba": (config_from_bamba, _bamba_name),
    "llama": (config_from_llama, lambda name: name),
}


def convert_to_se_hybrid(model: torch.nn.Module, **config_overrides) -> SEHybridForCausalLM:
    """A ``*ForCausalLM`` of a supported type -> SEHybridForCausalLM with the same weights.

    ``config_overrides`` set SE fields (``attention_mode``, ``se_chunk_sizes``, ...) on the new config.
    """
    model_type = model.config.model_type
    if model_type not in _SOURCES:
        raise ValueError(f"model_type {model_type!r} cannot be converted to se_hybrid; supported: {sorted(_SOURCES)}.")
    make_config, rename = _SOURCES[model_type]
    config = make_config(model.config, **config_overrides)
    target = SEHybridForCausalLM(config).to(dtype=next(model.parameters()).dtype)
    source = {rename(name): tensor for name, tensor in model.state_dict().items()}
    expected = target.state_dict()
    missing = sorted(set(expected) - set(source))
    unexpected = sorted(set(source) - set(expected))
    if missing or unexpected:
        raise ValueError(f"weight names do not line up: missing {missing[:5]}, unexpected {unexpected[:5]}.")
    for name, tensor in source.items():
        if tensor.shape != expected[name].shape:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not match se_hybrid's {tuple(expected[name].shape)}.")
    target.load_state_dict(source, strict=True)
    if config.tie_word_embeddings:
        target.tie_weights()
    return target.eval() if not model.training else target


__all__ = ["config_from_bamba", "config_from_llama", "convert_to_se_hybrid"]
