"""The split-K decode kernel of Forgetting Attention (kernels/forgetting_attention/decode_triton.py)
against its reference, and the reference against the cached-attention reference it restates.

One query per row at key position n - 1 of fixed-capacity buffers (n = length, a device counter):
columns >= n hold anything and must never reach the result. Runs in Triton's CPU interpreter
(tiny shapes, several splits so the combine pass is exercised) and on CUDA.
"""
from __future__ import annotations

import pytest
import torch

from hf_hybrid.kernels._backend import triton_interpreting
from sm90_check import sm90_report
from hf_hybrid.kernels.forgetting_attention import (
    forgetting_attention_decode,
    forgetting_attention_decode_reference,
    forgetting_attention_with_cache,
    forgetting_attention_with_cache_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernel = pytest.mark.skipif(
    not torch.cuda.is_available() and not triton_interpreting(), reason="needs CUDA or TRITON_INTERPRET=1"
)


def inputs(batch, capacity, heads, kv_heads, dim, lengths, dtype=torch.float32, seed=0):
    """Buffers whose columns past each row's length hold large garbage (never read)."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen)
    q, k, v = rand(batch, 1, heads, dim), rand(batch, capacity, kv_heads, dim), rand(batch, capacity, kv_heads, dim)
    c_k = torch.cumsum(torch.nn.functional.logsigmoid(rand(batch, capacity, heads) + 2.0), dim=1)
    length = torch.tensor(lengths)
    n = length.expand(batch)
    for b in range(batch):
        k[b, n[b]:], v[b, n[b]:], c_k[b, n[b]:] = 1e4, -1e4, -1e4
    c_q = torch.stack([c_k[b, n[b] - 1] for b in range(batch)])[:, None]
    to = lambda t: t.to(DEVICE)
    return to(q.to(dtype)), to(k.to(dtype)), to(v.to(dtype)), to(c_q), to(c_k), to(length)


def test_reference_is_cached_attention_over_the_filled_columns():
    """Restates forgetting_attention_with_cache_reference at Tq = 1 over k[:, :n]: the buffer tail is ignored."""
    q, k, v, c_q, c_k, length = inputs(2, 40, 4, 2, 16, [23])
    mask = torch.rand(2, 40, device=DEVICE) > 0.2
    mask[:, 22] = True
    for window in (None, 5):
        got = forgetting_attention_decode_reference(q, k, v, c_q, c_k, length, mask, None, window)
        want = forgetting_attention_with_cache_reference(
            q, k[:, :23], v[:, :23], c_q, c_k[:, :23], mask[:, :23], None, window)
        # The same math over 40 and over 23 columns: float32 products of different widths may round
        # differently (2.4e-7 seen on one CPU); the garbage tail (1e4) would be off by far more.
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths", [[97], [150, 1, 64]], ids=["shared-length", "per-row-lengths"])
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "key-mask"])
def test_triton_equals_reference(dtype, lengths, window, masked):
    q, k, v, c_q, c_k, length = inputs(3, 150, 4, 2, 32, lengths, dtype)  # GQA, odd capacity and lengths
    mask = None
    if masked:
        mask = torch.rand(3, 150, device=DEVICE) > 0.3
        mask[2] = False  # a row that sees no key returns 0
    got = forgetting_attention_decode(q, k, v, c_q, c_k, length, mask, window_size=window, backend="triton")
    want = forgetting_attention_decode_reference(q, k, v, c_q, c_k, length, mask, None, window)
    assert got.dtype == dtype and torch.isfinite(got).all()
    if masked:
        assert (got[2] == 0).all()
    # fp32 computes in fp32; bf16 differs from the float32 reference by the output's own rounding.
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=8e-3, atol=8e-3)
    torch.testing.assert_close(got.float(), want.float(), **tol)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_split_writes_the_output_directly(dtype):
    """A buffer of one tile: one split, whose program writes the normalised output (no merge pass)."""
    q, k, v, c_q, c_k, length = inputs(2, 30, 4, 1, 64, [19], dtype)
    got = forgetting_attention_decode(q, k, v, c_q, c_k, length, backend="triton")
    want = forgetting_attention_decode_reference(q, k, v, c_q, c_k, length)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=8e-3, atol=8e-3)
    torch.testing.assert_close(got.float(), want.float(), **tol)


@needs_kernel
def test_cached_attention_takes_the_decode_kernel_for_one_query():
    """forgetting_attention_with_cache on the Triton backend with one query per row equals its reference."""
    q, k, v, c_q, c_k, _ = inputs(2, 70, 4, 4, 16, [70])
    mask = torch.ones(2, 70, dtype=torch.bool, device=DEVICE)
    mask[0, :9] = False  # left padding
    got = forgetting_attention_with_cache(q, k, v, c_q, c_k, mask, backend="triton")
    want = forgetting_attention_with_cache_reference(q, k, v, c_q, c_k, mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_shipped_tile_compiles_for_sm90():
    """The shipped tile (128 keys x 4 warps, 2 pipeline stages) builds for sm_90 without a GPU. The
    prefetched tile is held in registers and ptxas spills some of it (480 bytes per thread with
    Triton 3.9, 2,136 with 3.6): the tile sweep on an H200 with Triton 3.6 timed it spills included,
    at 93-96% of the copy bandwidth. A spill past 4 KB would be a tile the sweep did not measure."""
    (row,) = sm90_report("fox_decode_report()")
    assert "error" not in row, row
    assert row["stack_bytes"] <= 4096 and not row["wgmma"], row


def test_bad_inputs_name_the_argument():
    q, k, v, c_q, c_k, length = inputs(2, 20, 4, 2, 16, [5])
    with pytest.raises(ValueError, match="one query per row"):
        forgetting_attention_decode(q.expand(2, 2, 4, 16), k, v, c_q, c_k, length)
    with pytest.raises(ValueError, match="length must be an integer tensor"):
        forgetting_attention_decode(q, k, v, c_q, c_k, length.float())
    with pytest.raises(ValueError, match="key_mask must be a bool"):
        forgetting_attention_decode(q, k, v, c_q, c_k, length, torch.ones(2, 20, device=DEVICE))
    with pytest.raises(ValueError, match="c_q must be"):
        forgetting_attention_decode(q, k, v, c_q[:, :, :2], c_k, length)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("batch, filled", [(8, 16384 + 17), (32, 2048 + 5)])
def test_gpu_long_cache_against_float64(batch, filled):
    """The generate() benchmark's shapes (16 heads x 128, a buffer 64 columns longer than the filled part):
    bf16 inputs within bf16 rounding of a float64 restatement, fp32 within 1e-5."""
    capacity = filled + 64
    for dtype, tol in ((torch.bfloat16, 1e-2), (torch.float32, 1e-5)):
        q, k, v, c_q, c_k, length = inputs(batch, capacity, 16, 16, 128, [filled], dtype, seed=1)
        got = forgetting_attention_decode(q, k, v, c_q, c_k, length)
        want = forgetting_attention_decode_reference(q.double(), k.double(), v.double(), c_q.double(), c_k.double(), length)
        rel = ((got.double() - want).norm() / want.norm()).item()
        assert rel <= tol, f"{dtype}: relative error {rel:.2e} > {tol}"
