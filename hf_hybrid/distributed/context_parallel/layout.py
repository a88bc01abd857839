"""Which chunks of the sequence each rank holds.

``"contiguous"``: the sequence cut into N chunks (N ranks), rank r holding chunk r. With causal
attention the last rank's queries see the most keys: it does about (2N - 1) / N times the
average work.

``"balanced"``: the sequence cut into 2N chunks, rank r holding chunks r and 2N - 1 - r (an early
and a late one; ring-attention implementations call this "zigzag"). Every rank then has the same
number of causal (query chunk, key chunk) pairs (``causal_block_pairs``).

A rank's shard is its chunks concatenated in sequence order; the mixers work per chunk ("segment"):
each segment's predecessor is the chunk before it in the sequence, wherever it lives.
"""
from __future__ import annotations

import torch

LAYOUTS = ("contiguous", "balanced")


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"context parallelism: layout={layout!r} is not one of {', '.join(map(repr, LAYOUTS))}.")


def num_chunks(layout: str, world_size: int) -> int:
    """How many chunks the sequence is cut into."""
    return 2 * world_size if layout == "balanced" else world_size


def rank_chunks(layout: str, rank: int, world_size: int) -> tuple[int, ...]:
    """The chunk indices ``rank`` holds, in sequence order (its shard concatenates them)."""
    if layout == "balanced":
        return (rank, 2 * world_size - 1 - rank)
    return (rank,)


def gathered_order(layout: str, world_size: int) -> list[int]:
    """For entries gathered rank by rank (each rank's chunks in its order), the index of each
    chunk's entry: ``gathered[gathered_order(...)]`` lists the chunks in sequence order."""
    where = {}
    for rank in range(world_size):
        for slot, chunk in enumerate(rank_chunks(layout, rank, world_size)):
            where[chunk] = rank * len(rank_chunks(layout, rank, world_size)) + slot
    return [where[chunk] for chunk in range(num_chunks(layout, world_size))]


def causal_block_pairs(layout: str, rank: int, world_size: int) -> int:
    """How many (query chunk, key chunk) pairs of the sequence's chunks ``rank`` computes under
    causal attention: a key chunk at or before the query chunk (the diagonal counts as one)."""
    return sum(key <= query for query in rank_chunks(layout, rank, world_size) for key in range(num_chunks(layout, world_size)))


def ring_block_pairs(cp, held_rank: int, shard_len: int) -> list[tuple[slice, slice]]:
    """Which parts of this rank's queries attend to which parts of the block of ``held_rank`` (not
    this rank), each pair whole (no causal mask): [(query rows, key rows)], alike in length.
    Contiguous: an earlier rank's block whole, a later one's not at all. Balanced (chunks r and
    2N-1-r; the held rank's j and 2N-1-j): an earlier rank's first chunk is seen by both query
    chunks, its second by neither; a later rank's two chunks by the second query chunk only.
    Either way every rank computes two chunk pairs per step (one shard pair when contiguous)."""
    whole = slice(None)
    if cp.layout == "contiguous":
        return [(whole, whole)] if held_rank < cp.rank else []
    half = shard_len // 2
    first, second = slice(0, half), slice(half, None)
    return [(first, first), (second, first)] if held_rank < cp.rank else [(second, first), (second, second)]


def segments(cp, tensor, dim: int = 1):
    """This rank's shard cut into its chunks (one segment each, in shard order)."""
    return tensor.chunk(len(cp.chunks), dim)


def gather_segments(cp, parts):
    """[chunks of the sequence, ...]: one tensor per segment of this rank (``parts``, alike in
    shape) from every rank, in sequence order (differentiable)."""
    return cp.gather_chunks(torch.stack(list(parts), 0))


def previous_chunk_entries(cp, parts):
    """[this rank's chunks, ...]: for each segment, the entry (of ``parts``, one per segment on
    every rank) of the chunk just before it; zeros before the first chunk. The gathered entries
    stay in the graph (zero weight for the first chunk), so every rank's backward reaches the same
    collectives; no index tensor is copied to the device."""
    gathered = gather_segments(cp, parts)
    return torch.stack([gathered[chunk - 1] if chunk > 0 else gathered[0] * 0 for chunk in cp.chunks])


def preceding_tokens(cp, parts, count: int):
    """[this rank's chunks, batch, count, ...]: for each segment, the ``count`` tokens just before
    it in the sequence (zeros before the first token), from ``parts`` (one [batch, chunk, ...]
    tensor per segment). A halo longer than a chunk reads several chunks before; each chunk gives
    its last min(count, chunk) tokens to one all-gather (differentiable)."""
    size = parts[0].shape[1]
    given = min(count, size)
    reach = -(-count // size)  # chunks back a halo spans
    gathered = gather_segments(cp, [part[:, size - given:] for part in parts])  # [chunks, batch, given, ...]
    halos = []
    for chunk in cp.chunks:
        pieces = [gathered[before] if before >= 0 else gathered[0] * 0 for before in range(chunk - reach, chunk)]
        halos.append(torch.cat(pieces, 1)[:, -count:])
    return torch.stack(halos)


def earlier_chunks_sum(cp, parts):
    """[this rank's chunks, ...]: for each segment, the sum of the entries of every chunk before it."""
    gathered = gather_segments(cp, parts)
    return torch.stack([gathered[:chunk].sum(0) if chunk > 0 else gathered[0] * 0 for chunk in cp.chunks])


def gather_sequence(cp, parts):
    """[batch, chunks of the sequence x n, ...]: one [batch, n, ...] tensor per segment of this rank
    (``parts``: tokens each segment gives, e.g. its chunk ends) from every rank, in sequence order;
    an all-gather along the sequence (dim 1), differentiable."""
    n = parts[0].shape[1]
    gathered = cp.all_gather(torch.cat(list(parts), 1), dim=1)  # rank by rank, each rank's segments in order
    if cp.layout == "contiguous":
        return gathered
    return torch.cat([gathered[:, i * n:(i + 1) * n] for i in gathered_order(cp.layout, cp.world_size)], 1)


def longer_chunks_hint(cp) -> str:
    """The fix for a chunk too short for a mixer's halo or chunking, naming the layout with longer chunks."""
    hint = " Use longer rows or fewer ranks"
    if cp.layout == "balanced":
        hint += ", or ContextParallelGroup(..., layout='contiguous') (one chunk per rank: twice as long)"
    return hint + "."
