"""benchmarks/generation.py's bare decode loop on a tiny RAT model (CPU)."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_hybrid  # noqa: F401  (registers the architectures)
from benchmarks.generation import decode_loop_ms
from hf_hybrid.models.rat import RatConfig

VOCAB = 61


def rat_model(**overrides):
    config = RatConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, chunk_size=4, pad_token_id=0, **overrides)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def se_model():
    from hf_hybrid.models.se_hybrid import SEHybridConfig

    config = SEHybridConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, layer_types=["mamba", "attention"], mamba_d_head=8, mamba_d_state=8, mamba_n_heads=8,
        mamba_chunk_size=8, se_chunk_sizes=[8], se_eval_chunk_size=8, se_block_size=2, se_top_k=2, se_select_every=4,
        attention_mode="se", pad_token_id=0,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


TINY = {
    "rat": rat_model,
    "rat_swa": lambda: rat_model(layer_types=["rat", "sliding_attention"], sliding_window=4),
    "se_hybrid_se": se_model,
}


@pytest.mark.parametrize("name", sorted(TINY))
def test_bare_decode_loop_runs_every_step_on_the_static_path(name):
    """decode_loop_ms (the generate() benchmark's floor and the decode profiler's loop):
    prefill, three warm-up steps, then the measured steps, all through the static step."""
    model = TINY[name]()
    ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(4))
    measured = []

    def measure(fn):
        fn()
        measured.append(True)
        return 0.004

    assert decode_loop_ms(model, ids, 5, mode="eager", measure=measure) == pytest.approx(0.8)
    assert measured == [True] and model._decode_graph_session is None


def test_rat_swa_and_se_mode_rows_build_what_they_name():
    """The model rows (the benchmark itself needs CUDA) build the configuration their name promises,
    on the meta device (no memory, no weights)."""
    from benchmarks.generation import MODELS, build_model

    assert {"rat_swa", "se_hybrid_se", "se_hybrid"} <= set(MODELS)
    swa = build_model("rat_swa", torch.device("meta"), torch.bfloat16, 64).config
    assert swa.layer_types == ["rat", "sliding_attention"] * (swa.num_hidden_layers // 2)
    se = build_model("se_hybrid_se", torch.device("meta"), torch.bfloat16, 64).config
    assert se.attention_mode == "se" and "attention" in se.layer_types
    with pytest.raises(ValueError, match="--models"):
        build_model("nope", torch.device("meta"), torch.bfloat16, 64)
