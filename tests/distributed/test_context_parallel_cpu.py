"""Context parallelism on CPU (gloo, 2 and 4 processes, float32, reference kernels): one sequence
split over the ranks (hf_hybrid.distributed.context_parallel) gives the forward, the loss and
every gradient of one process on the whole sequence, under both layouts: contiguous shards, and
the balanced layout (2N chunks, rank r holding chunks r and 2N - 1 - r), where every mixer's
exchange follows each rank's two chunks (one launch of the worker runs both).

Covered: RAT (whole models, RoPE and NoPE: the chunk ends all-gathered; hybrids with sliding-window
and full softmax layers: the window halo, ring attention), RAT+ (its joint objective of a dense and
a dilated pattern, sinks and local windows, with and without the recurrence, a dilated pattern
alone, and dense and dilated heads in one layer: the recurrent state carried through the earlier
shards, ring attention for dense heads, of dilated patterns only the chunk ends, window halo and
sinks gathered), FoX (whole models, llama and pro blocks, with and without RoPE: ring attention
over the shards' keys, values and cumulative forget-gate sums, the KV-shift's one-token halo; and
the ring alone on its Triton blocks, in Triton's CPU interpreter, with grouped query heads),
RATTENTION (whole models with local and global layers, and pure linear attention: the window halo,
the residual linear attention's state from the earlier shards, ring attention in the global
layers), SE hybrids (whole models, SE retrieval, full and sliding-window modes: the Mamba-2 conv
halo and SSM state passed on, the attention layers on the ring (full), the window halo (swa), and
for SE retrieval the block summaries gathered, the blocks chosen as one process chooses them and
only those brought by an all-to-all; SE chunks longer than a rank's chunk too; each segment's
attention on its CPU reference over blocks of a few queries and on the GPU's fused path over a
virtual sequence, its retrieved blocks moved by the Triton kernels in Triton's interpreter) and, alone, the
Mamba-2 layer at a larger gradient scale. A control run of each shard without the exchange
differs, so the comparison sees a missing exchange. With activation checkpointing (FoX, SE hybrid) the backward runs inside the block, so
each layer's recompute exchanges again; a backward after the block is refused with the fix named.
The ranks run context_parallel_cpu_worker.py under torchrun.
"""
from __future__ import annotations

import json
import os

import pytest

from distributed_launch import torchrun

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "context_parallel_cpu_worker.py")
CHECKS = ["rat", "rat_nope", "rat_swa", "rat_full_attention", "rat_plus", "rat_plus_sinks", "rat_plus_no_recurrence", "rat_plus_dilated", "rat_plus_mixed_heads", "fox_llama", "fox_pro", "fox_pro_rope", "rattention", "rattention_linear", "se_hybrid", "se_hybrid_full", "se_hybrid_swa", "se_hybrid_long_chunks", "fox_pro_checkpointed", "se_hybrid_checkpointed", "se_hybrid_query_blocks", "se_hybrid_fused", "se_hybrid_swa_fused", "se_hybrid_nomem_fused", "se_hybrid_long_chunks_fused", "se_hybrid_triton", "se_hybrid_long_chunks_triton", "mamba2_layer", "fox_ring_triton"]
_results = {}


def results(tmp_path_factory, ranks: int) -> dict:
    if ranks not in _results:
        out = tmp_path_factory.mktemp(f"cp{ranks}")
        torchrun(WORKER, ranks, str(out), *CHECKS)
        with open(out / f"results-{ranks}.json") as file:
            _results[ranks] = json.load(file)
    return _results[ranks]


