"""Fused RAT keys/values (gate sigmoid + both chunk recurrences + inter-chunk RoPE) == the op-by-op
reference, forward and every gradient (k groups, v, gate logits, gate bias)."""
from __future__ import annotations

import pytest
import torch

from hf_hybrid.kernels._backend import triton_interpreting
from hf_hybrid.kernels.gated_recurrence import rat_keys_values, rat_keys_values_reference
from hf_hybrid.kernels._common import expand_groups
from hf_hybrid.kernels.gated_recurrence.reference import gated_recurrence_reference
from hf_hybrid.layers.rotary import RotaryEmbedding
from sm90_check import sm90_report

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(DEVICE == "cpu" and not triton_interpreting(), reason="needs CUDA or TRITON_INTERPRET=1")


def make_inputs(batch, seq, groups, heads, dim, chunk, dtype=torch.float32, rope=True, device=DEVICE, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def leaf(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype).requires_grad_()

    k, v, logits = leaf(batch, seq, groups, dim), leaf(batch, seq, heads, dim), leaf(batch, seq, heads, dim)
    bias = leaf(heads * dim)
    chunk_index = torch.arange(seq, device=device)[None] // chunk
    cos_sin = RotaryEmbedding(dim, 10000.0)(chunk_index) if rope else None
    return (k, v, logits, bias), cos_sin


def outputs_and_grads(fn, leaves, seed=1):
    outs = fn()
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(o.shape, generator=gen).to(o.device, o.dtype) for o in outs]
    return outs, torch.autograd.grad(outs, leaves, weights)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def test_reference_is_the_layer_math_written_out():
    """k~ and v~ are the chunk-restarting recurrences with the float32 sigmoid gate; k_rot is k~ rotated."""
    (k, v, logits, bias), cos_sin = make_inputs(1, 11, 2, 4, 8, 4, device="cpu")
    k_rot, v_tilde = rat_keys_values_reference(k, v, logits, bias, 4, None)
    gate = torch.sigmoid(logits + bias.view(4, 8))
    assert torch.equal(v_tilde, gated_recurrence_reference(v, gate, 4))
    assert torch.equal(k_rot, gated_recurrence_reference(expand_groups(k, 4), gate, 4))
    assert torch.equal(expand_groups(k, 4)[:, :, 3], k[:, :, 1])  # head 3 reads group 3 % 2
    rotated, _ = rat_keys_values_reference(k, v, logits, bias, 4, cos_sin)
    assert torch.allclose(rotated[:, :4], k_rot[:, :4])  # chunk 0: angle 0
    assert not torch.allclose(rotated[:, 4:], k_rot[:, 4:])


CASES = [
    # batch, seq, groups, heads, dim, chunk, rope
    (2, 37, 2, 4, 16, 8, True),  # ragged last chunk, GQA-style groups
    (1, 32, 1, 2, 32, 16, True),  # whole chunks, one group
    (2, 5, 4, 4, 16, 8, False),  # shorter than a chunk, one head per group, NoPE
    (1, 19, 2, 2, 16, 1, True),  # L = 1: every token its own chunk (k~ = (1 - g) k)
    (1, 20, 2, 4, 64, 8, True),  # head_dim 64: the backward splits each half into column slices
]


@needs_triton
@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}t{}g{}h{}d{}L{}{}".format(*c[:6], "rope" if c[6] else "nope"))
def test_triton_equals_reference_fp32(case):
    batch, seq, groups, heads, dim, chunk, rope = case
    leaves, cos_sin = make_inputs(batch, seq, groups, heads, dim, chunk, rope=rope)
    got, got_grads = outputs_and_grads(lambda: rat_keys_values(*leaves, chunk, cos_sin, backend="triton"), leaves)
    want, want_grads = outputs_and_grads(lambda: rat_keys_values_reference(*leaves, chunk, cos_sin), leaves)
    for name, a, b in zip(("k_rot", "v~"), got, want):
        assert rel(a, b) < 1e-5, name
    for name, a, b in zip(("d k_groups", "d v", "d gate_logits", "d gate_bias"), got_grads, want_grads):
        assert rel(a, b) < 1e-5, name


@needs_triton
def test_triton_bf16_within_rounding():
    leaves, cos_sin = make_inputs(2, 24, 2, 4, 16, 8, dtype=torch.bfloat16)
    exact_leaves = [x.detach().double().requires_grad_() for x in leaves]
    got, got_grads = outputs_and_grads(lambda: rat_keys_values(*leaves, 8, cos_sin, backend="triton"), leaves)
    exact_cs = tuple(t.double() for t in cos_sin)
    want, want_grads = outputs_and_grads(lambda: rat_keys_values_reference(*exact_leaves, 8, exact_cs), exact_leaves)
    assert got[0].dtype == got[1].dtype == torch.bfloat16
    for a, b in zip(list(got) + list(got_grads), list(want) + list(want_grads)):
        assert rel(a, b) < 2e-2


