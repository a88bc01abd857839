"""RATTENTION local-layer ops: residual linear attention (RLA) and sliding-window attention (SWA).

Oracles: a token-by-token loop of the paper's Eq. 4 (S_t = S_{t-1} + phi(k_t)^T v_t, o_t = phi(q_t)
S_{t-w-1}), which checks the explicit-mask reference; the reference then checks the chunked
PyTorch form, the Triton kernel (CPU interpreter here, real shapes under the `gpu` marker) and
the decode helper, forward and backward, float32 and bfloat16, odd lengths.
"""
from __future__ import annotations

import pytest
import torch

from hf_hybrid.kernels._backend import triton_interpreting
from hf_hybrid.kernels.residual_linear_attention import (
    feature_dim,
    feature_map_fn,
    lagged_mask,
    residual_linear_attention,
    residual_linear_attention_chunked,
    residual_linear_attention_decode,
    residual_linear_attention_reference,
    sliding_window_attention,
    sliding_window_attention_reference,
)
from hf_hybrid.kernels.residual_linear_attention.sliding_window import band_mask

# Triton runs compiled on CUDA and in the CPU interpreter (conftest sets TRITON_INTERPRET=1) elsewhere.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    DEVICE == "cpu" and not triton_interpreting(), reason="needs CUDA or TRITON_INTERPRET=1"
)




def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def inputs(batch, seq, heads, kv_heads, dim, dtype=torch.float32, device="cpu", state=False, feature_map="softmax"):
    q = torch.randn(batch, seq, heads, dim, device=device).to(dtype).requires_grad_()
    k = torch.randn(batch, seq, kv_heads, dim, device=device).to(dtype).requires_grad_()
    v = torch.randn(batch, seq, kv_heads, dim, device=device).to(dtype).requires_grad_()
    s0 = None
    if state:
        s0 = torch.randn(batch, kv_heads, feature_dim(feature_map, dim), dim, device=device).requires_grad_()
    return q, k, v, s0


def grads(fn, q, k, v, s0):
    """Output, final state and the gradients of a random projection of both."""
    o, final = fn(q, k, v, s0)
    gen = torch.Generator().manual_seed(7)
    do = torch.randn(o.shape, generator=gen).to(o.device)
    dfinal = torch.randn(final.shape, generator=gen).to(o.device)
    wrt = [t for t in (q, k, v, s0) if t is not None]
    loss = (o.float() * do).sum() + (final * dfinal).sum()
    return o, final, torch.autograd.grad(loss, wrt)


def assert_matches_reference_fp32(fn, q, k, v, s0, w, feature_map):
    """fn's output, final state and gradients equal the reference's to 1e-5 (float32)."""
    o, f, g = grads(fn, q, k, v, s0)
    o2, f2, g2 = grads(lambda *a: residual_linear_attention_reference(*a[:3], w, feature_map, a[3]), q, k, v, s0)
    assert rel(o, o2) < 1e-5 and rel(f, f2) < 1e-5
    for name, a, b in zip("q k v s0".split(), g, g2):
        assert rel(a, b) < 1e-5, name


# ---------------------------------------------------------------- the reference against Eq. 4


