"""SE-Attn: reference == brute force from the paper's equations; fast path == reference (forward and
backward, fp64/fp32/bf16, odd lengths, GQA); causality in every mode; argument errors."""
import math

import pytest
import torch

from hf_hybrid.kernels.span_expanded_attention import (
    MODES,
    block_summaries,
    expand_kv_heads,
    select_blocks,
    selection_for_sequence,
    span_expanded_attention,
    span_expanded_attention_reference,
)
from hf_hybrid.kernels.span_expanded_attention.chunked import (
    _add_rows_,
    _block_rows,
    _gather_rows,
    _retrieval_parts,
    _retrieved_blocks,
)
from hf_hybrid.kernels.span_expanded_attention.reference import _hash_uniform

# Small shapes that still exercise every branch: several chunks, a partial last chunk, a partial
# last block, several selection groups per chunk, and (chunk 1 with M=8, S=4, k=3) a chunk that
# can retrieve fewer than k blocks.
SHAPES = [
    dict(seq=37, chunk_size=12, block_size=3, top_k=3, select_every=4, window=7),
    dict(seq=29, chunk_size=8, block_size=4, top_k=3, select_every=2, window=5),
    dict(seq=40, chunk_size=16, block_size=4, top_k=2, select_every=16, window=16),
]


def _inputs(seq, heads=4, kv_heads=2, dim=16, batch=2, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, heads, dim, generator=gen, dtype=torch.float64).to(dtype)
    k = torch.randn(batch, seq, kv_heads, dim, generator=gen, dtype=torch.float64).to(dtype)
    v = torch.randn(batch, seq, kv_heads, dim, generator=gen, dtype=torch.float64).to(dtype)
    return q, k, v


def _se_kwargs(shape, mode):
    return {key: val for key, val in shape.items() if key != "seq"} | {"mode": mode}


# ---------------------------------------------------------------------------------------------
# Brute force, written straight from Sec. 3.2-3.3 with explicit loops over rows, heads, chunks,
# blocks and queries (float64). See reference.py for the causal reading of R_ij.
# ---------------------------------------------------------------------------------------------


def _softmax_attend(query, keys, values, scale):
    weights = torch.softmax(keys @ query * scale, dim=0)
    return weights @ values


