"""benchmarks/generation.py's bare decode loop on a tiny RAT model (CPU)."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_hybrid  # noqa: F401  (registers the architectures)
from benchmarks.generation import decode_loop_ms
from hf_hybrid.models.rat import RatConfig

VOCAB = 61


def rat_model():
    config = RatConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, chunk_size=4, pad_token_id=0)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def test_bare_decode_loop_runs_every_step_on_the_static_path():
    """decode_loop_ms (the generate() benchmark's floor and the decode profiler's loop):
    prefill, three warm-up steps, then the measured steps, all through the static step."""
    model = rat_model()
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
