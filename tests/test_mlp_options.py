"""The feed-forward choice of the shared backbone (mlp_type / hidden_act / mlp_bias) in every architecture.

Each block equals its formula; every architecture builds the block its config asks for, decodes
with its cache exactly as one full forward, generates, and keeps the fields through save / load.
"""
from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F
from transformers import AutoModelForCausalLM

from hf_hybrid.layers.mlp import PlainMLP, SwiGLUMLP, build_mlp
from hf_hybrid.models.fox import FoxConfig
from hf_hybrid.models.rat import RatConfig
from hf_hybrid.models.rat_plus import RatPlusConfig
from hf_hybrid.models.rattention import RattentionConfig
from hf_hybrid.models.se_hybrid import SEHybridConfig

from models.model_checks import full_vs_cached_logits

COMMON = dict(vocab_size=61, hidden_size=32, intermediate_size=128, num_attention_heads=4, num_hidden_layers=2)
CONFIGS = {
    "rat": lambda **kw: RatConfig(**COMMON, **kw, chunk_size=4),
    "rat_plus": lambda **kw: RatPlusConfig(**COMMON, **kw, training_dilations=[1, 4]),
    "fox": lambda **kw: FoxConfig(**COMMON, **kw, kernel_backend="reference"),
    "rattention": lambda **kw: RattentionConfig(**COMMON, **kw, num_key_value_heads=2, window_size=3, layer_types=["local", "global"]),
    "se_hybrid": lambda **kw: SEHybridConfig(
        **COMMON, **kw, layer_types=["mamba", "attention"], mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=8,
        se_chunk_sizes=[8], se_eval_chunk_size=8, se_block_size=2, se_top_k=2, se_select_every=4, sliding_window=6,
    ),
}


def test_blocks_equal_their_formulas():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    plain = PlainMLP(16, 64, "gelu", bias=True).double()
    expected = F.linear(F.gelu(F.linear(x, plain.up_proj.weight, plain.up_proj.bias)), plain.down_proj.weight, plain.down_proj.bias)
    torch.testing.assert_close(plain(x), expected, rtol=0, atol=1e-12)
    tanh = PlainMLP(16, 64, "gelu_pytorch_tanh").double()
    torch.testing.assert_close(tanh(x), tanh.down_proj(F.gelu(tanh.up_proj(x), approximate="tanh")), rtol=0, atol=1e-12)
    geglu = SwiGLUMLP(16, 64, "gelu").double()
    torch.testing.assert_close(geglu(x), geglu.down_proj(F.gelu(geglu.gate_proj(x)) * geglu.up_proj(x)), rtol=0, atol=1e-12)
    swiglu = build_mlp(16, 64).double()
    assert isinstance(swiglu, SwiGLUMLP) and swiglu.gate_proj.bias is None
    torch.testing.assert_close(swiglu(x), swiglu.down_proj(F.silu(swiglu.gate_proj(x)) * swiglu.up_proj(x)), rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_architecture_takes_the_plain_gelu_mlp(name, tmp_path):
    config = CONFIGS[name](mlp_type="plain", hidden_act="gelu", mlp_bias=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    for layer in model.model.layers:
        assert isinstance(layer.mlp, PlainMLP) and layer.mlp.up_proj.bias is not None
        assert not hasattr(layer.mlp, "gate_proj")
    ids = torch.randint(3, 61, (1, 11), generator=torch.Generator().manual_seed(1))
    full, cached = full_vs_cached_logits(model, ids, [1, 1, 1])
    torch.testing.assert_close(cached, full, rtol=1e-4, atol=1e-4)
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 15)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert (loaded.config.mlp_type, loaded.config.hidden_act, loaded.config.mlp_bias) == ("plain", "gelu", True)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_default_stays_swiglu_and_old_configs_load_as_swiglu():
    config = RatConfig.from_dict({k: v for k, v in CONFIGS["rat"]().to_dict().items() if k not in ("mlp_type", "hidden_act", "mlp_bias")})
    assert (config.mlp_type, config.hidden_act, config.mlp_bias) == ("gated", "silu", False)
    model = AutoModelForCausalLM.from_config(config)
    assert all(isinstance(layer.mlp, SwiGLUMLP) for layer in model.model.layers)


@pytest.mark.parametrize("field, value, match", [("mlp_type", "moe", "mlp_type"), ("hidden_act", "nope", "hidden_act")])
def test_bad_mlp_fields_name_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        RatPlusConfig(**COMMON, **{field: value})