def test_auto_off_cuda_is_the_reference_and_errors_name_the_argument():
    (k, v, logits, bias), cos_sin = make_inputs(1, 6, 2, 4, 8, 4, device="cpu")
    if not torch.cuda.is_available():
        auto = rat_keys_values(k, v, logits, bias, 4, cos_sin)
        ref = rat_keys_values_reference(k, v, logits, bias, 4, cos_sin)
        assert all(torch.equal(a, b) for a, b in zip(auto, ref))
    with pytest.raises(ValueError, match="gate_logits"):
        rat_keys_values(k, v, logits[:, :, :2], bias, 4)
    with pytest.raises(ValueError, match="k_groups"):
        rat_keys_values(k[:, :, :1].expand(1, 6, 3, 8), v, logits, bias, 4)
    with pytest.raises(ValueError, match="gate_bias"):
        rat_keys_values(k, v, logits, bias[:-1], 4)
    with pytest.raises(ValueError, match="chunk_size"):
        rat_keys_values(k, v, logits, bias, 0)
    with pytest.raises(ValueError, match="cos_sin"):
        rat_keys_values(k, v, logits, bias, 4, (cos_sin[0][:, :3], cos_sin[1]))


@needs_triton
def test_explicit_triton_refuses_a_chunk_it_cannot_tile():
    (k, v, logits, bias), _ = make_inputs(1, 6, 2, 4, 16, 3)
    with pytest.raises(ValueError, match="powers of two"):
        rat_keys_values(k, v, logits, bias, 3, backend="triton")


@needs_triton
@pytest.mark.parametrize("chunk", [32, pytest.param(64, marks=pytest.mark.slow)])
def test_chunks_past_the_fused_kernel_take_the_op_by_op_triton_path(chunk):
    """L > MAX_FUSED_CHUNK: explicit 'triton' refuses (naming the way out), and the op-by-op Triton
    composition the 'auto' backend uses there equals the reference, forward and every gradient."""
    from hf_hybrid.kernels.gated_recurrence.rat_keys_values import MAX_FUSED_CHUNK, rat_keys_values_unfused

    assert chunk > MAX_FUSED_CHUNK
    leaves, cos_sin = make_inputs(2, 2 * chunk + 5, 2, 4, 16, chunk)
    with pytest.raises(ValueError, match="backend='auto'"):
        rat_keys_values(*leaves, chunk, cos_sin, backend="triton")
    got, got_grads = outputs_and_grads(lambda: rat_keys_values_unfused(*leaves, chunk, cos_sin, backend="triton"), leaves)
    want, want_grads = outputs_and_grads(lambda: rat_keys_values_reference(*leaves, chunk, cos_sin), leaves)
    for a, b in zip(list(got) + list(got_grads), list(want) + list(want_grads)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [64, 128])
def test_gpu_auto_backend_never_falls_back_to_the_reference_for_long_chunks(monkeypatch, chunk):
    import importlib

    module = importlib.import_module("hf_hybrid.kernels.gated_recurrence.rat_keys_values")  # the package re-exports the function under this name
    def refuse(*args, **kwargs):
        raise AssertionError("the PyTorch reference ran on CUDA")

    monkeypatch.setattr(module, "rat_keys_values_reference", refuse)
    leaves, cos_sin = make_inputs(2, 1000, 2, 8, 64, chunk, dtype=torch.bfloat16)
    exact_leaves = [x.detach().float().requires_grad_() for x in leaves]
    got, got_grads = outputs_and_grads(lambda: rat_keys_values(*leaves, chunk, cos_sin), leaves)
    monkeypatch.undo()
    want, want_grads = outputs_and_grads(lambda: rat_keys_values_reference(*exact_leaves, chunk, cos_sin), exact_leaves)
    for a, b in zip(list(got) + list(got_grads), list(want) + list(want_grads)):
        assert rel(a, b) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("seq", [4096, 1000])
def test_gpu_bf16_real_shapes(seq):
    """RAT(L=16) layer shape: 16 heads x 128, 2 key groups, bf16, against the float32 reference."""
    leaves, cos_sin = make_inputs(2, seq, 2, 16, 128, 16, dtype=torch.bfloat16)
    exact_leaves = [x.detach().float().requires_grad_() for x in leaves]
    got, got_grads = outputs_and_grads(lambda: rat_keys_values(*leaves, 16, cos_sin, backend="triton"), leaves)
    want, want_grads = outputs_and_grads(lambda: rat_keys_values_reference(*exact_leaves, 16, cos_sin), exact_leaves)
    for a, b in zip(list(got) + list(got_grads), list(want) + list(want_grads)):
        assert rel(a, b) < 2e-2


def test_kernels_compile_for_the_h100_at_the_shipped_warps_without_spilling_much():
    from hf_hybrid.kernels.gated_recurrence import rat_keys_values_triton as kv

    rows = sm90_report(f"rat_keys_values_report(({kv.FWD_WARPS}, {kv.BWD_WARPS}))")
    shipped = [r for r in rows if r["num_warps"] == (kv.FWD_WARPS if r["kernel"] == "_fwd_kernel" else kv.BWD_WARPS)]
    assert {r["kernel"] for r in shipped} == {"_fwd_kernel", "_bwd_kernel"}
    for row in shipped:
        assert "error" not in row, row
        assert row["regs"] <= 255 and row["stack_bytes"] <= 64, row
