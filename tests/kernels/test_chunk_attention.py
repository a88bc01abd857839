"""Triton block-end / chunk-end attention == the dense masked references, forward and all gradients.

CPU cases run in Triton's interpreter with tiny shapes and 16 x 16 tiles (several tiles per
sequence, so the unmasked, masked and ragged loops all run); `gpu` cases use real shapes and the
H100 tile sizes.
"""
import pytest
import torch

from hf_hybrid.kernels.chunk_attention import (
    block_end_attention,
    block_end_attention_reference,
    chunk_end_attention,
    chunk_end_attention_reference,
    chunk_ends,
    query_chunk_index,
)

pytest.importorskip("hf_hybrid.kernels.chunk_attention.triton")
from hf_hybrid.kernels.chunk_attention.decode import chunk_end_decode_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def _grads(fn, inputs, weight):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    (out.float() * weight).sum().backward()
    return [out] + [leaf.grad for leaf in leaves]


def _assert_close(out, ref, names, atol, rtol):
    for name, a, b in zip(names, out, ref):
        torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")


BLOCK_CASES = [
    # batch, seq, heads, head_dim, block_size (D), local_window (W), sinks (S)
    (1, 37, 2, 16, 4, 0, 0),    # RAT(L=4): chunk ends + own, odd length
    (2, 40, 1, 32, 5, 3, 2),    # RAT+ D=5 with a window and sinks
    (1, 35, 2, 16, 3, 17, 4),   # window longer than a tile
    (1, 33, 1, 16, 1, 0, 0),    # D = 1: dense causal attention
    (1, 34, 1, 16, 2, 0, 0),    # many ends per tile: unmasked loops run
    (1, 33, 1, 16, 8, 20, 17),  # sinks beyond the first block end
    (1, 29, 1, 16, 40, 0, 0),   # D > T: own token only
]


