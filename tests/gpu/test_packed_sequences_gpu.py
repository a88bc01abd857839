"""Packed rows on the GPU (Triton / cuDNN paths, bf16): each document as if alone, for every model.

Run: python -m pytest -m gpu tests/gpu/test_packed_sequences_gpu.py
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "features"))
from tiny_models import MODEL_TYPES, tiny_model  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# Around and across RAT's chunk (16 at this size), the windows, SE's blocks; one single token.
LENGTHS = (300, 17, 1, 513, 64)


@pytest.mark.parametrize("name", MODEL_TYPES)
def test_packed_row_equals_documents_alone_bf16(name):
    model = tiny_model(name, hidden_size=128, num_attention_heads=2, intermediate_size=256).to("cuda", torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    documents = [torch.randint(1, model.config.vocab_size, (n,), generator=generator).cuda() for n in LENGTHS]
    input_ids = torch.cat(documents)[None]
    position_ids = torch.cat([torch.arange(len(d), device="cuda") for d in documents])[None]
    with torch.no_grad():
        packed = model(input_ids, position_ids=position_ids).logits[0].float()
        alone = torch.cat([model(d[None]).logits[0] for d in documents]).float()
    # Each document alone runs the same kernels at another batch shape: bf16 rounding only.
    torch.testing.assert_close(packed, alone, atol=3e-2, rtol=3e-2)