def brute_force(q, k, v, *, mode, chunk_size, block_size, top_k, select_every, window, seed=0):
    q, k, v = q.double(), k.double(), v.double()
    batch, seq, heads, dim = q.shape
    group = heads // k.shape[2]
    scale = 1.0 / math.sqrt(dim)
    M, S = chunk_size, block_size
    num_blocks = seq // S
    out = torch.zeros_like(q)
    for b in range(batch):
        for h in range(heads):
            kh, vh = k[b, :, h // group], v[b, :, h // group]
            # c_j = mean over the block of non-causal attention inside the block.
            c = []
            for j in range(num_blocks):
                rows = range(j * S, (j + 1) * S)
                attn = torch.stack([_softmax_attend(q[b, t, h], kh[j * S:(j + 1) * S], vh[j * S:(j + 1) * S], scale) for t in rows])
                c.append(attn.mean(dim=0))
            for i in range(math.ceil(seq / M)):
                start = i * M
                past_blocks = [j for j in range(num_blocks) if (j + 1) * S <= start]
                for t in range(start, min(seq, start + M)):
                    if mode == "full":
                        keys = list(range(0, t + 1))
                    elif mode == "swa":
                        keys = list(range(max(0, t - window + 1), t + 1))
                    else:
                        retrieved = []
                        if mode == "se" and past_blocks:
                            group_first = start + ((t - start) // select_every) * select_every
                            relevancy = {
                                j: sum(float(q[b, u, h] @ c[j]) for u in range(start, group_first + 1)) for j in past_blocks
                            }
                            retrieved = sorted(past_blocks, key=lambda j: -relevancy[j])[:top_k]
                        elif mode == "se_random" and past_blocks:
                            score = {
                                j: float(_hash_uniform(torch.tensor(seed), torch.tensor(h), torch.tensor(i), torch.tensor(j)))
                                for j in past_blocks
                            }
                            retrieved = sorted(past_blocks, key=lambda j: -score[j])[:top_k]
                        keys = [s for j in retrieved for s in range(j * S, (j + 1) * S)] + list(range(start, t + 1))
                    out[b, t, h] = _softmax_attend(q[b, t, h], kh[keys], vh[keys], scale)
    return out


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", SHAPES[:2])
def test_reference_matches_brute_force(mode, shape):
    q, k, v = _inputs(shape["seq"], batch=1)
    kwargs = _se_kwargs(shape, mode)
    expected = brute_force(q, k, v, **kwargs)
    got = span_expanded_attention(q, k, v, backend="reference", **kwargs)
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9)


def test_retrieval_is_not_trivial():
    """se retrieves: later chunks differ from se_nomem, and the first chunk (no past) does not."""
    shape = SHAPES[0]
    q, k, v = _inputs(shape["seq"])
    se = span_expanded_attention_reference(q, k, v, **_se_kwargs(shape, "se"))
    nomem = span_expanded_attention_reference(q, k, v, **_se_kwargs(shape, "se_nomem"))
    M = shape["chunk_size"]
    torch.testing.assert_close(se[:, :M], nomem[:, :M])
    assert (se[:, M:] - nomem[:, M:]).abs().amax(dim=(-1, -2)).min() > 1e-3


def test_select_blocks_picks_the_most_relevant_past_block():
    batch, heads, dim, num_blocks = 1, 2, 8, 6
    summaries = torch.randn(batch, num_blocks, heads, dim) * 0.01
    summaries[:, 4] = 0.0
    summaries[:, 1, 0, 0] = summaries[:, 4, 1, 1] = 5.0  # head 0 likes block 1, head 1 likes block 4
    relevancy = torch.zeros(batch, 2, heads, dim)
    relevancy[..., 0, 0] = relevancy[..., 1, 1] = 1.0
    chunk_index = torch.tensor([1, 2])  # M=12, S=4: 3 and 6 past blocks
    idx, valid = select_blocks(relevancy, summaries, chunk_index, mode="se", chunk_size=12, block_size=4, top_k=2, num_heads=heads)
    assert idx[0, 0, 0, 0] == 1 and idx[0, 1, 1, 0] == 4
    assert idx[0, 1, 0, 0] < 3  # block 4 is not wholly in the past of chunk 1
    assert valid.all()


def test_random_selection_is_deterministic_distinct_and_past_only():
    summaries = torch.zeros(1, 20, 3, 4)
    chunk_index = torch.arange(6).repeat_interleave(2)
    kw = dict(mode="se_random", chunk_size=8, block_size=2, top_k=3, num_heads=3)
    idx, valid = select_blocks(None, summaries, chunk_index, seed=1, **kw)
    again, _ = select_blocks(None, summaries, chunk_index, seed=1, **kw)
    other, _ = select_blocks(None, summaries, chunk_index, seed=2, **kw)
    assert torch.equal(idx, again) and not torch.equal(idx, other)
    allowed = (chunk_index * 8 // 2)[None, None, :, None]
    assert ((idx < allowed) | ~valid).all()
    assert not valid[:, :, :2].any() and valid[:, :, 2:].all()  # chunk 0 has no past
    for row in idx[0].reshape(-1, 3):
        assert len(set(row.tolist())) == 3
    # se_random draws per chunk: both groups of a chunk retrieve the same blocks.
    assert torch.equal(idx[:, :, 2::2], idx[:, :, 3::2])


def test_block_summaries_definition():
    q, k, v = _inputs(10, heads=2, kv_heads=2, batch=1)
    c = block_summaries(q, k, v, block_size=4)
    assert c.shape == (1, 2, 2, 16)  # the partial last block has no summary
    attn = torch.softmax(q[0, 4:8, 1] @ k[0, 4:8, 1].T / 4.0, dim=-1) @ v[0, 4:8, 1]
    torch.testing.assert_close(c[0, 1, 1], attn.mean(0), rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# Fast path == reference, forward and backward
# ---------------------------------------------------------------------------------------------

TOLERANCES = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _relative_error(a, b):
    """||a - b|| / ||b||; where b is exactly zero (dq of a one-token sequence) the absolute error."""
    scale = b.double().norm()
    error = (a.double() - b.double()).norm()
    return (error / scale if scale > 0 else error).item()


def _compare_backends(q, k, v, kwargs, tol, fast="sdpa"):
    grad = torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(7)).to(q.device, q.dtype)
    results = []
    for backend in ("reference", fast):
        leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
        out = span_expanded_attention(*leaves, backend=backend, **kwargs)
        grads = torch.autograd.grad((out.float() * grad.float()).sum(), leaves)
        results.append((out, *grads))
    for name, ref, got in zip(("out", "dq", "dk", "dv"), *results):
        assert torch.isfinite(got).all(), name
        assert _relative_error(got, ref) < tol, (name, _relative_error(got, ref))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", SHAPES)
def test_sdpa_matches_reference(shape, mode, dtype):
    q, k, v = _inputs(shape["seq"], dtype=dtype, seed=3)
    _compare_backends(q, k, v, _se_kwargs(shape, mode), TOLERANCES[dtype])


def test_sdpa_short_sequences_and_mha():
    """Shorter than one block / one chunk, and heads == kv_heads."""
    for seq in (1, 2, 5):
        q, k, v = _inputs(seq, heads=2, kv_heads=2)
        _compare_backends(q, k, v, dict(mode="se", chunk_size=4, block_size=2, top_k=2, select_every=2), 1e-10)


# ---------------------------------------------------------------------------------------------
# Fast-path pieces: retrieval parts from shapes, the row gather and its backward, no host sync
# ---------------------------------------------------------------------------------------------


def _valid_slots_per_group(parts, num_groups, groups_per_chunk):
    counts = [0] * num_groups
    for valid, first_chunk, last_chunk in parts:
        for group in range(first_chunk * groups_per_chunk, last_chunk * groups_per_chunk):
            counts[group] = valid
    return counts


@pytest.mark.parametrize("mode", ["se", "se_random"])
@pytest.mark.parametrize(
    "seq, chunk_size, block_size, top_k, select_every",
    [(37, 12, 3, 3, 4), (29, 8, 4, 3, 2), (40, 16, 4, 2, 16), (100, 8, 16, 3, 4), (64, 16, 4, 8, 8),
     (5, 4, 2, 2, 2), (3, 4, 4, 2, 2), (40, 8, 4, 0, 4), (130, 4, 8, 5, 2)],
)
def test_retrieval_parts_match_the_selection(mode, seq, chunk_size, block_size, top_k, select_every):
    """The parts computed from shapes alone give every group exactly the valid-slot count of the
    selection (the old code read it back from the GPU with .tolist())."""
    q, k, v = _inputs(seq, batch=1)
    indices, valid, _ = selection_for_sequence(
        q, k, v, mode=mode, chunk_size=chunk_size, block_size=block_size, top_k=top_k, select_every=select_every
    )
    num_chunks = -(-seq // chunk_size)
    parts = _retrieval_parts(num_chunks, chunk_size, block_size, indices.shape[-1])
    per_group = valid[0, 0].sum(-1).tolist()
    assert _valid_slots_per_group(parts, len(per_group), chunk_size // select_every) == per_group
    assert all(p[1] < p[2] and p[0] > 0 for p in parts)
    assert all(a[2] <= b[1] and a[0] != b[0] for a, b in zip(parts, parts[1:]))  # ordered runs, merged


def _gather_by_advanced_indexing(x, indices, block_size):
    """The previous gather, as an oracle: x [b, t, h, d], indices [b, h, groups, k] -> [b, groups, h, k, S, d]."""
    batch, _, heads, dim = x.shape
    num_blocks = x.shape[1] // block_size
    blocks = x[:, : num_blocks * block_size].view(batch, num_blocks, block_size, heads, dim)
    rows = torch.arange(batch)[:, None, None, None]
    head = torch.arange(heads)[None, None, :, None]
    return blocks[rows, indices.permute(0, 2, 1, 3), :, head]


@pytest.mark.parametrize("first_group", [0, 3])
def test_row_gather_and_its_backward_equal_advanced_indexing(first_group):
    """GQA-expanded keys, batch 2, a length padded past the last block, many repeated blocks."""
    batch, seq, padded, heads, kv_heads, dim, block_size, slots, groups = 2, 37, 48, 4, 2, 8, 3, 3, 10
    gen = torch.Generator().manual_seed(4)
    keys = expand_kv_heads(torch.randn(batch, seq, kv_heads, dim, generator=gen, dtype=torch.float64), heads)
    x = torch.nn.functional.pad(keys, (0, 0, 0, 0, 0, padded - seq)).contiguous()
    indices = torch.randint(0, seq // block_size, (batch, heads, groups, slots), generator=gen)
    rows = _block_rows(_retrieved_blocks(indices, first_group), padded, block_size)
    assert rows.unique().numel() < rows.numel()  # the backward has to accumulate

    got = _gather_rows(x, rows, slots * block_size)
    expected = _gather_by_advanced_indexing(x, indices[:, :, first_group:], block_size)
    assert got.shape == (batch * (groups - first_group), heads, slots * block_size, dim)
    assert torch.equal(got, expected.reshape(got.shape))

    leaf = x.clone().requires_grad_(True)
    grad = torch.randn(expected.shape, generator=gen, dtype=torch.float64)
    (_gather_by_advanced_indexing(leaf, indices[:, :, first_group:], block_size) * grad).sum().backward()
    dx = torch.ones_like(x)  # the backward adds into an existing gradient (the chunk call's dK)
    _add_rows_(dx, rows, grad.reshape(got.shape))
    torch.testing.assert_close(dx, leaf.grad + 1, rtol=1e-12, atol=1e-12)
    assert dx[:, seq:].eq(1).all()  # padding is never retrieved


@pytest.mark.parametrize("mode", ["se", "se_random"])
@pytest.mark.parametrize("shape", SHAPES)
def test_fast_path_never_reads_values_back_to_the_host(mode, shape):
    """Meta tensors have shapes but no data, so any .item() / .tolist() / host copy raises: forward
    and backward run without one, hence on CUDA the CPU never waits for the GPU mid-step."""
    q = torch.randn(2, shape["seq"], 4, 16, device="meta", requires_grad=True)
    k, v = (torch.randn(2, shape["seq"], 2, 16, device="meta", requires_grad=True) for _ in range(2))
    out = span_expanded_attention(q, k, v, backend="sdpa", **_se_kwargs(shape, mode))
    out.backward(torch.empty_like(out))
    assert out.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


# ---------------------------------------------------------------------------------------------
# Causality: perturbing tokens after position p changes no output at positions <= p
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
@pytest.mark.parametrize("mode", MODES)
def test_no_query_sees_a_future_token(mode, backend):
    shape = SHAPES[0]
    q, k, v = _inputs(shape["seq"])
    kwargs = _se_kwargs(shape, mode)
    base = span_expanded_attention(q, k, v, backend=backend, **kwargs)
    gen = torch.Generator().manual_seed(11)
    for cut in (0, 3, 11, 12, 13, 23, 30):
        noise = [torch.randn(x[:, cut + 1:].shape, generator=gen, dtype=x.dtype) * 3 for x in (q, k, v)]
        q2, k2, v2 = (torch.cat([x[:, : cut + 1], x[:, cut + 1:] + n], dim=1) for x, n in zip((q, k, v), noise))
        out = span_expanded_attention(q2, k2, v2, backend=backend, **kwargs)
        torch.testing.assert_close(out[:, : cut + 1], base[:, : cut + 1], rtol=0, atol=1e-12)
        assert not torch.allclose(out[:, cut + 1:], base[:, cut + 1:])


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(mode="sparse"), "mode="),
        (dict(mode="swa"), "window"),
        (dict(mode="se", chunk_size=12, select_every=5), "select_every"),
        (dict(mode="se", block_size=0), "block_size"),
        (dict(mode="se", top_k=-1), "top_k"),
        (dict(mode="se_nomem", chunk_size=0), "chunk_size"),
        (dict(mode="se", backend="triton"), "backend='sdpa'"),
        (dict(mode="se", backend="flash"), "backend="),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    q, k, v = _inputs(8)
    with pytest.raises(ValueError, match=match):
        span_expanded_attention(q, k, v, **kwargs)


def test_bad_shapes_raise():
    q, k, v = _inputs(8, heads=3, kv_heads=2)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        span_expanded_attention(q, k, v)
    with pytest.raises(ValueError, match="head_dim"):
        span_expanded_attention(q[..., :8], k, v)


# ---------------------------------------------------------------------------------------------
# GPU: the fused kernels (FlashAttention-2 for bf16) against the reference at realistic shapes
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mode", MODES)
def test_gpu_sdpa_matches_reference(mode, dtype):
    q, k, v = (x.cuda() for x in _inputs(1000, heads=4, kv_heads=2, dim=64, batch=2, dtype=dtype, seed=5))
    kwargs = dict(mode=mode, chunk_size=256, block_size=32, top_k=4, select_every=64, window=256)
    _compare_backends(q, k, v, kwargs, 2e-2 if dtype == torch.bfloat16 else 1e-4)


@pytest.mark.gpu
def test_gpu_auto_uses_the_fast_path_and_is_causal():
    q, k, v = (x.cuda() for x in _inputs(4096 + 77, heads=4, kv_heads=4, dim=128, batch=1, dtype=torch.bfloat16))
    kwargs = dict(mode="se", chunk_size=1024, block_size=32, top_k=8, select_every=128)
    base = span_expanded_attention(q, k, v, **kwargs)
    ref = span_expanded_attention(q, k, v, backend="reference", **kwargs)
    assert _relative_error(base, ref) < 2e-2
    cut = 2500
    q2, k2, v2 = (torch.cat([x[:, :cut], torch.randn_like(x[:, cut:])], 1) for x in (q, k, v))
    out = span_expanded_attention(q2, k2, v2, **kwargs)
    torch.testing.assert_close(out[:, :cut], base[:, :cut], rtol=0, atol=1e-6)


@pytest.mark.gpu
def test_gpu_lse_kernels_agree_with_math():
    """Whichever fused kernel is picked (cuDNN after its self-check, else FlashAttention-2) returns
    the same output, lse and gradients as the plain-PyTorch version, also with foreign (merged) stats."""
    from hf_hybrid.kernels import _lse_attention as la

    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, grad = (torch.randn(3, 2, 192, 64, device="cuda", generator=gen) for _ in range(4))
    for causal in (True, False):
        out_m, lse_m, saved_m = la._forward("math", q, k, v, causal, 0.125)
        fast = [x.bfloat16() for x in (q, k, v)]
        out_f, lse_f, saved_f = la.attention_with_lse(*fast, causal, 0.125)
        assert (out_f.float() - out_m).abs().max() < 3e-2 and (lse_f - lse_m).abs().max() < 3e-2
        shifted = lse_m + 0.5  # a merged lse from a larger softmax: gradients scale by exp(-0.5)
        ref = la._backward(saved_m, grad, q, k, v, out_m, shifted, causal, 0.125)
        got = la.attention_with_lse_backward(grad.bfloat16(), *fast, out_m.bfloat16(), shifted, saved_f, causal, 0.125)
        for a, b in zip(got, ref):
            assert ((a.float() - b).norm() / b.norm()) < 3e-2
