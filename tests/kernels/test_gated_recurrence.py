"""Triton gated recurrence == the loop reference, forward and every gradient (x, g, initial_state).

On CPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1), so
the CPU cases are tiny; the `gpu` cases repeat the comparison at real shapes.
"""
import pytest
import torch

from hf_hybrid.kernels.gated_recurrence import gated_recurrence, gated_recurrence_scan

triton_mod = pytest.importorskip("hf_hybrid.kernels.gated_recurrence.triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(batch, seq, shape, dtype, with_state, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, *shape, generator=gen).to(DEVICE, dtype)
    g = torch.rand(batch, seq, *shape, generator=gen).mul(0.9).add(0.05).to(DEVICE, torch.float32)
    state = torch.randn(batch, *shape, generator=gen).to(DEVICE, dtype) if with_state else None
    return x, g, state


def _run(backend, x, g, chunk_size, start, state, weight):
    leaves = [t.detach().clone().requires_grad_() for t in (x, g)]
    state_leaf = state.detach().clone().requires_grad_() if state is not None else None
    h = gated_recurrence(*leaves, chunk_size, start, state_leaf, backend=backend)
    (h.float() * weight).sum().backward()
    grads = [leaf.grad for leaf in leaves]
    if state_leaf is not None:  # the reference leaves it unused when a restart comes first
        grads.append(state_leaf.grad if state_leaf.grad is not None else torch.zeros_like(state_leaf))
    return [h] + grads


def _compare(x, g, chunk_size, start, state, atol, rtol):
    weight = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(x.device)
    ref = _run("reference", x.double() if x.dtype == torch.float32 else x, g, chunk_size, start,
               state.double() if state is not None and state.dtype == torch.float32 else state, weight)
    out = _run("triton", x, g, chunk_size, start, state, weight)
    names = ["h", "dx", "dg", "d_initial_state"]
    for name, a, b in zip(names, out, ref):
        assert a.dtype == b.dtype or x.dtype == torch.float32, f"{name}: dtype {a.dtype} vs {b.dtype}"
        torch.testing.assert_close(a.double(), b.double(), atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize(
    "seq,chunk_size,start,with_state",
    [
        (37, 0, 0, False),   # RAT+: full sequence, odd length
        (37, 0, 5, True),    # carried state
        (40, 4, 0, True),    # RAT: restart at t=0 ignores the state (its gradient is zero)
        (33, 4, 3, True),    # continuation inside a chunk: state feeds the first partial chunk
        (29, 16, 7, True),
        (23, 1, 0, False),   # L = 1: every step restarts, h = (1 - g) x
    ],
)
def test_fp32_matches_reference(seq, chunk_size, start, with_state):
    x, g, state = _inputs(2, seq, (2, 3), torch.float32, with_state)
    _compare(x, g, chunk_size, start, state, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk_size,start", [(0, 0), (6, 2), (200, 3)])
def test_multi_segment_carry(monkeypatch, chunk_size, start):
    """The three-pass path (full sequence or chunks longer than MAX_DIRECT_CHUNK) across many
    segments and several carry groups, made cheap by shrinking the segment and group sizes."""
    monkeypatch.setattr(triton_mod, "GENERAL_SEGMENT", 4)
    monkeypatch.setattr(triton_mod, "CARRY_UNROLL", 4)
    monkeypatch.setattr(triton_mod, "MAX_DIRECT_CHUNK", 4)
    x, g, state = _inputs(1, 39, (3,), torch.float32, True, seed=3)
    _compare(x, g, chunk_size, start, state, atol=1e-5, rtol=1e-5)


def test_bf16_matches_reference_loosely():
    x, g, state = _inputs(2, 35, (2, 16), torch.bfloat16, True, seed=4)
    _compare(x, g, 8, 5, state, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("backend", ["triton", "scan"])
@pytest.mark.parametrize("chunk_size,start", [(0, 3), (4, 0)])
def test_float32_states_from_bf16_inputs(backend, chunk_size, start):
    """out_dtype=float32 with bf16 x (RAT+'s keys and values) == the recurrence of x.float(): the
    same states and gate / state gradients bit for bit; dx is the same float32 value rounded to bf16
    by the kernel instead of by x.float()'s backward (Triton's interpreter truncates: 1 ulp)."""
    x, g, state = _inputs(2, 21, (2, 8), torch.bfloat16, True, seed=5)
    state = state.float()
    weight = torch.randn(x.shape, generator=torch.Generator().manual_seed(2)).to(x.device)

    def run(fn):
        leaves = [t.detach().clone().requires_grad_() for t in (x, g, state)]
        h = fn(*leaves)
        (h * weight).sum().backward()
        return [h] + [leaf.grad for leaf in leaves]

    got = run(lambda x, g, s: gated_recurrence(x, g, chunk_size, start, s, backend=backend, out_dtype=torch.float32))
    want = run(lambda x, g, s: gated_recurrence(x.float(), g, chunk_size, start, s, backend=backend))
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.bfloat16
    for name, a, b in zip(["h", "dx", "dg", "d_state"], got, want):
        exact = name != "dx"
        torch.testing.assert_close(a, b, rtol=0 if exact else 2**-7, atol=0, msg=lambda m: f"{name}: {m}")
    with pytest.raises(ValueError, match="out_dtype"):
        gated_recurrence(x, g, backend=backend, out_dtype=torch.float16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_size,start,with_state", [(0, 0, False), (0, 3, True), (8, 0, False), (8, 5, True), (8, 8, True)])
def test_scan_backward_is_the_loop_gradient(chunk_size, start, with_state, dtype):
    """The scan's backward (the reverse recurrence, not autograd through its log-depth steps) gives
    the loop oracle's gradients, restarts and the carried state included, at an odd length."""
    x, g, state = _inputs(2, 53, (3, 4), dtype, with_state, seed=7)
    weight = torch.randn(x.shape, generator=torch.Generator().manual_seed(3)).to(x.device)
    want = _run("reference", x, g, chunk_size, start, state, weight)
    got = _run("scan", x, g, chunk_size, start, state, weight)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for name, a, b in zip(["h", "dx", "dg", "d_initial_state"], got, want):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, **tol, msg=lambda m: f"{name}: {m}")


def test_dispatch_and_errors():
    x, g, _ = _inputs(1, 5, (2,), torch.float32, False)
    with pytest.raises(ValueError, match="same shape"):
        gated_recurrence(x, g[:, :4], backend="triton")
    with pytest.raises(ValueError, match="chunk_size"):
        gated_recurrence(x, g, chunk_size=-1, backend="triton")
    empty = gated_recurrence(x[:, :0], g[:, :0], backend="triton")
    assert empty.shape == (1, 0, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("chunk_size,start", [(16, 0), (16, 9), (0, 0), (64, 0), (512, 100)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_real_shapes(chunk_size, start, dtype):
    x, g, state = _inputs(2, 4099, (16, 128), dtype, True, seed=5)
    weight = torch.randn(x.shape, device=x.device)
    out = _run("triton", x, g, chunk_size, start, state, weight)
    ref = _run("scan", x.double(), g.double(), chunk_size, start, state.double(), weight)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for name, a, b in zip(["h", "dx", "dg", "d_initial_state"], out, ref):
        err = (a.double() - b).norm() / b.norm().clamp_min(1e-12)
        assert err < tol, f"{name}: relative error {err:.2e}"