@pytest.mark.parametrize("batch,seq,heads,head_dim,D,W,S", BLOCK_CASES)
def test_block_end_fp32(batch, seq, heads, head_dim, D, W, S):
    inputs = [_randn(batch, seq, heads, head_dim, seed=i) for i in range(3)]
    weight = _randn(batch, seq, heads, head_dim, seed=9)
    ref = _grads(lambda q, k, v: block_end_attention_reference(q.double(), k.double(), v.double(), D, W, S), inputs, weight)
    out = _grads(lambda q, k, v: block_end_attention(q, k, v, D, W, S, backend="triton"), inputs, weight)
    _assert_close(out, ref, ["out", "dq", "dk", "dv"], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("D,W,S", [(4, 0, 0), (3, 5, 4)])
def test_block_end_bf16(D, W, S):
    inputs = [_randn(2, 39, 2, 32, dtype=torch.bfloat16, seed=i) for i in range(3)]
    weight = _randn(2, 39, 2, 32, seed=9)
    ref = _grads(lambda q, k, v: block_end_attention_reference(q, k, v, D, W, S), inputs, weight)
    out = _grads(lambda q, k, v: block_end_attention(q, k, v, D, W, S, backend="triton"), inputs, weight)
    _assert_close(out, ref, ["out", "dq", "dk", "dv"], atol=4e-2, rtol=4e-2)
    gate = _randn(2, 39, 2, 32, dtype=torch.bfloat16, seed=5)  # with the output gate: dO rounded as stored
    ref = _grads(lambda q, k, v, g: block_end_attention(q, k, v, D, W, S, backend="reference", output_gate=g), inputs + [gate], weight)
    out = _grads(lambda q, k, v, g: block_end_attention(q, k, v, D, W, S, backend="triton", output_gate=g), inputs + [gate], weight)
    _assert_close(out, ref, ["out", "dq", "dk", "dv", "dgate"], atol=4e-2, rtol=4e-2)


@pytest.mark.parametrize("seq,L,start,chunks", [(37, 4, 0, 10), (21, 4, 13, 12), (18, 3, 0, 6)])
def test_chunk_end_fp32(seq, L, start, chunks):
    q, k, v = [_randn(2, seq, 2, 16, seed=i) for i in range(3)]
    ke, ve = [_randn(2, chunks, 2, 16, seed=5 + i) for i in range(2)]
    weight = _randn(2, seq, 2, 16, seed=9)
    qc = query_chunk_index(2, seq, L, start, q.device)
    ref = _grads(lambda *t: chunk_end_attention_reference(*(x.double() for x in t), qc), [q, k, v, ke, ve], weight)
    out = _grads(lambda *t: chunk_end_attention(*t, query_chunk=qc, backend="triton"), [q, k, v, ke, ve], weight)
    _assert_close(out, ref, ["out", "dq", "dk_own", "dv_own", "dk_ends", "dv_ends"], atol=2e-5, rtol=2e-5)


def test_chunk_end_per_row_chunks():
    """Rows at different positions (left padding): per-row query_chunk, including clipped values."""
    q, k, v = [_randn(2, 19, 1, 16, seed=i) for i in range(3)]
    ke, ve = [_randn(2, 7, 1, 16, seed=5 + i) for i in range(2)]
    qc = torch.stack([torch.arange(19) // 3, (torch.arange(19) + 5) // 3]).clamp(max=7).to(DEVICE)
    weight = _randn(2, 19, 1, 16, seed=9)
    ref = _grads(lambda *t: chunk_end_attention_reference(*(x.double() for x in t), qc), [q, k, v, ke, ve], weight)
    out = _grads(lambda *t: chunk_end_attention(*t, query_chunk=qc, backend="triton"), [q, k, v, ke, ve], weight)
    _assert_close(out, ref, ["out", "dq", "dk_own", "dv_own", "dk_ends", "dv_ends"], atol=2e-5, rtol=2e-5)


def test_rat_block_and_compact_agree():
    """RAT in both layouts: block_end over k~ itself == chunk_end over its strided chunk ends."""
    q, k, v = [_randn(1, 30, 2, 16, seed=i) for i in range(3)]
    block = block_end_attention(q, k, v, 4, backend="triton")
    compact = chunk_end_attention(q, k, v, chunk_ends(k, 4), chunk_ends(v, 4), chunk_size=4, backend="triton")
    torch.testing.assert_close(block, compact, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("batch,seq,heads,head_dim,D", [c[:5] for c in BLOCK_CASES if c[5] == 0 and c[6] == 0])
def test_block_end_atomic_dq(monkeypatch, batch, seq, heads, head_dim, D):
    """ATOMIC_DQ (dQ of the ends added by the dK/dV kernel with float32 atomics, the own pair's by
    the row-wise kernel): the same gradients as the reference, with shared q heads and the gate too;
    window / sink geometries keep the dQ kernel."""
    from hf_hybrid.kernels.chunk_attention import triton as kernels

    monkeypatch.setattr(kernels, "ATOMIC_DQ", True)
    inputs = [_randn(batch, seq, heads, head_dim, seed=i) for i in range(3)]
    weight = _randn(batch, seq, heads, head_dim, seed=9)
    ref = _grads(lambda q, k, v: block_end_attention_reference(q.double(), k.double(), v.double(), D), inputs, weight)
    out = _grads(lambda q, k, v: block_end_attention(q, k, v, D, backend="triton"), inputs, weight)
    _assert_close(out, ref, ["out", "dq", "dk", "dv"], atol=2e-5, rtol=2e-5)
    q = _randn(batch, seq, 1, head_dim, seed=4)  # one q head shared by every head, and the output gate
    k, v, gate = (_randn(batch, seq, 2, head_dim, seed=s) for s in (5, 6, 7))
    weight = _randn(batch, seq, 2, head_dim, seed=8)
    got = _grads(lambda q, k, v, g: block_end_attention(q, k, v, D, backend="triton", output_gate=g), [q, k, v, gate], weight)
    want = _grads(lambda q, k, v, g: block_end_attention(q.repeat(1, 1, 2, 1).double(), k.double(), v.double(), D,
                                                         backend="reference", output_gate=g.double()), [q, k, v, gate], weight)
    _assert_close(got, want, ["out", "dq", "dk", "dv", "dgate"], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("D,W,S", [(4, 0, 0), (5, 3, 2)])
def test_block_end_shared_query_heads(backend, D, W, S):
    """q with G < H heads (head h reads q head h % G, RAT's sharing) equals q expanded to every
    head: every Triton kernel reads it in place, and dq sums the heads sharing a q head."""
    q = _randn(2, 21, 2, 16, seed=0)
    k, v = _randn(2, 21, 4, 16, seed=1), _randn(2, 21, 4, 16, seed=2)
    expanded = q.repeat(1, 1, 2, 1)  # [.., 4, ..]: head h = q head h % 2
    with torch.no_grad():
        torch.testing.assert_close(
            block_end_attention(q, k, v, D, W, S, backend=backend),
            block_end_attention(expanded, k, v, D, W, S, backend=backend), atol=1e-6, rtol=1e-6,
        )
    weight = _randn(2, 21, 4, 16, seed=9)
    grouped = _grads(lambda q, k, v: block_end_attention(q, k, v, D, W, S, backend=backend), [q, k, v], weight)
    full = _grads(lambda q, k, v: block_end_attention(q.repeat(1, 1, 2, 1), k, v, D, W, S, backend=backend), [q, k, v], weight)
    _assert_close(grouped, full, ["out", "dq", "dk", "dv"], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="divisor"):
        block_end_attention(_randn(2, 21, 3, 16), k, v, D, W, S, backend=backend)


@pytest.mark.parametrize("grad", [False, True])
def test_block_end_output_gate(grad):
    """output_gate: sigmoid(gate) * attention in the forward kernel's epilogue, its gradient (and the
    attention's dO) from the row-wise backward kernel; equal to the reference either way (and shared
    q heads combine with it)."""
    q = _randn(2, 19, 2, 16, seed=0)
    k, v, gate = (_randn(2, 19, 4, 16, seed=s) for s in (1, 2, 3))
    want = block_end_attention_reference(q.repeat(1, 1, 2, 1).double(), k.double(), v.double(), 4)
    want = torch.sigmoid(gate.double()) * want
    if grad:
        weight = _randn(2, 19, 4, 16, seed=9)
        got = _grads(lambda q, k, v, g: block_end_attention(q, k, v, 4, backend="triton", output_gate=g), [q, k, v, gate], weight)
        ref = _grads(lambda q, k, v, g: block_end_attention(q.repeat(1, 1, 2, 1).double(), k.double(), v.double(), 4,
                                                            backend="reference", output_gate=g.double()), [q, k, v, gate], weight)
        _assert_close(got, ref, ["out", "dq", "dk", "dv", "dgate"], atol=2e-5, rtol=2e-5)
        # a gate without gradient of its own (only q, k, v train), and a gate that alone trains
        fixed_gate = _grads(lambda q, k, v: block_end_attention(q, k, v, 4, backend="triton", output_gate=gate), [q, k, v], weight)
        _assert_close(fixed_gate, ref[:4], ["out", "dq", "dk", "dv"], atol=2e-5, rtol=2e-5)
        gate_only = _grads(lambda g: block_end_attention(q, k, v, 4, backend="triton", output_gate=g), [gate], weight)
        _assert_close(gate_only, [ref[0], ref[4]], ["out", "dgate"], atol=2e-5, rtol=2e-5)
    else:
        with torch.no_grad():
            got = block_end_attention(q, k, v, 4, backend="triton", output_gate=gate)
        torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=2e-6)
    with pytest.raises(ValueError, match="output_gate"):
        block_end_attention(q, k, v, 4, output_gate=gate[:, :, :2])


def test_decode_matches_reference():
    q, k, v = [_randn(3, 1, 2, 32, seed=i) for i in range(3)]
    cache_k, cache_v = [_randn(3, 80, 2, 32, seed=5 + i) for i in range(2)]  # preallocated, partly filled
    qc = torch.tensor([[0], [17], [80]], device=DEVICE)
    ref = chunk_end_attention_reference(q, k, v, cache_k, cache_v, qc)
    torch.testing.assert_close(chunk_end_decode_triton(q, k, v, cache_k, cache_v, qc), ref, atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # the public op routes seq = 1 without gradients to the decode kernel
        routed = chunk_end_attention(q, k, v, cache_k[:, :40], cache_v[:, :40], query_chunk=qc.clamp(max=40), backend="triton")
    torch.testing.assert_close(routed, chunk_end_attention_reference(q, k, v, cache_k[:, :40], cache_v[:, :40], qc.clamp(max=40)))


def test_errors_name_the_problem():
    q = _randn(1, 8, 1, 12)
    with pytest.raises(ValueError, match="head_dim"):
        block_end_attention(q, q, q, 4, backend="triton")
    with pytest.raises(ValueError, match="block_size"):
        block_end_attention(q, q, q, 0, backend="triton")
    assert block_end_attention(q, q, q, 4).shape == q.shape  # auto falls back to the reference off-fit


# ---------------------------------------------------------------------------------------------- GPU


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12)).item()


@pytest.mark.gpu
@pytest.mark.parametrize("D,W,S", [(16, 0, 0), (64, 0, 0), (16, 256, 4), (8, 100, 4), (1, 0, 0)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_block_end_real_shapes(D, W, S, dtype):
    """Exactness bounds against float64: fp32 <= 1e-5 (fp32 dots run as three TF32
    products; one TF32 product was at ~1e-3), bf16 <= 1e-2, output and every gradient."""
    q, k, v = [_randn(1, 2051, 4, 128, dtype=dtype, seed=i) for i in range(3)]
    weight = _randn(1, 2051, 4, 128, seed=9)
    ref = _grads(lambda q, k, v: block_end_attention_reference(q.double(), k.double(), v.double(), D, W, S),
                 [q, k, v], weight)
    out = _grads(lambda q, k, v: block_end_attention(q, k, v, D, W, S, backend="triton"), [q, k, v], weight)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for name, a, b in zip(["out", "dq", "dk", "dv"], out, ref):
        assert _rel(a, b) < tol, f"{name}: relative error {_rel(a, b):.2e}"


@pytest.mark.gpu
def test_gpu_chunk_end_fp32_against_float64():
    """The compact chunk-end op's fp32 path: <= 1e-5 against float64, output and every gradient."""
    q, k, v = [_randn(2, 700, 4, 64, seed=i) for i in range(3)]
    ke, ve = [_randn(2, 60, 4, 64, seed=5 + i) for i in range(2)]
    qc = query_chunk_index(2, 700, 16, 250, q.device)
    weight = _randn(2, 700, 4, 64, seed=9)
    ref = _grads(lambda *t: chunk_end_attention_reference(*(x.double() for x in t), qc), [q, k, v, ke, ve], weight)
    out = _grads(lambda *t: chunk_end_attention(*t, query_chunk=qc, backend="triton"), [q, k, v, ke, ve], weight)
    for name, a, b in zip(["out", "dq", "dk_own", "dv_own", "dk_ends", "dv_ends"], out, ref):
        assert _rel(a, b) < 1e-5, f"{name}: relative error {_rel(a, b):.2e}"


@pytest.mark.gpu
def test_gpu_chunk_end_and_decode_real_shapes():
    q, k, v = [_randn(2, 1500, 8, 128, dtype=torch.bfloat16, seed=i) for i in range(3)]
    ke, ve = [_randn(2, 200, 8, 128, dtype=torch.bfloat16, seed=5 + i) for i in range(2)]
    qc = query_chunk_index(2, 1500, 16, 1700, q.device)
    weight = _randn(2, 1500, 8, 128, seed=9)
    ref = _grads(lambda *t: chunk_end_attention_reference(*(x.float() for x in t), qc), [q, k, v, ke, ve], weight)
    out = _grads(lambda *t: chunk_end_attention(*t, query_chunk=qc), [q, k, v, ke, ve], weight)
    for name, a, b in zip(["out", "dq", "dk_own", "dv_own", "dk_ends", "dv_ends"], out, ref):
        assert _rel(a, b) < 2e-2, f"{name}: relative error {_rel(a, b):.2e}"
    qd, kd, vd = q[:, :1], k[:, :1], v[:, :1]
    qcd = torch.randint(0, 201, (2, 1), device=q.device)
    ref = chunk_end_attention_reference(qd.float(), kd.float(), vd.float(), ke.float(), ve.float(), qcd)
    assert _rel(chunk_end_decode_triton(qd, kd, vd, ke, ve, qcd), ref) < 1e-2
