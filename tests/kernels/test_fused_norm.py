"""Fused per-head norms: RMSNorm + RoPE (QK-norm of the SWA branch) and the branch-norm sum.

The references are checked bit for bit against the layer modules (RMSNorm, apply_rotary); the
Triton kernels (CPU interpreter here, real shapes under the `gpu` marker) against the references,
forward and every gradient, float32 and bfloat16, odd row counts, GQA head counts, strided views.
"""
from __future__ import annotations

import pytest
import torch

from hf_hybrid.kernels._backend import triton_interpreting
from hf_hybrid.kernels.fused_norm import (
    branch_norm_sum,
    branch_norm_sum_reference,
    rms_norm_rotary,
    rms_norm_rotary_reference,
    rotary,
    rotary_reference,
)
from hf_hybrid.layers.fused_norms import norm_backend, qk_norm_rotary, sum_branch_norms
from hf_hybrid.layers.norm import RMSNorm
from hf_hybrid.layers.rotary import RotaryEmbedding, apply_rotary
from sm90_check import sm90_report

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    DEVICE == "cpu" and not triton_interpreting(), reason="needs CUDA or TRITON_INTERPRET=1"
)




def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def rows(batch, seq, heads, dim, dtype=torch.float32, layout="contiguous", device=DEVICE):
    """(leaf, x): x a [B, T, H, D] view of the leaf laid out as the layer sees it: contiguous, a
    slice of a wider projection output (fused-QKV style), or a transposed [B, H, T, D] attention
    output. Gradients are taken w.r.t. the leaf, so they cover the strided writes too."""
    shape = {
        "slice": (batch, seq, (heads + 3) * dim),
        "transposed": (batch, heads, seq, dim),
        "contiguous": (batch, seq, heads, dim),
    }[layout]
    leaf = torch.randn(shape, device=device).to(dtype).requires_grad_()
    return leaf, as_rows(leaf, layout, heads, dim)


def as_rows(leaf, layout, heads, dim):
    if layout == "slice":
        return leaf[..., dim : (heads + 1) * dim].unflatten(-1, (heads, dim))
    return leaf.transpose(1, 2) if layout == "transposed" else leaf


def float_copy(leaf, layout, heads, dim):
    """A float32 leaf with the same values and the same view, for float32 'exact' gradients."""
    leaf32 = leaf.detach().float().requires_grad_()
    return leaf32, as_rows(leaf32, layout, heads, dim)


def norm_weight(heads, dim, dtype=torch.float32, device=DEVICE):
    return (1.0 + 0.3 * torch.randn(heads, dim, device=device)).to(dtype).requires_grad_()


def rotary_tables(batch, seq, dim, device=DEVICE, shared=False):
    positions = torch.arange(seq, device=device).expand(1 if shared else batch, seq) + 3
    return RotaryEmbedding(dim, 10000.0)(positions)


def output_and_grads(fn, wrt, grad_layout="contiguous"):
    """fn() and the gradients of <fn(), dy> for a fixed random dy (optionally a strided dy)."""
    out = fn()
    gen = torch.Generator().manual_seed(11)
    dy = torch.randn(out.shape, generator=gen).to(out.device)
    if grad_layout == "transposed":
        dy = dy.transpose(1, 2).contiguous().transpose(1, 2)
    grads = torch.autograd.grad(out, wrt, dy.to(out.dtype))
    return out, grads


def assert_bit_identical(fn, reference_fn, wrt):
    """fn and reference_fn give the same output and the same gradients, bit for bit."""
    out, grads = output_and_grads(fn, wrt)
    out_ref, grads_ref = output_and_grads(reference_fn, wrt)
    assert torch.equal(out, out_ref)
    for a, b in zip(grads, grads_ref):
        assert torch.equal(a, b)


def assert_close_all(got, want, tol, names):
    for name, a, b in zip(names, got, want):
        assert a.dtype == b.dtype, name
        assert rel(a, b) < tol, (name, rel(a, b))


