"""gated_rms_norm (kernels/gated_rms_norm): Mamba-2's gated output norm, transformers' BambaRMSNormGated.

The reference is checked bit for bit against the transformers module; the Triton kernels (CPU
interpreter here, a real Bamba shape under the `gpu` marker) against the reference and the module,
forward and every gradient (dy, dz, dweight), float32 and bfloat16, one and two groups, a group
size that is not a power of two, a gate sliced out of a wider projection, odd row counts.
"""
from __future__ import annotations

import inspect

import pytest
import torch
from transformers.models.bamba.modeling_bamba import BambaRMSNormGated

from hf_hybrid.kernels._backend import triton_interpreting
from hf_hybrid.kernels.gated_rms_norm import (
    TRITON_MAX_GROUP_SIZE,
    gated_rms_norm,
    gated_rms_norm_fwd,
    gated_rms_norm_reference,
)
from sm90_check import sm90_compile

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    DEVICE == "cpu" and not triton_interpreting(), reason="needs CUDA or TRITON_INTERPRET=1"
)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def gated_inputs(shape, dtype=torch.float32, layout="contiguous", device=DEVICE):
    """(leaves, y, z) with y, z [..., D] laid out as the Mamba-2 mixer hands them over: contiguous,
    z a slice of the wider in_proj output (row stride > D), or both transposed [T, B] -> [B, T].
    Gradients are taken w.r.t. the leaves, so they cover the strided reads and writes too."""
    *lead, dim = shape

    def randn(*size):
        return torch.randn(size, device=device).to(dtype).requires_grad_()

    if layout == "slice":
        y_leaf, projection = randn(*shape), randn(*lead, 2 * dim + 24)
        return (y_leaf, projection), y_leaf, projection[..., dim + 8 : 2 * dim + 8]
    if layout == "transposed":
        y_leaf, z_leaf = randn(lead[1], lead[0], dim), randn(lead[1], lead[0], dim)
        return (y_leaf, z_leaf), y_leaf.transpose(0, 1), z_leaf.transpose(0, 1)
    y_leaf, z_leaf = randn(*shape), randn(*shape)
    return (y_leaf, z_leaf), y_leaf, z_leaf


def norm_weight(dim, dtype=torch.float32, device=DEVICE):
    return (1.0 + 0.3 * torch.randn(dim, device=device)).to(dtype).requires_grad_()


def bamba_norm(weight, group_size, eps):
    """transformers' module holding a copy of weight (same dtype and device). Older releases (5.17
    among them) take no group_size and norm the whole last dim as one group: groups > 1 skip there."""
    dim = weight.shape[0]
    if "group_size" in inspect.signature(BambaRMSNormGated).parameters:
        module = BambaRMSNormGated(dim, group_size=group_size, eps=eps)
    elif group_size == dim:
        module = BambaRMSNormGated(dim, eps=eps)
    else:
        pytest.skip("this transformers' BambaRMSNormGated has no group_size (one group only)")
    module = module.to(weight.device, weight.dtype)
    with torch.no_grad():
        module.weight.copy_(weight)
    return module


def output_and_grads(fn, wrt):
    """fn() and the gradients of <fn(), dout> for a fixed random dout (bf16-representable, so a
    bf16 run and its float64 oracle take the same dout)."""
    out = fn()
    gen = torch.Generator().manual_seed(11)
    dout = torch.randn(out.shape, generator=gen).to(torch.bfloat16).to(out.device, out.dtype)
    return out, torch.autograd.grad(out, wrt, dout)


# ---------------------------------------------------------------- reference == transformers' module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group_size", [24, 48])
def test_reference_is_bamba_module_bit_for_bit(dtype, group_size):
    torch.manual_seed(0)
    leaves, y, z = gated_inputs((2, 5, 48), dtype, "slice", device="cpu")
    weight = norm_weight(48, dtype, device="cpu")
    module = bamba_norm(weight, group_size, 1e-6)
    out, grads = output_and_grads(lambda: gated_rms_norm_reference(y, z, weight, group_size, 1e-6), (*leaves, weight))
    want, want_grads = output_and_grads(lambda: module(y, z), (*leaves, module.weight))
    assert out.dtype == dtype and torch.equal(out, want)
    for got, expected in zip(grads, want_grads):
        assert torch.equal(got, expected)


