"""Reference Span-Expanded Attention (SE-Attn, "Expansion Span", Sec. 3.2-3.3) and its ablations.

Tensors are ``[batch, seq, heads, head_dim]``; keys/values may have fewer heads (GQA: query head
h reads key/value head ``h // (heads / kv_heads)``). Positions count from 0; ``scale`` defaults to
``head_dim ** -0.5``. Every mode is causal softmax attention under a mode-specific visibility set:

* ``full``      query p sees every key s <= p.
* ``swa``       sliding window of ``window`` keys: p - window < s <= p (the paper's SW-Attn).
* ``se_nomem``  "SE-Attn-NoMem" (Sec. 3.2): the sequence is cut into chunks of M = ``chunk_size``
                tokens, chunk i = [iM, (i+1)M), and a query sees only its own chunk causally,
                iM <= s <= p. No information crosses chunks.
* ``se``        SE-Attn (Sec. 3.3): se_nomem plus an *expansion span* of ``top_k`` retrieved memory
                blocks. Memory block j = [jS, (j+1)S), S = ``block_size``, is summarised by the
                mean of non-causal attention inside the block,

                    c_j = (1/S) sum_t softmax(Q_j K_j^T * scale)[t] V_j          (per head)

                and chunk i scores block j by R_ij = sum_{t in chunk i} (Q_i c_j)_t, masked to
                blocks wholly in the past of the chunk, (j+1)S <= iM. The paper softmaxes
                (R_i + mask) / sqrt(d) and keeps the top k; the softmax is monotone, so the
                top k of the masked R_i are the same blocks. A query then attends over
                [retrieved blocks' K/V ; its own chunk's K/V causally] (Eqs. 1-3) in one softmax.
* ``se_random`` "SE-Attn-Random" (Sec. 4.3): like ``se`` but each chunk retrieves ``top_k`` blocks
                drawn uniformly (without replacement) among the same past blocks, from a
                deterministic hash of (seed, head, chunk, block), so prefill and decode agree.

Our reading of "sum over the chunk's queries", made causal. Summed over *all* M queries of the
chunk, the selection of an early query would depend on later queries of its chunk (a leak of
future tokens through the choice of blocks), and a decoder could not reproduce it. So queries
share a retrieval decision in groups of G = ``select_every`` consecutive positions of a chunk
(G divides M), and group g of chunk i ranks blocks with the chunk's queries *seen so far*:

    R_ij(g) = sum_{t = iM}^{iM + gG} q_t . c_j          (through the group's first query)

With G = 1 every query ranks with the prefix of its chunk that ends at itself; at the chunk's last
query the prefix is the paper's full-chunk R_ij. Every query of the group is at or after iM + gG,
so no output depends on a later token. Selection is a discrete choice and carries no gradient
(the paper's top-k is not differentiable either); it runs under no_grad, summing and scoring in
float32 (float64 for float64 inputs); the summaries come from a fused attention call.

Heads retrieve independently (the paper's exposition is single-head). Blocks that are not yet
complete are never retrieved (they cannot lie wholly before a chunk start).
"""
from __future__ import annotations

import torch

MODES = ("full", "se", "swa", "se_nomem", "se_random")
RETRIEVAL_MODES = ("se", "se_random")


# ---------------------------------------------------------------------------------------------
# Retrieval: block summaries, relevancy, top-k selection
# ---------------------------------------------------------------------------------------------