# ---------------------------------------------------------------- references == the layer today


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_rope", [True, False])
def test_qk_helper_reference_is_the_layer_math_bit_for_bit(dtype, with_rope):
    torch.manual_seed(0)
    q_leaf, q = rows(2, 9, 8, 16, dtype, device="cpu")
    k_leaf, k = rows(2, 9, 2, 16, dtype, device="cpu")
    q_norm, k_norm = RMSNorm((8, 16), eps=1e-6).to(dtype), RMSNorm((2, 16), eps=1e-6).to(dtype)
    with torch.no_grad():
        q_norm.weight.mul_(torch.rand(8, 16) + 0.5)
        k_norm.weight.mul_(torch.rand(2, 16) + 0.5)
    cos_sin = rotary_tables(2, 9, 16, device="cpu") if with_rope else None
    wrt = (q_leaf, k_leaf, q_norm.weight, k_norm.weight)

    def layer_today():
        return torch.cat([apply_rotary(q_norm(q), cos_sin), apply_rotary(k_norm(k), cos_sin)], 2)

    def helper():
        return torch.cat(qk_norm_rotary(q, k, q_norm, k_norm, cos_sin, backend="reference"), 2)

    assert_bit_identical(helper, layer_today, wrt)


def test_qk_helper_without_norm_modules_is_rope_alone():
    q, k = torch.randn(1, 5, 4, 8), torch.randn(1, 5, 2, 8)
    cos_sin = rotary_tables(1, 5, 8, device="cpu")
    q2, k2 = qk_norm_rotary(q, k, None, None, cos_sin, backend="reference")
    assert torch.equal(q2, apply_rotary(q, cos_sin)) and torch.equal(k2, apply_rotary(k, cos_sin))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("branches", ["both", "swa", "rla"])
def test_branch_helper_reference_is_the_layer_math_bit_for_bit(dtype, branches):
    torch.manual_seed(1)
    a_leaf, o_swa = rows(2, 7, 4, 16, dtype, layout="transposed", device="cpu")
    b_leaf, o_rla = rows(2, 7, 4, 16, dtype, device="cpu")
    swa_norm, rla_norm = RMSNorm((4, 16), eps=1e-8).to(dtype), RMSNorm((4, 16), eps=1e-8).to(dtype)
    with torch.no_grad():
        swa_norm.weight.mul_(torch.rand(4, 16) + 0.5)
        rla_norm.weight.mul_(torch.rand(4, 16) + 0.5)
    use_swa, use_rla = branches in ("both", "swa"), branches in ("both", "rla")
    wrt = [t for t, used in ((a_leaf, use_swa), (swa_norm.weight, use_swa), (b_leaf, use_rla), (rla_norm.weight, use_rla)) if used]

    def layer_today():  # RattentionLocalAttention.forward's output sum
        out = 0
        if use_swa:
            out = swa_norm(o_swa)
        if use_rla:
            out = out + rla_norm(o_rla)
        return out

    def helper():
        return sum_branch_norms(
            o_swa if use_swa else None, swa_norm if use_swa else None,
            o_rla if use_rla else None, rla_norm if use_rla else None, backend="reference",
        )

    assert_bit_identical(helper, layer_today, wrt)


def test_auto_off_cuda_is_the_reference():
    x, w = torch.randn(1, 4, 2, 8), torch.rand(2, 8)
    cos_sin = rotary_tables(1, 4, 8, device="cpu")
    assert torch.equal(rms_norm_rotary(x, w, 1e-6, cos_sin, backend="auto"), rms_norm_rotary_reference(x, w, 1e-6, cos_sin))
    assert norm_backend("chunked") == "auto" and norm_backend("triton") == "triton" and norm_backend("reference") == "reference"
    # decode-sized inputs stay on PyTorch under "auto" (launch cost), never under an explicit "triton"
    assert norm_backend("auto", tokens=64) == "reference" and norm_backend("auto", tokens=4096) == "auto"
    assert norm_backend("triton", tokens=1) == "triton" and norm_backend("chunked", tokens=8) == "reference"


# ---------------------------------------------------------------- Triton: RMSNorm + RoPE