def test_auto_off_cuda_is_the_reference():
    y, z, weight = torch.randn(3, 32), torch.randn(3, 32), torch.rand(32)
    assert torch.equal(gated_rms_norm(y, z, weight, 16, 1e-6), gated_rms_norm_reference(y, z, weight, 16, 1e-6))


# ---------------------------------------------------------------- Triton


TRITON_CASES = [
    # shape [..., D_total], group_size, layout, eps
    ((2, 5, 64), 64, "contiguous", 1e-6),  # one group
    ((2, 7, 64), 32, "slice", 1e-6),  # two groups, the gate a slice of in_proj's output
    ((3, 5, 192), 96, "slice", 1e-5),  # a group size that is not a power of two
    ((13, 48), 48, "contiguous", 0.0),  # 2-D, odd rows; eps = 0: ragged tail rows stay finite
    ((3, 7, 64), 32, "transposed", 1e-6),  # [T, B] -> [B, T] views: two row strides, no copy
]


@needs_triton
@pytest.mark.parametrize("shape,group_size,layout,eps", TRITON_CASES)
def test_triton_matches_reference_fp32(shape, group_size, layout, eps):
    torch.manual_seed(1)
    leaves, y, z = gated_inputs(shape, layout=layout)
    weight = norm_weight(shape[-1])
    wrt = (*leaves, weight)

    def run(backend):
        return output_and_grads(lambda: gated_rms_norm(y, z, weight, group_size, eps, backend=backend), wrt)

    (out, grads), (want, want_grads) = run("triton"), run("reference")
    assert out.dtype == torch.float32 and out.shape == y.shape
    assert rel(out, want) < 1e-5
    for name, got, expected in zip(("y", "z", "weight"), grads, want_grads):
        assert got.dtype == expected.dtype and rel(got, expected) < 1e-5, (name, rel(got, expected))


@needs_triton
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("groups", [1, 2])
def test_triton_matches_bamba_module(dtype, tol, groups):
    """Against BambaRMSNormGated itself in the model's dtype (weight included): output, dy, dz,
    dweight. (In bf16 the interpreter truncates float32 -> bfloat16 where CUDA rounds to nearest,
    so only the GPU test can hold the kernel to the module's roundings closely.)"""
    torch.manual_seed(2)
    group_size = 40
    leaves, y, z = gated_inputs((3, 5, groups * group_size), dtype, "slice")
    weight = norm_weight(groups * group_size, dtype)
    module = bamba_norm(weight, group_size, 1e-6)
    wrt = (*leaves, weight)
    out, grads = output_and_grads(lambda: gated_rms_norm(y, z, weight, group_size, 1e-6, backend="triton"), wrt)
    want, want_grads = output_and_grads(lambda: module(y, z), (*leaves, module.weight))
    assert out.dtype == want.dtype == dtype
    assert rel(out, want) < tol
    for name, got, expected in zip(("y", "z", "weight"), grads, want_grads):
        assert got.dtype == expected.dtype and rel(got, expected) < tol, (name, rel(got, expected))


@needs_triton
def test_triton_rounds_like_bamba_module_fp16():
    """Both of the module's roundings (h * r to the input dtype, then the weight product): float16
    rounds to nearest in the interpreter as on CUDA, so the outputs agree but for rare flips from
    float32 summation order (rounding once instead would differ in about a quarter of them)."""
    torch.manual_seed(8)
    y, z = (3 * torch.randn(5, 7, 128, device=DEVICE).half() for _ in range(2))
    weight = norm_weight(128, torch.float16).detach()
    out = gated_rms_norm(y, z, weight, 64, 1e-6, backend="triton")
    want = bamba_norm(weight, 64, 1e-6)(y, z).detach()
    assert out.dtype == torch.float16
    assert (out == want).float().mean().item() > 0.99


