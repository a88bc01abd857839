"""Context parallelism: one sequence split over the ranks of a process group, each token mixer
exchanging only what its math needs across the chunk borders.

    cp = ContextParallelGroup.from_mesh(mesh)               # a 1-D DeviceMesh (or .from_group)
    ids, targets = cp.shard(input_ids), cp.shard_labels(labels)   # targets: already shifted
    with context_parallel(model, cp):
        loss = model(input_ids=ids, shift_labels=targets, num_items_in_batch=cp.count_targets(targets), use_cache=False).loss
    loss.backward()                                          # then sum each gradient over the group
    cp.all_reduce_gradients(model)

Layouts (layout.py; ``layout=`` of the group). ``"balanced"`` (the default): the sequence is cut
into 2N chunks of C tokens and rank r holds chunks r and 2N - 1 - r, concatenated (ring-attention
implementations call it zigzag); under causal attention every rank then does the same work.
``"contiguous"``: rank r holds tokens [r S, (r + 1) S), S = seq / N; the last rank does about
(2N - 1) / N times the average attention work. ``cp.positions`` are a rank's true token positions
(RoPE, RAT's chunk indices, RAT+'s dilation grid); ``cp.unshard`` gathers per-token outputs back in
sequence order. The mixers work per segment (one of a rank's chunks): each segment's predecessor is
the chunk before it in the sequence, wherever it lives, and per-chunk quantities (halos, states,
sums) are all-gathered and read in sequence order (``gather_chunks``).

The labels are shifted before they are split (``shift_labels``), so the target of a chunk's last
token is the next chunk's first token and the loss is exact at the borders; with
``num_items_in_batch`` set to the group's count of targets, each rank's loss is its share of the
global mean and the shares add up to it. Norms, MLPs and embeddings act per token; what each mixer
exchanges ("shard" below: a segment):

- RAT (``RatAttention``): a query sees its own chunk's recurrent state and the end of every
  earlier chunk. The recurrence restarts at every chunk, so a shard of whole chunks computes its
  own k~, v~; the ranks all-gather their chunk ends (1/L of the keys and values).
- RAT+ (``RatPlusAttention``): the gated recurrence runs over the whole sequence, so each shard
  scans from zero, the ranks all-gather (final state, product of the gates), and each carries the
  earlier shards' states through into its own initial state and scans again from it. Dilated
  patterns (rat.py, ``shard_tokens_read``): each shard's chunk ends (1/D of its keys and values),
  its last local_window tokens (the next shard's window halo) and the first shard's sinks are
  all-gathered, read through the pattern's mask at their positions (dilated ones whose D does not
  divide the shard, or whose window or sinks pass a shard, gather the earlier keys whole). Dense
  patterns (D = 1) read every earlier key: ring attention (below). Top-k patterns raise.
- FoX (``ForgettingAttention``): query i weighs key j by exp(c_i - c_j), c the running sum of
  log forget gates over the whole sequence. Each shard's c is its own running sum plus the earlier
  shards' totals (all-gathered, one number per row and head). Ring attention (ring.py): the keys,
  values and c of each shard travel rank to rank, one block per step, each rank attending to the
  block in hand (the diagonal causally; balanced, the two unmasked chunk pairs of each other rank's
block, stacked in one call) and merging the partial outputs by their log-sum-exps; the
  backward passes the blocks again with their dK, dV, dc accumulators. A rank holds its own block
  and two in transit, never the prefix. The KV-shift reads the previous shard's last key and value.
- RATTENTION local layers (``RattentionLocalAttention``): the sliding window of the shard's first
  tokens reaches w + 1 tokens into the previous shard (a halo of keys and values), and the
  residual linear attention starts from the state of every token before that halo: the sum of
  the earlier shards' phi(k) v^T (all-gathered, one state per shard; the sums have no decay) less
  the halo's own. Global layers (``RattentionGlobalAttention``): ring attention.
- Softmax attention (``SoftmaxAttention``: the sliding-window and full layers of RAT hybrids):
  a window of w tokens reads the previous shard's last w - 1 keys and values (a halo); full
  attention is ring attention.
- SE attention (``SpanExpandedAttention``, the attention layers of SE hybrids; full, swa, se and
  se_nomem modes): full mode is ring attention; swa reads the window halo and se_nomem the halo
  back to its SE chunk's start (either may span several chunks). se: the block summaries (one
  vector per block and head) and each chunk's query sum since its SE chunk start are all-gathered
  without gradient; each rank chooses its selection groups' blocks as one process does, the ranks
  all-gather which (batch row, key head, block) each needs from before its own span, and one
  all-to-all (``exchange_rows``, differentiable) brings just those from the ranks holding them.
  Each segment attends over [received blocks ; local span] on the one-process layer's fused
  kernels on CUDA (se_segment.py: no mask, no [queries, keys] scores), on the reference over
  blocks of queries on CPU. se_random raises.
- Mamba-2 (``SEMambaMixer``, the SSM layers of SE hybrids): the causal conv reads the last K - 1
  inputs of the previous shard (a halo), and the scan starts from the state the earlier shards
  leave. Each rank scans its shard from zero, the ranks all-gather (final state, total decay),
  and each combines the earlier shards' states into its initial state and scans again from it.

Every other exchange is an all-gather whose backward sums the gradient over the ranks and keeps
the own part (SE's all-to-all returns each block's gradient to its rank), so forward, loss and
every gradient equal one process on the whole sequence. A model with another mixer raises
NotImplementedError naming it (see ``supported_mixers``). SE retrieval is exact, so a rank holds
the union over its query heads and groups of their top-k blocks: few with long blocks and few
groups, but at small blocks and many groups it can approach the whole prefix. Halos must fit in one chunk (the balanced layout's chunks are half a contiguous shard); a chunk too
short raises, naming ``layout="contiguous"``.

Modules: group.py (the group, its all-gather, shared helpers), layout.py (which chunks each rank
holds, the per-chunk exchanges' helpers), ring.py (ring attention and its point-to-point passes), one module per mixer family (rat.py, fox.py, rattention.py, softmax.py,
se_hybrid.py; se_segment.py: SE attention of one segment over the keys it holds).
"""
from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