ROTARY_CASES = [
    # batch, seq, heads, dim, rope ("batch" tables, "shared" [1, T, 1, D], None), x layout, dy layout, eps
    (2, 7, 4, 16, "batch", "contiguous", "contiguous", 1e-6),
    (1, 9, 16, 32, "batch", "slice", "contiguous", 1e-6),  # 16 query heads, a fused-QKV slice
    (3, 5, 4, 32, "shared", "transposed", "transposed", 1e-6),
    (2, 7, 4, 16, None, "slice", "contiguous", 1e-6),
    (1, 11, 16, 16, None, "contiguous", "transposed", 0.0),  # eps = 0: ragged tail rows stay finite
]


@needs_triton
@pytest.mark.parametrize("batch,seq,heads,dim,rope,layout,grad_layout,eps", ROTARY_CASES)
def test_rms_norm_rotary_triton_matches_reference_fp32(batch, seq, heads, dim, rope, layout, grad_layout, eps):
    torch.manual_seed(2)
    leaf, x = rows(batch, seq, heads, dim, layout=layout)
    weight = norm_weight(heads, dim)
    cos_sin = None if rope is None else rotary_tables(batch, seq, dim, shared=rope == "shared")

    def run(backend):
        return output_and_grads(lambda: rms_norm_rotary(x, weight, eps, cos_sin, backend=backend), (leaf, weight), grad_layout)

    out, grads = run("triton")
    out2, grads2 = run("reference")
    assert out.dtype == x.dtype and out.shape == x.shape
    assert rel(out, out2) < 1e-5
    assert_close_all(grads, grads2, 1e-5, ("x", "weight"))


@needs_triton
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("layout,shared", [("contiguous", True), ("slice", False), ("transposed", True)])
def test_rotary_triton_matches_reference(dtype, tol, layout, shared):
    """RoPE alone (the norm kernels without the norm): output and input gradient, odd length,
    strided views, per-row or shared tables; None tables give x back."""
    torch.manual_seed(4)
    leaf, x = rows(2, 13, 3, 32, dtype, layout=layout)
    cos_sin = rotary_tables(2, 13, 32, shared=shared)
    out, grads = output_and_grads(lambda: rotary(x, cos_sin, backend="triton"), (leaf,))
    leaf32, x32 = float_copy(leaf, layout, 3, 32)
    exact, exact_grads = output_and_grads(lambda: rotary_reference(x32, cos_sin), (leaf32,))
    assert out.dtype == dtype and out.shape == x.shape
    assert rel(out, exact) < tol and rel(grads[0], exact_grads[0]) < tol
    assert rotary(x, None, backend="triton") is x


@needs_triton
@pytest.mark.parametrize("heads,rope", [(16, True), (4, True), (4, False)])
def test_rms_norm_rotary_triton_bf16(heads, rope):
    """bfloat16 in and out (bfloat16 weight, as in a bf16 model): within bf16 rounding of the
    float32 math, and no farther from it than the reference, which rounds twice."""
    torch.manual_seed(3)
    leaf, x = rows(2, 13, heads, 32, torch.bfloat16, layout="slice")
    weight = norm_weight(heads, 32, torch.bfloat16)
    cos_sin = rotary_tables(2, 13, 32) if rope else None
    wrt = (leaf, weight)
    out, grads = output_and_grads(lambda: rms_norm_rotary(x, weight, 1e-6, cos_sin, backend="triton"), wrt)
    out_ref, grads_ref = output_and_grads(lambda: rms_norm_rotary(x, weight, 1e-6, cos_sin, backend="reference"), wrt)
    leaf32, x32 = float_copy(leaf, "slice", heads, 32)
    w32 = weight.detach().float().requires_grad_()
    exact, exact_grads = output_and_grads(lambda: rms_norm_rotary_reference(x32, w32, 1e-6, cos_sin), (leaf32, w32))
    assert out.dtype == torch.bfloat16 and grads[0].dtype == torch.bfloat16 and grads[1].dtype == torch.bfloat16
    assert rel(out, exact) < 1e-2
    if not triton_interpreting():
        # Rounding once lands nearer the float32 result than rounding twice. (Triton's CPU
        # interpreter truncates float32 -> bfloat16 instead of rounding to nearest, so only the
        # compiled kernel is held to this.)
        assert rel(out, exact) <= 1.1 * rel(out_ref, exact)
    assert rel(grads[0], exact_grads[0]) < 2e-2 and rel(grads[1], exact_grads[1]) < 2e-2
    assert rel(grads[0], grads_ref[0]) < 2e-2


