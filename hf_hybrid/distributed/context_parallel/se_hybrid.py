"""Context-parallel forwards of SE hybrids, each per segment (a rank's chunk): SE attention and
Mamba-2 (conv halo, SSM state).

SE attention per mode: ``full`` is ring attention (ring.py). ``swa`` and ``se_nomem`` read their
local span, which reaches back w - 1 tokens or to the SE chunk's start: a halo of the chunks before.
``se`` adds retrieval: every block's summary (one vector per head) and each chunk's query sum since
its SE chunk start are all-gathered without gradient, so each rank ranks its selection groups'
blocks exactly as one process does; the blocks a rank's groups select from before its local span
(as (batch row, key head, block) units, the union over the key head's query heads and groups) are
requested with one all-gather of bools and brought by one all-to-all from the ranks holding them,
differentiable. Attention then runs over [received blocks ; local span] as the reference mask's
rows (kernels/span_expanded_attention/reference.py) say, per segment (se_segment.py): on CUDA on the
one-process layer's fused path (own SE chunk on cuDNN / FlashAttention-2, retrieved blocks moved by
the Triton block kernels, merged by log-sum-exp; no mask built) over a virtual sequence of the
received blocks and the local span; on CPU the readable masked softmax over blocks of queries,
whose mask rows are built a block at a time (memory linear in the segment)."""
from __future__ import annotations

import torch

from .group import ContextParallelGroup, check_plain, keep_in_graph
from .layout import gather_segments, longer_chunks_hint, preceding_tokens, previous_chunk_entries, rank_chunks, segments
from .ring import ring_softmax_attention
from .se_segment import fused_segment_attention, segment_attention, segment_backend


def se_attention_forward(mixer, cp: ContextParallelGroup, hidden_states, context, cache_layer=None,
                          attention_mode=None, se_chunk_size=None, **unused):
    from ...kernels.span_expanded_attention import MODES
    from ...layers.rotary import rotary_tables

    check_plain(mixer, context, cache_layer)
    mode = mixer.settings.mode if attention_mode is None else attention_mode
    if mode not in MODES or mode == "se_random":
        raise NotImplementedError(f"context parallelism with SE attention: mode {mode!r} has no exchange yet.")
    settings = mixer.settings
    if se_chunk_size is None and mixer.training and len(settings.chunk_sizes) > 1 and mode in ("se", "se_nomem"):
        raise ValueError("context parallelism with SE attention: train with one se_chunk_sizes entry (every rank must chunk alike).")
    chunk_size = mixer._chunk_size(se_chunk_size, mode, cached=False)
    batch, seq, _ = hidden_states.shape
    q = mixer.q_proj(hidden_states).view(batch, seq, mixer.num_heads, mixer.head_dim)
    k = mixer.k_proj(hidden_states).view(batch, seq, mixer.num_kv_heads, mixer.head_dim)
    v = mixer.v_proj(hidden_states).view(batch, seq, mixer.num_kv_heads, mixer.head_dim)
    positions = cp.positions(seq, q.device)[None]
    cos_sin = rotary_tables(mixer.rotary, context, positions, tag=("context parallel positions", cp.layout, cp.rank, seq))
    q, k = mixer._rotate(q, cos_sin), mixer._rotate(k, cos_sin)
    if mode == "full":  # every earlier key: ring attention, no rank holds the prefix
        backend = "reference" if settings.backend == "reference" else "auto"
        out = ring_softmax_attention(q, k, v, cp, mixer.head_dim**-0.5, backend)
        return mixer.o_proj(out.reshape(batch, seq, -1))
    size = seq // len(cp.chunks)
    spans = _LocalSpans(mode, cp, size, chunk_size, settings)
    if mode == "se":
        for what, multiple in (("se_block_size", settings.block_size), ("se_select_every", settings.select_every)):
            if size % multiple:
                raise ValueError(f"context parallelism with SE attention: each chunk of the {cp.layout} layout ({size} tokens) "
                                 f"must be a multiple of {what} ({multiple})." + longer_chunks_hint(cp))
    # The keys a segment reads of its own neighbourhood: the halo of the chunks before it.
    halos = [preceding_tokens(cp, segments(cp, t), spans.halo) for t in (k, v)] if spans.halo else []
    tables, selections, remote = None, None, None
    if mode == "se":
        tables, selections = _retrieval_tables(cp, q.detach(), k.detach(), v.detach(), size, chunk_size, settings, mixer.num_heads)
        remote = _retrieved_blocks(cp, k, v, tables, spans, size, settings.block_size)
    backend = segment_backend(settings.backend, q.device)
    outs = []
    for index, (start, q_seg, k_seg, v_seg) in enumerate(zip(cp.segment_starts(seq), *(segments(cp, t) for t in (q, k, v)))):
        first = spans.first_key(start)
        held = start - first
        keys, values = k_seg, v_seg
        if held:
            keys = torch.cat([halos[0][index][:, spans.halo - held:], k_seg], 1)
            values = torch.cat([halos[1][index][:, spans.halo - held:], v_seg], 1)
        if backend == "sdpa":
            outs.append(fused_segment_attention(
                q_seg, keys, values, mode=mode, start=start, first=first, settings=settings, chunk_size=chunk_size,
                scale=mixer.head_dim**-0.5, remote=remote, selection=None if selections is None else selections[index],
            ))
            continue
        rows = _SegmentMask(spans, start, first, size, settings, q.device)
        if tables is not None:
            k_remote, v_remote, remote_blocks = remote
            rows.retrieve(tables[index], remote_blocks.repeat_interleave(mixer.num_key_value_groups, 1))
            keys, values = torch.cat([k_remote, keys], 1), torch.cat([v_remote, values], 1)
        outs.append(segment_attention(q_seg, keys, values, rows, scale=mixer.head_dim**-0.5))
    out = keep_in_graph(torch.cat(outs, 1), [*halos, *(remote[:2] if remote else ())])
    return mixer.o_proj(out.reshape(batch, seq, -1))


