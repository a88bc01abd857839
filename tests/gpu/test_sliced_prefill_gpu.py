"""generate() with a sliced prefill on the GPU (hf_hybrid/generation/sliced_prefill.py): the
Triton / cuDNN paths of a slice that continues a filled cache give what the one-shot prefill
gives (fp32), the CUDA-graph decode step takes every decode step afterwards, the automatic choice
slices when the free-memory figure is short, and at a batch whose one-shot prefill runs out of
memory generate() completes. The CPU tests: tests/features/test_sliced_prefill.py."""
from __future__ import annotations

import pytest
import torch

import hf_hybrid.generation.sliced_prefill as sliced_prefill

from test_graph_decode_gpu import build

pytestmark = pytest.mark.gpu

NAMES = ("rat", "fox", "rattention", "rat_plus_dense", "rat_plus_d16", "se_hybrid")


def generate(model, ids, new=6, **kwargs):
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                             return_dict_in_generate=True, output_logits=True, **kwargs)
    return out.sequences, torch.stack(out.logits, 1), model.last_decode_report


@pytest.mark.parametrize("name", NAMES)
def test_sliced_prefill_equals_one_shot_and_the_graph_decodes_after_it(name):
    model = build(name, torch.float32)
    ids = torch.randint(1, 512, (3, 300), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    seq, logits, report = generate(model, ids)
    for tokens in (77, 128):  # across RAT's chunks of 16, RATTENTION's window of 32, RAT+'s dilation of 16
        sliced_seq, sliced_logits, sliced_report = generate(model, ids, prefill_chunk_size=tokens)
        assert torch.equal(sliced_seq, seq)
        torch.testing.assert_close(sliced_logits, logits, atol=2e-4, rtol=0)
        assert sliced_report["static_steps"] == report["static_steps"] == 5, sliced_report
        assert sliced_report["graph_captured"], sliced_report


@pytest.mark.parametrize("name", ("rat", "fox", "rattention"))
def test_automatic_slices_with_a_short_free_memory_figure(name, monkeypatch):
    model = build(name, torch.float32)
    ids = torch.randint(1, 512, (4, 1100), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    seq, logits, _ = generate(model, ids)
    per_token = sliced_prefill.activation_bytes_per_token(model.config, model.dtype)
    cache = sliced_prefill.probe_cache_footprint(model).bytes(4, 1106)
    # room for about 300 of the 1100 tokens per row
    monkeypatch.setattr(sliced_prefill, "free_device_memory",
                        lambda device: (cache + 4 * 300 * per_token) / sliced_prefill.HEADROOM * 1.05)
    sliced_seq, sliced_logits, report = generate(model, ids)
    assert model.last_prefill_plan["slice_tokens"] == 256, model.last_prefill_plan
    assert torch.equal(sliced_seq, seq)
    torch.testing.assert_close(sliced_logits, logits, atol=2e-4, rtol=0)
    assert report["graph_captured"] and report["static_steps"] == 5


def test_rat_generates_where_the_one_shot_prefill_runs_out_of_memory():
    """A batch whose one-shot prefill needs more than the GPU's memory while RAT's decode cache is
    small: with the automatic choice generate() completes; with it off it runs out of memory."""
    from transformers import AutoModelForCausalLM

    from hf_hybrid.models.rat import RatConfig

    config = RatConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=2,
                       num_attention_heads=16, head_dim=128, chunk_size=16, pad_token_id=0, eos_token_id=None)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    free = sliced_prefill.free_device_memory(torch.device("cuda"))
    per_token = sliced_prefill.activation_bytes_per_token(config, torch.bfloat16)
    prompt = 4096
    batch = int(3 * free / (per_token * prompt)) // 8 * 8  # 3x the memory by the estimate
    ids = torch.randint(3, 32000, (batch, prompt), device="cuda")
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    assert out.shape == (batch, prompt + 4)
    assert model.last_prefill_plan["slice_tokens"] is not None, model.last_prefill_plan
    assert model.last_decode_report["graph_captured"]
    del out
    torch.cuda.empty_cache()
    with pytest.raises(torch.cuda.OutOfMemoryError), torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, prefill_slicing=False)


WIDE = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=2, num_attention_heads=16,
            head_dim=128, pad_token_id=0, eos_token_id=None)


def wide_config(name):
    from hf_hybrid.models.fox import FoxConfig
    from hf_hybrid.models.rat import RatConfig
    from hf_hybrid.models.rattention import RattentionConfig
    from hf_hybrid.models.se_hybrid import SEHybridConfig

    return {
        "rat": lambda: RatConfig(**WIDE, chunk_size=16),
        "fox": lambda: FoxConfig(**WIDE, num_key_value_heads=16),
        "rattention": lambda: RattentionConfig(**WIDE, num_key_value_heads=16, layer_types=["local", "global"]),
        "se_hybrid": lambda: SEHybridConfig(**WIDE, num_key_value_heads=16, layer_types=["mamba", "attention"]),
    }[name]()


@pytest.mark.parametrize("name", ("rat", "fox", "rattention", "se_hybrid"))
def test_activation_estimate_bounds_the_one_shot_prefill_peak(name):
    """The planner's estimate (activations per token of one layer, plus the measured cache) is at
    least what a one-shot prefill's peak adds to the weights, at the 1.3B width in bf16, and not
    more than four times it (a failure message gives the ratio)."""
    from transformers import AutoModelForCausalLM

    config = wide_config(name)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    rows, prompt = 8, 4096
    ids = torch.randint(3, 32000, (rows, prompt), device="cuda")
    with torch.no_grad():  # warm-up: kernels compiled and tuned outside the measured peak
        model.generate(ids[:1, :256], attention_mask=torch.ones_like(ids[:1, :256]), max_new_tokens=2, do_sample=False)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False, prefill_slicing=False)
    peak = torch.cuda.max_memory_allocated() - base
    per_token = sliced_prefill.activation_bytes_per_token(config, torch.bfloat16)
    estimate = rows * prompt * per_token + sliced_prefill.probe_cache_footprint(model).bytes(rows, prompt + 2)
    assert peak <= estimate <= 4 * peak, f"{name}: estimate / measured peak = {estimate / peak:.2f} ({estimate / 2**30:.2f} GiB / {peak / 2**30:.2f} GiB)"