@needs_triton
def test_weight_gradient_is_deterministic():
    torch.manual_seed(4)
    leaf, x = rows(2, 23, 4, 16)
    weight = norm_weight(4, 16)
    cos_sin = rotary_tables(2, 23, 16)
    first = output_and_grads(lambda: rms_norm_rotary(x, weight, 1e-6, cos_sin, backend="triton"), (leaf, weight))[1]
    second = output_and_grads(lambda: rms_norm_rotary(x, weight, 1e-6, cos_sin, backend="triton"), (leaf, weight))[1]
    assert torch.equal(first[1], second[1]) and torch.equal(first[0], second[0])


# ---------------------------------------------------------------- Triton: branch-norm sum


BRANCH_CASES = [
    # batch, seq, heads, dim, branches, a layout, eps
    (2, 7, 4, 16, "both", "transposed", 1e-8),
    (1, 9, 16, 32, "both", "contiguous", (1e-8, 0.5)),  # eps large enough to tell the branches apart
    (3, 5, 4, 16, "a", "slice", (0.25, 3.0)),
    (1, 11, 16, 16, "b", "transposed", (3.0, 0.0)),  # eps_b = 0: ragged tail rows stay finite
]


@needs_triton
@pytest.mark.parametrize("batch,seq,heads,dim,branches,layout,eps", BRANCH_CASES)
def test_branch_norm_sum_triton_matches_reference_fp32(batch, seq, heads, dim, branches, layout, eps):
    torch.manual_seed(5)
    a_leaf, a = rows(batch, seq, heads, dim, layout=layout)
    b_leaf, b = rows(batch, seq, heads, dim)
    weight_a, weight_b = norm_weight(heads, dim), norm_weight(heads, dim)
    use_a, use_b = branches in ("both", "a"), branches in ("both", "b")
    args = (a if use_a else None, weight_a if use_a else None, b if use_b else None, weight_b if use_b else None)
    wrt = [t for t, used in ((a_leaf, use_a), (weight_a, use_a), (b_leaf, use_b), (weight_b, use_b)) if used]

    def run(backend):
        return output_and_grads(lambda: branch_norm_sum(*args, eps, backend=backend), wrt)

    out, grads = run("triton")
    out2, grads2 = run("reference")
    assert rel(out, out2) < 1e-5
    names = [n for n, used in (("a", use_a), ("weight_a", use_a), ("b", use_b), ("weight_b", use_b)) if used]
    assert_close_all(grads, grads2, 1e-5, names)


@needs_triton
def test_branch_norm_sum_triton_bf16():
    torch.manual_seed(6)
    a_leaf, a = rows(2, 13, 4, 32, torch.bfloat16, layout="transposed")
    b_leaf, b = rows(2, 13, 4, 32, torch.bfloat16)
    weight_a, weight_b = norm_weight(4, 32), norm_weight(4, 32)  # float32 weights (mixed precision)
    wrt = (a_leaf, weight_a, b_leaf, weight_b)
    out, grads = output_and_grads(lambda: branch_norm_sum(a, weight_a, b, weight_b, 1e-8, backend="triton"), wrt)
    (a_leaf32, a32), (b32, _) = float_copy(a_leaf, "transposed", 4, 32), float_copy(b_leaf, "contiguous", 4, 32)
    exact, exact_grads = output_and_grads(
        lambda: branch_norm_sum_reference(a32, weight_a, b32, weight_b, 1e-8), (a_leaf32, weight_a, b32, weight_b)
    )
    assert out.dtype == torch.bfloat16 and rel(out, exact) < 1e-2
    for name, got, want in zip(("a", "weight_a", "b", "weight_b"), grads, exact_grads):
        assert got.dtype == (torch.bfloat16 if name in "ab" else torch.float32), name
        assert rel(got, want) < 2e-2, name


