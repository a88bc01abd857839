"""Forgetting Attention: reference semantics, Triton kernel == reference (forward and every
gradient, log f included), the cache/decode op, and input validation.

CPU runs the Triton kernel in the interpreter on tiny shapes; the `gpu` tests use real lengths.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from hf_hybrid.kernels._backend import triton_interpreting
from hf_hybrid.kernels.forgetting_attention import (
    cumulative_log_forget,
    cumulative_log_forget_by_head,
    forgetting_attention,
    forgetting_attention_reference,
    forgetting_attention_with_cache,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    DEVICE == "cpu" and not triton_interpreting(), reason="needs CUDA or TRITON_INTERPRET=1"
)


def make_inputs(b, t, hq, hkv, d, dtype, device=DEVICE, gate_mean=1.0, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(b, t, hq, d, generator=g).to(device, dtype)
    k = torch.randn(b, t, hkv, d, generator=g).to(device, dtype)
    v = torch.randn(b, t, hkv, d, generator=g).to(device, dtype)
    log_f = F.logsigmoid(torch.randn(b, t, hq, generator=g) * 2 + gate_mean).to(device)
    do = torch.randn(b, t, hq, d, generator=g).to(device, dtype)
    return q, k, v, log_f, do


def run_with_grads(q, k, v, log_f, do, **kw):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, log_f)]
    out = forgetting_attention(*leaves, **kw)
    grads = torch.autograd.grad(out, leaves, do)
    return (out, *grads)


def rel_err(a, b):
    """||a - b|| / ||b||, with a tiny absolute floor so an all-zero gradient (T = 1) compares too."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / (b.norm() + 1e-2 * b.numel() ** 0.5)).item()


NAMES = ("o", "dq", "dk", "dv", "dlog_f")


