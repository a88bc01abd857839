"""RAT's chunk-end attention on the dense fused kernel (kernels/chunk_attention/sdpa_ends.py) ==
the masked reference, forward and every gradient (q shared by groups of heads, output gate, odd
lengths, several rows). CPU: PyTorch's flash CPU kernel + the Triton interpreter; `gpu`: cuDNN."""
import pytest
import torch

from hf_hybrid.kernels.chunk_attention import block_end_attention, block_end_attention_reference

pytest.importorskip("hf_hybrid.kernels.chunk_attention.sdpa_ends_triton")
from test_chunk_attention import DEVICE, _grads, _randn  # noqa: E402  (the Triton path's helpers)


def _reference(q, k, v, gate, L):
    heads = k.shape[2]
    out = block_end_attention_reference(q.repeat(1, 1, heads // q.shape[2], 1).double(), k.double(), v.double(), L)
    return out if gate is None else torch.sigmoid(gate.double()) * out


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("batch,seq,heads,groups,L,gated", [
    (1, 37, 2, 2, 4, True),    # odd length: the last chunk is open, its slots padded
    (2, 40, 4, 2, 8, True),    # q shared by 2 heads, two rows, whole chunks
    (1, 23, 2, 1, 1, False),   # L = 1: dense causal attention, no gate
    (1, 9, 2, 2, 8, True),     # one chunk end only
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_ends_match_reference(batch, seq, heads, groups, L, gated, dtype):
    dim = 64  # the smallest head size the path takes
    q = _randn(batch, seq, groups, dim, dtype=dtype, seed=0)
    k, v, gate = (_randn(batch, seq, heads, dim, dtype=dtype, seed=s) for s in (1, 2, 3))
    weight = _randn(batch, seq, heads, dim, seed=9)
    names = ["out", "dq", "dk", "dv"] + (["dgate"] if gated else [])
    inputs = [q, k, v] + ([gate] if gated else [])
    got = _grads(lambda q, k, v, g=None: block_end_attention(q, k, v, L, backend="sdpa", output_gate=g), inputs, weight)
    ref = _grads(lambda q, k, v, g=None: _reference(q, k, v, g, L), inputs, weight)
    with torch.no_grad():  # without a backward the merge stores y only: the same output
        plain = block_end_attention(q, k, v, L, backend="sdpa", output_gate=gate if gated else None)
    torch.testing.assert_close(plain, got[0], atol=0, rtol=0)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5  # bf16: as the Triton path's tests
    for name, a, b in zip(names, got, ref):
        assert a.dtype == dtype and a.shape == b.shape, name
        assert _rel(a, b) < tol, f"{name}: relative error {_rel(a, b):.2e}"


def test_sdpa_ends_without_ends_and_errors():
    q, k, v = (_randn(1, 4, 2, 64, seed=s) for s in range(3))
    # no chunk is complete before any query: the own value (through the gate)
    torch.testing.assert_close(block_end_attention(q, k, v, 8, backend="sdpa"), v)
    with pytest.raises(ValueError, match="local_window"):
        block_end_attention(q, k, v, 2, local_window=3, backend="sdpa")
    with pytest.raises(ValueError, match="head_dim"):
        small = _randn(1, 12, 2, 16)
        block_end_attention(small, small, small, 2, backend="sdpa")


def test_auto_keeps_triton_off_cuda_and_for_fp32(monkeypatch):
    """The automatic choice takes the dense path only on CUDA in fp16 / bf16 with RAT's geometry,
    and the environment switch turns it off for A/B timings."""
    from hf_hybrid.kernels.chunk_attention import sdpa_ends

    cpu = torch.zeros(1, 64, 2, 64)
    assert not sdpa_ends.applies(cpu, cpu, 16, 0, 0)
    monkeypatch.setenv(sdpa_ends.ENV_SWITCH, "cudnn")
    with pytest.raises(ValueError, match=sdpa_ends.ENV_SWITCH):
        sdpa_ends.applies(cpu, cpu, 16, 0, 0)
    monkeypatch.delenv(sdpa_ends.ENV_SWITCH)
    if torch.cuda.is_available():
        x = torch.zeros(1, 64, 2, 64, device="cuda", dtype=torch.bfloat16)
        assert not sdpa_ends.applies(x.float(), x.float(), 16, 0, 0)
        assert not sdpa_ends.applies(x, x, 16, 4, 0)
        monkeypatch.setenv(sdpa_ends.ENV_SWITCH, "triton")
        assert not sdpa_ends.applies(x, x, 16, 0, 0)


def _rat_inputs(seq):
    q = _randn(1, seq, 2, 128, dtype=torch.bfloat16, seed=0)
    k, v, gate = (_randn(1, seq, 16, 128, dtype=torch.bfloat16, seed=s) for s in (1, 2, 3))
    return [q, k, v, gate], _randn(1, seq, 16, 128, seed=9)


@pytest.mark.gpu
def test_gpu_sdpa_ends_real_shapes():
    """bf16 at RAT's shapes (L = 16, 2 q groups, 16 heads of 128) on cuDNN: against the float32
    reference and against the Triton kernels."""
    inputs, weight = _rat_inputs(4099)
    got = _grads(lambda *t: block_end_attention(*t[:3], 16, backend="sdpa", output_gate=t[3]), inputs, weight)
    ref = _grads(lambda *t: _reference(*(x.float() for x in t[:3]), t[3].float(), 16), inputs, weight)
    tri = _grads(lambda *t: block_end_attention(*t[:3], 16, backend="triton", output_gate=t[3]), inputs, weight)
    for name, a, b, c in zip(["out", "dq", "dk", "dv", "dgate"], got, ref, tri):
        assert _rel(a, b) < 1e-2, f"{name}: relative error {_rel(a, b):.2e}"
        assert _rel(a, c) < 1e-2, f"{name}: against Triton {_rel(a, c):.2e}"


@pytest.mark.gpu
def test_gpu_auto_takes_sdpa_for_long_sequences():
    """From MIN_ENDS chunk ends on, "auto" takes the dense path; it agrees with the Triton kernels."""
    from hf_hybrid.kernels.chunk_attention import sdpa_ends

    seq = 16 * sdpa_ends.MIN_ENDS + 21
    inputs, weight = _rat_inputs(seq)
    assert sdpa_ends.applies(inputs[0], inputs[1], 16, 0, 0)
    assert not sdpa_ends.applies(inputs[0][:, :seq // 2], inputs[1][:, :seq // 2], 16, 0, 0)
    got = _grads(lambda *t: block_end_attention(*t[:3], 16, output_gate=t[3]), inputs, weight)
    tri = _grads(lambda *t: block_end_attention(*t[:3], 16, backend="triton", output_gate=t[3]), inputs, weight)
    for name, a, c in zip(["out", "dq", "dk", "dv", "dgate"], got, tri):
        assert _rel(a, c) < 1e-2, f"{name}: against Triton {_rel(a, c):.2e}"


def test_sdpa_ends_compile_fullgraph_matches_eager():
    """One node per direction under torch.compile (custom ops), equal to eager."""
    q = _randn(1, 13, 1, 64, seed=0)
    k, v, gate = (_randn(1, 13, 2, 64, seed=s).requires_grad_() for s in (1, 2, 3))
    q.requires_grad_()

    def step(q, k, v, gate):
        return block_end_attention(q, k, v, 4, backend="sdpa", output_gate=gate).square().sum()

    inputs = (q, k, v, gate)
    eager = torch.autograd.grad(step(*inputs), inputs)
    torch._dynamo.reset()
    compiled = torch.autograd.grad(torch.compile(step, fullgraph=True, backend="aot_eager")(*inputs), inputs)
    for name, a, b in zip(["dq", "dk", "dv", "dgate"], compiled, eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
