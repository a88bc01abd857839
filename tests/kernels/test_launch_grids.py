"""Every Triton launch of every op stays inside CUDA's grid limits at extreme shapes.

CUDA refuses a launch whose grid axis 0 passes 2**31 - 1 programs or whose axis 1 or 2 passes
65,535 ("invalid argument"): a prefill of 128 x 4,096 tokens once put 65,536 token blocks on axis 1.
These tests call each op's Triton path forward and backward on ``meta`` tensors (shapes without
memory) at B x T = 2M tokens, 131,072-token rows, batches past 65,535 and many heads, with
Triton's interpreter made to record each launch's grid instead of running it. They run twice: with
the interpreter's small tiles (more programs) and with the tile sizes and plans of the CUDA path.
"""
from __future__ import annotations

import inspect

import pytest
import torch

triton = pytest.importorskip("triton")
interpreter = pytest.importorskip("triton.runtime.interpreter")

from hf_hybrid.kernels._grid import MAX_GRID_X, MAX_GRID_YZ, check_grid  # noqa: E402

if not hasattr(interpreter, "GridExecutor"):
    pytest.skip(f"Triton {triton.__version__}'s interpreter has no GridExecutor to record", allow_module_level=True)

# (batch, seq): 2M tokens as 512 x 4K and as one row, the 128 x 4K prefill that once failed, a
# 131,072-token training row, and a batch past grid axis 1's limit.
SHAPES = [(128, 4096), (512, 4096), (1, 2_097_152), (1, 131_072), (131_072, 16)]
HEADS, DIM = 16, 128
META = dict(device="meta", dtype=torch.bfloat16)


@pytest.fixture(params=["interpreter tiles", "cuda tiles"])
def launches(request, monkeypatch):
    """The (kernel, grid) of every launch, none of them run. "cuda tiles": the modules' own
    ``triton_interpreting`` answers False, so they pick the block sizes and plans of a GPU."""
    recorded: list[tuple[str, tuple[int, ...]]] = []

    def record(executor, *args, **kwargs):
        spec = inspect.getfullargspec(executor.fn)
        bound = inspect.getcallargs(executor.fn, *args, **{k: v for k, v in kwargs.items() if k in spec.args})
        grid = executor.grid(bound) if callable(executor.grid) else executor.grid
        recorded.append((executor.fn.__name__, tuple(int(g) for g in grid)))

    monkeypatch.setattr(interpreter.GridExecutor, "__call__", record)
    if request.param == "cuda tiles":
        import sys

        for name, module in list(sys.modules.items()):
            if name.startswith("hf_hybrid.kernels") and getattr(module, "triton_interpreting", None) is not None:
                monkeypatch.setattr(module, "triton_interpreting", lambda: False)
    return recorded


def _empty(*shape, dtype=torch.bfloat16, grad=False):
    return torch.empty(*shape, device="meta", dtype=dtype, requires_grad=grad)


def _backward(*outputs):
    torch.autograd.backward([o for o in outputs if o.requires_grad], [torch.empty_like(o) for o in outputs if o.requires_grad])


def _assert_within_limits(launches, op):
    assert launches, f"{op}: no launch was recorded"
    for kernel, grid in launches:
        check_grid(grid, f"{op}: {kernel}")
        assert all(size >= 0 for size in grid), (op, kernel, grid)


# ---------------------------------------------------------------- the grid check itself


def test_check_grid_names_the_axis_past_its_limit():
    assert check_grid((MAX_GRID_X, MAX_GRID_YZ, MAX_GRID_YZ)) == (MAX_GRID_X, MAX_GRID_YZ, MAX_GRID_YZ)
    with pytest.raises(ValueError, match="axis 1"):
        check_grid((16, MAX_GRID_YZ + 1), "norm")
    with pytest.raises(ValueError, match="axis 0"):
        check_grid((MAX_GRID_X + 1,), "gate")


