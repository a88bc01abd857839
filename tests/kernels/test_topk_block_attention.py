"""Top-k block attention (Quest / MoBA scoring, || dilation) against a per-query brute force."""
import math

import pytest
import torch

from hf_hybrid.kernels.chunk_attention import block_end_mask
from hf_hybrid.kernels.topk_block_attention import (
    block_scores,
    block_summaries,
    dilated_mask,
    masked_attention_reference,
    topk_block_attention,
)


def brute_force(q, k, v, block_size, top_k, scoring, dilation=1, window=0, sinks=0, q_pos=None, k_pos=None):
    """Loops over batch, head and query; scores blocks from their definition and picks them by sorting."""
    batch, q_len, heads, dim = q.shape
    k_len, kv_heads = k.shape[1], k.shape[2]
    rep = heads // kv_heads
    if q_pos is None:
        k_pos = torch.arange(k_len).expand(batch, k_len)
        q_pos = k_pos[:, k_len - q_len :]
    out = torch.zeros(batch, q_len, heads, dim, dtype=torch.float64)
    masks = torch.zeros(batch, heads, q_len, k_len, dtype=torch.bool)
    for b in range(batch):
        cols = {int(p): c for c, p in enumerate(k_pos[b].tolist()) if p >= 0}
        for h in range(heads):
            kh = k[b, :, h // rep].double()
            for t in range(q_len):
                i = int(q_pos[b, t])
                qv = q[b, t, h].double()
                own = i // block_size
                scored = []
                for c in range(own):
                    members = [cols[p] for p in range(c * block_size, (c + 1) * block_size) if p in cols]
                    if len(members) < block_size:
                        continue
                    keys = kh[members]
                    if scoring == "quest":
                        s = sum(max(qv[d] * keys[:, d].min(), qv[d] * keys[:, d].max()) for d in range(dim))
                    else:
                        s = qv @ keys.mean(0)
                    scored.append((-float(s), c))
                chosen = {c for _, c in sorted(scored)[: top_k - 1]} | {own}
                visible = []
                for p, col in cols.items():
                    if p > i:
                        continue
                    in_block = p // block_size in chosen
                    in_base = p < sinks or i - p <= window or (dilation > 1 and (p + 1) % dilation == 0)
                    if in_block or in_base:
                        visible.append(col)
                masks[b, h, t, visible] = True
                scores = torch.stack([qv @ kh[c] for c in visible]) / math.sqrt(dim)
                probs = torch.softmax(scores, 0)
                out[b, t, h] = sum(p * v[b, c, h // rep].double() for p, c in zip(probs, visible))
    return out, masks


def rand(*shape, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype)


@pytest.mark.parametrize("scoring", ["quest", "moba"])
@pytest.mark.parametrize(
    "seq,block,top_k,dilation,window,sinks,kv_heads",
    [(23, 4, 2, 1, 0, 0, 2), (31, 4, 3, 1, 2, 2, 1), (37, 8, 2, 4, 0, 1, 2), (16, 4, 4, 1, 0, 0, 2), (29, 5, 1, 3, 1, 0, 1)],
)
def test_matches_brute_force(scoring, seq, block, top_k, dilation, window, sinks, kv_heads):
    q, k, v = rand(2, seq, 2, 8, seed=1), rand(2, seq, kv_heads, 8, seed=2), rand(2, seq, kv_heads, 8, seed=3)
    out = topk_block_attention(q, k, v, block, top_k, scoring, dilation, window, sinks)
    expected, _ = brute_force(q, k, v, block, top_k, scoring, dilation, window, sinks)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scoring", ["quest", "moba"])
def test_large_top_k_is_dense_causal_attention(scoring):
    q, k, v = rand(1, 26, 2, 8, seed=4), rand(1, 26, 2, 8, seed=5), rand(1, 26, 2, 8, seed=6)
    out = topk_block_attention(q, k, v, block_size=4, top_k=7, scoring=scoring)
    dense = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    torch.testing.assert_close(out, dense.transpose(1, 2), atol=1e-5, rtol=1e-5)


def test_top_k_one_is_own_block_only():
    q, k, v = rand(1, 20, 1, 8, seed=7), rand(1, 20, 1, 8, seed=8), rand(1, 20, 1, 8, seed=9)
    out = topk_block_attention(q, k, v, block_size=5, top_k=1)
    i = torch.arange(20)[:, None]
    j = torch.arange(20)[None, :]
    mask = (j <= i) & (j // 5 == i // 5)
    expected = masked_attention_reference(q, k, v, mask[None, None])
    torch.testing.assert_close(out, expected)


def test_quest_score_bounds_every_key_in_the_block():
    q, k = rand(1, 12, 2, 8, seed=10), rand(1, 12, 2, 8, seed=11)
    positions = torch.arange(12)[None]
    summary, complete = block_summaries(k, positions, 4, "quest")
    assert complete.all()
    scores = block_scores(q, summary, "quest")  # [1, heads, 12, 3]
    exact = torch.einsum("bthd,bshd->bhts", q, k).view(1, 2, 12, 3, 4).amax(-1)
    assert (scores >= exact - 1e-5).all()


@pytest.mark.parametrize("scoring", ["quest", "moba"])
def test_cached_continuation_matches_full_sequence(scoring):
    """Queries that are the last rows of a longer key sequence (a decode step) see what they see in full."""
    q, k, v = rand(1, 33, 2, 8, seed=12), rand(1, 33, 2, 8, seed=13), rand(1, 33, 2, 8, seed=14)
    full = topk_block_attention(q, k, v, 4, 3, scoring, dilation=8, local_window=1, num_sink_tokens=2)
    for tail in (1, 5):
        part = topk_block_attention(q[:, -tail:], k, v, 4, 3, scoring, dilation=8, local_window=1, num_sink_tokens=2)
        torch.testing.assert_close(part, full[:, -tail:])


@pytest.mark.parametrize("scoring", ["quest", "moba"])
def test_left_padding_with_positions_matches_unpadded_row(scoring):
    q, k, v = rand(1, 21, 2, 8, seed=15), rand(1, 21, 1, 8, seed=16), rand(1, 21, 1, 8, seed=17)
    alone = topk_block_attention(q, k, v, 4, 2, scoring, num_sink_tokens=1)
    pad = 3
    qp = torch.cat([rand(1, pad, 2, 8, seed=18), q], 1)
    kp = torch.cat([rand(1, pad, 1, 8, seed=19), k], 1)
    vp = torch.cat([rand(1, pad, 1, 8, seed=20), v], 1)
    k_pos = torch.cat([torch.full((1, pad), -1), torch.arange(21)[None]], 1)
    q_pos = k_pos.clamp(min=0)
    padded = topk_block_attention(qp, kp, vp, 4, 2, scoring, num_sink_tokens=1, query_positions=q_pos, key_positions=k_pos)
    torch.testing.assert_close(padded[:, pad:], alone)


def test_precomputed_summary_is_used():
    q, k, v = rand(1, 17, 2, 8, seed=21), rand(1, 17, 2, 8, seed=22), rand(1, 17, 2, 8, seed=23)
    positions = torch.arange(17)[None]
    summary = block_summaries(k, positions, 4, "moba", num_blocks=5)
    assert summary[1].tolist() == [[True, True, True, True, False]]
    with_summary = topk_block_attention(q, k, v, 4, 2, "moba", summary=summary)
    torch.testing.assert_close(with_summary, topk_block_attention(q, k, v, 4, 2, "moba"))


@pytest.mark.parametrize("scoring", ["quest", "moba"])
def test_backward_matches_masked_attention_with_the_brute_force_mask(scoring):
    q, k, v = (rand(1, 19, 2, 8, seed=s).requires_grad_() for s in (24, 25, 26))
    out = topk_block_attention(q, k, v, 4, 2, scoring, dilation=4)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    _, mask = brute_force(q.detach(), k.detach(), v.detach(), 4, 2, scoring, dilation=4)
    ref = masked_attention_reference(q, k, v, mask)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_bf16_close_to_fp32():
    q, k, v = rand(1, 24, 2, 16, seed=27), rand(1, 24, 2, 16, seed=28), rand(1, 24, 2, 16, seed=29)
    # Dilation || top-k with enough blocks that every query sees the same set in both dtypes.
    ref = topk_block_attention(q, k, v, 4, 6, "quest", dilation=4)
    low = topk_block_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), 4, 6, "quest", dilation=4)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), ref, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("dilation,window,sinks,start", [(1, 0, 0, 0), (4, 0, 0, 0), (3, 2, 4, 0), (5, 0, 2, 7), (16, 3, 1, 2)])
def test_dilated_mask_is_block_end_mask(dilation, window, sinks, start):
    q_pos = torch.arange(start, start + 13)[None]
    k_pos = torch.arange(start + 13)[None]
    got = dilated_mask(q_pos, k_pos, dilation, window, sinks)[0]
    torch.testing.assert_close(got, block_end_mask(13, start + 13, dilation, window, sinks, query_start=start))


def test_errors_name_the_parameter():
    q = k = v = rand(1, 8, 1, 8)
    with pytest.raises(ValueError, match="block_size"):
        topk_block_attention(q, k, v, 0, 1)
    with pytest.raises(ValueError, match="top_k"):
        topk_block_attention(q, k, v, 4, 0)
    with pytest.raises(ValueError, match="scoring"):
        topk_block_attention(q, k, v, 4, 1, scoring="mean")
    with pytest.raises(ValueError, match="backend"):
        topk_block_attention(q, k, v, 4, 1, backend="cuda")
    with pytest.raises(ValueError, match="query_positions"):
        topk_block_attention(q, k, v, 4, 1, query_positions=torch.arange(8)[None])
    with pytest.raises(ValueError, match="kv_heads"):
        topk_block_attention(rand(1, 8, 3, 8), rand(1, 8, 2, 8), rand(1, 8, 2, 8), 4, 1)
