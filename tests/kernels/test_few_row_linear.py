"""few_row_linear (kernels/few_row_linear): several linears of a few rows in one launch, against
float64 products (fp32 <= 1e-5, bf16 / fp16 <= 1e-2 relative), odd widths and depths, and the
conditions under which it runs."""
from __future__ import annotations

import pytest
import torch

from hf_hybrid.kernels._backend import triton_interpreting
from hf_hybrid.kernels.few_row_linear import MAX_ROWS, few_row_linear, few_row_linear_applies

needs_triton = pytest.mark.skipif(
    not (torch.cuda.is_available() or triton_interpreting()), reason="needs CUDA or TRITON_INTERPRET=1"
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def _operands(rows, widths, depth, dtype, lead=None):
    g = torch.Generator().manual_seed(rows * 7 + depth)
    x = torch.randn(*(lead or (rows,)), depth, generator=g).to(DEVICE, dtype)
    weights = tuple((torch.randn(n, depth, generator=g) / depth**0.5).to(DEVICE, dtype) for n in widths)
    return x, weights


def _relative_error(got, x, w):
    exact = x.double() @ w.double().t()
    return ((got.double() - exact).norm() / exact.norm()).item()


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows, widths, depth", [(1, (16,), 128), (5, (48, 40, 16), 72), (8, (100, 32, 32, 64, 64), 200), (33, (24,), 130)])
def test_matches_float64_products(dtype, rows, widths, depth):
    x, weights = _operands(rows, widths, depth, dtype)
    assert few_row_linear_applies(x, weights, backend="triton")
    outs = few_row_linear(x, weights, backend="triton")
    assert len(outs) == len(weights)
    for out, w in zip(outs, weights):
        assert out.shape == (rows, w.shape[0]) and out.dtype == dtype
        assert _relative_error(out, x, w) <= TOLERANCE[dtype]


@needs_triton
def test_leading_dims_and_a_strided_input():
    x, weights = _operands(6, (32, 16), 64, torch.float32, lead=(3, 2))
    outs = few_row_linear(x, weights, backend="triton")
    assert outs[0].shape == (3, 2, 32) and outs[1].shape == (3, 2, 16)
    wide = torch.randn(6, 2 * 64, device=DEVICE)[:, ::2]  # K with stride 2: made contiguous first
    out = few_row_linear(wide, weights[:1], backend="triton")[0]
    assert _relative_error(out, wide, weights[0]) <= 1e-5


def test_runs_only_where_it_should():
    x, weights = _operands(4, (16, 16), 32, torch.float32)
    cpu_x, cpu_weights = x.cpu(), tuple(w.cpu() for w in weights)
    assert not few_row_linear_applies(cpu_x, cpu_weights)  # CPU, backend auto: F.linear
    x_many = torch.randn(MAX_ROWS + 1, 32, device=DEVICE)
    if torch.cuda.is_available() or triton_interpreting():
        assert not few_row_linear_applies(x_many, weights, backend="triton")
        assert not few_row_linear_applies(x.requires_grad_(), weights, backend="triton")  # no autograd on the kernel
        assert not few_row_linear_applies(x.detach().half(), weights, backend="triton")  # dtypes differ
        with pytest.raises(ValueError, match="few_row_linear: the kernel needs at most"):
            few_row_linear(x_many, weights, backend="triton")
    auto = few_row_linear(cpu_x, cpu_weights)  # on the CPU the fallback is F.linear itself
    assert all(torch.equal(a, torch.nn.functional.linear(cpu_x, w)) for a, w in zip(auto, cpu_weights))


def test_kernel_compiles_for_sm90_without_spills():
    """Each tile the wrapper picks (8, 32 and MAX_ROWS rows), compiled for the H100 in the compile helper process."""
    from sm90_check import _json_from_compile_helper

    usage = _json_from_compile_helper(
        "import json\n"
        "from sm90_resources import compile_for_sm90\n"
        "from hf_hybrid.kernels.few_row_linear import triton as kernel\n"
        "types = {f'{p}{i}': '*bf16' for p in ('W', 'O') for i in range(6)} | {'X': '*bf16'}\n"
        "out = {}\n"
        f"for rows in (8, 32, {MAX_ROWS}):\n"
        "    block_m, block_n, block_k, warps, stages = kernel.tile_for(rows)\n"
        "    constexprs = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_PREC='tf32')\n"
        "    out[rows] = compile_for_sm90(kernel._few_row_linear_kernel, types, constexprs, warps, stages)\n"
        "print(json.dumps(out))\n"
    )
    assert len(usage) == 3 and all(u["stack_bytes"] == 0 for u in usage.values()), usage


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 8, 32])
def test_decode_shapes_on_the_gpu(rows):
    """RAT's five projections and an MLP's down projection at the 1.3B shape, bf16."""
    x, weights = _operands(rows, (256, 256, 2048, 2048, 2048), 2048, torch.bfloat16)
    for out, w in zip(few_row_linear(x, weights), weights):
        assert _relative_error(out, x, w) <= 1e-2
    h, down = _operands(rows, (2048,), 5632, torch.bfloat16)
    assert _relative_error(few_row_linear(h, down)[0], h, down[0]) <= 1e-2
