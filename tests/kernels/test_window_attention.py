"""Sliding-window softmax attention (kernels/window_attention): the reference states the band, the
Triton kernels (Forgetting Attention's with the gate compiled out) and PyTorch's FlashAttention-2
with its window match it forward and backward in fp32 (Triton) and bf16 / fp16, at odd lengths,
with GQA and packed sequences; "auto" picks FlashAttention-2 for half precision and Triton for
float32; bad input is named.

CPU runs the kernels in Triton's interpreter on tiny shapes; the `gpu` tests use real lengths.
"""
from __future__ import annotations

import importlib

import pytest
import torch

from hf_hybrid.kernels._backend import triton_interpreting
from hf_hybrid.kernels.forgetting_attention import forgetting_attention
from hf_hybrid.kernels.window_attention import (
    flash_window_applies,
    window_attention,
    window_attention_decode,
    window_attention_decode_reference,
    window_attention_reference,
)

window_module = importlib.import_module("hf_hybrid.kernels.window_attention")  # the package: its name is also the op's
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(DEVICE == "cpu" and not triton_interpreting(), reason="needs CUDA or TRITON_INTERPRET=1")


def make_inputs(b, t, hq, hkv, d, dtype, device=DEVICE, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return tuple(torch.randn(b, t, h, d, generator=g).to(device, dtype) for h in (hq, hkv, hkv, hq))


def with_grads(fn, q, k, v, do):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = fn(*leaves)
    return (out, *torch.autograd.grad(out, leaves, do))


def rel_err(a, b):
    """||a - b|| / ||b||, with a small absolute floor so an all-zero gradient (window 1: dq) compares too."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / (b.norm() + 1e-2 * b.numel() ** 0.5)).item()


def test_reference_is_softmax_over_the_band():
    q, k, v, _ = make_inputs(1, 9, 1, 1, 4, torch.float32, "cpu")
    out = window_attention_reference(q, k, v, window_size=3, scale=0.5)
    i = 6  # sees keys 4, 5, 6
    probs = torch.softmax(q[0, i, 0] @ k[0, 4:7, 0].T * 0.5, 0)
    torch.testing.assert_close(out[0, i, 0], probs @ v[0, 4:7, 0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out[0, 0, 0], v[0, 0, 0])  # the first token sees only itself


def test_reference_is_forgetting_attention_without_forgetting():
    q, k, v, _ = make_inputs(2, 13, 4, 2, 8, torch.float32, "cpu")
    log_f = torch.zeros(2, 13, 4)
    torch.testing.assert_close(window_attention_reference(q, k, v, 5),
                               forgetting_attention(q, k, v, log_f, window_size=5, backend="reference"))


@needs_triton
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("b,t,hq,hkv,d,window", [
    (2, 37, 4, 2, 16, 5),    # odd length, GQA, several blocks of the interpreter's tiles
    (1, 40, 2, 2, 32, 1),    # each token alone
    (2, 33, 2, 1, 16, 100),  # a window longer than the sequence: causal
    (1, 48, 2, 2, 16, 16),   # a window on the tile boundary
])
def test_triton_matches_reference_forward_and_backward(dtype, tol, b, t, hq, hkv, d, window):
    q, k, v, do = make_inputs(b, t, hq, hkv, d, dtype)
    got = with_grads(lambda *x: window_attention(*x, window_size=window, backend="triton"), q, k, v, do)
    want = with_grads(lambda *x: window_attention_reference(*(y.float() for y in x), window), q, k, v, do.float())
    assert got[0].dtype == dtype
    for name, a, w in zip(("o", "dq", "dk", "dv"), got, want):
        assert rel_err(a, w) < tol, name


@needs_triton
def test_packed_sequences_see_only_their_own_tokens():
    q, k, v, do = make_inputs(1, 37, 2, 2, 16, torch.float32)
    cu = torch.tensor([0, 10, 11, 37], dtype=torch.int32, device=DEVICE)
    got = with_grads(lambda *x: window_attention(*x, window_size=6, cu_seqlens=cu, backend="triton"), q, k, v, do)
    want = with_grads(lambda *x: window_attention_reference(*x, 6, None, cu), q, k, v, do)
    for name, a, w in zip(("o", "dq", "dk", "dv"), got, want):
        assert rel_err(a, w) < 1e-5, name
    alone = window_attention_reference(q[:, 11:], k[:, 11:], v[:, 11:], 6)  # the last document by itself
    torch.testing.assert_close(got[0][:, 11:], alone, atol=1e-5, rtol=1e-5)


@needs_triton
def test_gated_forgetting_attention_is_unchanged_by_the_ungated_build():
    """The gate is a compile-time switch of the shared kernels: FoX with a window still matches its reference."""
    q, k, v, do = make_inputs(1, 29, 2, 1, 16, torch.float32)
    log_f = torch.nn.functional.logsigmoid(torch.randn(1, 29, 2, generator=torch.Generator().manual_seed(1))).to(DEVICE)
    got = forgetting_attention(q, k, v, log_f, window_size=7, backend="triton")
    torch.testing.assert_close(got, forgetting_attention(q, k, v, log_f, window_size=7, backend="reference"),
                               atol=1e-5, rtol=1e-5)


def test_auto_runs_the_reference_off_cuda():
    q, k, v, _ = make_inputs(1, 11, 2, 2, 8, torch.float32, "cpu")
    torch.testing.assert_close(window_attention(q, k, v, window_size=3), window_attention_reference(q, k, v, 3))


def test_flash_is_named_where_it_cannot_run():
    q, k, v, _ = make_inputs(1, 11, 2, 2, 8, torch.float32, "cpu")
    assert not flash_window_applies(q)
    with pytest.raises(ValueError, match="backend='flash' needs CUDA fp16 / bf16"):
        window_attention(q, k, v, window_size=3, backend="flash")
    with pytest.raises(ValueError, match="backend='flash' is not one of"):
        window_attention_decode(q[:, :1], k, v, torch.tensor([4]), backend="flash")


def test_auto_takes_flash_for_half_precision_and_triton_for_float32(monkeypatch):
    """On CUDA: FlashAttention-2 wherever it applies (fp16 / bf16), the Triton kernels for float32
    (computed in float32) and for what flash does not take, the reference past both."""
    from types import SimpleNamespace

    monkeypatch.setattr(window_module, "flash_window_applies", lambda q: q.dtype in (torch.float16, torch.bfloat16))

    def query(dtype, dim=128):
        return SimpleNamespace(shape=(1, 64, 4, dim), dtype=dtype, is_cuda=True, device=torch.device("cuda"))

    monkeypatch.setattr(window_module, "resolve_backend", lambda backend, device, op: "triton" if backend == "auto" else backend)
    pick = window_module._implementation
    assert pick("op", "auto", query(torch.bfloat16)) == "flash"
    assert pick("op", "auto", query(torch.float16)) == "flash"
    assert pick("op", "auto", query(torch.float32)) == "triton"
    assert pick("op", "auto", query(torch.float32, dim=24)) == "reference"
    assert pick("op", "triton", query(torch.bfloat16)) == "triton"  # named: kept
    assert pick("op", "auto", query(torch.bfloat16), with_flash=False) == "triton"  # the decode op


@pytest.mark.parametrize("kwargs,match", [
    (dict(window_size=0), "window_size must be an int >= 1"),
    (dict(window_size=2.5), "window_size must be an int >= 1"),
    (dict(window_size=True), "window_size must be an int >= 1"),
    (dict(window_size=3, cu_seqlens=torch.tensor([0.0, 11.0])), "cu_seqlens must be a 1-D integer tensor"),
    (dict(window_size=3, cu_seqlens=torch.tensor([0, 5])), "end at the sequence length 11"),
    (dict(window_size=3, backend="flex"), "backend='flex' is not one of"),
])
def test_bad_arguments_are_named(kwargs, match):
    q, k, v, _ = make_inputs(1, 11, 2, 2, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match=match):
        window_attention(q, k, v, **kwargs)


def test_mismatched_lengths_and_heads_are_named():
    q, k, v, _ = make_inputs(1, 11, 3, 2, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match="multiple of the number of key/value heads"):
        window_attention(q, k, v, window_size=3)
    q, k, v, _ = make_inputs(1, 11, 2, 2, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match="same sequence length"):
        window_attention(q, k[:, :5], v[:, :5], window_size=3)


@needs_triton
def test_an_unsupported_head_dim_is_named_for_triton():
    q, k, v, _ = make_inputs(1, 11, 2, 2, 8, torch.float32)
    with pytest.raises(ValueError, match="head_dim in"):
        window_attention(q, k, v, window_size=3, backend="triton")


@pytest.mark.slow  # seven sm_90 builds: about two minutes of ptxas on two cores
def test_kernels_compile_for_sm90_with_and_without_the_gate():
    """Forgetting Attention's portable kernels with a window, gated (FoX) and not (this op), and the
    ungated decode kernel build for the H100 without a GPU, with their products on wgmma that
    ptxas keeps asynchronous. (The portable tiles spill with head_dim 128, gated or not.)"""
    from sm90_check import sm90_report

    rows = sm90_report("window_attention_report()")
    assert len(rows) == 7 and all("error" not in row for row in rows), rows
    assert all(not row["wgmma_serialized"] for row in rows), rows
    assert all(row["stack_bytes"] <= 4096 for row in rows), rows


# ---------------------------------------------------------------- decode step


def test_decode_reference_is_the_last_row_of_the_forward():
    """A query at position n - 1 over buffers filled up to n equals the causal forward's last row."""
    q, k, v, _ = make_inputs(2, 13, 4, 2, 8, torch.float32, "cpu")
    n = 9
    padded_k, padded_v = (torch.cat([x[:, :n], torch.randn_like(x[:, n:]) * 100], 1) for x in (k, v))  # unread
    for window in (None, 4):
        got = window_attention_decode_reference(q[:, n - 1 : n], padded_k, padded_v, torch.tensor([n]), window_size=window)
        want = window_attention_reference(q[:, :n], k[:, :n], v[:, :n], window or n)[:, -1:]
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@needs_triton
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window", [None, 5])
def test_decode_triton_matches_reference(dtype, tol, window):
    b, t, hq, hkv, d = 3, 300, 4, 2, 16
    q, k, v, _ = make_inputs(b, t, hq, hkv, d, dtype)
    q = q[:, :1]
    # The cache's layout: [B, HKV, T, D] buffers, read transposed.
    k_buffer, v_buffer = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    length = torch.tensor([1, 170, 299], device=DEVICE)
    got = window_attention_decode(q, k_buffer.transpose(1, 2), v_buffer.transpose(1, 2), length, window_size=window,
                                  backend="triton")
    want = window_attention_decode_reference(q.float(), k.float(), v.float(), length, window_size=window)
    assert got.dtype == dtype and rel_err(got, want) < tol


@needs_triton
def test_decode_over_a_ring_reads_every_slot():
    """A ring buffer (slots in any order) passes a length past its size: every slot is seen, once."""
    q, k, v, _ = make_inputs(2, 40, 2, 2, 16, torch.float32)
    q = q[:, :1]
    ring = torch.randperm(40, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    got = window_attention_decode(q, k[:, ring], v[:, ring], torch.tensor([57], device=DEVICE), backend="triton")
    want = window_attention_decode_reference(q, k, v, torch.tensor([40], device=DEVICE))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("change,match", [
    (dict(queries=2), "one query per row"),
    (dict(length=torch.tensor([3.0])), "length must be an integer tensor"),
    (dict(length=torch.tensor([3, 4, 5])), "length must be an integer tensor"),
    (dict(window_size=0), "window_size must be None or an int >= 1"),
])
def test_decode_bad_arguments_are_named(change, match):
    q, k, v, _ = make_inputs(2, 11, 2, 2, 8, torch.float32, "cpu")
    q = q[:, : change.get("queries", 1)]
    with pytest.raises(ValueError, match=match):
        window_attention_decode(q, k, v, change.get("length", torch.tensor([4])), window_size=change.get("window_size"))


# ---------------------------------------------------------------- real GPU shapes


@pytest.mark.gpu
@pytest.mark.parametrize("t,window", [(8192, 1024), (4099, 513), (2053, 4096)])
def test_gpu_bf16_real_shapes(t, window):
    """RAT-SWA's window layers at the 1.3B shape (16 heads x 128): bf16 against float32 SDPA with the band mask."""
    q, k, v, do = make_inputs(1, t, 16, 16, 128, torch.bfloat16, "cuda")
    got = with_grads(lambda *x: window_attention(*x, window_size=window), q, k, v, do)
    i = torch.arange(t, device="cuda")
    band = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window)

    def sdpa(q, k, v):
        out = torch.nn.functional.scaled_dot_product_attention(*(x.float().transpose(1, 2) for x in (q, k, v)), attn_mask=band)
        return out.transpose(1, 2)

    want = with_grads(sdpa, q, k, v, do.float())
    for name, a, w in zip(("o", "dq", "dk", "dv"), got, want):
        assert rel_err(a, w) < 2e-2, name


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b,t,hq,hkv,window", [(1, 4099, 16, 4, 513), (3, 1000, 8, 8, 1), (2, 777, 4, 2, 2048)])
def test_gpu_flash_matches_reference_and_triton(dtype, b, t, hq, hkv, window):
    """FlashAttention-2's window against the float32 reference and the Triton kernels, forward and
    backward: odd lengths, GQA, several rows, a window of the token alone and one past the sequence."""
    q, k, v, do = make_inputs(b, t, hq, hkv, 128, dtype, "cuda")
    got = with_grads(lambda *x: window_attention(*x, window_size=window, backend="flash"), q, k, v, do)
    triton_way = with_grads(lambda *x: window_attention(*x, window_size=window, backend="triton"), q, k, v, do)
    want = with_grads(lambda *x: window_attention_reference(*(y.float() for y in x), window), q, k, v, do.float())
    for name, a, tr, w in zip(("o", "dq", "dk", "dv"), got, triton_way, want):
        assert rel_err(a, w) < 1e-2, name
        assert rel_err(a, w) < 2 * rel_err(tr, w) + 1e-3, name  # no less exact than the Triton kernels
    assert window_attention(q, k, v, window_size=window).equal(got[0])  # "auto" takes it for half precision


@pytest.mark.gpu
def test_gpu_flash_packed_sequences_see_only_their_own_tokens():
    q, k, v, do = make_inputs(1, 3001, 16, 4, 128, torch.bfloat16, "cuda")
    cu = torch.tensor([0, 1000, 1001, 2500, 3001], device="cuda", dtype=torch.int32)
    got = with_grads(lambda *x: window_attention(*x, window_size=700, cu_seqlens=cu, backend="flash"), q, k, v, do)
    want = with_grads(lambda *x: window_attention_reference(*(y.float() for y in x), 700, None, cu), q, k, v, do.float())
    for name, a, w in zip(("o", "dq", "dk", "dv"), got, want):
        assert rel_err(a, w) < 1e-2, name


@pytest.mark.gpu
def test_gpu_float32_stays_on_triton_in_float32():
    q, k, v, do = make_inputs(1, 300, 4, 2, 64, torch.float32, "cuda")
    got = with_grads(lambda *x: window_attention(*x, window_size=33), q, k, v, do)
    want = with_grads(lambda *x: window_attention_reference(*x, 33), q, k, v, do)
    for name, a, w in zip(("o", "dq", "dk", "dv"), got, want):
        assert rel_err(a, w) < 1e-4, name


@pytest.mark.gpu
@pytest.mark.parametrize("batch,keys,filled", [(8, 16384, 16000), (256, 4160, 4100), (32, 2048, 7)])
def test_gpu_decode_bf16_real_shapes(batch, keys, filled):
    """RATTENTION's global layers at the largest batch and the decode benches' shapes (16 query
    heads x 128 over 4 key heads, bf16): the kernel against the float32 reference."""
    q = torch.randn(batch, 1, 16, 128, device="cuda", dtype=torch.bfloat16)
    k_buffer, v_buffer = (torch.randn(batch, 4, keys, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    length = torch.tensor([filled], device="cuda")
    got = window_attention_decode(q, k_buffer.transpose(1, 2), v_buffer.transpose(1, 2), length)
    want = window_attention_decode_reference(q.float(), k_buffer.transpose(1, 2).float(), v_buffer.transpose(1, 2).float(), length)
    assert rel_err(got, want) < 1e-2