# ---------------------------------------------------------------- row-wise ops


@pytest.mark.parametrize("batch,seq", SHAPES)
def test_fused_norms(launches, batch, seq):
    from hf_hybrid.kernels.fused_norm.triton import branch_norm_sum_triton, rms_norm_rotary_triton, rotary_triton

    x = _empty(batch, seq, HEADS, DIM, grad=True)
    w = _empty(HEADS, DIM, grad=True)
    cos = _empty(1, seq, 1, DIM)
    _backward(rms_norm_rotary_triton(x, w, 1e-6, (cos, cos)))
    _backward(rotary_triton(x, (cos, cos)))
    b, wb = _empty(batch, seq, HEADS, DIM, grad=True), _empty(HEADS, DIM, grad=True)
    _backward(branch_norm_sum_triton(x, w, b, wb, 1e-6, 1e-6))
    _backward(rms_norm_rotary_triton(x, w, 1e-6, None, programs_per_head=10**9))  # a tuning past the limit
    _assert_within_limits(launches, "fused_norm")


@pytest.mark.parametrize("batch,seq", SHAPES)
def test_elementwise_and_row_ops(launches, batch, seq):
    from hf_hybrid.kernels.gated_rms_norm.triton import gated_rms_norm_backward, gated_rms_norm_forward
    from hf_hybrid.kernels.kv_shift.triton import kv_shift_backward, kv_shift_forward
    from hf_hybrid.kernels.output_gate.triton import sigmoid_gate_triton
    from hf_hybrid.kernels.residual_norm.triton import add_rms_norm_triton

    hidden = HEADS * DIM
    z, y = _empty(batch, seq, hidden, grad=True), _empty(batch, seq, hidden, grad=True)
    _backward(sigmoid_gate_triton(z, y))
    add_rms_norm_triton(_empty(batch, seq, hidden), _empty(batch, seq, hidden), _empty(hidden), 1e-6)
    x, logits, previous = _empty(batch, seq, HEADS, DIM), _empty(batch, seq, HEADS), _empty(batch, HEADS, DIM)
    kv_shift_forward(x, logits, previous)
    kv_shift_backward(x, logits, previous, _empty(batch, seq, HEADS, DIM))
    w = _empty(hidden)
    gated_rms_norm_forward(y, z, w, 256, 1e-6)
    gated_rms_norm_backward(y, z, w, _empty(batch, seq, hidden), 256, 1e-6)
    _assert_within_limits(launches, "row ops")


# ---------------------------------------------------------------- recurrences and scans


@pytest.mark.parametrize("batch,seq", SHAPES)
def test_recurrences_and_convolution(launches, batch, seq):
    from hf_hybrid.kernels.causal_conv1d.triton import causal_conv1d_step_triton, causal_conv1d_triton
    from hf_hybrid.kernels.gated_recurrence.rat_keys_values_triton import rat_keys_values_triton
    from hf_hybrid.kernels.gated_recurrence.triton import gated_recurrence_triton

    channels = HEADS * DIM
    for chunk in (16, 0, 1024):  # direct chunked, plain and the three-pass path
        x, g = _empty(batch, seq, channels, grad=True), _empty(batch, seq, channels, grad=True)
        _backward(gated_recurrence_triton(x, g, chunk_size=chunk))
    k_groups, v = _empty(batch, seq, 2, DIM, grad=True), _empty(batch, seq, HEADS, DIM, grad=True)
    logits, bias = _empty(batch, seq, HEADS, DIM, grad=True), _empty(HEADS, DIM, grad=True)
    cos = _empty(batch, seq, DIM, dtype=torch.float32)
    _backward(*rat_keys_values_triton(k_groups, v, logits, bias, 16, (cos, cos)))
    x, weight, conv_bias = _empty(batch, seq, channels, grad=True), _empty(channels, 4, grad=True), _empty(channels, grad=True)
    _backward(causal_conv1d_triton(x, weight, conv_bias, None, "silu", False))
    causal_conv1d_step_triton(_empty(batch, channels), _empty(batch, channels, 4), weight.detach(), None, "silu", None)
    _assert_within_limits(launches, "recurrences")


