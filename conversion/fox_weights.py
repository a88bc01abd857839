"""Parameter names and shapes: official FoX / FLA checkpoints <-> hf-hybrid ``fox`` models.

Each tensor maps by name, except three layouts that differ:

* per-head norm weights (QK-norm, output norm) are one flat vector over all heads in the sources
  ([heads * head_dim], or [head_dim] shared by every head in the official code's
  ``qk_norm_share_param_across_head`` variant) and [heads, head_dim] here;
* the official SwiGLU keeps [gate; up] in one ``mlp.gate_proj`` matrix, split here into
  ``gate_proj`` and ``up_proj`` (FLA already keeps them apart);
* the official KV-shift lives inside ``k_proj`` / ``v_proj`` (``.linear`` + ``.shift_proj``); here it
  is ``k_proj`` + ``k_shift.proj``.

Every source tensor must be used and every model tensor filled: anything left over is an error.
"""
from __future__ import annotations

import torch

from ..models.fox import FoxConfig
from .fox_formats import FLA, OFFICIAL, UnsupportedCheckpoint


def _attention_names(fmt: str, config: FoxConfig) -> dict[str, str]:
    """{source suffix: our suffix} for one layer's attention tensors whose layout is the same."""
    names = {"q_proj.weight": "q_proj.weight", "o_proj.weight": "o_proj.weight"}
    if fmt == FLA:
        names.update({"k_proj.weight": "k_proj.weight", "v_proj.weight": "v_proj.weight",
                      "f_proj.weight": "f_proj.weight", "f_proj.bias": "f_proj.bias", "g_proj.weight": "g_proj.weight"})
        return names
    for kv in ("k", "v"):
        if config.kv_shift:
            names[f"{kv}_proj.linear.weight"] = f"{kv}_proj.weight"
            names[f"{kv}_proj.shift_proj.weight"] = f"{kv}_shift.proj.weight"
        else:
            names[f"{kv}_proj.weight"] = f"{kv}_proj.weight"
    if config.forget_gate == "data_dependent":
        names.update({"fgate_proj.weight": "f_proj.weight", "fgate_proj.bias": "f_proj.bias"})
    elif config.forget_gate in ("data_independent", "fixed"):
        names["fgate_bias"] = "forget_bias"
    names["ogate_proj.weight"] = "g_proj.weight"
    return names


def _per_head(weight: torch.Tensor, heads: int, head_dim: int, name: str) -> torch.Tensor:
    if weight.shape == (head_dim,):  # one weight shared by every head (official legacy variant)
        return weight.expand(heads, head_dim).clone()
    if weight.shape != (heads * head_dim,):
        raise UnsupportedCheckpoint(f"{name} has shape {tuple(weight.shape)}; expected ({heads * head_dim},) or ({head_dim},).")
    return weight.reshape(heads, head_dim).clone()


def _norm_names(fmt: str) -> dict[str, str]:
    out_norm = "output_norm.weight" if fmt == OFFICIAL else None
    return {"q_norm.weight": "q_norm.weight", "k_norm.weight": "k_norm.weight", **({out_norm: "o_norm.weight"} if out_norm else {})}