@needs_triton
def test_layer_helpers_triton_within_tolerance_of_reference():
    torch.manual_seed(7)
    q_leaf, q = rows(2, 9, 16, 16, layout="slice")
    k_leaf, k = rows(2, 9, 4, 16, layout="slice")
    q_norm, k_norm = RMSNorm((16, 16)).to(DEVICE), RMSNorm((4, 16)).to(DEVICE)
    swa_norm, rla_norm = RMSNorm((16, 16), eps=1e-8).to(DEVICE), RMSNorm((16, 16), eps=1e-8).to(DEVICE)
    o_rla_leaf, o_rla = rows(2, 9, 16, 16)
    cos_sin = rotary_tables(2, 9, 16)
    params = (q_leaf, k_leaf, o_rla_leaf, q_norm.weight, k_norm.weight, swa_norm.weight, rla_norm.weight)

    def layer_piece(backend):
        q_swa, k_swa = qk_norm_rotary(q, k, q_norm, k_norm, cos_sin, backend)
        o_swa = q_swa * k_swa.repeat_interleave(4, dim=2)  # stands in for the attention
        return sum_branch_norms(o_swa, swa_norm, o_rla, rla_norm, backend)

    out, grads = output_and_grads(lambda: layer_piece("triton"), params)
    out2, grads2 = output_and_grads(lambda: layer_piece("reference"), params)
    assert rel(out, out2) < 1e-5
    assert_close_all(grads, grads2, 1e-4, ("q", "k", "o_rla", "q_norm", "k_norm", "swa_norm", "rla_norm"))


# ---------------------------------------------------------------- errors


def test_bad_inputs_raise_clear_errors():
    x, w = torch.randn(1, 4, 2, 8), torch.ones(2, 8)
    cos_sin = rotary_tables(1, 4, 8, device="cpu")
    with pytest.raises(ValueError, match=r"weight must be \[heads, head_dim\] = \(2, 8\)"):
        rms_norm_rotary(x, torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="x must be a floating"):
        rms_norm_rotary(torch.randn(4, 2, 8), w, 1e-6)
    with pytest.raises(ValueError, match="cos_sin's cos must broadcast"):
        rms_norm_rotary(x, w, 1e-6, (torch.ones(1, 5, 1, 8), torch.ones(1, 5, 1, 8)))
    with pytest.raises(ValueError, match="cos_sin's sin must broadcast"):
        rms_norm_rotary(x, w, 1e-6, (cos_sin[0], torch.ones(1, 4, 2, 8)))
    with pytest.raises(ValueError, match="cos_sin must be None or a"):
        rms_norm_rotary(x, w, 1e-6, cos_sin[0])
    with pytest.raises(ValueError, match="head_dim must be even"):
        rms_norm_rotary(torch.randn(1, 4, 2, 7), torch.ones(2, 7), 1e-6, (torch.ones(1, 4, 1, 7),) * 2)
    with pytest.raises(ValueError, match="eps"):
        rms_norm_rotary(x, w, -1.0)
    with pytest.raises(ValueError, match="eps"):
        rms_norm_rotary(x, w, (1e-6, 1e-6))
    with pytest.raises(ValueError, match="backend"):
        rms_norm_rotary(x, w, 1e-6, backend="cuda")
    with pytest.raises(ValueError, match="both be None"):
        branch_norm_sum(None, None, None, None, 1e-8)
    with pytest.raises(ValueError, match="weight_b is given but b is None"):
        branch_norm_sum(x, w, None, w, 1e-8)
    with pytest.raises(ValueError, match=r"weight_a must be \[heads, head_dim\]"):
        branch_norm_sum(x, torch.ones(3, 8), x, w, 1e-8)
    with pytest.raises(ValueError, match="a and b must share shape and dtype"):
        branch_norm_sum(x, w, x.double(), w, 1e-8)
    with pytest.raises(ValueError, match="eps"):
        branch_norm_sum(x, w, x, w, (1e-8,))


@needs_triton
def test_triton_refuses_what_it_cannot_do():
    x, w = torch.randn(1, 4, 2, 8, device=DEVICE), torch.ones(2, 8, device=DEVICE)
    cos, sin = rotary_tables(1, 4, 8)
    with pytest.raises(ValueError, match="cos/sin that require grad"):
        rms_norm_rotary(x, w, 1e-6, (cos.requires_grad_(), sin), backend="triton")
    with pytest.raises(ValueError, match="dtype"):
        rms_norm_rotary(x.double(), w, 1e-6, backend="triton")
    empty = torch.randn(1, 0, 2, 8, device=DEVICE)
    assert rms_norm_rotary(empty, w, 1e-6, backend="triton").shape == empty.shape