@pytest.mark.parametrize("batch,seq", SHAPES)
@pytest.mark.parametrize("heads", [HEADS, 128])
def test_ssd_scan(launches, batch, seq, heads):
    from hf_hybrid.kernels.ssd_scan.triton import ssd_scan_triton, ssd_step_triton

    x, dt = _empty(batch, seq, heads, 64, grad=True), _empty(batch, seq, heads, dtype=torch.float32, grad=True)
    A, D = _empty(heads, dtype=torch.float32, grad=True), _empty(heads, dtype=torch.float32, grad=True)
    B, C = _empty(batch, seq, 1, 128, grad=True), _empty(batch, seq, 1, 128, grad=True)
    _backward(ssd_scan_triton(x, dt, A, B, C, D, None, False))
    state = torch.empty(batch, heads, 64, 128, device="meta", dtype=torch.float32)
    ssd_step_triton(state, x[:, 0].detach(), dt[:, 0].detach(), A.detach(), B[:, 0].detach(), C[:, 0].detach(),
                    D.detach(), None, False, (0.0, float("inf")), None)
    _assert_within_limits(launches, "ssd_scan")


# ---------------------------------------------------------------- attention


@pytest.mark.parametrize("batch,seq", SHAPES)
def test_block_end_attention(launches, batch, seq):
    from hf_hybrid.kernels.chunk_attention.triton import block_end_attention_triton

    for block, window, sinks, q_heads in ((16, 0, 0, 2), (16, 64, 4, HEADS), (1, 0, 0, HEADS)):
        q = _empty(batch, seq, q_heads, DIM, grad=True)
        k, v = _empty(batch, seq, HEADS, DIM, grad=True), _empty(batch, seq, HEADS, DIM, grad=True)
        _backward(block_end_attention_triton(q, k, v, block, window, sinks, output_gate=_empty(batch, seq, HEADS, DIM, grad=True)))
    _assert_within_limits(launches, "block_end_attention")


@pytest.mark.parametrize("batch,seq", SHAPES)
def test_forgetting_attention(launches, batch, seq):
    from hf_hybrid.kernels.forgetting_attention.cumulative import cumulative_log_forget_by_head_triton
    from hf_hybrid.kernels.forgetting_attention.triton import forgetting_attention_triton

    q, k, v = (_empty(batch, seq, HEADS, DIM, grad=True) for _ in range(3))
    c = _empty(HEADS, batch * seq, dtype=torch.float32, grad=True)
    for window in (None, 512):
        _backward(forgetting_attention_triton(q, k, v, c, DIM**-0.5, window))
    _backward(cumulative_log_forget_by_head_triton(_empty(batch, seq, HEADS, dtype=torch.float32, grad=True)))
    _assert_within_limits(launches, "forgetting_attention")


def test_forgetting_attention_many_packed_sequences(launches):
    """A packed row of 2M tokens in 131,072 documents of 16: the sequences ride on grid axis 0."""
    from hf_hybrid.kernels.forgetting_attention import triton as fox

    total, docs = 2_097_152, 131_072
    q, k, v = (_empty(total, HEADS, DIM) for _ in range(3))
    c = _empty(HEADS, total, dtype=torch.float32)
    cu = torch.empty(docs + 1, device="meta", dtype=torch.int32)
    o, lse = fox._forward(q, k, v, c, cu, 16, DIM**-0.5, None)
    fox._backward(_empty(total, HEADS, DIM), q, k, v, c, o, lse, cu, 16, DIM**-0.5, None)
    x = _empty(1, total, HEADS, dtype=torch.float32)
    fox_scan = pytest.importorskip("hf_hybrid.kernels.forgetting_attention.cumulative")
    fox_scan._scan(x, torch.empty_like(x), cu, HEADS, (HEADS, 1), (HEADS, 1), False)
    _assert_within_limits(launches, "forgetting_attention (packed)")


