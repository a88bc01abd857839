"""Every model at the 1.3B shape's widths (hidden 2048, 16 heads x 128, bf16) on batches and
lengths past CUDA's launch-grid limits and past 2**31 elements per tensor:

* a no-grad prefill of B x T = 512K tokens (128 x 4,096, with the cache generate() builds) and of
  2M tokens (512 x 4,096: 2M x 2,048 = 4.3e9 elements per activation) gives, for the first, middle
  and last rows, the hidden states those rows get when run alone;
* generate() runs on a 128 x 4,096 prompt (the batch that once failed to launch);
* a training step on one 131,072-token row gives a finite loss and finite gradients.

Each model has two layers (its two layer kinds where it mixes them) and a narrow MLP
(intermediate 1,024), which the kernels' shapes do not depend on, so that 2M tokens fit one GPU.
The CPU test of the launch grids of every op is tests/kernels/test_launch_grids.py.

Run: HF_HYBRID_SLOW=1 pytest -q -rs -m gpu tests/gpu/test_large_shapes_gpu.py
"""
from __future__ import annotations

import gc

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import hf_hybrid  # noqa: F401  (registers the architectures)
from hf_hybrid import RatConfig

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

WIDTHS = dict(
    vocab_size=256, hidden_size=2048, intermediate_size=1024, num_attention_heads=16, head_dim=128,
    num_hidden_layers=2, max_position_embeddings=131_072, pad_token_id=0,
)
# name -> (model_type, settings beyond WIDTHS); the rest are each config's defaults.
MODELS = {
    "rat": ("rat", {}),
    "rat_swa": ("rat", dict(layer_types=RatConfig.hybrid_layer_types(2, "rat"))),
    "rat_plus": ("rat_plus", {}),
    "fox_llama": ("fox", dict(block_type="llama")),
    "fox_pro": ("fox", dict(block_type="pro")),
    "rattention": ("rattention", dict(layer_types=["local", "global"])),
    "se_hybrid_se": ("se_hybrid", dict(layer_types=["mamba", "attention"], attention_mode="se")),
    "se_hybrid_full": ("se_hybrid", dict(layer_types=["mamba", "attention"], attention_mode="full")),
}
SEQ = 4096
# Relative error of a row against the same row run alone: cuBLAS may pick other GEMM tiles for
# another number of rows (bf16 rounding); an overflowed offset or a dropped program is O(1).
ROW_TOLERANCE = 1e-2


def _model(name: str):
    model_type, settings = MODELS[name]
    config = AutoConfig.for_model(model_type, **(WIDTHS | settings))
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(device="cuda", dtype=torch.bfloat16)


def _free():
    gc.collect()
    torch.cuda.empty_cache()


def _relative_errors(batch_rows: torch.Tensor, alone: torch.Tensor) -> list[float]:
    diff = (batch_rows.float() - alone.float()).flatten(1).norm(dim=1)
    return (diff / alone.float().flatten(1).norm(dim=1)).tolist()


def _check_rows_match_alone(model, batch: int, use_cache: bool):
    generator = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(1, WIDTHS["vocab_size"], (batch, SEQ), device="cuda", generator=generator)
    rows = [0, batch // 2, batch - 1]  # the last row has the largest offsets of every tensor
    with torch.no_grad():
        hidden = model.model(input_ids=ids, use_cache=use_cache).last_hidden_state
        picked = hidden[rows].clone()
        assert torch.isfinite(picked).all()
        del hidden
        _free()
        alone = model.model(input_ids=ids[rows], use_cache=use_cache).last_hidden_state
    errors = _relative_errors(picked, alone)
    assert max(errors) < ROW_TOLERANCE, f"rows {rows} of a batch of {batch} differ from the rows alone: {errors}"


@pytest.mark.parametrize("name", MODELS)
def test_prefill_512k_tokens_matches_rows_alone(name):
    """128 x 4,096 tokens with the cache, as generate()'s prefill (this batch once failed to launch
    the QK-norm + RoPE kernel: 65,536 token blocks on grid axis 1)."""
    model = _model(name).eval()
    try:
        _check_rows_match_alone(model, batch=128, use_cache=True)
    finally:
        del model
        _free()


@pytest.mark.parametrize("name", MODELS)
def test_prefill_2m_tokens_matches_rows_alone(name):
    """512 x 4,096 tokens: every [tokens, 2,048] activation has 4.3e9 elements, past int32 offsets.
    One activation is 8.6 GB: a layer's working set may pass an 80 GB card (then it skips, saying
    so; a 141 GB H200 holds it)."""
    model = _model(name).eval()
    out_of_memory = None
    try:
        _check_rows_match_alone(model, batch=512, use_cache=False)
    except torch.cuda.OutOfMemoryError as error:  # skipped below, once the error's frames are freed
        out_of_memory = str(error)[:120]
    finally:
        del model
        _free()
    if out_of_memory is not None:
        total = torch.cuda.get_device_properties(0).total_memory / 2**30
        pytest.skip(f"2M-token prefill of {name} needs more than this GPU's {total:.0f} GiB: {out_of_memory}")


@pytest.mark.parametrize("name", MODELS)
def test_training_step_at_131k_tokens(name):
    model = _model(name).train()
    try:
        generator = torch.Generator(device="cuda").manual_seed(2)
        ids = torch.randint(1, WIDTHS["vocab_size"], (1, 131_072), device="cuda", generator=generator)
        loss = model(input_ids=ids, labels=ids).loss
        assert torch.isfinite(loss), loss
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        missing = [n for n, g in grads.items() if g is None]
        assert not missing, f"parameters without a gradient: {missing[:5]}"
        bad = [n for n, g in grads.items() if not torch.isfinite(g).all()]
        assert not bad, f"non-finite gradients: {bad[:5]}"
        assert any(g.abs().max() > 0 for g in grads.values())
    finally:
        del model
        _free()


@pytest.mark.parametrize("name", MODELS)
def test_generate_at_batch_128_of_4k_prompts(name):
    """generate() as it once failed: a 128 x 4,096 prompt, then decode steps over that cache."""
    model = _model(name).eval()
    try:
        generator = torch.Generator(device="cuda").manual_seed(3)
        ids = torch.randint(1, WIDTHS["vocab_size"], (128, SEQ), device="cuda", generator=generator)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, min_new_tokens=4, do_sample=False)
        assert out.shape == (128, SEQ + 4)
        assert torch.equal(out[:, :SEQ], ids)
        assert ((out[:, SEQ:] >= 0) & (out[:, SEQ:] < WIDTHS["vocab_size"])).all()
    finally:
        del model
        _free()
