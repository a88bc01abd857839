"""No kernel computes an element offset in 32-bit integers that passes 2**31 at 2M-token shapes.

A [2M tokens, 2,048] activation has 4.3e9 elements: an offset such as row * stride computed in
int32 wraps and the GPU reads or writes the wrong rows. These tests run kernels in Triton's CPU
interpreter at those shapes without their memory: the large tensors are ``meta`` tensors (no
storage; their loads read zeros, stores are dropped), small index tensors are real, only the
corner programs of each grid run (first and last along every axis: the largest batch, head and
token indices), and every signed 32-bit add, subtract and multiply the kernel makes is checked
against the exact result. Each op's forward (and backward where it has one) runs through its Triton
entry point, as tests/kernels/test_launch_grids.py does for the grids.
"""
from __future__ import annotations

import inspect
import itertools

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")
interpreter = pytest.importorskip("triton.runtime.interpreter")
tl = pytest.importorskip("triton.language")

_INTERNALS = ("GridExecutor", "InterpreterBuilder", "TensorHandle", "interpreter_builder", "_interpreter",
              "_implicit_cvt", "_patch_lang", "_get_np_dtype")
if not all(hasattr(interpreter, name) for name in _INTERNALS):
    pytest.skip(f"Triton {triton.__version__}'s interpreter lacks one of {_INTERNALS}", allow_module_level=True)

HEADS, DIM = 16, 128
INT32 = (-(2**31), 2**31 - 1)


class Int32Overflow(AssertionError):
    pass


def _checked(op, name):
    def binary(builder, lhs, rhs):
        if lhs.dtype.scalar == tl.int32 and rhs.dtype.scalar == tl.int32:
            exact = op(lhs.data.astype(np.int64), rhs.data.astype(np.int64))
            if exact.size and (exact.min() < INT32[0] or exact.max() > INT32[1]):
                raise Int32Overflow(f"int32 {name} overflows: exact range [{exact.min()}, {exact.max()}]")
        return builder.binary_op(lhs, rhs, op)

    return binary


@pytest.fixture
def dry_run(monkeypatch):
    """Kernels run only their corner programs, on addresses: loads outside real CPU tensors read
    the masked-load default (zeros), stores and atomics write nothing, int32 arithmetic is checked.
    Yields the names of the kernels that ran."""
    ran: list[str] = []
    real_ranges: list[tuple[int, int]] = []

    def load(builder, ptrs, mask, other, cache_policy, is_volatile):
        dtype_tt = ptrs.get_element_ty()
        dtype_np = interpreter._get_np_dtype(dtype_tt)
        if other is None:
            other = interpreter.TensorHandle(np.zeros_like(ptrs.data, dtype=dtype_np), dtype_tt)
        inside = np.zeros(ptrs.data.shape, dtype=bool)
        for lo, hi in real_ranges:
            inside |= (ptrs.data >= lo) & (ptrs.data < hi)
        readable = mask.data & inside
        return interpreter.TensorHandle(interpreter._interpreter.load(ptrs.data, readable, other.data, dtype_np), dtype_tt)

    def nothing(builder, *args):
        return None

    def atomic(builder, rmw_op, ptr, val, mask, sem, scope):
        return interpreter.TensorHandle(np.zeros_like(val.data), val.dtype.scalar)

    def execute(executor, *args, **kwargs):
        spec = inspect.getfullargspec(executor.fn)
        bound = inspect.getcallargs(executor.fn, *args, **{k: v for k, v in kwargs.items() if k in spec.args})
        for value in bound.values():
            if isinstance(value, torch.Tensor) and value.device.type == "cpu":
                storage = value.untyped_storage()
                real_ranges.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
        grid = executor.grid(bound) if callable(executor.grid) else executor.grid
        grid = tuple(grid) + (1,) * (3 - len(grid))
        if 0 in grid:
            return
        args = {name: value if name in executor.constexprs else interpreter._implicit_cvt(value)
                for name, value in bound.items()}
        scope = interpreter._patch_lang(executor.fn)
        try:
            interpreter.interpreter_builder.set_grid_dim(*grid)
            for index in itertools.product(*({0, size - 1} for size in grid)):
                interpreter.interpreter_builder.set_grid_idx(*index)
                try:
                    executor.fn(**args)
                except Int32Overflow as error:
                    raise Int32Overflow(f"{executor.fn.__name__}, program {index} of grid {grid}: {error}") from None
        finally:
            scope.restore()
        ran.append(executor.fn.__name__)

    builder = interpreter.InterpreterBuilder
    monkeypatch.setattr(interpreter.GridExecutor, "__call__", execute)
    monkeypatch.setattr(builder, "create_masked_load", load)
    monkeypatch.setattr(builder, "create_masked_store", nothing)
    monkeypatch.setattr(builder, "create_atomic_rmw", atomic)
    for name, op in (("create_add", np.add), ("create_sub", np.subtract), ("create_mul", np.multiply)):
        monkeypatch.setattr(builder, name, _checked(op, name.removeprefix("create_")))
    return ran