@pytest.mark.parametrize("batch,seq", SHAPES)
def test_forgetting_attention_sdpa_augmentation(launches, batch, seq):
    from hf_hybrid.kernels.forgetting_attention.sdpa import _augmented

    q, k = _empty(batch, seq, HEADS, DIM), _empty(batch, seq, HEADS, DIM)
    _augmented(q, k, _empty(HEADS, batch * seq, dtype=torch.float32), DIM**-0.5)
    _assert_within_limits(launches, "forgetting_attention sdpa")


@pytest.mark.parametrize("batch,seq", SHAPES)
def test_residual_linear_attention(launches, batch, seq):
    from hf_hybrid.kernels.residual_linear_attention.triton import residual_linear_attention_triton

    for fuse, kv_heads in ((False, HEADS), (True, 4)):
        q = _empty(batch, seq, HEADS, DIM, grad=True)
        k, v = _empty(batch, seq, kv_heads, DIM, grad=True), _empty(batch, seq, kv_heads, DIM, grad=True)
        out, final = residual_linear_attention_triton(q, k, v, 512, "softmax", state_every=16, fuse_halves=fuse)
        _backward(out, final)
    _assert_within_limits(launches, "residual_linear_attention")


@pytest.mark.parametrize("rows", [128, 131_072])
def test_decode_steps(launches, rows):
    """One query per row over a 131,072-token cache, batches up to 131,072 rows."""
    from hf_hybrid.kernels.chunk_attention.decode import chunk_end_decode_triton
    from hf_hybrid.kernels.forgetting_attention.decode_triton import forgetting_attention_decode_triton
    from hf_hybrid.kernels.residual_linear_attention.triton import residual_linear_attention_decode_triton

    keys = 131_072
    q = _empty(rows, 1, HEADS, DIM)
    cache = _empty(rows, keys, HEADS, DIM)
    chunk_end_decode_triton(q, q, q, cache, cache, torch.empty(rows, 1, device="meta", dtype=torch.int64))
    forgetting_attention_decode_triton(q, cache, cache, _empty(rows, 1, HEADS, dtype=torch.float32),
                                       _empty(rows, keys, HEADS, dtype=torch.float32),
                                       torch.empty(rows, device="meta", dtype=torch.int64))
    state = torch.empty(rows, HEADS, 2 * DIM, DIM, device="meta", dtype=torch.float32)
    residual_linear_attention_decode_triton(q[:, 0], state, q[:, 0], q[:, 0], None, "softmax", True)
    _assert_within_limits(launches, "decode")


@pytest.mark.parametrize("batch,seq", SHAPES)
def test_block_end_attention_sdpa_ends(launches, batch, seq):
    """RAT's chunk ends on the dense fused attention: the row kernels around the dense call."""
    from hf_hybrid.kernels.chunk_attention import sdpa_ends

    q = _empty(batch, seq, 2, DIM)
    k, v = _empty(batch, seq, HEADS, DIM), _empty(batch, seq, HEADS, DIM)
    sdpa_ends._query_slots(q, HEADS, 16, sdpa_ends._num_slots(seq, 16))
    _assert_within_limits(launches, "sdpa_ends")


@pytest.mark.parametrize("batch,seq", SHAPES)
def test_span_block_rows(launches, batch, seq):
    from hf_hybrid.kernels.span_expanded_attention.block_rows import gather_blocks

    k, v = _empty(batch, seq, HEADS, DIM), _empty(batch, seq, HEADS, DIM)
    blocks = torch.empty(batch, 4, HEADS, 8, device="meta", dtype=torch.int32)
    gather_blocks(k, v, blocks, 64)
    _assert_within_limits(launches, "span_expanded_attention")
