"""Dense Llama-architecture checkpoint -> RAT+ that reproduces it at D = 1 before any training.

The RAT+ layer (``hf_hybrid.layers.rat_plus_attention``) is a Llama attention layer plus two
projections, so every Llama weight is copied by name and the new ones are set so that the
converted model computes the dense model's function:

* recurrence gate ``g_proj``: weight 0, bias ``gate_logit`` (default -20): g = sigmoid(-20) = 2e-9,
  so k~_t = k_t + g (k~_{t-1} - k_t) ~ k_t ("closed": the recurrence passes the current token on).
  (It cannot be exactly 0 and stay a sigmoid gate; the logit difference at D = 1 is O(g).) A gate
  this saturated barely trains, so ``hf_hybrid.adapt`` opens it before adapting (see
  ``open_recurrence_gates`` there for why and the measured effect).
* output gate ``z_proj``: weight 0, so sigmoid(0) = 1/2 on every channel, and ``o_proj`` is
  doubled: W_o (x / 2) * 2 = W_o x exactly (powers of two are exact in floating point).

Then ``hf_hybrid.adapt`` runs resolution adaptation with the joint objective, after which the
model can be used with sparse patterns (paper Sec. 3 "Inference-time sparsification": a dense
model needs this adaptation; RAT+ needs only the short one).

CLI: ``hf-hybrid convert dense-to-rat-plus SRC DST`` -> :func:`main_convert`.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ..models.rat_plus import RatPlusConfig, RatPlusForCausalLM
from ..sparse import SparseInferenceConfig
from .checkpoint_io import copy_side_files, load_state

DEFAULT_GATE_LOGIT = -20.0


def _rope_theta(llama: dict) -> float:
    """RoPE base from a Llama config dict (transformers 5 ``rope_parameters`` or 4.x ``rope_theta``)."""
    params = llama.get("rope_parameters") or {}
    scaling = llama.get("rope_scaling") or {}
    rope_type = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type not in (None, "default"):
        raise ValueError(
            f"rope type {rope_type!r}: RAT+ conversion supports only default RoPE (no scaling); "
            "convert a checkpoint without rope scaling."
        )
    return float(params.get("rope_theta", llama.get("rope_theta", 10000.0)))


def config_from_llama(llama: dict, **overrides) -> RatPlusConfig:
    """RatPlusConfig with the Llama config's sizes; checks the features RAT+ does not carry."""
    model_type = llama.get("model_type")
    if model_type != "llama":
        raise ValueError(f"expected a Llama checkpoint (config model_type 'llama'), got model_type={model_type!r}.")
    for flag in ("attention_bias", "mlp_bias"):
        if llama.get(flag):
            raise ValueError(f"{flag}=True is not supported: RAT+ projections have no biases.")
    if llama.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={llama['hidden_act']!r} is not supported: the RAT+ MLP is SwiGLU (silu).")
    heads = llama["num_attention_heads"]
    settings = dict(
        vocab_size=llama["vocab_size"],
        hidden_size=llama["hidden_size"],
        intermediate_size=llama["intermediate_size"],
        num_hidden_layers=llama["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=llama.get("num_key_value_heads") or heads,
        head_dim=llama.get("head_dim") or llama["hidden_size"] // heads,
        rope_theta=_rope_theta(llama),
        max_position_embeddings=llama.get("max_position_embeddings", 4096),
        rms_norm_eps=llama.get("rms_norm_eps", 1e-6),
        initializer_range=llama.get("initializer_range", 0.02),
        tie_word_embeddings=llama.get("tie_word_embeddings", False),
        pad_token_id=llama.get("pad_token_id"),
        bos_token_id=llama.get("bos_token_id"),
        eos_token_id=llama.get("eos_token_id"),
        recurrence_gate_bias=True,
    )
    settings.update(overrides)
    return RatPlusConfig(**settings)


def convert_state_dict(llama_state: dict[str, torch.Tensor], config: RatPlusConfig, gate_logit: float = DEFAULT_GATE_LOGIT) -> dict[str, torch.Tensor]:
    """Llama state dict -> RAT+ state dict (names match; adds the gates, doubles o_proj)."""
    state = {}
    for name, tensor in llama_state.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue  # a buffer recomputed from rope_theta
        state[name] = tensor.clone() if not name.endswith("self_attn.o_proj.weight") else tensor * 2
    kv_dim = config.num_key_value_heads * config.head_dim
    inner = config.num_attention_heads * config.head_dim
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}.self_attn"
        reference = state[f"{prefix}.q_proj.weight"]
        state[f"{prefix}.g_proj.weight"] = reference.new_zeros(kv_dim, config.hidden_size)
        state[f"{prefix}.g_proj.bias"] = reference.new_full((kv_dim,), gate_logit)
        state[f"{prefix}.z_proj.weight"] = reference.new_zeros(inner, config.hidden_size)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def convert_llama_checkpoint(
    src: str | Path,
    dst: str | Path | None = None,
    gate_logit: float = DEFAULT_GATE_LOGIT,
    dtype: str = "source",
    **config_overrides,
) -> RatPlusForCausalLM:
    """Convert the LlamaForCausalLM directory ``src``; save to ``dst`` (with tokenizer files) when given.

    ``dtype``: "source" keeps the checkpoint's dtype, or "float32" / "bfloat16" / "float16".
    ``config_overrides`` go to RatPlusConfig (e.g. training_dilations, sparse_config).
    """
    src = Path(src)
    config_path = src / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{config_path} not found: SRC must be a LlamaForCausalLM directory (save_pretrained output).")
    config = config_from_llama(json.loads(config_path.read_text()), **config_overrides)
    llama_state = load_state(src)
    source_dtype = next(iter(llama_state.values())).dtype
    target = source_dtype if dtype == "source" else getattr(torch, dtype)
    state = convert_state_dict(llama_state, config, gate_logit)
    model = RatPlusForCausalLM(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (config.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match a Llama layout: missing {missing[:5]}, unexpected {unexpected[:5]}.")
    if config.tie_word_embeddings:
        model.tie_weights()
    model = model.to(target).eval()
    if dst is not None:
        dst = Path(dst)
        model.save_pretrained(dst)
        copy_side_files(src, dst)
    return model


def max_logit_difference(src: str | Path, converted: RatPlusForCausalLM, input_ids: torch.Tensor) -> float:
    """max |logits_llama - logits_rat_plus| at D = 1 on ``input_ids`` (both in float32)."""
    from transformers import LlamaForCausalLM

    llama = LlamaForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    model = converted.float().eval()
    with torch.no_grad():
        ref = llama(input_ids).logits
        ours = model(input_ids, sparse_config=SparseInferenceConfig()).logits
    return (ref - ours).abs().max().item()


def main_convert(argv: list[str] | None = None) -> None:
    """``hf-hybrid convert dense-to-rat-plus SRC DST [options]`` (argv may start with "dense-to-rat-plus")."""
    argv = list(argv or [])
    if argv and argv[0] == "dense-to-rat-plus":
        argv = argv[1:]
    parser = argparse.ArgumentParser(prog="hf-hybrid convert dense-to-rat-plus", description=__doc__.split("\n\n")[0])
    parser.add_argument("src", help="LlamaForCausalLM checkpoint directory")
    parser.add_argument("dst", help="output directory for the RAT+ checkpoint")
    parser.add_argument("--gate-logit", type=float, default=DEFAULT_GATE_LOGIT, help="initial recurrence-gate bias (closed: very negative)")
    parser.add_argument("--dtype", default="source", choices=["source", "float32", "bfloat16", "float16"])
    parser.add_argument("--training-dilations", default="1,64", help="joint objective for later adaptation, e.g. 1,64")
    parser.add_argument("--sparse-config", default=None, help="default inference pattern as JSON, e.g. '{\"dilation\": 16}'")
    parser.add_argument("--verify", action="store_true", help="load both models and report the max logit difference at D=1")
    args = parser.parse_args(argv)
    overrides = {"training_dilations": [int(d) for d in args.training_dilations.split(",")]}
    if args.sparse_config:
        overrides["sparse_config"] = SparseInferenceConfig.from_dict(json.loads(args.sparse_config)).to_dict()
    model = convert_llama_checkpoint(args.src, args.dst, args.gate_logit, args.dtype, **overrides)
    params = sum(p.numel() for p in model.parameters())
    print(f"converted {args.src} -> {args.dst}: RAT+ with {model.config.num_hidden_layers} layers, {params / 1e6:.2f}M parameters")
    if args.verify:
        ids = torch.randint(0, model.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
        print(f"max |logits difference| at D=1: {max_logit_difference(args.src, model, ids):.3g}")


if __name__ == "__main__":
    import sys

    main_convert(sys.argv[1:])