# ---------------------------------------------------------------- real GPU shapes


@pytest.mark.gpu
@pytest.mark.parametrize("heads,seq,rope", [(16, 4096, True), (4, 4096, True), (16, 4093, False)])
def test_gpu_rms_norm_rotary_bf16_real_shapes(heads, seq, rope):
    """16 query / 4 KV heads x 128, bf16, compiled kernels vs the float32 reference."""
    torch.manual_seed(8)
    leaf, x = rows(2, seq, heads, 128, torch.bfloat16, layout="slice")
    weight = norm_weight(heads, 128, torch.bfloat16)
    cos_sin = rotary_tables(2, seq, 128) if rope else None
    out, grads = output_and_grads(lambda: rms_norm_rotary(x, weight, 1e-6, cos_sin, backend="triton"), (leaf, weight))
    leaf32, x32 = float_copy(leaf, "slice", heads, 128)
    w32 = weight.detach().float().requires_grad_()
    exact, exact_grads = output_and_grads(lambda: rms_norm_rotary_reference(x32, w32, 1e-6, cos_sin), (leaf32, w32))
    assert rel(out, exact) < 1e-2
    assert rel(grads[0], exact_grads[0]) < 2e-2 and rel(grads[1], exact_grads[1]) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("dim", [64, 128, 256])
def test_gpu_fp32_tight(dim):
    torch.manual_seed(9)
    leaf, x = rows(2, 1031, 16, dim, layout="slice")
    weight = norm_weight(16, dim)
    cos_sin = rotary_tables(2, 1031, dim)
    a_leaf, a = rows(2, 1031, 16, dim, layout="transposed")
    weight_b = norm_weight(16, dim)
    for fn, wrt in (
        (lambda backend: rms_norm_rotary(x, weight, 1e-6, cos_sin, backend=backend), (leaf, weight)),
        (lambda backend: branch_norm_sum(a, weight, x, weight_b, 1e-8, backend=backend), (a_leaf, weight, leaf, weight_b)),
    ):
        out, grads = output_and_grads(lambda: fn("triton"), wrt)
        out2, grads2 = output_and_grads(lambda: fn("reference"), wrt)
        assert rel(out, out2) < 1e-5
        assert_close_all(grads, grads2, 1e-5, ("x", "weight", "x2", "weight2"))


@pytest.mark.gpu
def test_gpu_branch_norm_sum_bf16_real_shapes():
    torch.manual_seed(10)
    a_leaf, a = rows(2, 4096, 16, 128, torch.bfloat16, layout="transposed")
    b_leaf, b = rows(2, 4096, 16, 128, torch.bfloat16)
    weight_a, weight_b = norm_weight(16, 128, torch.bfloat16), norm_weight(16, 128, torch.bfloat16)
    wrt = (a_leaf, weight_a, b_leaf, weight_b)
    out, grads = output_and_grads(lambda: branch_norm_sum(a, weight_a, b, weight_b, 1e-8), wrt)  # auto = Triton
    (a_leaf32, a32), (b32, _) = float_copy(a_leaf, "transposed", 16, 128), float_copy(b_leaf, "contiguous", 16, 128)
    wa32, wb32 = weight_a.detach().float().requires_grad_(), weight_b.detach().float().requires_grad_()
    exact, exact_grads = output_and_grads(
        lambda: branch_norm_sum_reference(a32, wa32, b32, wb32, 1e-8), (a_leaf32, wa32, b32, wb32)
    )
    assert rel(out, exact) < 1e-2
    for got, want in zip(grads, exact_grads):
        assert rel(got, want) < 2e-2


def test_kernels_compile_for_the_h100_with_the_shipped_tiles():
    rows = sm90_report("fused_norm_report()")
    assert len(rows) == 6  # four norm kernels, and the RoPE-only forward and backward
    for row in rows:
        assert "error" not in row and row["stack_bytes"] == 0, row