def _empty(*shape, dtype=torch.bfloat16, grad=False):
    return torch.empty(*shape, device="meta", dtype=dtype, requires_grad=grad)


def _backward(*outputs):
    torch.autograd.backward([o for o in outputs if o.requires_grad], [torch.empty_like(o) for o in outputs if o.requires_grad])


def test_the_check_catches_a_wrapped_offset(dry_run):
    """A kernel that multiplies an int32 row index by an int32 stride, at a row past 2**31 / stride."""

    @triton.jit
    def copy_row(X, Y, stride, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        tl.store(Y + row * stride + cols, tl.load(X + row * stride + cols))

    x = _empty(2**20 + 1, 2048)
    copy_row[(2**20,)](x, x, 2048, BLOCK=16)  # last row 2**20 - 1: offsets end just below 2**31
    assert dry_run == ["copy_row"]
    with pytest.raises(Int32Overflow, match="mul"):
        copy_row[(2**20 + 1,)](x, x, 2048, BLOCK=16)  # row 2**20 starts at 2**31


BIG = [(512, 4096), (1, 2_097_152)]  # 2M tokens as a batch and as one row


@pytest.mark.parametrize("batch,seq", BIG)
def test_row_ops(dry_run, batch, seq):
    from hf_hybrid.kernels.fused_norm.triton import branch_norm_sum_triton, rms_norm_rotary_triton
    from hf_hybrid.kernels.gated_rms_norm.triton import gated_rms_norm_forward
    from hf_hybrid.kernels.kv_shift.triton import kv_shift_backward, kv_shift_forward
    from hf_hybrid.kernels.output_gate.triton import sigmoid_gate_triton
    from hf_hybrid.kernels.residual_norm.triton import add_rms_norm_triton

    hidden = HEADS * DIM
    # Forward only for the norms: their backward programs walk long token ranges (too slow to
    # interpret) through the same row-offset helpers.
    x, w = _empty(batch, seq, HEADS, DIM), _empty(HEADS, DIM)
    cos = _empty(1, seq, 1, DIM, dtype=torch.float32)
    rms_norm_rotary_triton(x, w, 1e-6, (cos, cos))
    branch_norm_sum_triton(x, w, _empty(batch, seq, HEADS, DIM), _empty(HEADS, DIM), 1e-6, 1e-6)
    # k of a fused [q | k | v] projection: a token stride of three widths
    k = _empty(batch, seq, 3, HEADS, DIM)[:, :, 1]
    kv_shift_forward(k, _empty(batch, seq, HEADS), _empty(batch, HEADS, DIM))
    kv_shift_backward(k, _empty(batch, seq, HEADS), _empty(batch, HEADS, DIM), _empty(batch, seq, HEADS, DIM))
    z, y = _empty(batch, seq, hidden, grad=True), _empty(batch, seq, hidden, grad=True)
    _backward(sigmoid_gate_triton(z, y))
    add_rms_norm_triton(_empty(batch, seq, hidden), _empty(batch, seq, hidden), _empty(hidden), 1e-6)
    gated_rms_norm_forward(y, z, _empty(hidden), 256, 1e-6)
    assert len(dry_run) >= 8, dry_run


@pytest.mark.parametrize("batch,seq", BIG)
def test_recurrences_and_convolution(dry_run, batch, seq):
    from hf_hybrid.kernels.causal_conv1d.triton import causal_conv1d_triton
    from hf_hybrid.kernels.gated_recurrence.rat_keys_values_triton import rat_keys_values_triton
    from hf_hybrid.kernels.gated_recurrence.triton import gated_recurrence_triton

    channels = HEADS * DIM
    x, g = _empty(batch, seq, channels, grad=True), _empty(batch, seq, channels, grad=True)
    _backward(gated_recurrence_triton(x, g, chunk_size=16))
    # k of a fused projection ([k groups | v | gate logits] per token): a token stride past the width
    fused = _empty(batch, seq, 2 * DIM + 2 * channels, grad=True)
    k_groups = fused[..., : 2 * DIM].unflatten(-1, (2, DIM))
    v = _empty(batch, seq, HEADS, DIM, grad=True)
    logits = _empty(batch, seq, HEADS, DIM, grad=True)
    cos = _empty(batch, seq, DIM, dtype=torch.float32)
    _backward(*rat_keys_values_triton(k_groups, v, logits, _empty(HEADS, DIM, grad=True), 16, (cos, cos)))
    _backward(causal_conv1d_triton(_empty(batch, seq, channels, grad=True), _empty(channels, 4, grad=True),
                                   _empty(channels, grad=True), None, "silu", False))
    assert len(dry_run) >= 6, dry_run


def _forgetting_attention(batch: int, seq: int, window: int | None):
    """Forward and backward of the portable kernels on a dense batch, with real row boundaries
    (the kernels read each sequence's start and length from them)."""
    from hf_hybrid.kernels.forgetting_attention import triton as fox

    q, k, v = (_empty(batch * seq, HEADS, DIM) for _ in range(3))
    c = _empty(HEADS, batch * seq, dtype=torch.float32)
    cu = torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32)
    o, lse = fox._forward(q, k, v, c, cu, seq, DIM**-0.5, window)
    fox._backward(_empty(batch * seq, HEADS, DIM), q, k, v, c, o, lse, cu, seq, DIM**-0.5, window)


