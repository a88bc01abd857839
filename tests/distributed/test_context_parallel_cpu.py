"""Context parallelism on CPU (gloo, 2 and 4 processes, float32, reference kernels): one sequence
split over the ranks (hf_hybrid.distributed.context_parallel) gives the forward, the loss and
every gradient of one process on the whole sequence.

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
halo and SSM state passed on, the attention layers' earlier keys gathered and their retrieval
chosen from the earlier queries) and, alone, the Mamba-2 layer at a larger gradient scale. A
control run of each shard without the exchange differs, so the comparison sees a missing
exchange. With activation checkpointing (FoX, SE hybrid) the backward runs inside the block, so
each layer's recompute exchanges again; a backward after the block is refused with the fix named.
The ranks run context_parallel_cpu_worker.py under torchrun.
"""
from __future__ import annotations

import json
import os

import pytest

from distributed_launch import torchrun

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "context_parallel_cpu_worker.py")
CHECKS = ["rat", "rat_nope", "rat_swa", "rat_full_attention", "rat_plus", "rat_plus_sinks", "rat_plus_no_recurrence", "rat_plus_dilated", "rat_plus_mixed_heads", "fox_llama", "fox_pro", "fox_pro_rope", "rattention", "rattention_linear", "se_hybrid", "se_hybrid_full", "se_hybrid_swa", "fox_pro_checkpointed", "se_hybrid_checkpointed", "mamba2_layer", "fox_ring_triton"]
_results = {}


def results(tmp_path_factory, ranks: int) -> dict:
    if ranks not in _results:
        out = tmp_path_factory.mktemp(f"cp{ranks}")
        torchrun(WORKER, ranks, str(out), *CHECKS)
        with open(out / f"results-{ranks}.json") as file:
            _results[ranks] = json.load(file)
    return _results[ranks]


@pytest.mark.parametrize("ranks", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4 ranks: ~35 s more
@pytest.mark.parametrize("name", CHECKS)
def test_split_sequence_matches_one_process(tmp_path_factory, ranks, name):
    result = results(tmp_path_factory, ranks)[name]
    assert result["missing_grads"] == []
    assert result["loss_diff"] <= 1e-5
    assert result["logits_diff"] <= 1e-5
    # Gradients: 1e-5 relative to the largest gradient (Mamba-2's reach ~100 on these inputs).
    assert result["grad_diff"] <= 1e-5 * max(1.0, result["grad_scale"])
    assert result["no_exchange_logits_diff"] > 1e-3
    if name.endswith("_checkpointed"):  # a backward after the block would recompute without the exchange
        assert result["late_backward_refused"] is True


# The largest share of a shard's tokens any all-gather along the sequence takes from each rank:
# ring attention gathers none (its blocks pass point to point), RAT its chunk ends (1/L, L = 4),
# a dilated RAT+ pattern its chunk ends, window halo and sinks; SE attention gathers whole shards.
LARGEST_GATHER = {
    "fox_llama": 0.0, "fox_pro": 0.0, "fox_pro_rope": 0.0, "rat_full_attention": 1 / 4, "rattention": 0.0,
    "rattention_linear": 0.0, "rat": 1 / 4, "rat_nope": 1 / 4,
}


@pytest.mark.parametrize("ranks", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_ring_mixers_gather_no_keys_of_the_prefix(tmp_path_factory, ranks):
    shard = 32 // ranks
    for name, largest in LARGEST_GATHER.items():
        assert results(tmp_path_factory, ranks)[name]["largest_gather"] == pytest.approx(largest), name
    # RAT+ (dense heads on the ring) with dilation D, window w and s sinks: each shard's D-th keys,
    # its last w and its first s
    dilated = {"rat_plus": (8, 0, 0), "rat_plus_dilated": (4, 2, 2), "rat_plus_mixed_heads": (4, 0, 1)}
    for name, (dilation, window, sinks) in dilated.items():
        read = set(range(dilation - 1, shard, dilation)) | set(range(shard - window, shard)) | set(range(sinks))
        assert results(tmp_path_factory, ranks)[name]["largest_gather"] == pytest.approx(len(read) / shard), name
    assert results(tmp_path_factory, ranks)["se_hybrid"]["largest_gather"] == 1.0


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