@needs_triton
def test_triton_mixed_precision_follows_type_promotion():
    """bf16 activations with a float32 weight (autocast-style training): the output is float32 as
    the module's, the gradients keep each input's dtype."""
    torch.manual_seed(3)
    leaves, y, z = gated_inputs((2, 9, 64), torch.bfloat16, "slice")
    weight = norm_weight(64)
    module = bamba_norm(weight, 32, 1e-6)
    out, grads = output_and_grads(lambda: gated_rms_norm(y, z, weight, 32, 1e-6, backend="triton"), (*leaves, weight))
    want, want_grads = output_and_grads(lambda: module(y, z), (*leaves, module.weight))
    assert out.dtype == want.dtype == torch.float32 and rel(out, want) < 1e-2
    assert [g.dtype for g in grads] == [torch.bfloat16, torch.bfloat16, torch.float32]
    for got, expected in zip(grads, want_grads):
        assert rel(got, expected) < 1e-2


@needs_triton
def test_weight_gradient_is_deterministic():
    torch.manual_seed(4)
    leaves, y, z = gated_inputs((3, 11, 64), layout="slice")
    weight = norm_weight(64)

    def grads():
        return output_and_grads(lambda: gated_rms_norm(y, z, weight, 32, 1e-6, backend="triton"), (*leaves, weight))[1]

    first, second = grads(), grads()
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@needs_triton
def test_opcheck():
    torch.manual_seed(5)
    _, y, z = gated_inputs((2, 5, 48), layout="slice")
    torch.library.opcheck(gated_rms_norm_fwd, (y, z, norm_weight(48), 24, 1e-6))