@pytest.mark.parametrize("ranks", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4 ranks: ~70 s more
@pytest.mark.parametrize("layout", ["contiguous", "balanced"])
@pytest.mark.parametrize("name", CHECKS)
def test_split_sequence_matches_one_process(tmp_path_factory, ranks, layout, name):
    result = results(tmp_path_factory, ranks)[name if layout == "contiguous" else f"{name}:{layout}"]
    assert result["missing_grads"] == []
    assert result["loss_diff"] <= 1e-5
    assert result["logits_diff"] <= 1e-5
    # Gradients: 1e-5 relative to the largest gradient (Mamba-2's reach ~100 on these inputs).
    assert result["grad_diff"] <= 1e-5 * max(1.0, result["grad_scale"])
    assert result["no_exchange_logits_diff"] > 1e-3
    if "unshard_logits_diff" in result:  # whole models: the logits gathered back in sequence order
        assert result["unshard_logits_diff"] <= 1e-5
    if name.endswith("_checkpointed"):  # a backward after the block would recompute without the exchange
        assert result["late_backward_refused"] is True


# The largest share of a shard's tokens any all-gather along the sequence takes from each rank:
# ring attention gathers none (its blocks pass point to point), RAT its chunk ends (1/L, L = 4),
# a dilated RAT+ pattern its chunk ends, window halo and sinks; SE attention in full mode runs on
# the ring and its sliding window reads a halo (gathered per chunk, count 0).
LARGEST_GATHER = {
    "fox_llama": 0.0, "fox_pro": 0.0, "fox_pro_rope": 0.0, "rat_full_attention": 1 / 4, "rattention": 0.0,
    "rattention_linear": 0.0, "rat": 1 / 4, "rat_nope": 1 / 4, "se_hybrid_full": 0.0, "se_hybrid_swa": 0.0,
}
# SE retrieval: the (batch row, key head, block) units the queries of a rank select from another
# rank's shard, as a share of that shard: some, never the whole shard at these settings (top 2 of
# blocks of 2 tokens per group of 4 queries; how much depends on the scores, so bounds only).
SE_RETRIEVAL = ["se_hybrid", "se_hybrid_checkpointed", "se_hybrid_long_chunks", "se_hybrid_fused", "se_hybrid_triton"]


@pytest.mark.parametrize("ranks", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("layout", ["contiguous", "balanced"])
def test_ring_mixers_gather_no_keys_of_the_prefix(tmp_path_factory, ranks, layout):
    suffix = "" if layout == "contiguous" else f":{layout}"
    seq = 32 if layout == "contiguous" else max(32, 16 * ranks)  # the worker's rows (seq_len)
    chunk = seq // ranks // (1 if layout == "contiguous" else 2)
    for name, largest in LARGEST_GATHER.items():
        assert results(tmp_path_factory, ranks)[name + suffix]["largest_gather"] == pytest.approx(largest), name
    # RAT+ (dense heads on the ring) with dilation D, window w and s sinks: each shard's D-th keys,
    # its last w and its first s, of each of its chunks
    dilated = {"rat_plus": (8, 0, 0), "rat_plus_dilated": (4, 2, 2), "rat_plus_mixed_heads": (4, 0, 1)}
    for name, (dilation, window, sinks) in dilated.items():
        read = set(range(dilation - 1, chunk, dilation)) | set(range(chunk - window, chunk)) | set(range(sinks))
        if chunk % dilation:  # a dilation that does not divide the chunk: every key gathered
            read = set(range(chunk))
        assert results(tmp_path_factory, ranks)[name + suffix]["largest_gather"] == pytest.approx(len(read) / chunk), name
    for name in SE_RETRIEVAL:
        assert 0.0 < results(tmp_path_factory, ranks)[name + suffix]["largest_gather"] < 1.0, name


def test_uncovered_patterns_are_named():
    """SE's random retrieval and RAT+'s top-k patterns have no exchange: they raise before any
    collective, naming what is missing."""
    import sys

    import torch
    import torch.distributed as dist

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "features"))
    from tiny_models import tiny_model

    from hf_hybrid.distributed.context_parallel import ContextParallelGroup, context_parallel
    from hf_hybrid.layers.context import SequenceContext
    from hf_hybrid.sparse import SparseInferenceConfig

    cp = ContextParallelGroup(group=dist.GroupMember.WORLD, rank=0, world_size=2)  # never communicates here
    hidden = torch.randn(1, 8, 32)
    context = SequenceContext.build(1, 8, 0, None, None, hidden.device)
    se_attention_layer = tiny_model("se_hybrid").model.layers[1]
    assert type(se_attention_layer.self_attn).__name__ == "SpanExpandedAttention"
    with context_parallel(se_attention_layer, cp):
        with pytest.raises(NotImplementedError, match="se_random"):
            se_attention_layer.self_attn(hidden, context, attention_mode="se_random")
    rat_plus_layer = tiny_model("rat_plus").model.layers[0]
    with context_parallel(rat_plus_layer, cp):
        with pytest.raises(NotImplementedError, match="top-k"):
            rat_plus_layer.self_attn(hidden, context, sparse_config=SparseInferenceConfig(top_k=2, block_size=2))