# ------------------------------------------------------------------------------------------
# the reference states the math
# ------------------------------------------------------------------------------------------
def explicit_loop(q, k, v, log_f, scale, window=None):
    """o_i from Eq. 11 with F_ij = prod_{l=j+1..i} f_l written out, one (b, h, i) at a time."""
    b, t, hq, d = q.shape
    group = hq // k.shape[2]
    out = torch.zeros(b, t, hq, d, dtype=torch.float64)
    f = log_f.double().exp()
    for bi in range(b):
        for h in range(hq):
            for i in range(t):
                js = [j for j in range(i + 1) if window is None or i - j < window]
                w = torch.stack([
                    torch.prod(f[bi, j + 1:i + 1, h]) * torch.exp(scale * q[bi, i, h].double() @ k[bi, j, h // group].double())
                    for j in js
                ])
                out[bi, i, h] = (w[:, None] * v[bi, js, h // group].double()).sum(0) / w.sum()
    return out


@pytest.mark.parametrize("window", [None, 3])
def test_reference_matches_the_product_form(window):
    q, k, v, log_f, _ = make_inputs(2, 9, 2, 1, 8, torch.float64, "cpu")
    ref = forgetting_attention_reference(q, k, v, log_f.double(), None, window)
    assert rel_err(ref, explicit_loop(q, k, v, log_f, 8 ** -0.5, window)) < 1e-6


def test_reference_with_f_one_is_causal_softmax_attention():
    q, k, v, _, _ = make_inputs(2, 13, 4, 4, 16, torch.float32, "cpu")
    out = forgetting_attention_reference(q, k, v, torch.zeros(2, 13, 4))
    sdpa = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    assert rel_err(out, sdpa.transpose(1, 2)) < 1e-5


def test_reference_packed_sequences_equal_separate_runs():
    q, k, v, log_f, _ = make_inputs(1, 20, 2, 1, 8, torch.float32, "cpu")
    cu = torch.tensor([0, 7, 8, 20], dtype=torch.int32)
    packed = forgetting_attention_reference(q, k, v, log_f, cu_seqlens=cu)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        alone = forgetting_attention_reference(q[:, s:e], k[:, s:e], v[:, s:e], log_f[:, s:e])
        assert rel_err(packed[:, s:e], alone) < 1e-6


def test_cumulative_log_forget_restarts_per_sequence():
    log_f = -torch.rand(1, 10, 3)
    cu = torch.tensor([0, 4, 10])
    c = cumulative_log_forget(log_f, cu)
    assert torch.allclose(c[:, :4], log_f[:, :4].cumsum(1))
    assert torch.allclose(c[:, 4:], log_f[:, 4:].cumsum(1), atol=1e-6)


@pytest.mark.parametrize("cu", [None, [0, 3, 9, 10]])
def test_cumulative_log_forget_by_head_layout_and_gradient(cu):
    """[heads, batch * seq] sums along the contiguous axis == the per-row cumsum, values and grads."""
    batch = 1 if cu is not None else 2
    log_f = (-torch.rand(batch, 10, 3, dtype=torch.float64)).requires_grad_()
    cu_t = None if cu is None else torch.tensor(cu)
    got = cumulative_log_forget_by_head(log_f, cu_t)
    bounds = [(0, 10)] if cu is None else list(zip(cu[:-1], cu[1:]))
    want = torch.cat([log_f[:, s:e].cumsum(1) for s, e in bounds], dim=1).permute(2, 0, 1).reshape(3, -1)
    assert got.shape == (3, batch * 10) and got.dtype == torch.float32
    assert torch.allclose(got.double(), want, atol=1e-6)
    weights = torch.randn(3, batch * 10, dtype=torch.float64)
    (grad_got,) = torch.autograd.grad((got.double() * weights).sum(), log_f)
    (grad_want,) = torch.autograd.grad((want * weights).sum(), log_f)
    assert torch.allclose(grad_got, grad_want, atol=1e-6)
    assert torch.equal(cumulative_log_forget(log_f, cu_t), got.view(3, batch, 10).permute(1, 2, 0))


# ------------------------------------------------------------------------------------------
# Triton == reference (interpreter on CPU, compiled on GPU)
# ------------------------------------------------------------------------------------------
CASES = [
    # b, t, hq, hkv, d, window, cu_seqlens
    (2, 37, 2, 1, 16, None, None),  # odd length, GQA 2:1, several blocks + ragged tail
    (1, 40, 2, 2, 32, 7, None),  # sliding window (edge, interior and diagonal phases)
    (1, 40, 4, 2, 16, None, [0, 5, 23, 40]),  # packed sequences, GQA
    (1, 33, 2, 1, 16, 20, [0, 17, 33]),  # packed + window
    (3, 1, 2, 1, 16, None, None),  # single token
]


@needs_triton
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}t{c[1]}h{c[2]}/{c[3]}d{c[4]}w{c[5]}cu{c[6] is not None}")
def test_triton_matches_reference_fp32(case):
    b, t, hq, hkv, d, window, cu = case
    q, k, v, log_f, do = make_inputs(b, t, hq, hkv, d, torch.float32)
    cu = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=DEVICE)
    kw = dict(window_size=window, cu_seqlens=cu)
    ref = run_with_grads(q, k, v, log_f, do, backend="reference", **kw)
    tri = run_with_grads(q, k, v, log_f, do, backend="triton", **kw)
    for name, a, r in zip(NAMES, tri, ref):
        assert a.dtype == r.dtype and a.shape == r.shape, name
        assert torch.isfinite(a).all(), name
        assert rel_err(a, r) < 2e-5, (name, rel_err(a, r))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_matches_reference_low_precision(dtype):
    # The reference runs in float32 on the same rounded inputs; the kernel rounds P and dS to
    # the input dtype for the tensor cores, hence the looser bound.
    q, k, v, log_f, do = make_inputs(2, 29, 2, 1, 32, dtype)
    ref = run_with_grads(q, k, v, log_f, do, backend="reference")
    tri = run_with_grads(q, k, v, log_f, do, backend="triton")
    tol = 2e-2 if dtype == torch.bfloat16 else 3e-3
    for name, a, r in zip(NAMES, tri, ref):
        assert a.dtype == r.dtype, name
        assert rel_err(a, r) < tol, (name, rel_err(a, r))


@needs_triton
def test_triton_handles_strong_forgetting_far_into_the_sequence():
    # c reaches about -900 by the end: the kernel must never add raw c to a score.
    q, k, v, _, do = make_inputs(1, 40, 2, 1, 16, torch.float32)
    log_f = torch.full((1, 40, 2), -25.0, device=DEVICE)
    log_f[:, :, 1] = -0.01
    ref = run_with_grads(q, k, v, log_f, do, backend="reference")
    tri = run_with_grads(q, k, v, log_f, do, backend="triton")
    for name, a, r in zip(NAMES, tri, ref):
        assert rel_err(a, r) < 1e-4, (name, rel_err(a, r))


@needs_triton
def test_triton_with_f_one_is_causal_softmax_attention():
    q, k, v, _, _ = make_inputs(1, 24, 2, 2, 16, torch.float32)
    out = forgetting_attention(q, k, v, torch.zeros(1, 24, 2, device=DEVICE), backend="triton")
    sdpa = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    assert rel_err(out, sdpa.transpose(1, 2)) < 1e-5


# ------------------------------------------------------------------------------------------
# decode / continuation against a cache
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["reference", "sdpa"])
@pytest.mark.parametrize("window", [None, 5])
def test_cache_continuation_equals_full_forward(backend, window):
    q, k, v, log_f, _ = make_inputs(2, 17, 4, 2, 16, torch.float32, "cpu")
    full = forgetting_attention_reference(q, k, v, log_f, window_size=window)
    c = cumulative_log_forget(log_f)
    for start in (0, 11, 16):  # whole prefill, a chunk of 6, one decode step
        part = forgetting_attention_with_cache(
            q[:, start:], k, v, c[:, start:], c, window_size=window, backend=backend
        )
        assert rel_err(part, full[:, start:]) < 1e-5, start


@pytest.mark.parametrize("block_elements", [1, 2 * 7 * 17, 2 * 7 * 17 * 3], ids=["query-blocks", "one-head", "three-heads"])
@pytest.mark.parametrize("window", [None, 5])
def test_cache_sdpa_over_blocks_equals_one_call(block_elements, window):
    """The sdpa path's float32 bias over blocks of heads (and of queries when one head's is too
    large), as a prefill continuing in slices at a large batch runs it: the same output."""
    from hf_hybrid.kernels.forgetting_attention.decode import forgetting_attention_with_cache_sdpa

    q, k, v, log_f, _ = make_inputs(2, 17, 4, 2, 16, torch.float32, "cpu")
    c = cumulative_log_forget(log_f)
    key_mask = torch.ones(2, 17, dtype=torch.bool)
    key_mask[1, :6] = False
    start = 10  # 7 new queries over 17 keys
    args = (q[:, start:], k, v, c[:, start:], c, key_mask, None, window)
    whole = forgetting_attention_with_cache_sdpa(*args)
    blocked = forgetting_attention_with_cache_sdpa(*args, block_elements=block_elements)
    torch.testing.assert_close(blocked, whole, atol=1e-6, rtol=0)
    reference = forgetting_attention_with_cache(*args[:6], window_size=window, backend="reference")
    assert rel_err(blocked, reference) < 1e-5


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_cache_left_padding_equals_per_row(backend):
    q, k, v, log_f, _ = make_inputs(2, 12, 2, 1, 8, torch.float32, "cpu")
    pad = 5  # row 1 is left-padded by 5 tokens
    key_mask = torch.ones(2, 12, dtype=torch.bool)
    key_mask[1, :pad] = False
    c = cumulative_log_forget(log_f)
    out = forgetting_attention_with_cache(q, k, v, c, c, key_mask, backend=backend)
    alone = forgetting_attention_reference(q[1:, pad:], k[1:, pad:], v[1:, pad:], log_f[1:, pad:])
    assert rel_err(out[1, pad:], alone[0]) < 1e-5
    assert torch.count_nonzero(out[1, :pad]) == 0  # padded queries see nothing: zeros, no NaN
    assert rel_err(out[0], forgetting_attention_reference(q[:1], k[:1], v[:1], log_f[:1])[0]) < 1e-5


# ------------------------------------------------------------------------------------------
# errors name the argument
# ------------------------------------------------------------------------------------------
def test_bad_inputs_raise_clear_errors():
    q, k, v, log_f, _ = make_inputs(2, 8, 3, 2, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match="multiple of the number of key/value heads"):
        forgetting_attention(q, k, v, log_f, backend="reference")
    q, k, v, log_f, _ = make_inputs(2, 8, 2, 1, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match="log_f must be"):
        forgetting_attention(q, k, v, log_f[:, :, :1], backend="reference")
    with pytest.raises(ValueError, match="window_size"):
        forgetting_attention(q, k, v, log_f, window_size=0, backend="reference")
    with pytest.raises(ValueError, match="batch 1"):
        forgetting_attention(q, k, v, log_f, cu_seqlens=torch.tensor([0, 8]), backend="reference")
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        forgetting_attention(q[:1], k[:1], v[:1], log_f[:1], cu_seqlens=torch.tensor([0, 5]), backend="reference")
    with pytest.raises(ValueError, match="backend"):
        forgetting_attention(q, k, v, log_f, backend="cuda")
    with pytest.raises(ValueError, match="c_k must be"):
        forgetting_attention_with_cache(q, k, v, log_f, log_f[:, :4])
    with pytest.raises(ValueError, match="key_mask must be"):
        forgetting_attention_with_cache(q, k, v, log_f, log_f, torch.ones(2, 3, dtype=torch.bool))


def test_triton_head_dim_limits_are_explained():
    if DEVICE == "cpu" and not triton_interpreting():
        pytest.skip("needs CUDA or the interpreter")
    q, k, v, log_f, _ = make_inputs(1, 8, 2, 1, 24, torch.float32)
    with pytest.raises(ValueError, match="head_dim"):
        forgetting_attention(q, k, v, log_f, backend="triton")


# ------------------------------------------------------------------------------------------
# launch tiles: one per kernel at a first use, the autotuner on request
# ------------------------------------------------------------------------------------------
def test_portable_tiles_are_the_tiles_the_autotuner_would_choose_from(monkeypatch):
    """Without autotuning each portable kernel launches one of its candidates (the forward's by
    length: the sweep's 4K and 64K winners), or the one tile the autotuner keeps for float32 and
    head_dim 256, so a first use compiles one variant per kernel instead of four."""
    from hf_hybrid.kernels.forgetting_attention import triton as fa

    monkeypatch.setattr(fa, "triton_interpreting", lambda: False)

    def tile(kind, max_len, head_dim=128, dtype=torch.bfloat16):
        c = fa.portable_tile(kind, max_len, head_dim, dtype)
        return (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)

    assert tile("fwd", 2048) == tile("fwd", fa.SHORT_FORWARD_MAX_LEN) == (128, 32, 4, 3)
    assert tile("fwd", fa.SHORT_FORWARD_MAX_LEN + 1) == tile("fwd", 65536) == (128, 64, 8, 3)
    for kind in ("fwd", "dkdv", "dq"):
        for max_len in (1, 2048, 65536):
            for head_dim in (64, 128):
                assert tile(kind, max_len, head_dim) in fa.CANDIDATES[kind], (kind, max_len, head_dim)
                assert tile(kind, max_len, head_dim, torch.float16) == tile(kind, max_len, head_dim)
        for dtype, head_dim in ((torch.float32, 128), (torch.bfloat16, 256)):
            kept = fa._prune(fa._configs(kind), {"Q": torch.empty(0, dtype=dtype)}, HEAD_DIM=head_dim)
            assert len(kept) == 1 and str(kept[0]) == str(fa.portable_tile(kind, 2048, head_dim, dtype))


def test_launches_are_autotuned_only_under_the_switch():
    """A fixed tile by default (launched through launch_cached on a GPU, with a grid tuple), every
    candidate under HF_HYBRID_AUTOTUNE=1 (the autotuner, with the grid as a function of the tile)."""
    from hf_hybrid import options
    from hf_hybrid.kernels.forgetting_attention import triton as fa

    q = torch.empty(4, 2, 128, dtype=torch.bfloat16)
    with options.override(HF_HYBRID_AUTOTUNE=None):
        kernel, extra = fa._launch(fa._dq_kernel, "dq", None, 2048, q)
        tile = fa.portable_tile("dq", 2048, 128, torch.bfloat16)
        assert getattr(kernel, "jit_function", kernel) is fa._dq_kernel.fn  # through launch_cached on a GPU
        assert extra == dict(tile.kwargs, num_warps=tile.num_warps, num_stages=tile.num_stages)
    with options.override(HF_HYBRID_AUTOTUNE="1"):
        assert fa._launch(fa._dq_kernel, "dq", None, 2048, q) == (fa._dq_kernel, {})


@needs_triton
def test_autotuned_and_fixed_tile_launches_agree():
    q, k, v, log_f, do = make_inputs(2, 37, 4, 2, 16, torch.float32)
    from hf_hybrid import options

    with options.override(HF_HYBRID_AUTOTUNE="0"):
        fixed = run_with_grads(q, k, v, log_f, do, backend="triton", window_size=9)
    with options.override(HF_HYBRID_AUTOTUNE="1"):
        tuned = run_with_grads(q, k, v, log_f, do, backend="triton", window_size=9)
    for name, a, b in zip(NAMES, fixed, tuned):
        assert rel_err(a, b) < 1e-5, name


# ------------------------------------------------------------------------------------------
# GPU: real lengths in bf16
# ------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("t", [4096, 16384])
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_long_sequences_bf16(t, d):
    """Documented tolerance: relative Frobenius error < 1e-2 (output) and < 2e-2 (gradients)
    against the float32 reference on the same bf16 inputs; gates mix slow (f ~ 0.98) and fast
    (f ~ 0.5) heads so c spans 0 .. -8000 at 16K."""
    q, k, v, _, do = make_inputs(1, t, 2, 1, d, torch.bfloat16, seed=t + d)
    g = torch.Generator(device="cpu").manual_seed(1)
    means = torch.tensor([4.0, 0.0])
    log_f = F.logsigmoid(torch.randn(1, t, 2, generator=g) + means).to(DEVICE)
    ref = run_with_grads(q, k, v, log_f, do, backend="reference")
    tri = run_with_grads(q, k, v, log_f, do, backend="triton")
    for name, a, r in zip(NAMES, tri, ref):
        err = rel_err(a, r)
        assert math.isfinite(err) and err < (1e-2 if name == "o" else 2e-2), (name, err)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [(3, 1000, 4, 2, 64, None, None), (1, 777, 2, 1, 128, 129, None),
                                  (1, 3000, 2, 2, 128, None, [0, 1, 900, 2047, 3000]),
                                  (2, 515, 2, 1, 256, None, None)])
