"""benchmarks/train_ab.py: each way puts the model's step on the path it names and undoes it."""
from __future__ import annotations

import pytest
import torch

from benchmarks import train_ab
from hf_hybrid.bench.cases import BenchConfig
from hf_hybrid.bench.models import architectures, build_ours
from hf_hybrid.layers import attention as attention_module
from hf_hybrid.layers.residual_linear_attention import RattentionLocalAttention


def test_flex_moves_both_models_window_layers_and_is_undone():
    config = BenchConfig(device=torch.device("cpu"), dtype=torch.float32, quick=True)
    model = build_ours(next(a for a in architectures(True) if a.name == "RATTENTION"), config)
    local = next(m for m in model.modules() if isinstance(m, RattentionLocalAttention))
    query = torch.zeros(1, 2, 3, 16)
    default_backend, applies = local._swa_backend(), attention_module.window_attention_applies
    with train_ab.way(model, "flex"):
        assert local._swa_backend() == "flex" and attention_module.window_attention_applies(query) is False
    assert local._swa_backend() == default_backend and attention_module.window_attention_applies is applies
    with train_ab.way(model, "window"):
        assert local._swa_backend() == default_backend


def test_triton_window_kernel_moves_both_models_window_layers_and_is_undone():
    config = BenchConfig(device=torch.device("cpu"), dtype=torch.float32, quick=True)
    model = build_ours(next(a for a in architectures(True) if a.name == "RATTENTION"), config)
    local = next(m for m in model.modules() if isinstance(m, RattentionLocalAttention))
    default_backend, applies = local._swa_backend(), attention_module.flash_window_applies
    with train_ab.way(model, "triton"):
        assert local._swa_backend() == "triton" and attention_module.flash_window_applies(torch.zeros(1, 2, 3, 16)) is False
    assert local._swa_backend() == default_backend and attention_module.flash_window_applies is applies


def test_an_unknown_way_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="window, flex, ours, liger"):
        with train_ab.way(torch.nn.Module(), "cudnn"):
            pass


def test_it_needs_a_gpu_and_says_so(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    assert train_ab.main(["--seq", "64"]) == 1
    assert "needs a CUDA device" in capsys.readouterr().err


def test_liger_puts_the_backbone_norm_and_swiglu_on_ligers_functions_and_is_undone():
    from hf_hybrid.layers import mlp as mlp_module
    from hf_hybrid.layers import norm as norm_module

    ours = norm_module.fused_rms_norm, mlp_module.fused_silu_mul
    with train_ab.way(torch.nn.Module(), "liger"):
        assert (norm_module.fused_rms_norm, mlp_module.fused_silu_mul) == (train_ab._liger_rms_norm, train_ab._liger_silu_mul)
    assert (norm_module.fused_rms_norm, mlp_module.fused_silu_mul) == ours
    with train_ab.way(torch.nn.Module(), "ours"):
        assert (norm_module.fused_rms_norm, mlp_module.fused_silu_mul) == ours


def test_split_runs_the_local_layers_rla_with_the_former_tiling_and_is_undone():
    from hf_hybrid.layers import residual_linear_attention as rla_layer_module

    default = rla_layer_module.residual_linear_attention
    seen = {}

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return default(*args, **{k: v for k, v in kwargs.items() if k not in train_ab.SPLIT_RLA})

    rla_layer_module.residual_linear_attention = spy
    try:
        with train_ab.way(torch.nn.Module(), "split"):
            rla_layer_module.residual_linear_attention(*(torch.zeros(1, 4, 2, 16) for _ in range(3)), 1, backend="chunked")
        assert {k: seen[k] for k in train_ab.SPLIT_RLA} == train_ab.SPLIT_RLA
        assert rla_layer_module.residual_linear_attention is spy
        seen.clear()
        with train_ab.way(torch.nn.Module(), "stacked"):
            rla_layer_module.residual_linear_attention(*(torch.zeros(1, 4, 2, 16) for _ in range(3)), 1, backend="chunked")
        assert not set(seen) & set(train_ab.SPLIT_RLA)
    finally:
        rla_layer_module.residual_linear_attention = default