class _SegmentMask:
    """The reference mask's rows of a segment's queries over [received blocks ; local span], built
    for a block of queries at a time (``rows(lo, hi)``: queries start + lo .. start + hi - 1):
    never [queries, keys] for the whole segment, nor [queries, blocks of the sequence]."""

    def __init__(self, spans, start: int, first: int, size: int, settings, device):
        self.spans, self.start, self.first, self.settings = spans, start, first, settings
        self.key_pos = torch.arange(first, start + size, device=device)[None, :]
        self.table = None

    def retrieve(self, table, remote_blocks):
        """table [batch, heads, groups of the segment, blocks of the sequence]: the blocks each
        group retrieves; remote_blocks [batch, heads, n]: the block of each received slot (-1: padding)."""
        block = self.settings.block_size
        self.table, first = table, self.first
        # Padding (-1) and blocks this segment holds itself (a later segment asked for them) stay masked.
        usable = (remote_blocks >= 0) & (remote_blocks < first // block)
        picked = torch.gather(table, -1, remote_blocks.clamp(min=0)[:, :, None].expand(-1, -1, table.shape[2], -1))
        self.remote = picked & usable[:, :, None]  # [batch, heads, groups, n]
        self.local_blocks = self.key_pos[0] // block

    def __call__(self, lo: int, hi: int) -> torch.Tensor:
        key_pos = self.key_pos
        query_pos = torch.arange(self.start + lo, self.start + hi, device=key_pos.device)[:, None]
        mask = self.spans.own_mask(query_pos, key_pos)  # [queries, keys]
        if self.table is None:
            return mask
        every, block = self.settings.select_every, self.settings.block_size
        group = (query_pos[:, 0] - self.start) // every
        g_lo, g_hi = lo // every, (hi - 1) // every + 1  # the block's groups
        # Groups, then blocks to keys, then groups to queries: a block's rows only.
        in_span = self.table[:, :, g_lo:g_hi][..., self.local_blocks][:, :, group - g_lo] & (key_pos <= query_pos)
        remote = self.remote[:, :, group].repeat_interleave(block, -1)
        return torch.cat([remote, mask | in_span], -1)


class _LocalSpans:
    """Which keys near a query a mode reads without retrieval, as positions: a query p of a segment
    starting at ``start`` reads keys from ``first_key(start)`` on (``own_mask`` says which), and
    ``halo`` is the most tokens any segment of the sequence reads before its own start."""

    def __init__(self, mode: str, cp, size: int, chunk_size: int, settings):
        self.mode, self.chunk_size, self.window, self.block_size = mode, chunk_size, settings.window, settings.block_size
        self.halo = max(start - self.first_key(start) for start in range(0, size * cp.num_chunks, size))

    def first_key(self, start: int) -> int:
        if self.mode == "swa":
            return max(0, start - (self.window - 1))
        chunk_start = (start // self.chunk_size) * self.chunk_size
        if self.mode == "se":  # from the first block the SE chunk touches: blocks are whole here or retrieved
            return (chunk_start // self.block_size) * self.block_size
        return chunk_start

    def own_mask(self, query_pos, key_pos):
        causal = key_pos <= query_pos
        if self.mode == "swa":
            return causal & (key_pos > query_pos - self.window)
        return causal & (key_pos >= (query_pos // self.chunk_size) * self.chunk_size)


@torch.no_grad()
def _retrieval_tables(cp, q, k, v, size: int, chunk_size: int, settings, num_heads: int):
    """Per segment, [batch, heads, its selection groups, blocks of the sequence] bool: the blocks
    each group retrieves, chosen as one process chooses them; and per segment select_blocks'
    (indices, valid) [batch, heads, groups, k'], the same choice as slots (for the fused path). Gathered: every block's summary
    (one vector per head) and, per chunk, the sum of its queries since its last SE chunk start
    (what a group whose SE chunk began in an earlier chunk ranks with)."""
    from ...kernels.span_expanded_attention import block_summaries, retrieved_block_table, select_blocks

    block, every = settings.block_size, settings.select_every
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    starts = [chunk * size for chunk in cp.chunks]
    parts = list(zip(*(segments(cp, t) for t in (q, k, v))))
    summaries = gather_segments(cp, [block_summaries(q_s, k_s, v_s, block) for q_s, k_s, v_s in parts])
    summaries = summaries.transpose(0, 1).flatten(1, 2)  # [batch, blocks of the sequence, heads, dim]
    last_starts = [max(start, ((start + size - 1) // chunk_size) * chunk_size) for start in starts]
    tails = gather_segments(cp, [q_s[:, last - start:].sum(1, dtype=acc) for (q_s, _, _), start, last in zip(parts, starts, last_starts)])
    tables, selections = [], []
    for (q_s, _, _), start in zip(parts, starts):
        end = start + size
        chunk_start = (start // chunk_size) * chunk_size
        # Queries of this SE chunk in the chunks before: every earlier chunk that ends after its start.
        earlier = [j for j in range(start // size) if (j + 1) * size > chunk_start]
        carried = sum((tails[j] for j in earlier), torch.zeros_like(tails[0]))
        offsets = torch.arange(start, end, device=q.device)
        own_chunk_start = (offsets // chunk_size) * chunk_size
        running = torch.nn.functional.pad(q_s.to(acc).cumsum(1), (0, 0, 0, 0, 1, 0))  # [batch, size + 1, heads, dim]
        since = running[:, 1:] - running[:, (own_chunk_start - start).clamp(min=0)]
        since = since + (own_chunk_start < start)[None, :, None, None] * carried[:, None]
        relevancy = since[:, ::every]  # through each group's first query
        chunk_index = offsets[::every] // chunk_size
        indices, valid = select_blocks(
            relevancy, summaries[:, : end // block], chunk_index, mode="se", chunk_size=chunk_size, block_size=block,
            top_k=settings.top_k, num_heads=num_heads, seed=settings.seed,
        )
        tables.append(retrieved_block_table(indices, valid, summaries.shape[1]))
        selections.append((indices, valid))
    return tables, selections


def _retrieved_blocks(cp, k, v, tables, spans, size: int, block: int):
    """(keys, values [batch, n x block, kv heads, dim], block indices [batch, kv heads, n], -1 for
    padding): per batch row and key head, the blocks this rank's segments retrieve from before their
    own neighbourhood (n: the most any row and head needs). Each (row, key head, block) comes from
    the rank holding it by one all-to-all of just those, whose backward returns their gradients;
    the requests (a bool per row, key head and block of the sequence, per rank) are all-gathered first."""
    batch, seq, kv_heads, dim = k.shape
    blocks_per_chunk, num_blocks = size // block, tables[0].shape[-1]
    wanted = torch.zeros(batch, kv_heads, num_blocks, dtype=torch.bool, device=k.device)
    for table, chunk in zip(tables, cp.chunks):
        reach = spans.first_key(chunk * size) // block  # blocks from here on are in the segment's own keys
        by_key_head = table.unflatten(1, (kv_heads, -1)).any(2).any(2)  # query heads of a key head, groups
        wanted[..., :reach] |= by_key_head[..., :reach]
    with torch.no_grad():
        requests = cp.all_gather(wanted[None].to(torch.uint8), 0).bool()  # [ranks, batch, kv heads, blocks]
    owner = torch.empty(cp.num_chunks, dtype=torch.long)
    for rank in range(cp.world_size):
        owner[list(rank_chunks(cp.layout, rank, cp.world_size))] = rank
    block_owner = owner.repeat_interleave(blocks_per_chunk).to(k.device)
    # Where block j of this rank's chunks sits in its shard (chunks concatenated in shard order).
    slot = torch.full((num_blocks,), -1, dtype=torch.long, device=k.device)
    for index, chunk in enumerate(cp.chunks):
        slot[chunk * blocks_per_chunk:(chunk + 1) * blocks_per_chunk] = torch.arange(
            index * blocks_per_chunk, (index + 1) * blocks_per_chunk, device=k.device)
    send = [(requests[rank] & (block_owner == cp.rank)).nonzero() for rank in range(cp.world_size)]  # (row, head, block)
    receive = [(requests[cp.rank] & (block_owner == rank)).nonzero() for rank in range(cp.world_size)]
    units = torch.cat([k, v], -1).view(batch, seq // block, block, kv_heads, 2 * dim).permute(0, 3, 1, 2, 4)
    sent = torch.cat(send)
    rows = units[sent[:, 0], sent[:, 1], slot[sent[:, 2]]]  # [units, block, 2 dim]
    received = cp.exchange_rows(rows, [len(s) for s in send], [len(r) for r in receive])
    # Lay the received units out per (row, key head), padded to the longest with a zero unit.
    got = torch.cat(receive)
    pair = got[:, 0] * kv_heads + got[:, 1]
    counts = torch.bincount(pair, minlength=batch * kv_heads)
    most = int(counts.max()) if len(got) else 0
    order = torch.sort(pair, stable=True).indices
    place = torch.arange(len(got), device=k.device) - (counts.cumsum(0) - counts)[pair[order]]
    where = torch.full((batch * kv_heads, most), len(got), dtype=torch.long, device=k.device)
    where[pair[order], place] = order
    ids = torch.full((batch * kv_heads, most), -1, dtype=torch.long, device=k.device)
    ids[pair[order], place] = got[order, 2]
    padded = torch.cat([received, received.new_zeros(1, *received.shape[1:])])[where]  # [rows x heads, most, block, 2 dim]
    keys_values = padded.view(batch, kv_heads, most * block, 2 * dim).transpose(1, 2)
    return (*keys_values.split(dim, -1), ids.view(batch, kv_heads, most))


# ------------------------------------------------------------------------------------ Mamba-2


def mamba2_forward(mixer, cp: ContextParallelGroup, hidden_states, context, cache_layer=None, **unused):
    from ...kernels.causal_conv1d import causal_conv1d
    from ...kernels.ssd_scan import ssd_scan
    from ...models.se_hybrid.modeling_se_hybrid import _mamba_backend

    check_plain(mixer, context, cache_layer)
    batch, seq, _ = hidden_states.shape
    dtype = hidden_states.dtype
    backend = _mamba_backend(mixer)
    gate, xBC, dt = mixer.in_proj(hidden_states).split([mixer.intermediate_size, mixer.conv_dim, mixer.num_heads], dim=-1)
    K, size = mixer.conv_kernel_size, seq // len(cp.chunks)
    if size < K:
        raise ValueError(f"context parallelism with Mamba-2: each chunk of the {cp.layout} layout needs at least the conv width {K} tokens; got {size}." + longer_chunks_hint(cp))
    # Halo: a segment's conv state is the last K inputs of the chunk before (zeros before the first).
    tails = previous_chunk_entries(cp, [part[:, -K:].transpose(1, 2) for part in segments(cp, xBC)])  # [segments, batch, channels, K]
    xBC = torch.cat([
        causal_conv1d(part, mixer.conv1d.weight[:, 0], mixer.conv1d.bias, tail, mixer.activation, backend=backend)
        for part, tail in zip(segments(cp, xBC), tails)
    ], 1)
    group_width = mixer.n_groups * mixer.ssm_state_size
    x, B, C = xBC.split([mixer.intermediate_size, group_width, group_width], dim=-1)
    x = x.reshape(batch, seq, mixer.num_heads, mixer.head_dim)
    B = B.reshape(batch, seq, mixer.n_groups, mixer.ssm_state_size)
    C = C.reshape(batch, seq, mixer.n_groups, mixer.ssm_state_size)
    A = -torch.exp(mixer.A_log.float())
    scan = dict(D=mixer.D, dt_bias=mixer.dt_bias, dt_softplus=True, dt_limit=mixer.time_step_limit,
                chunk_size=mixer.chunk_size, backend=backend)
    parts = list(zip(*(segments(cp, t) for t in (x, dt, B, C))))
    # Each segment's own final state from zero, and how much of a state entering it survives to its end.
    own_states = [ssd_scan(x_s, dt_s, A, B_s, C_s, return_final_state=True, **scan)[1] for x_s, dt_s, B_s, C_s in parts]
    log_decay = [(torch.nn.functional.softplus(dt_s.float() + mixer.dt_bias.float()).clamp(*mixer.time_step_limit) * A).sum(dim=1)
                 for _, dt_s, _, _ in parts]  # [batch, heads] each
    states = gather_segments(cp, own_states)  # [chunks, batch, heads, P, N] in sequence order
    log_decays = gather_segments(cp, log_decay)  # [chunks, batch, heads]
    # State entering chunk c: h = sum over j < c of exp(log decay of chunks j+1 .. c-1) h_j.
    inclusive = log_decays.cumsum(0)  # sum of the log decays of chunks 0 .. j
    ys = []
    for chunk, (x_s, dt_s, B_s, C_s) in zip(cp.chunks, parts):
        before_own = inclusive[chunk] - log_decays[chunk]  # chunks 0 .. c-1
        earlier = (torch.arange(cp.num_chunks, device=x.device) < chunk)[:, None, None]
        exponent = torch.where(earlier, before_own - inclusive, float("-inf"))  # later chunks: weight 0
        initial_state = torch.einsum("rbh,rbhpn->bhpn", torch.exp(exponent), states)
        ys.append(ssd_scan(x_s, dt_s, A, B_s, C_s, initial_state=initial_state, **scan))
    return mixer._norm_and_project(torch.cat(ys, 1), gate, backend, dtype)