@needs_triton
def test_compiles_fullgraph_and_matches_eager():
    torch.manual_seed(6)
    leaves, y, z = gated_inputs((2, 5, 48), layout="slice")
    weight = norm_weight(48)

    def step(y, z, weight):
        return gated_rms_norm(y, z, weight, 24, 1e-6, backend="triton").square().sum()

    eager = torch.autograd.grad(step(y, z, weight), (*leaves, weight))
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for a, b in zip(torch.autograd.grad(compiled(y, z, weight), (*leaves, weight)), eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- errors


def test_bad_inputs_raise_errors_naming_the_parameter():
    y, z, w = torch.randn(2, 3, 8), torch.randn(2, 3, 8), torch.ones(8)
    cases = [
        (dict(z=torch.randn(2, 3, 4)), r"z \(the gate\) must have y's shape \(2, 3, 8\)"),
        (dict(weight=torch.ones(4)), r"weight must be \[D_total\] = \(8,\)"),
        (dict(group_size=3), "group_size must be a positive int dividing D_total = 8"),
        (dict(group_size=0), "group_size must be a positive int"),
        (dict(eps=-1.0), "eps must be a float >= 0"),
        (dict(y=y.double()), "y must be float16, bfloat16 or float32"),
        (dict(z=z.to(torch.int32)), "z must be float16, bfloat16 or float32"),
        (dict(weight=torch.tensor(1.0)), "weight must be a"),
        (dict(y=None), "y must be a"),
        (dict(weight=w.to("meta")), "z and weight must be on y's device"),
        (dict(backend="cuda"), "backend"),
    ]
    for change, message in cases:
        args = dict(y=y, z=z, weight=w, group_size=4, eps=1e-6) | change
        backend = args.pop("backend", "auto")
        with pytest.raises(ValueError, match=message):
            gated_rms_norm(**args, backend=backend)


@needs_triton
def test_triton_refuses_what_it_cannot_do():
    from hf_hybrid.kernels.gated_rms_norm import triton as kernels

    assert TRITON_MAX_GROUP_SIZE == kernels.MAX_GROUP_SIZE
    big = 2 * TRITON_MAX_GROUP_SIZE
    y, w = torch.randn(1, big, device=DEVICE), torch.ones(big, device=DEVICE)
    with pytest.raises(ValueError, match="group_size <= 8192"):
        gated_rms_norm(y, y, w, big, 1e-6, backend="triton")
    empty = torch.randn(0, 3, 8, device=DEVICE)
    assert gated_rms_norm(empty, empty, w[:8], 4, 1e-6, backend="triton").shape == empty.shape


def test_kernels_compile_for_the_h100_without_spills():
    """Bamba's shape (bf16, one group of 4096) with the shipped tile and warps."""
    from hf_hybrid.kernels.gated_rms_norm import triton as kernels

    block_d, block_t = kernels._tile(4096)
    tile = dict(GROUP=4096, D_TOTAL=4096, BLOCK_D=block_d, BLOCK_T=block_t)
    bf, f32 = "*bf16", "*fp32"
    specs = {
        "_fwd_kernel": (dict(Y=bf, Z=bf, W=bf, OUT=bf, eps="fp32"), tile, kernels._forward_warps(4096)),
        "_bwd_kernel": (
            dict(Y=bf, Z=bf, W=bf, DOUT=bf, DY=bf, DZ=bf, DW_PART=f32, eps="fp32"), tile, kernels._backward_warps(4096),
        ),
    }
    rows = sm90_compile(kernels.__name__, specs)
    assert set(rows) == set(specs) and all(row["stack_bytes"] == 0 for row in rows.values()), rows


# ---------------------------------------------------------------- real GPU shape


@pytest.mark.gpu
def test_gpu_bamba_shape_bf16_against_float64():
    """[1, 8192, 4096] bf16, one group of 4096 (Bamba's default), the gate a slice of in_proj's
    output: compiled kernels vs the float64 reference, and vs the bf16 module's roundings."""
    torch.manual_seed(7)
    leaves, y, z = gated_inputs((1, 8192, 4096), torch.bfloat16, "slice")
    weight = norm_weight(4096, torch.bfloat16)
    wrt = (*leaves, weight)
    out, grads = output_and_grads(lambda: gated_rms_norm(y, z, weight, 4096, 1e-6), wrt)  # auto = Triton
    exact_leaves = tuple(t.detach().double().requires_grad_() for t in wrt)
    y64, projection64, w64 = exact_leaves
    z64 = projection64[..., 4096 + 8 : 2 * 4096 + 8]
    exact, exact_grads = output_and_grads(lambda: gated_rms_norm_reference(y64, z64, w64, 4096, 1e-6), exact_leaves)
    assert out.dtype == torch.bfloat16 and rel(out, exact) < 1e-2
    for name, got, expected in zip(("y", "z", "weight"), grads, exact_grads):
        assert got.dtype == torch.bfloat16 and rel(got, expected) < 1e-2, (name, rel(got, expected))
    with torch.no_grad():
        module_out = bamba_norm(weight, 4096, 1e-6)(y, z)
    # Same two roundings: apart from float32 summation order, the module's bf16 numbers.
    assert (out == module_out).float().mean().item() > 0.99


@pytest.mark.gpu
def test_gpu_prefill_size_past_a_grid_axis_limit():
    """8 x 16400 tokens of one 4096-wide group: 131,200 one-token forward programs, more than a
    second grid axis can hold (65,535); the forward's flat index covers them all."""
    torch.manual_seed(3)
    y = torch.randn(8, 16400, 4096, device="cuda", dtype=torch.bfloat16)
    z = torch.randn(8, 16400, 4096, device="cuda", dtype=torch.bfloat16)
    weight = norm_weight(4096, torch.bfloat16)
    with torch.no_grad():
        out = gated_rms_norm(y, z, weight, 4096, 1e-6)
        last = gated_rms_norm_reference(y[-1:, -16:], z[-1:, -16:], weight, 4096, 1e-6)
    assert rel(out[-1:, -16:], last) < 1e-2
