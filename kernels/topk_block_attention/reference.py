"""Reference top-k block attention (Quest / MoBA block selection), optionally united with dilation.

Math (RAT+ paper Sec. 5.2-5.3, Tables 17-19). Keys are grouped into blocks of ``block_size`` = B
consecutive *positions*: block c holds positions cB .. cB + B - 1. For a query at position i
(its own block c_i = i // B) and head h:

* candidates: the complete blocks strictly before the query's own block, c < c_i;
* block score (keys of the query's kv head):
    quest: s_c = sum_d max(q_d * min_{j in c} k_{j,d}, q_d * max_{j in c} k_{j,d})
           (an upper bound of q . k_j over the block; Quest's min/max page statistics)
    moba:  s_c = q . mean_{j in c} k_j
* selected blocks: the query's own block (always, as in MoBA; it counts towards K) plus the
  top_k - 1 best-scoring candidates (all of them when there are fewer); equal scores go to the
  lower block index, so the choice is deterministic;
* visible keys: j <= i and (block(j) selected, or j < num_sink_tokens, or i - j <= local_window,
  or, when dilation D > 1, (j + 1) % D == 0). The last three are the dilated pattern of
  ``dilated_mask``; with dilation = 1 top-k has no dilated part ("dilation || top-k" of Table 19
  is dilation D > 1 together with top_k);
* one softmax over the visible keys with scale head_dim^-0.5, scores in float32.

Tensors are [batch, seq, heads, head_dim]; k and v may have fewer heads than q (GQA: query head h
reads kv head h // (heads // kv_heads)). Positions are explicit so that cached continuation and
left-padded rows work: ``query_positions`` [batch, q_len], ``key_positions`` [batch, k_len] with
-1 marking keys that are not real tokens (padding, empty cache slots).
"""
from __future__ import annotations

import torch

SCORINGS = ("quest", "moba")


def default_positions(batch: int, num_queries: int, num_keys: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries at the last num_queries of num_keys positions (no padding, any cached prefix)."""
    keys = torch.arange(num_keys, device=device).expand(batch, num_keys)
    return keys[:, num_keys - num_queries :], keys


def dilated_mask(
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    dilation: int,
    local_window: int = 0,
    num_sink_tokens: int = 0,
) -> torch.Tensor:
    """[batch, q_len, k_len] bool: key at position j is visible to the query at position i iff
    j >= 0 (a real key), j <= i and ((j + 1) % dilation == 0 or i - j <= local_window or
    j < num_sink_tokens). With arange positions this is ``chunk_attention.block_end_mask``."""
    i = query_positions[:, :, None]
    j = key_positions[:, None, :]
    pattern = ((j + 1) % dilation == 0) | (i - j <= local_window) | (j < num_sink_tokens)
    return (j >= 0) & (j <= i) & pattern


def block_summaries(
    k: torch.Tensor, key_positions: torch.Tensor, block_size: int, scoring: str, num_blocks: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block key statistics, slot-indexed by block: slot c summarises positions cB .. cB + B - 1.

    Returns (summary, complete): summary [batch, num_blocks, kv_heads, 2 or 1, head_dim] in float32
    holding (min, max) for quest or (mean,) for moba, and complete [batch, num_blocks] bool, True
    where all B keys of the block are present. Incomplete slots hold zeros and are never scored.
    """
    if scoring not in SCORINGS:
        raise ValueError(f"block_summaries: scoring must be one of {SCORINGS}, got {scoring!r}.")
    batch, _, heads, dim = k.shape
    valid = key_positions >= 0
    block = torch.div(key_positions.clamp(min=0), block_size, rounding_mode="floor")
    if num_blocks is None:
        num_blocks = int(block[valid].max()) + 1 if bool(valid.any()) else 0
    # Keys outside [0, num_blocks) go to a spill slot that is dropped at the end.
    in_range = valid & (block < num_blocks)
    slot = torch.where(in_range, block, torch.full_like(block, num_blocks))
    index = slot[:, :, None, None].expand(batch, slot.shape[1], heads, dim)
    kf = k.float()
    count = torch.zeros(batch, num_blocks + 1, device=k.device).scatter_add_(1, slot, in_range.float())
    complete = (count[:, :num_blocks] == block_size)
    shape = (batch, num_blocks + 1, heads, dim)
    if scoring == "quest":
        low = torch.zeros(shape, device=k.device).scatter_reduce_(1, index, kf, "amin", include_self=False)
        high = torch.zeros(shape, device=k.device).scatter_reduce_(1, index, kf, "amax", include_self=False)
        summary = torch.stack([low, high], dim=3)
    else:
        total = torch.zeros(shape, device=k.device).scatter_add_(1, index, kf)
        summary = (total / block_size)[:, :, :, None]
    summary = summary[:, :num_blocks] * complete[:, :, None, None, None]
    return summary, complete


def block_scores(q: torch.Tensor, summary: torch.Tensor, scoring: str) -> torch.Tensor:
    """[batch, heads, q_len, num_blocks] float32 scores of every block for every query (see module doc)."""
    heads, kv_heads = q.shape[2], summary.shape[2]
    summary = summary.repeat_interleave(heads // kv_heads, dim=2)
    qf = q.float()
    if scoring == "quest":
        # max(q_d min_d, q_d max_d) = q_d+ max_d + q_d- min_d: two matmuls, no [.., blocks, head_dim] product.
        high = torch.einsum("bthd,bchd->bhtc", qf.clamp(min=0), summary[:, :, :, 1])
        low = torch.einsum("bthd,bchd->bhtc", qf.clamp(max=0), summary[:, :, :, 0])
        return high + low
    if scoring == "moba":
        return torch.einsum("bthd,bchd->bhtc", qf, summary[:, :, :, 0])
    raise ValueError(f"block_scores: scoring must be one of {SCORINGS}, got {scoring!r}.")


def select_blocks(
    scores: torch.Tensor, query_positions: torch.Tensor, complete: torch.Tensor, block_size: int, top_k: int
) -> torch.Tensor:
    """[batch, heads, q_len, num_blocks] bool: the top_k - 1 best complete blocks before each query's own
    block (the own block is added by the mask, it is not a candidate)."""
    num_blocks = scores.shape[-1]
    own = torch.div(query_positions, block_size, rounding_mode="floor")  # [batch, q_len]
    blocks = torch.arange(num_blocks, device=scores.device)
    candidate = (blocks < own[:, :, None]) & complete[:, None, :]  # [batch, q_len, blocks]
    scores = scores.masked_fill(~candidate[:, None], float("-inf"))
    picks = top_k - 1
    if picks <= 0 or num_blocks == 0:
        return torch.zeros_like(scores, dtype=torch.bool)
    # A stable descending sort gives equal scores to the lower block index.
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :picks]
    chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, order, True)
    return chosen & candidate[:, None]