def expand_kv_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[b, s, kv_heads, d] -> [b, s, num_heads, d] by repeating each kv head for its query group."""
    if x.shape[2] == num_heads:
        return x
    return x.repeat_interleave(num_heads // x.shape[2], dim=2)


@torch.no_grad()
def block_summaries(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_size: int, scale: float | None = None) -> torch.Tensor:
    """c_j for every *complete* block of the given tokens (the first ``seq // block_size`` blocks).

    q [b, s, h, d], k/v [b, s, hk, d] -> [b, s // block_size, h, d] float32: the mean over the
    block's rows of non-causal attention of the block's queries over the block's keys/values,
    c_j = mean_t softmax(Q_j K_j^T * scale)[t] V_j. Each block is one batch entry of a fused
    non-causal attention call (an S x S problem), so this never costs more than O(T S d).
    """
    batch, _, heads, dim = q.shape
    num_blocks = q.shape[1] // block_size
    used = num_blocks * block_size
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    if num_blocks == 0:  # shorter than a block (a one-token document): no summary (CUDA SDPA returns nothing for an empty batch)
        return q.new_zeros(batch, 0, heads, dim, dtype=acc)

    def blocks(x):  # [b, used, h, d] -> [b * blocks, h, S, d]
        x = expand_kv_heads(x[:, :used], heads)
        return x.reshape(batch * num_blocks, block_size, heads, dim).transpose(1, 2)

    attended = torch.nn.functional.scaled_dot_product_attention(blocks(q), blocks(k), blocks(v), scale=scale)
    return attended.mean(dim=2, dtype=acc).view(batch, num_blocks, heads, dim)


@torch.no_grad()
def group_relevancy_queries(q: torch.Tensor, chunk_size: int, select_every: int) -> torch.Tensor:
    """r for every selection group of a sequence starting at position 0.

    q [b, s, h, d] -> [b, groups, h, d] float32 with groups = ceil(s / chunk_size) * (chunk_size //
    select_every); group g of chunk i holds sum_{t=iM}^{iM+gG} q_t (zero for groups past the end),
    computed as (sum of the whole groups before g in the chunk) + q at the group's first position.
    """
    batch, seq, heads, dim = q.shape
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    num_chunks = -(-seq // chunk_size)
    per_chunk = chunk_size // select_every
    padded = q if seq == num_chunks * chunk_size else torch.nn.functional.pad(q, (0, 0, 0, 0, 0, num_chunks * chunk_size - seq))
    group_sums = padded.view(batch, num_chunks, per_chunk, select_every, heads, dim).sum(dim=3, dtype=acc)
    before = group_sums.cumsum(dim=2) - group_sums  # whole groups before g, same chunk
    firsts = padded[:, ::select_every].to(acc).view(batch, num_chunks, per_chunk, heads, dim)
    return (before + firsts).view(batch, num_chunks * per_chunk, heads, dim)


def allowed_blocks(chunk_index: torch.Tensor, chunk_size: int, block_size: int) -> torch.Tensor:
    """Number of memory blocks wholly before the start of each chunk: floor(iM / S)."""
    return (chunk_index * chunk_size) // block_size


def _hash_uniform(*keys: torch.Tensor) -> torch.Tensor:
    """A deterministic uniform [0, 1) float per element from integer keys (32-bit mix, wraps mod 2^32)."""
    mask = 0xFFFFFFFF
    x = torch.zeros((), dtype=torch.int64, device=keys[0].device)
    for key in keys:
        x = ((x ^ key.to(torch.int64)) * 0x9E3779B1 + 0x7F4A7C15) & mask
        x = ((x ^ (x >> 16)) * 0x85EBCA6B) & mask
        x = ((x ^ (x >> 13)) * 0xC2B2AE35) & mask
        x = x ^ (x >> 16)
    return x.to(torch.float64) / 2.0**32


@torch.no_grad()
def select_blocks(
    relevancy_queries: torch.Tensor | None,
    summaries: torch.Tensor | None,
    chunk_index: torch.Tensor,
    *,
    mode: str,
    chunk_size: int,
    block_size: int,
    top_k: int,
    num_heads: int,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k past memory blocks for each selection group.

    relevancy_queries [b, groups, h, d] (``se``; None for ``se_random``), summaries [b, blocks, h, d]
    (c_j of the complete blocks available), chunk_index [groups] (the chunk each group belongs to).
    Returns (indices [b, h, groups, k'], valid [b, h, groups, k'] bool), k' = min(top_k, blocks),
    sorted by decreasing relevancy; slot n of group g is valid iff n < min(top_k, floor(iM/S)).
    """
    num_blocks = summaries.shape[1] if summaries is not None else 0
    batch = relevancy_queries.shape[0] if relevancy_queries is not None else summaries.shape[0]
    groups = chunk_index.shape[0]
    device = chunk_index.device
    kk = min(top_k, num_blocks)
    if kk == 0:
        empty = torch.zeros(batch, num_heads, groups, 0, dtype=torch.long, device=device)
        return empty, empty.bool()
    blocks = torch.arange(num_blocks, device=device)
    past = blocks[None, :] < allowed_blocks(chunk_index, chunk_size, block_size)[:, None]  # [groups, blocks]
    if mode == "se":
        scores = torch.einsum("bghd,bjhd->bhgj", relevancy_queries, summaries.to(relevancy_queries.dtype))
    elif mode == "se_random":
        heads = torch.arange(num_heads, device=device)
        seed_key = torch.full((), seed, dtype=torch.int64, device=device)  # filled on device: no host-to-device copy (a sync)
        scores = _hash_uniform(
            seed_key, heads[:, None, None], chunk_index[None, :, None], blocks[None, None, :]
        )[None].expand(batch, num_heads, groups, num_blocks)
    else:
        raise ValueError(f"select_blocks: mode must be one of {RETRIEVAL_MODES}, got {mode!r}.")
    scores = scores.masked_fill(~past, float("-inf"))
    indices = scores.topk(kk, dim=-1, sorted=True).indices
    n_valid = past.sum(-1).clamp(max=kk)  # [groups]
    valid = torch.arange(kk, device=device)[None, :] < n_valid[:, None]
    return indices, valid[None, None].expand(batch, num_heads, groups, kk)


def retrieved_blocks_of_sequence(q, k, v, mode, chunk_size, block_size, top_k, select_every, seed, scale):
    """retrieved_block_table of the blocks each selection group retrieves (None in modes without retrieval)."""
    if mode not in RETRIEVAL_MODES:
        return None
    indices, valid, _ = selection_for_sequence(
        q, k, v, mode=mode, chunk_size=chunk_size, block_size=block_size, top_k=top_k,
        select_every=select_every, seed=seed, scale=scale,
    )
    return retrieved_block_table(indices, valid, q.shape[1] // block_size)


def selection_for_sequence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mode: str,
    chunk_size: int,
    block_size: int,
    top_k: int,
    select_every: int,
    seed: int = 0,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Summaries + selection for a whole sequence from position 0 (the training / prefill case).

    Returns (indices, valid, chunk_index): indices/valid [b, h, groups, k'] and the chunk of each
    group. Shared by the reference and the fast path, so both retrieve the same blocks.
    """
    groups_per_chunk = chunk_size // select_every
    num_chunks = -(-q.shape[1] // chunk_size)
    chunk_index = torch.arange(num_chunks, device=q.device).repeat_interleave(groups_per_chunk)
    summaries = block_summaries(q, k, v, block_size, scale)
    relevancy = group_relevancy_queries(q, chunk_size, select_every) if mode == "se" else None
    indices, valid = select_blocks(
        relevancy, summaries, chunk_index, mode=mode, chunk_size=chunk_size, block_size=block_size,
        top_k=top_k, num_heads=q.shape[2], seed=seed,
    )
    return indices, valid, chunk_index


# ---------------------------------------------------------------------------------------------
# The visibility mask and dense attention
# ---------------------------------------------------------------------------------------------


def retrieved_block_table(indices: torch.Tensor, valid: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """[b, h, groups, k'] indices -> [b, h, groups, num_blocks] bool: True where a block was retrieved."""
    table = torch.zeros(*indices.shape[:3], num_blocks + 1, dtype=torch.bool, device=indices.device)
    # Invalid slots write into a spare last column, which is then dropped.
    table.scatter_(-1, torch.where(valid, indices, num_blocks), True)
    return table[..., :num_blocks]


def span_expanded_mask(
    mode: str,
    num_queries: int,
    num_keys: int,
    *,
    query_start: int = 0,
    chunk_size: int = 1,
    block_size: int = 1,
    select_every: int = 1,
    window: int | None = None,
    retrieved: torch.Tensor | None = None,
) -> torch.Tensor:
    """Visibility of key s (absolute position) to query p = query_start + t, from the definitions.

    Returns [q, k] bool for ``full``/``swa``/``se_nomem`` and [b, h, q, k] for ``se``/``se_random``,
    where ``retrieved`` [b, h, groups, blocks] (see :func:`retrieved_block_table`) says which blocks
    each selection group retrieved; group of p = (p // M) * (M // G) + (p % M) // G.
    """
    device = retrieved.device if retrieved is not None else None
    p = torch.arange(query_start, query_start + num_queries, device=device)[:, None]
    s = torch.arange(num_keys, device=device)[None, :]
    causal = s <= p
    if mode == "full":
        return causal
    if mode == "swa":
        return causal & (s > p - window)
    own_chunk = causal & (s >= (p // chunk_size) * chunk_size)
    if mode == "se_nomem":
        return own_chunk
    group = (p // chunk_size) * (chunk_size // select_every) + (p % chunk_size) // select_every  # [q, 1]
    block = s // block_size  # [1, k]
    num_blocks = retrieved.shape[-1]
    padded = torch.nn.functional.pad(retrieved, (0, 1))  # keys of incomplete blocks read the False column
    in_span = padded[:, :, group[:, 0]][..., block.clamp(max=num_blocks)[0]]  # [b, h, q, k]
    # Retrieved blocks lie before the chunk start by construction; `causal` keeps the mask honest.
    return own_chunk | (in_span & causal)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """softmax(q k^T * scale + log mask) v, scores in float32 (float64 for float64 inputs);
    mask [q, k] or [b, h, q, k]; q [b, q, h, d], k/v [b, k, hk, d]."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    k, v = expand_kv_heads(k, q.shape[2]), expand_kv_heads(v, q.shape[2])
    scores = torch.einsum("bthd,bshd->bhts", q.to(acc), k.to(acc)) * scale
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.einsum("bhts,bshd->bthd", probs, v.to(acc)).to(q.dtype)


def span_expanded_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mode: str = "se",
    chunk_size: int = 2048,
    block_size: int = 32,
    top_k: int = 8,
    select_every: int = 128,
    window: int | None = None,
    seed: int = 0,
    scale: float | None = None,
) -> torch.Tensor:
    """The oracle: dense T x T masked softmax attention with :func:`span_expanded_mask`.

    q [b, s, h, d], k/v [b, s, hk, d], positions 0..s-1. For tests and short sequences only.
    """
    seq = q.shape[1]
    retrieved = retrieved_blocks_of_sequence(q, k, v, mode, chunk_size, block_size, top_k, select_every, seed, scale)
    mask = span_expanded_mask(
        mode, seq, seq, chunk_size=chunk_size, block_size=block_size, select_every=select_every,
        window=window, retrieved=retrieved,
    ).to(q.device)
    return masked_attention(q, k, v, mask, scale)