def test_forgetting_attention_at_512_rows_of_4k(dry_run):
    _forgetting_attention(512, 4096, 64)
    assert len(dry_run) == 4, dry_run


def test_forgetting_attention_window_on_one_2m_row(dry_run):
    """One 2M-token row: positions within the sequence times the token stride pass 2**31."""
    _forgetting_attention(1, 2_097_152, 64)
    assert len(dry_run) == 4, dry_run


def test_block_end_attention_at_512_rows_of_4k(dry_run):
    from hf_hybrid.kernels.chunk_attention.triton import block_end_attention_triton

    q, k, v = (_empty(512, 4096, HEADS, DIM, grad=True) for _ in range(3))
    _backward(block_end_attention_triton(q, k, v, 16, 0, 0))
    assert len(dry_run) >= 3, dry_run


def test_residual_linear_attention_at_512_rows_of_4k(dry_run):
    from hf_hybrid.kernels.residual_linear_attention.triton import residual_linear_attention_triton

    q = _empty(512, 4096, HEADS, DIM, grad=True)
    k, v = _empty(512, 4096, 4, DIM, grad=True), _empty(512, 4096, 4, DIM, grad=True)
    # Segments of two chunks: each program walks a short range (the interpreter is slow).
    out, final = residual_linear_attention_triton(q, k, v, 512, "softmax", state_every=2)
    _backward(out, final)
    assert len(dry_run) >= 5, dry_run


def test_ssd_scan_at_2m_tokens(dry_run):
    """2M tokens in short rows (each program walks its row's chunks: the interpreter is slow)."""
    from hf_hybrid.kernels.ssd_scan.triton import ssd_scan_triton

    batch, seq, heads = 16_384, 128, 32
    x, dt = _empty(batch, seq, heads, 64, grad=True), _empty(batch, seq, heads, dtype=torch.float32, grad=True)
    A, D = _empty(heads, dtype=torch.float32, grad=True), _empty(heads, dtype=torch.float32, grad=True)
    B, C = _empty(batch, seq, 1, 128, grad=True), _empty(batch, seq, 1, 128, grad=True)
    _backward(ssd_scan_triton(x, dt, A, B, C, D, None, False))
    assert len(dry_run) >= 4, dry_run
