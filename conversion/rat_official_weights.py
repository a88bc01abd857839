"""Tensor names and layouts: the RAT / RAT+ authors' state dicts <-> hf-hybrid's.

Official (per layer i, prefix ``backbone.layers.{i}.``)        hf-hybrid (prefix ``model.layers.{i}.``)
  seq_layer.input_norm.weight                                    input_layernorm.weight
  seq_layer.in_proj.weight  RAT+ rows [o | q | k | v | g]        self_attn.{z,q,k,v,g}_proj.weight
                            RAT  rows [z | v | g | q | k]        self_attn.{z,v,g,q,k}_proj.weight
  seq_layer.fgate_proj.weight (older RAT+ files: the g rows)     self_attn.g_proj.weight
  seq_layer.gate_bias (RAT)                                      self_attn.gate_bias
  seq_layer.out_proj.weight                                      self_attn.o_proj.weight
  hidden_layer.ln.weight                                         post_attention_layernorm.weight
  hidden_layer.fc1.{weight,bias}                                 mlp.up_proj (swiglu: rows [up | gate])
  hidden_layer.fc2.{weight,bias}                                 mlp.down_proj
  embedding.wte.weight / backbone.ln.weight / head.lm_head.weight  model.embed_tokens / model.norm / lm_head

RAT's ``gate_bias`` is copied as stored; at chunk size 1 the official code never initialises it
(torch.empty), so the file holds whatever that memory held, and so does the converted model.

Mapping functions yield (name, tensor) pairs lazily: the tensors are views of the (memory-mapped)
source, so a writer can stream them shard by shard.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

from .rat_official_format import RAT, RAT_PLUS, OfficialSpec, UnsupportedCheckpoint

_SPLITS = {RAT_PLUS: ("z_proj", "q_proj", "k_proj", "v_proj", "g_proj"), RAT: ("z_proj", "v_proj", "g_proj", "q_proj", "k_proj")}


def _row_sizes(kind: str, d_model: int, qk_rows: int, apply_re: bool = True) -> list[int]:
    if kind == RAT_PLUS:
        return [d_model] * (5 if apply_re else 4)
    return [d_model, d_model, d_model, qk_rows, qk_rows]


def to_hf_tensors(state: dict[str, torch.Tensor], spec: OfficialSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """Official state dict -> hf-hybrid names (views, no copies). Unknown keys are refused."""
    used = set()

    def take(key: str) -> torch.Tensor:
        if key not in state:
            raise UnsupportedCheckpoint(f"{key} is missing from the checkpoint.")
        used.add(key)
        return state[key]

    yield "model.embed_tokens.weight", take("embedding.wte.weight")
    qk_rows = spec.ngroups * spec.d_head
    for i in range(spec.num_layers):
        src, dst = f"backbone.layers.{i}.", f"model.layers.{i}."
        yield dst + "input_layernorm.weight", take(src + "seq_layer.input_norm.weight")
        in_proj = take(src + "seq_layer.in_proj.weight")
        if spec.kind == RAT_PLUS and src + "seq_layer.fgate_proj.weight" in state and in_proj.shape[0] == 4 * spec.d_model:
            in_proj = torch.cat([in_proj, take(src + "seq_layer.fgate_proj.weight")])  # older files: gate rows kept apart
        sizes = _row_sizes(spec.kind, spec.d_model, qk_rows, spec.apply_re)
        if in_proj.shape != (sum(sizes), spec.d_model):
            raise UnsupportedCheckpoint(f"{src}seq_layer.in_proj.weight has shape {tuple(in_proj.shape)}, "
                                        f"expected {(sum(sizes), spec.d_model)}.")
        for name, rows in zip(_SPLITS[spec.kind], in_proj.split(sizes)):
            yield dst + f"self_attn.{name}.weight", rows
        if spec.kind == RAT:
            yield dst + "self_attn.gate_bias", take(src + "seq_layer.gate_bias")
        yield dst + "self_attn.o_proj.weight", take(src + "seq_layer.out_proj.weight")
        yield dst + "post_attention_layernorm.weight", take(src + "hidden_layer.ln.weight")
        for part in ("weight", "bias"):
            key = src + f"hidden_layer.fc1.{part}"
            if part == "bias" and not spec.ffn_bias:
                if key in state:
                    raise UnsupportedCheckpoint(f"{key} exists but model.backbone.hidden_cell.bias is false.")
                continue
            fc1 = take(key)
            if spec.act_fn == "swiglu":  # official SwiGLU: x, gate = fc1(x).chunk(2); silu(gate) * x
                up, gate = fc1.chunk(2)
                yield dst + f"mlp.up_proj.{part}", up
                yield dst + f"mlp.gate_proj.{part}", gate
            else:
                yield dst + f"mlp.up_proj.{part}", fc1
            yield dst + f"mlp.down_proj.{part}", take(src + f"hidden_layer.fc2.{part}")
    yield "model.norm.weight", take("backbone.ln.weight")
    if not spec.tie_embedding:
        yield "lm_head.weight", take("head.lm_head.weight")
    else:
        used.add("head.lm_head.weight")
    unused = sorted(set(state) - used)
    if unused:
        raise UnsupportedCheckpoint(f"the checkpoint has tensors this converter does not map: {unused[:8]}"
                                    f"{' ...' if len(unused) > 8 else ''}.")


def to_official_state(state: dict[str, torch.Tensor], config, kind: str) -> dict[str, torch.Tensor]:
    """hf-hybrid state dict -> the official state dict (tied head stored as the official trainer
    stores it: the same tensor under both names)."""
    out = {"embedding.wte.weight": state["model.embed_tokens.weight"]}
    gated = config.mlp_type == "gated"
    for i in range(config.num_hidden_layers):
        src, dst = f"model.layers.{i}.", f"backbone.layers.{i}."
        out[dst + "seq_layer.input_norm.weight"] = state[src + "input_layernorm.weight"]
        names = _SPLITS[kind] if kind == RAT or config.use_recurrence else _SPLITS[kind][:4]
        out[dst + "seq_layer.in_proj.weight"] = torch.cat([state[src + f"self_attn.{name}.weight"] for name in names])
        if kind == RAT:
            out[dst + "seq_layer.gate_bias"] = state[src + "self_attn.gate_bias"]
        out[dst + "seq_layer.out_proj.weight"] = state[src + "self_attn.o_proj.weight"]
        for part in ("weight", "bias") if config.mlp_bias else ("weight",):
            up = state[src + f"mlp.up_proj.{part}"]
            out[dst + f"hidden_layer.fc1.{part}"] = torch.cat([up, state[src + f"mlp.gate_proj.{part}"]]) if gated else up
            out[dst + f"hidden_layer.fc2.{part}"] = state[src + f"mlp.down_proj.{part}"]
        out[dst + "hidden_layer.ln.weight"] = state[src + "post_attention_layernorm.weight"]
    out["backbone.ln.weight"] = state["model.norm.weight"]
    out["head.lm_head.weight"] = out["embedding.wte.weight"] if config.tie_word_embeddings else state["lm_head.weight"]
    return out