from ...layers.backbone import DecoderLayer
from .group import ContextParallelGroup

__all__ = ["ContextParallelGroup", "context_parallel", "supported_mixers"]


def supported_mixers() -> dict[type, callable]:
    """Mixer class -> its context-parallel forward(mixer, cp, hidden_states, context, cache_layer)."""
    from ...layers.attention import SoftmaxAttention
    from ...layers.forgetting_attention import ForgettingAttention
    from ...layers.rat_attention import RatAttention
    from ...layers.rat_plus_attention import RatPlusAttention
    from ...layers.residual_linear_attention import RattentionGlobalAttention, RattentionLocalAttention
    from ...layers.span_expanded_attention import SpanExpandedAttention
    from ...models.se_hybrid.modeling_se_hybrid import SEMambaMixer
    from .fox import fox_forward
    from .rat import rat_forward, rat_plus_forward
    from .rattention import rattention_global_forward, rattention_local_forward
    from .se_hybrid import mamba2_forward, se_attention_forward
    from .softmax import softmax_forward

    return {
        RatAttention: rat_forward, SEMambaMixer: mamba2_forward, ForgettingAttention: fox_forward,
        RattentionLocalAttention: rattention_local_forward, RattentionGlobalAttention: rattention_global_forward,
        SoftmaxAttention: softmax_forward, RatPlusAttention: rat_plus_forward,
        SpanExpandedAttention: se_attention_forward,
    }


@contextlib.contextmanager
def context_parallel(model: nn.Module, cp: ContextParallelGroup):
    """Within the block, every DecoderLayer's mixer of ``model`` runs its context-parallel forward
    over ``cp`` (feed the model this rank's shard, ``ContextParallelGroup.shard``)."""
    forwards = supported_mixers()
    mixers = [layer.self_attn for layer in model.modules() if isinstance(layer, DecoderLayer)]
    if not mixers:
        raise ValueError(f"context_parallel: {type(model).__name__} has no DecoderLayer; pass an hf-hybrid model.")
    missing = sorted({type(m).__name__ for m in mixers if type(m) not in forwards})
    if missing:
        raise NotImplementedError(
            f"context_parallel: no context-parallel exchange for {', '.join(missing)} yet; "
            f"supported mixers: {', '.join(sorted(cls.__name__ for cls in forwards))}."
        )
    for mixer in mixers:
        forward = forwards[type(mixer)]
        mixer.forward = lambda *args, _mixer=mixer, _forward=forward, **kwargs: _forward(_mixer, cp, *args, **kwargs)
    # Models that would run a backward inside their forward (RAT+'s joint objective) keep their
    # plain graphs under the group: the exchanges' collectives are kept in step for one backward.
    models = [m for m in model.modules() if hasattr(m, "config") and hasattr(m, "base_model_prefix")]
    for m in models:
        m.context_parallel_group = cp
    layers = [layer for layer in model.modules() if isinstance(layer, DecoderLayer)]
    try:
        yield model
    finally:
        for layer in layers:
            if getattr(layer, "gradient_checkpointing", False):
                # Its backward reruns the forward: that rerun must exchange as the forward did.
                layer.self_attn.forward = functools.partial(_after_block, layer.self_attn)
            else:
                del layer.self_attn.forward
        for m in models:
            del m.context_parallel_group


def _after_block(mixer: nn.Module, *args, **kwargs):
    """A checkpointed layer's mixer after a ``context_parallel`` block: a rerun inside a backward
    (activation checkpointing's recompute) would compute without the exchange, silently wrong; the
    first plain forward puts the mixer's own forward back."""
    if torch._C._current_graph_task_id() != -1:
        raise RuntimeError(
            "context_parallel: a gradient-checkpointed layer recomputed its forward in a backward that ran after "
            "the `with context_parallel(model, cp)` block ended; call loss.backward() inside the block so the "
            "recompute exchanges with the other ranks as the forward did."
        )
    del mixer.forward
    return mixer.forward(*args, **kwargs)