def to_fox_state(state: dict[str, torch.Tensor], fmt: str, config: FoxConfig) -> dict[str, torch.Tensor]:
    """Source state dict -> hf-hybrid fox state dict (FoxForCausalLM names)."""
    source = dict(state)
    out: dict[str, torch.Tensor] = {}

    def take(name: str) -> torch.Tensor:
        if name not in source:
            raise UnsupportedCheckpoint(f"the checkpoint has no tensor {name!r}, which its config implies.")
        return source.pop(name)

    out["model.embed_tokens.weight"] = take("model.embeddings.weight")
    out["model.norm.weight"] = take("model.norm.weight")
    if "lm_head.weight" in source:
        lm_head = source.pop("lm_head.weight")
        if not config.tie_word_embeddings:
            out["lm_head.weight"] = lm_head
    elif not config.tie_word_embeddings:
        raise UnsupportedCheckpoint("the checkpoint has no lm_head.weight but tie_word_embeddings is false.")
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    norm_heads = {"q_norm.weight": heads, "k_norm.weight": kv_heads, "o_norm.weight": heads}
    for i in range(config.num_hidden_layers):
        src, dst = f"model.layers.{i}.", f"model.layers.{i}."
        out[dst + "input_layernorm.weight"] = take(src + "attn_norm.weight")
        out[dst + "post_attention_layernorm.weight"] = take(src + "mlp_norm.weight")
        for theirs, ours in _attention_names(fmt, config).items():
            if ours.startswith("g_proj") and not config.output_gate:
                continue
            out[dst + "self_attn." + ours] = take(src + "attn." + theirs)
        for theirs, ours in _norm_names(fmt).items():
            wanted = config.qk_norm if ours != "o_norm.weight" else config.output_norm
            if wanted:
                out[dst + "self_attn." + ours] = _per_head(take(src + "attn." + theirs), norm_heads[ours], dim, src + "attn." + theirs)
        if fmt == OFFICIAL:
            gate, up = take(src + "mlp.gate_proj.weight").chunk(2, dim=0)
            out[dst + "mlp.gate_proj.weight"], out[dst + "mlp.up_proj.weight"] = gate.clone(), up.clone()
        else:
            out[dst + "mlp.gate_proj.weight"] = take(src + "mlp.gate_proj.weight")
            out[dst + "mlp.up_proj.weight"] = take(src + "mlp.up_proj.weight")
        out[dst + "mlp.down_proj.weight"] = take(src + "mlp.down_proj.weight")
    if source:
        raise UnsupportedCheckpoint(
            f"tensors the config does not account for: {sorted(source)[:6]}; the checkpoint uses a feature "
            "this converter does not map (check use_output_gate / qk_norm / shift flags in config.json)."
        )
    return out


def from_fox_state(state: dict[str, torch.Tensor], fmt: str, config: FoxConfig) -> dict[str, torch.Tensor]:
    """hf-hybrid fox state dict -> the source format's names and layouts (inverse of to_fox_state)."""
    ours = dict(state)
    out = {"model.embeddings.weight": ours.pop("model.embed_tokens.weight"), "model.norm.weight": ours.pop("model.norm.weight")}
    lm_head = ours.pop("lm_head.weight", None)
    if lm_head is not None and not config.tie_word_embeddings:
        out["lm_head.weight"] = lm_head
    for i in range(config.num_hidden_layers):
        src, dst = f"model.layers.{i}.", f"model.layers.{i}."
        out[dst + "attn_norm.weight"] = ours.pop(src + "input_layernorm.weight")
        out[dst + "mlp_norm.weight"] = ours.pop(src + "post_attention_layernorm.weight")
        for theirs, our_name in _attention_names(fmt, config).items():
            if our_name.startswith("g_proj") and not config.output_gate:
                continue
            out[dst + "attn." + theirs] = ours.pop(src + "self_attn." + our_name)
        for theirs, our_name in _norm_names(fmt).items():
            key = src + "self_attn." + our_name
            if key in ours:
                out[dst + "attn." + theirs] = ours.pop(key).reshape(-1).clone()
        gate, up = ours.pop(src + "mlp.gate_proj.weight"), ours.pop(src + "mlp.up_proj.weight")
        if fmt == OFFICIAL:
            out[dst + "mlp.gate_proj.weight"] = torch.cat([gate, up], dim=0)
        else:
            out[dst + "mlp.gate_proj.weight"], out[dst + "mlp.up_proj.weight"] = gate, up
        out[dst + "mlp.down_proj.weight"] = ours.pop(src + "mlp.down_proj.weight")
    if ours:
        raise UnsupportedCheckpoint(f"the {fmt} format has no place for {sorted(ours)[:6]}.")
    return out