def test_gpu_odd_shapes_fp32(case):
    b, t, hq, hkv, d, window, cu = case
    q, k, v, log_f, do = make_inputs(b, t, hq, hkv, d, torch.float32)
    cu = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=DEVICE)
    ref = run_with_grads(q, k, v, log_f, do, backend="reference", window_size=window, cu_seqlens=cu)
    tri = run_with_grads(q, k, v, log_f, do, backend="triton", window_size=window, cu_seqlens=cu)
    for name, a, r in zip(NAMES, tri, ref):
        assert rel_err(a, r) < 1e-4, (name, rel_err(a, r))


@pytest.mark.gpu
@pytest.mark.parametrize("config_index", range(4))
def test_gpu_every_forward_config_matches_reference(config_index):
    """Each autotuning candidate of the forward is correct on its own, whichever one the tuner
    picks; packed ragged sequences and GQA exercise every phase."""
    import triton as _triton

    from hf_hybrid.kernels.forgetting_attention import triton as fa

    configs = fa._fwd_kernel.configs
    if config_index >= len(configs):
        pytest.skip("fewer candidates")
    config = configs[config_index]
    q, k, v, log_f, _ = make_inputs(1, 3000, 4, 2, 128, torch.bfloat16)
    cu = torch.tensor([0, 700, 701, 3000], dtype=torch.int32, device=DEVICE)
    c = cumulative_log_forget(log_f, cu)
    c_t = c[0].t().contiguous()
    out, _ = fa._forward(q[0], k[0], v[0], c_t, cu, 2299, 128 ** -0.5, None, config=_triton.Config(
        dict(config.kwargs), num_warps=config.num_warps, num_stages=config.num_stages))
    ref = forgetting_attention_reference(q, k, v, log_f, cu_seqlens=cu)[0]
    assert rel_err(out, ref) < 1e-2, str(config)