def test_se_retrieval_needs_chunks_of_whole_blocks_and_groups():
    """SE retrieval under context parallelism reads whole blocks and selection groups per chunk: a
    chunk of 3 tokens (blocks of 2) raises before any collective, naming the setting and the fix."""
    import sys

    import torch
    import torch.distributed as dist

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "features"))
    from tiny_models import tiny_model

    from hf_hybrid.distributed.context_parallel import ContextParallelGroup, context_parallel
    from hf_hybrid.layers.context import SequenceContext

    cp = ContextParallelGroup(group=dist.GroupMember.WORLD, rank=0, world_size=2)  # balanced: 4 chunks of 3 tokens
    hidden = torch.randn(1, 6, 32)
    context = SequenceContext.build(1, 6, 0, None, None, hidden.device)
    layer = tiny_model("se_hybrid").model.layers[1]
    with context_parallel(layer, cp):
        with pytest.raises(ValueError, match="multiple of se_block_size.*layout='contiguous'"):
            layer.self_attn(hidden, context, attention_mode="se")


def test_dilated_patterns_gather_only_what_they_read():
    """A shard of 16 tokens under dilation 4, a local window of 2 and one sink: later shards read its
    chunk ends 3, 7, 11, 15, the halo 14, 15 and the sink 0 (6 of 16 keys); a dense pattern, or a
    dilation that does not divide the shard, gathers every key (None)."""
    from hf_hybrid.distributed.context_parallel.rat import shard_tokens_read
    from hf_hybrid.sparse import AttentionPattern

    dilated = AttentionPattern(dilation=4, local_window=2, num_sink_tokens=1)
    assert shard_tokens_read([dilated], 16) == [0, 3, 7, 11, 14, 15]
    assert shard_tokens_read([dilated, AttentionPattern(dilation=8, num_sink_tokens=0)], 16) == [0, 3, 7, 11, 14, 15]
    assert shard_tokens_read([dilated, AttentionPattern(dilation=1)], 16) is None
    assert shard_tokens_read([AttentionPattern(dilation=3)], 16) is None


@pytest.mark.parametrize("ranks", [2, 3, 4, 8])
def test_balanced_layout_gives_every_rank_the_same_causal_work(ranks):
    """With 2N chunks and rank r holding chunks r and 2N - 1 - r, every rank computes the same
    number of causal (query chunk, key chunk) pairs and of causal (query, key) token pairs; with
    contiguous shards the last rank does (2N - 1) times the first's."""
    from hf_hybrid.distributed.context_parallel.layout import causal_block_pairs, rank_chunks

    balanced = [causal_block_pairs("balanced", rank, ranks) for rank in range(ranks)]
    assert balanced == [2 * ranks + 1] * ranks
    contiguous = [causal_block_pairs("contiguous", rank, ranks) for rank in range(ranks)]
    assert contiguous == list(range(1, ranks + 1))
    chunk = 5  # tokens per chunk: query i sees keys 0 .. i
    tokens = [sum(c * chunk + t + 1 for c in rank_chunks("balanced", rank, ranks) for t in range(chunk)) for rank in range(ranks)]
    assert len(set(tokens)) == 1
    # every chunk held exactly once
    assert sorted(c for rank in range(ranks) for c in rank_chunks("balanced", rank, ranks)) == list(range(2 * ranks))