def eq4_loop(q, k, v, w, feature_map):
    """Eq. 4 literally: states S_t after each token, o_t read from S_{t-w-1} (zero before token 0)."""
    batch, seq, heads, dim = q.shape
    group = heads // k.shape[2]
    out = torch.zeros(batch, seq, heads, dim)
    for b in range(batch):
        for h in range(heads):
            states, s = [], torch.zeros(feature_dim(feature_map, dim), dim)
            for t in range(seq):
                s = s + torch.outer(feature_map_fn(k[b, t, h // group], feature_map), v[b, t, h // group].float())
                states.append(s)
            for t in range(seq):
                src = t - w - 1
                if src >= 0:
                    out[b, t, h] = feature_map_fn(q[b, t, h], feature_map) @ states[src]
    return out


@pytest.mark.parametrize("w", [-1, 0, 1, 4, 12, 30])
@pytest.mark.parametrize("feature_map", ["softmax", "relu", "identity"])
def test_reference_is_eq4(w, feature_map):
    torch.manual_seed(0)
    q, k, v, _ = inputs(1, 13, 2, 1, 8)
    o, final = residual_linear_attention_reference(q, k, v, w, feature_map)
    assert rel(o, eq4_loop(q, k, v, w, feature_map)) < 1e-6
    # final state = what token T reads before folding key T - w - 1: keys j <= T - 1 - (w + 1)
    last = max(13 - (w + 1), 0)
    expected = sum(
        (torch.outer(feature_map_fn(k[0, j, 0], feature_map), v[0, j, 0]) for j in range(last)),
        torch.zeros(feature_dim(feature_map, 8), 8),
    )
    assert torch.allclose(final[0, 0], expected, atol=1e-5)


def test_softmax_feature_map_is_two_softmaxes_over_head_dim():
    x = torch.randn(3, 5)
    phi = feature_map_fn(x, "softmax")
    assert phi.shape == (3, 10) and phi.dtype == torch.float32
    assert torch.allclose(phi[:, :5], torch.softmax(x, -1)) and torch.allclose(phi[:, 5:], torch.softmax(-x, -1))


@pytest.mark.parametrize("seq,w", [(17, 3), (17, 0), (9, 40)])
def test_swa_and_rla_partition_the_causal_past(seq, w):
    swa, rla = band_mask(seq, w, "cpu"), lagged_mask(seq, w)
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    assert not (swa & rla).any() and torch.equal(swa | rla, causal)
    assert int(swa[-1].sum()) == min(w + 1, seq)  # w keys to the left plus the token itself


# ---------------------------------------------------------------- chunked PyTorch form


@pytest.mark.parametrize(
    "seq,heads,kv_heads,w,feature_map,chunk",
    [(37, 4, 2, 5, "softmax", 8), (20, 2, 2, -1, "relu", 7), (16, 2, 1, 0, "identity", 16), (11, 2, 2, 11, "softmax", 4)],
)
def test_chunked_matches_reference_fwd_bwd(seq, heads, kv_heads, w, feature_map, chunk):
    torch.manual_seed(1)
    q, k, v, s0 = inputs(2, seq, heads, kv_heads, 16, state=True, feature_map=feature_map)
    o, f, g = grads(lambda *a: residual_linear_attention_chunked(*a[:3], w, feature_map, a[3], chunk_size=chunk), q, k, v, s0)
    o2, f2, g2 = grads(lambda *a: residual_linear_attention_reference(*a[:3], w, feature_map, a[3]), q, k, v, s0)
    assert rel(o, o2) < 1e-5 and rel(f, f2) < 1e-5
    for a, b in zip(g, g2):
        assert (a - b).abs().max() < 1e-4 * max(1.0, b.abs().max().item())


# ---------------------------------------------------------------- Triton kernel (interpreter on CPU)


TRITON_CASES = [
    # batch, seq, heads, kv_heads, dim, w, feature_map, state_every (None: one segment on CPU), fuse_halves
    (2, 37, 2, 1, 32, 5, "softmax", None, True),
    (1, 40, 2, 2, 16, -1, "softmax", 1, False),
    (1, 33, 4, 2, 32, 0, "relu", 2, True),
    (2, 35, 4, 2, 32, 2, "softmax", 1, True),
    (1, 37, 4, 1, 32, 6, "relu", None, False),
    (1, 21, 2, 2, 16, 3, "identity", 1, None),
]


@needs_triton
@pytest.mark.parametrize("batch,seq,heads,kv_heads,dim,w,feature_map,state_every,fuse", TRITON_CASES)
def test_triton_matches_reference_fp32(batch, seq, heads, kv_heads, dim, w, feature_map, state_every, fuse):
    torch.manual_seed(2)
    q, k, v, s0 = inputs(batch, seq, heads, kv_heads, dim, device=DEVICE, state=True, feature_map=feature_map)

    def triton_fn(q, k, v, s0):
        return residual_linear_attention(
            q, k, v, w, feature_map, s0, backend="triton", state_every=state_every, fuse_halves=fuse
        )

    assert_matches_reference_fp32(triton_fn, q, k, v, s0, w, feature_map)


@needs_triton
@pytest.mark.parametrize(
    "feature_map,block_v,state_every,fuse,dtype,tol",
    [("softmax", 32, 2, False, torch.float32, 1e-5), ("relu", 32, 3, True, torch.float32, 1e-5),
     ("identity", 32, 2, None, torch.float32, 1e-5), ("softmax", 32, 1, False, torch.bfloat16, 2e-2)],
)
def test_triton_two_partials_and_segment_prefix_sums(feature_map, block_v, state_every, fuse, dtype, tol):
    """block_v = head_dim: each output is the sum of two partials (float32 atomics), or of one
    (identity: stored directly); five chunks in segments with an uneven last one, whose states
    and adjoints come from per-segment sums and prefix sums; an initial state."""
    torch.manual_seed(11)
    q, k, v, s0 = inputs(2, 75, 4, 2, 32, dtype=dtype, device=DEVICE, state=True, feature_map=feature_map)

    def triton_fn(q, k, v, s0):
        return residual_linear_attention(
            q, k, v, 6, feature_map, s0, backend="triton", block_v=block_v, state_every=state_every, fuse_halves=fuse
        )

    o, f, g = grads(triton_fn, q, k, v, s0)
    ref = [t.detach().float().requires_grad_() for t in (q, k, v)] + [s0.detach().clone().requires_grad_()]
    o2, f2, g2 = grads(lambda *a: residual_linear_attention_reference(*a[:3], 6, feature_map, a[3]), *ref)
    assert o.dtype == dtype and rel(o, o2) < tol and rel(f, f2) < tol
    for name, a, b in zip("q k v s0".split(), g, g2):
        assert rel(a, b) < tol, name


@needs_triton
@pytest.mark.parametrize("block_v,fuse", [(32, False), (16, False), (32, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_launch_per_half_gives_the_bits_of_one_launch_over_both(block_v, fuse, dtype):
    """half_launches: the first half's launch leaves its partials in float32 scratch and the
    second's adds them to its own and stores the result; one launch over both halves adds the two
    with atomics into a zeroed buffer. Each sum is x0 + x1 rounded once, so outputs and gradients
    are equal bit for bit (block_v = head_dim: two partials; half of it: dq and dk of four slices
    summed on the host, dv and o of two), with keys that never leave the window and odd lengths."""
    torch.manual_seed(13)
    q, k, v, s0 = inputs(2, 53, 4, 2, 32, dtype=dtype, device=DEVICE, state=True)

    def run(half_launches):
        def fn(q, k, v, s0):
            return residual_linear_attention(q, k, v, 9, "softmax", s0, backend="triton", block_v=block_v, state_every=2,
                                             fuse_halves=fuse, half_launches=half_launches)
        return grads(fn, *(t.detach().clone().requires_grad_() for t in (q, k, v, s0)))

    (o1, f1, g1), (o2, f2, g2) = run(True), run(False)
    # Triton's CPU interpreter rounds float32 -> bfloat16 toward zero inside kernels, where the GPU
    # and torch round to nearest: there the kernel-stored bfloat16 results may differ by one unit.
    same = (lambda a, b: torch.equal(a, b)) if dtype == torch.float32 or not triton_interpreting() else (
        lambda a, b: bool(((a.float() - b.float()).abs() <= b.float().abs() * 2**-7).all()))
    assert same(o1, o2) and torch.equal(f1, f2)
    for name, a, b in zip("q k v s0".split(), g1, g2):
        assert (torch.equal if name == "s0" else same)(a, b), name
    # and both are the function: the float32 reference
    ref = [t.detach().float().requires_grad_() for t in (q, k, v)] + [s0.detach().clone().requires_grad_()]
    o3, _, g3 = grads(lambda *a: residual_linear_attention_reference(*a[:3], 9, "softmax", a[3]), *ref)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert rel(o1, o3) < tol and all(rel(a, b) < tol for a, b in zip(g1, g3))


@needs_triton
@pytest.mark.parametrize("heads_per_tile,fuse", [(1, False), (2, False), (4, True), (2, True)])
def test_triton_stacked_query_heads_of_a_group_of_three(heads_per_tile, fuse):
    """Six query heads on two key/value heads (groups of three) stacked one, two or four per tile:
    two slices with a padding head in the last, or one slice with one; float32 forward and
    gradients against the reference, several segments and an initial state."""
    torch.manual_seed(12)
    q, k, v, s0 = inputs(2, 45, 6, 2, 16, device=DEVICE, state=True)

    def triton_fn(q, k, v, s0):
        return residual_linear_attention(
            q, k, v, 4, "softmax", s0, backend="triton", state_every=1, fuse_halves=fuse, heads_per_tile=heads_per_tile
        )

    o, f, g = grads(triton_fn, q, k, v, s0)
    o2, f2, g2 = grads(lambda *a: residual_linear_attention_reference(*a[:3], 4, "softmax", a[3]), q, k, v, s0)
    assert rel(o, o2) < 1e-5 and rel(f, f2) < 1e-5
    for name, a, b in zip("q k v s0".split(), g, g2):
        assert rel(a, b) < 1e-5, name


CHUNK_PARALLEL_CASES = [
    # batch, seq, heads, kv_heads, dim, w, feature_map, chunk_size, state_every (None: one segment on CPU)
    (2, 37, 2, 1, 32, 5, "softmax", 16, None),
    (1, 75, 4, 2, 32, 6, "softmax", 16, 2),
    (1, 40, 2, 2, 16, -1, "softmax", 16, 1),
    (1, 33, 6, 2, 16, 0, "relu", 16, 1),
    (2, 35, 4, 4, 32, 40, "softmax", 16, 1),
    (1, 21, 2, 2, 16, 3, "identity", 16, None),
    (1, 45, 2, 1, 16, 2, "softmax", 32, 1),
]


@needs_triton
@pytest.mark.parametrize("batch,seq,heads,kv_heads,dim,w,feature_map,chunk,state_every", CHUNK_PARALLEL_CASES)
def test_triton_chunk_parallel_matches_reference_fp32(batch, seq, heads, kv_heads, dim, w, feature_map, chunk,
                                                      state_every):
    """Every chunk's state stored, outputs and gradients in parallel over chunks: odd lengths, GQA
    groups of one to three, one segment or several (an uneven last one), pure linear attention, a
    window longer than the sequence, an initial state and a final-state gradient."""
    torch.manual_seed(13)
    q, k, v, s0 = inputs(batch, seq, heads, kv_heads, dim, device=DEVICE, state=True, feature_map=feature_map)

    def triton_fn(q, k, v, s0):
        return residual_linear_attention(q, k, v, w, feature_map, s0, backend="triton", chunk_parallel=True,
                                         chunk_size=chunk, state_every=state_every)

    assert_matches_reference_fp32(triton_fn, q, k, v, s0, w, feature_map)


@needs_triton
def test_triton_chunk_parallel_bf16_without_initial_state():
    """bfloat16 against the float32 reference, no initial state (its gradient is not asked for)."""
    torch.manual_seed(14)
    q, k, v, _ = inputs(1, 50, 4, 2, 32, dtype=torch.bfloat16, device=DEVICE)
    o, f, g = grads(lambda *a: residual_linear_attention(*a[:3], 4, backend="triton", chunk_parallel=True,
                                                         state_every=2), q, k, v, None)
    ref = [t.detach().float().requires_grad_() for t in (q, k, v)]
    o2, f2, g2 = grads(lambda *a: residual_linear_attention_reference(*a[:3], 4), *ref, None)
    assert o.dtype == torch.bfloat16 and rel(o, o2) < 2e-2 and rel(f, f2) < 1e-2
    for name, a, b in zip("q k v".split(), g, g2):
        assert a.dtype == torch.bfloat16 and rel(a, b) < 2e-2, name


@needs_triton
def test_heads_per_tile_must_fit_the_group():
    q, k, v, _ = inputs(1, 8, 4, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="heads_per_tile"):
        residual_linear_attention(q, k, v, 2, backend="triton", heads_per_tile=4)
    with pytest.raises(ValueError, match="heads_per_tile"):
        residual_linear_attention(q, k, v, 2, backend="triton", heads_per_tile=3)


def test_default_segments_on_cuda_and_one_segment_elsewhere():
    from hf_hybrid.kernels.residual_linear_attention.triton import DEFAULT_STATE_EVERY, _num_segments

    assert _num_segments(128, None, torch.device("cuda")) == 128 // DEFAULT_STATE_EVERY
    assert _num_segments(DEFAULT_STATE_EVERY + 1, None, torch.device("cuda")) == 2  # a short last segment
    assert _num_segments(128, None, torch.device("cpu")) == 1
    assert _num_segments(128, 3, torch.device("cpu")) == 43 and _num_segments(128, 0, torch.device("cuda")) == 1


@needs_triton
def test_triton_bf16_matches_fp32_reference():
    torch.manual_seed(3)
    q, k, v, _ = inputs(1, 39, 2, 1, 32, dtype=torch.bfloat16, device=DEVICE)
    o, f = residual_linear_attention(q, k, v, 4, backend="triton", state_every=1)
    assert o.dtype == torch.bfloat16 and f.dtype == torch.float32
    o2, f2 = residual_linear_attention_reference(q.float(), k.float(), v.float(), 4)
    do = torch.randn_like(o2)
    g = torch.autograd.grad((o.float() * do).sum(), (q, k, v))
    g2 = torch.autograd.grad((o2 * do).sum(), (q, k, v))
    assert rel(o, o2) < 2e-2 and rel(f, f2) < 1e-2
    for a, b in zip(g, g2):
        assert a.dtype == torch.bfloat16 and rel(a, b) < 2e-2


@needs_triton
def test_window_covering_the_sequence_gives_exact_zero():
    q, k, v, _ = inputs(1, 21, 2, 2, 16, device=DEVICE)
    for backend in ("triton", "chunked", "reference"):
        o, final = residual_linear_attention(q, k, v, 20, backend=backend)
        assert torch.count_nonzero(o) == 0 and torch.count_nonzero(final) == 0, backend


# ---------------------------------------------------------------- decode helper


@pytest.mark.parametrize("w,heads,kv_heads,feature_map", [(-1, 2, 2, "softmax"), (0, 4, 2, "relu"), (3, 4, 1, "softmax"), (5, 2, 2, "identity")])
def test_decode_steps_equal_the_full_sequence(w, heads, kv_heads, feature_map):
    """Fold token t - w - 1 (when it exists) then read: step by step == one full call."""
    torch.manual_seed(4)
    q, k, v, _ = inputs(2, 15, heads, kv_heads, 16)
    with torch.no_grad():
        full, final = residual_linear_attention_reference(q, k, v, w, feature_map)
        state = torch.zeros(2, kv_heads, feature_dim(feature_map, 16), 16)
        steps = []
        for t in range(15):
            leave = t - w - 1
            kl, vl = (k[:, leave], v[:, leave]) if leave >= 0 else (None, None)
            o, state = residual_linear_attention_decode(q[:, t], state, kl, vl, feature_map=feature_map)
            steps.append(o)
    assert rel(torch.stack(steps, 1), full) < 1e-5
    # after the last step the state holds keys <= T - 1 - (w + 1): the op's final_state
    assert torch.allclose(state, final, atol=1e-5)


@needs_triton
@pytest.mark.parametrize("feature_map,heads,state_heads,dim", [("softmax", 4, 2, 32), ("relu", 2, 2, 16), ("identity", 4, 1, 64)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_fused_decode_kernel_matches_reference(feature_map, heads, state_heads, dim, dtype, tol):
    torch.manual_seed(10)
    state = torch.randn(3, state_heads, feature_dim(feature_map, dim), dim, device=DEVICE)
    q = torch.randn(3, heads, dim, device=DEVICE).to(dtype)
    k, v = (torch.randn(3, state_heads, dim, device=DEVICE).to(dtype) for _ in range(2))
    mask = torch.tensor([True, False, True], device=DEVICE)
    for leaving in ((k, v, mask), (k, v, None), (None, None, None)):
        o, new = residual_linear_attention_decode(q, state, *leaving, feature_map=feature_map, backend="triton")
        o2, new2 = residual_linear_attention_decode(q, state, *leaving, feature_map=feature_map, backend="reference")
        assert o.dtype == dtype and rel(o, o2) < tol and rel(new, new2) < 1e-6
        own = state.clone()
        o3, new3 = residual_linear_attention_decode(q, own, *leaving, feature_map=feature_map, backend="triton", inplace=True)
        assert new3.data_ptr() == own.data_ptr() and torch.equal(new3, new) and torch.equal(o3, o)


def test_decode_leaving_mask_skips_padding_rows():
    q = torch.randn(2, 2, 8)
    state = torch.zeros(2, 2, 16, 8)
    k, v = torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    _, new = residual_linear_attention_decode(q, state, k, v, torch.tensor([True, False]))
    assert new[0].abs().sum() > 0 and torch.count_nonzero(new[1]) == 0
    assert torch.count_nonzero(state) == 0  # the input state is not modified


# ---------------------------------------------------------------- sliding-window attention


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("w", [0, 3, 22, 40])
def test_sliding_window_backends_match_reference(backend, dtype, tol, w):
    torch.manual_seed(5)
    needs_grad = backend != "flex"  # flex_attention has no CPU backward; the gpu test covers it
    q, k, v, _ = inputs(2, 23, 4, 2, 16, dtype=dtype)
    if not needs_grad:
        q, k, v = q.detach(), k.detach(), v.detach()
    o = sliding_window_attention(q, k, v, w, backend=backend)
    o2 = sliding_window_attention_reference(q.float(), k.float(), v.float(), w)
    assert o.dtype == dtype and rel(o, o2) < tol
    if needs_grad:
        do = torch.randn_like(o2)
        g = torch.autograd.grad((o.float() * do).sum(), (q, k, v))
        g2 = torch.autograd.grad((o2 * do).sum(), (q, k, v))
        for a, b in zip(g, g2):
            assert (a.float() - b).norm() <= tol * max(b.norm().item(), v.float().norm().item())


def test_sliding_window_reference_is_the_band():
    q, k, v, _ = inputs(1, 9, 1, 1, 4)
    with torch.no_grad():
        o = sliding_window_attention_reference(q, k, v, 2)
        i = 6  # sees keys 4, 5, 6
        scores = (q[0, i, 0] @ k[0, 4:7, 0].T) * 0.5
        assert torch.allclose(o[0, i, 0], torch.softmax(scores, 0) @ v[0, 4:7, 0], atol=1e-6)


# ---------------------------------------------------------------- errors


def test_bad_inputs_raise_clear_errors():
    q, k, v, _ = inputs(1, 8, 4, 2, 16)
    with pytest.raises(ValueError, match="window_size"):
        residual_linear_attention(q, k, v, -2)
    with pytest.raises(ValueError, match="window_size"):
        sliding_window_attention(q, k, v, -1)
    with pytest.raises(ValueError, match="feature_map"):
        residual_linear_attention(q, k, v, 2, feature_map="elu")
    with pytest.raises(ValueError, match="multiple"):
        residual_linear_attention(torch.randn(1, 8, 3, 16), k, v, 2)
    with pytest.raises(ValueError, match="initial_state"):
        residual_linear_attention(q, k, v, 2, initial_state=torch.zeros(1, 4, 32, 16))
    with pytest.raises(ValueError, match="only apply to backend='triton'"):
        residual_linear_attention(q, k, v, 2, backend="chunked", chunk_size=32)
    with pytest.raises(ValueError, match="backend"):
        residual_linear_attention(q, k, v, 2, backend="cuda")
    with pytest.raises(ValueError, match="head_dim"):
        odd = [torch.randn(1, 8, 2, 24, device=DEVICE) for _ in range(3)]  # where backend="triton" runs
        residual_linear_attention(*odd, 2, backend="triton")
    with pytest.raises(ValueError, match="state"):
        residual_linear_attention_decode(torch.randn(2, 4, 16), torch.zeros(2, 3, 32, 16))


# ---------------------------------------------------------------- real GPU shapes


@pytest.mark.gpu
def test_gpu_auto_swa_small_head_dim_avoids_flex():
    """flex_attention's compiled kernels need head_dim >= 16: "auto" takes the SDPA band mask
    below that, and an explicit "flex" says so instead of failing inside Inductor."""
    q, k, v = (torch.randn(2, 40, 4, 8, device="cuda") for _ in range(3))
    out = sliding_window_attention(q, k, v, 5)
    torch.testing.assert_close(out, sliding_window_attention_reference(q, k, v, 5), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="head_dim >= 16"):
        sliding_window_attention(q, k, v, 5, backend="flex")



@pytest.mark.gpu
@pytest.mark.parametrize(
    "seq,w,options",
    [(4096, 512, {}), (4099, 511, {"state_every": 0}), (2053, -1, {"state_every": 3, "fuse_halves": True}),
     (4096, 512, {"chunk_size": 64, "block_v": 128}), (4099, 511, {"chunk_parallel": True}),
     (2053, -1, {"chunk_parallel": True, "chunk_size": 32, "state_every": 3})],
)
def test_gpu_triton_bf16_real_shapes(seq, w, options):
    """16 query heads x 128, 4 KV heads, bf16: forward and gradients vs the float32 chunked form."""
    torch.manual_seed(6)
    q, k, v, s0 = inputs(2, seq, 16, 4, 128, dtype=torch.bfloat16, device="cuda", state=True)
    o, f, g = grads(lambda *a: residual_linear_attention(*a[:3], w, "softmax", a[3], backend="triton", **options), q, k, v, s0)
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    s0f = s0.detach().clone().requires_grad_()
    o2, f2, g2 = grads(lambda *a: residual_linear_attention_chunked(*a[:3], w, "softmax", a[3]), qf, kf, vf, s0f)
    assert rel(o, o2) < 1e-2 and rel(f, f2) < 1e-2
    for name, a, b in zip("q k v s0".split(), g, g2):
        assert rel(a, b) < 2e-2, name


@pytest.mark.gpu
@pytest.mark.parametrize("feature_map", ["relu", "identity"])
def test_gpu_triton_fp32_other_feature_maps(feature_map):
    torch.manual_seed(8)
    q, k, v, s0 = inputs(1, 1000, 4, 2, 64, device="cuda", state=True, feature_map=feature_map)
    o, f, g = grads(lambda *a: residual_linear_attention(*a[:3], 63, feature_map, a[3], backend="triton"), q, k, v, s0)
    o2, f2, g2 = grads(lambda *a: residual_linear_attention_chunked(*a[:3], 63, feature_map, a[3]), q, k, v, s0)
    assert rel(o, o2) < 1e-4 and rel(f, f2) < 1e-4
    for a, b in zip(g, g2):
        assert rel(a, b) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("seq,w", [(4096, 512), (1027, 100)])
def test_gpu_flex_sliding_window_fwd_bwd(seq, w):
    torch.manual_seed(9)
    q, k, v, _ = inputs(1, seq, 16, 4, 128, dtype=torch.bfloat16, device="cuda")
    o = sliding_window_attention(q, k, v, w, backend="flex")
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    o2 = sliding_window_attention(qf, kf, vf, w, backend="sdpa")
    do = torch.randn_like(o2)
    g = torch.autograd.grad((o.float() * do).sum(), (q, k, v))
    g2 = torch.autograd.grad((o2 * do).sum(), (qf, kf, vf))
    assert rel(o, o2) < 1e-2
    for a, b in zip(g, g2):
        assert rel(a, b) < 2e-2


def test_cuda_defaults_split_the_halves_and_fuse_long_forwards(monkeypatch):
    """Compiled (not interpreted): split programs over whole value rows stacking SPLIT_ROWS query
    rows per tile, and from FUSE_HALVES_MIN_TOKENS tokens a forward that keeps both feature halves
    in one program over 64 value columns with FUSED_ROWS; the interpreter splits both passes; a
    value given applies to both."""
    from types import SimpleNamespace

    from hf_hybrid.kernels.residual_linear_attention import triton as rla_triton

    def plan(seq=8192, fuse=None, heads_per_tile=None, interpreted=False):
        monkeypatch.setattr(rla_triton, "triton_interpreting", lambda: interpreted)
        q = SimpleNamespace(shape=(1, seq, 16, 128), is_cuda=True, dtype=torch.bfloat16, device=torch.device("cuda"))
        k = SimpleNamespace(shape=(1, seq, 4, 128))
        return rla_triton._Plan(q, k, "softmax", 512, None, None, None, None, fuse, heads_per_tile)

    assert rla_triton.SPLIT_ROWS == 32 * 2 and rla_triton.FUSED_ROWS == 32 * 4
    p = plan()
    assert p.chunk == 32 and p.forward == p.backward
    assert (p.backward.fuse, p.backward.block_v, p.backward.heads_per_tile) == (False, 128, 2)
    long = plan(seq=rla_triton.FUSE_HALVES_MIN_TOKENS)
    assert (long.forward.fuse, long.forward.block_v, long.forward.heads_per_tile) == (True, 64, 4)
    assert long.backward == p.backward and not plan(seq=rla_triton.FUSE_HALVES_MIN_TOKENS - 1).forward.fuse
    p = plan(seq=2 * rla_triton.FUSE_HALVES_MIN_TOKENS, fuse=False, heads_per_tile=1)
    assert not p.forward.fuse and not p.backward.fuse and p.forward.block_v == 128
    assert p.forward.heads_per_tile == p.backward.heads_per_tile == 1
    assert plan(fuse=True).backward.fuse
    p = plan(interpreted=True)
    assert p.chunk == 16 and not p.forward.fuse and p.forward.block_v == 64 and p.forward.heads_per_tile == 4


def test_block_masks_of_short_bands_are_built_without_compiling_the_builder(monkeypatch):
    """On CUDA the SWA branch's block mask is built eagerly up to EAGER_MASK_MAX_TOKENS (no
    torch.compile of the builder at a first use), by a compiled builder past it; never on CPU."""
    from hf_hybrid.kernels.residual_linear_attention import sliding_window as sw

    limit = sw.EAGER_MASK_MAX_TOKENS
    assert not sw.compiles_mask_builder(limit, "cuda") and sw.compiles_mask_builder(limit + 1, "cuda")
    assert not sw.compiles_mask_builder(4 * limit, "cpu")
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # the outer compile traces the builder
    assert not sw.compiles_mask_builder(4 * limit, "cuda")


@pytest.mark.slow  # compiles the builder with Inductor on the CPU
def test_eager_and_compiled_mask_builders_give_the_same_block_mask():
    from torch.nn.attention.flex_attention import create_block_mask

    seq, w = 640, 200

    def in_band(batch, head, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx <= w)

    eager = create_block_mask(in_band, None, None, seq, seq, device="cpu", _compile=False)
    compiled = create_block_mask(in_band, None, None, seq, seq, device="cpu", _compile=True)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        assert torch.equal(getattr(eager, name), getattr(compiled, name)), name