def topk_block_mask(
    selected: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    block_size: int,
    dilation: int = 1,
    local_window: int = 0,
    num_sink_tokens: int = 0,
) -> torch.Tensor:
    """[batch, heads, q_len, k_len] bool visibility from the selected blocks (see module doc)."""
    num_blocks = selected.shape[-1]
    i = query_positions[:, None, :, None]
    j = key_positions[:, None, None, :]
    key_block = torch.div(key_positions.clamp(min=0), block_size, rounding_mode="floor")
    own = torch.div(query_positions, block_size, rounding_mode="floor")
    in_range = key_block < num_blocks
    index = key_block.clamp(max=max(num_blocks - 1, 0))[:, None, None, :].expand(*selected.shape[:3], -1)
    if num_blocks:
        in_selected = torch.gather(selected, -1, index) & in_range[:, None, None, :]
    else:
        in_selected = torch.zeros_like(index, dtype=torch.bool)
    in_own = key_block[:, None, :] == own[:, :, None]  # [batch, q_len, k_len]
    base = (j < num_sink_tokens) | (i - j <= local_window)
    if dilation > 1:
        base = base | ((j + 1) % dilation == 0)
    visible = in_selected | in_own[:, None] | base
    return visible & (j >= 0) & (j <= i)


def masked_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """softmax(q k^T * scale, masked) v with an explicit bool mask [batch, 1 or heads, q_len, k_len].

    GQA: k, v may have fewer heads. A query with no visible key gets a zero output (never NaN).
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    rep = q.shape[2] // k.shape[2]
    kf = k.float().repeat_interleave(rep, dim=2)
    vf = v.float().repeat_interleave(rep, dim=2)
    scores = torch.einsum("bthd,bshd->bhts", q.float(), kf) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhts,bshd->bthd", probs, vf).to(q.dtype)


def topk_block_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_size: int,
    top_k: int,
    scoring: str = "quest",
    dilation: int = 1,
    local_window: int = 0,
    num_sink_tokens: int = 0,
    query_positions: torch.Tensor | None = None,
    key_positions: torch.Tensor | None = None,
    summary: tuple[torch.Tensor, torch.Tensor] | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Top-k block attention (optionally || dilation); see the module docstring for the math.

    ``summary`` = (summary, complete) from :func:`block_summaries` (e.g. kept by a cache); computed
    from k when None. Builds q_len x k_len masks: for tests, decoding and short prefills.
    """
    if query_positions is None or key_positions is None:
        query_positions, key_positions = default_positions(q.shape[0], q.shape[1], k.shape[1], q.device)
    if summary is None:
        num_blocks = int(query_positions.max()) // block_size + 1 if query_positions.numel() else 0
        summary = block_summaries(k, key_positions, block_size, scoring, num_blocks)
    stats, complete = summary
    scores = block_scores(q, stats, scoring)
    selected = select_blocks(scores, query_positions, complete, block_size, top_k)
    mask = topk_block_mask(selected, query_positions, key_positions, block_size, dilation, local_window, num_sink_tokens)
    return masked_attention_reference(q, k, v, mask, scale)