def test_balanced_ring_steps_do_equal_work():
    """Each ring step of the balanced layout pairs two of this rank's query chunks' worth of rows
    with keys (never a fully masked pair): two (query chunk, key chunk) pairs per step, the same
    on every rank, and together with the diagonal they cover exactly the causal pairs."""
    import torch.distributed as dist

    from hf_hybrid.distributed.context_parallel import ContextParallelGroup
    from hf_hybrid.distributed.context_parallel.layout import ring_block_pairs

    ranks, shard = 4, 8
    for rank in range(ranks):
        cp = ContextParallelGroup(group=dist.GroupMember.WORLD, rank=rank, world_size=ranks, layout="balanced")
        seen = {(q, k) for q in cp.chunks for k in cp.chunks if k <= q}  # the diagonal block, causally
        for held in range(ranks):
            if held == rank:
                continue
            pairs = ring_block_pairs(cp, held, shard)
            assert len(pairs) == 2
            held_chunks = ContextParallelGroup(group=dist.GroupMember.WORLD, rank=held, world_size=ranks, layout="balanced").chunks
            for rows, cols in pairs:
                q_chunk = cp.chunks[0 if rows.start in (None, 0) else 1]
                k_chunk = held_chunks[0 if cols.start in (None, 0) else 1]
                assert k_chunk < q_chunk  # whole, unmasked
                seen.add((q_chunk, k_chunk))
        assert seen == {(q, k) for q in cp.chunks for k in range(2 * ranks) if k <= q}


def test_balanced_shard_and_unshard_follow_the_layout():
    """shard gives rank r chunks r and 2N - 1 - r; positions are their true positions; a wrong
    layout name is refused."""
    import torch
    import torch.distributed as dist

    from hf_hybrid.distributed.context_parallel import ContextParallelGroup

    sequence = torch.arange(16)[None]
    cp = ContextParallelGroup(group=dist.GroupMember.WORLD, rank=1, world_size=2, layout="balanced")
    assert cp.shard(sequence).tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    assert cp.positions(8).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    cp0 = ContextParallelGroup(group=dist.GroupMember.WORLD, rank=0, world_size=2, layout="balanced")
    assert cp0.shard(sequence).tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]
    assert cp0.positions(8).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    with pytest.raises(ValueError, match="4 chunks"):
        cp0.shard(torch.arange(10)[None])
    with pytest.raises(ValueError, match="layout='zigzag'"):
        ContextParallelGroup(group=dist.GroupMember.WORLD, rank=0, world_size=2, layout="zigzag")


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_se_segment_attention_in_query_blocks_matches_dense(kv_heads):
    """The SE segments' reference attention (se_segment.py) over blocks of 3 queries equals the
    dense masked softmax over the whole [queries, keys] mask: output and the gradients of q, keys
    and values, each block's mask rows built alone."""
    import torch

    from hf_hybrid.distributed.context_parallel.se_segment import segment_attention
    from hf_hybrid.kernels.span_expanded_attention import masked_attention

    g = torch.Generator().manual_seed(0)
    batch, queries, keys, heads, dim = 2, 10, 17, 4, 8
    q = torch.randn(batch, queries, heads, dim, generator=g)
    k, v = (torch.randn(batch, keys, kv_heads, dim, generator=g) for _ in range(2))
    mask = torch.rand(batch, heads, queries, keys, generator=g) < 0.4
    mask[..., 0] = True  # every query reads a key
    weights = torch.randn(batch, queries, heads, dim, generator=g)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    dense = masked_attention(*leaves, mask)
    dense_grads = torch.autograd.grad((dense * weights).sum(), leaves)
    calls = []

    def rows(lo, hi):
        calls.append((lo, hi))
        return mask[:, :, lo:hi]

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = segment_attention(*leaves, rows, budget=batch * heads * keys * 3)  # blocks of 3 queries
    grads = torch.autograd.grad((out * weights).sum(), leaves)
    assert sorted(set(calls)) == [(0, 3), (3, 6), (6, 9), (9, 10)]  # never the whole mask
    torch.testing.assert_close(out, dense, atol=1e-5, rtol=1e-5)
    for grad, expected in zip(grads, dense_grads):
        torch.testing.assert_close(grad, expected, atol=1e-5, rtol=1e-5)
