"""Context parallelism: one sequence split contiguously over the ranks of a process group, each
token mixer exchanging only what its math needs across the shard borders.

    cp = ContextParallelGroup.from_mesh(mesh)               # a 1-D DeviceMesh (or .from_group)
    ids, targets = cp.shard(input_ids), cp.shard_labels(labels)   # targets: already shifted
    with context_parallel(model, cp):
        loss = model(input_ids=ids, shift_labels=targets, num_items_in_batch=cp.count_targets(targets), use_cache=False).loss
    loss.backward()                                          # then sum each gradient over the group
    cp.all_reduce_gradients(model)

Rank r holds tokens [r S, (r + 1) S) of every row (S = seq / ranks). The labels are shifted
before they are split (``shift_labels``), so the target of a shard's last token is the next
shard's first token and the loss is exact at the borders; with ``num_items_in_batch`` set to the
group's count of targets, each rank's loss is its share of the global mean and the shares add
up to it. Norms, MLPs and embeddings act per token; what each mixer exchanges:

- RAT (``RatAttention``): a query sees its own chunk's recurrent state and the end of every
  earlier chunk. The recurrence restarts at every chunk, so a shard of whole chunks computes its
  own k~, v~; the ranks all-gather their chunk ends (1/L of the keys and values).
- RAT+ (``RatPlusAttention``): the gated recurrence runs over the whole sequence, so each shard
  scans from zero, the ranks all-gather (final state, product of the gates), and each carries the
  earlier shards' states through into its own initial state and scans again from it. The keys
  and values of the earlier shards are all-gathered (dense and dilated patterns, windows and sinks
  read them through the pattern's mask; gathering only the dilated 1/D is left to do). Top-k
  patterns raise.
- FoX (``ForgettingAttention``): query i weighs key j by exp(c_i - c_j), c the running sum of
  log forget gates over the whole sequence. Each shard's c is its own running sum plus the earlier
  shards' totals (all-gathered, one number per row and head); keys, values and c are all-gathered
  (each rank attends over the prefix up to its shard's end: the memory of the keys of the whole
  sequence, not a ring yet), and the KV-shift reads the previous shard's last key and value.
- RATTENTION local layers (``RattentionLocalAttention``): the sliding window of the shard's first
  tokens reaches w + 1 tokens into the previous shard (a halo of keys and values), and the
  residual linear attention starts from the state of every token before that halo: the sum of
  the earlier shards' phi(k) v^T (all-gathered, one state per shard; the sums have no decay) less
  the halo's own. Global layers (``RattentionGlobalAttention``): keys and values all-gathered.
- Softmax attention (``SoftmaxAttention``: the sliding-window and full layers of RAT hybrids):
  a window of w tokens reads the previous shard's last w - 1 keys and values (a halo); full
  attention gathers the keys and values of the shards before.
- SE attention (``SpanExpandedAttention``, the attention layers of SE hybrids; full, swa, se and
  se_nomem modes): the keys and values of the shards before are all-gathered; which blocks a
  group of queries retrieves is chosen from the earlier queries and keys (gathered without
  gradient), the same causal choice one process makes. se_random raises.
- Mamba-2 (``SEMambaMixer``, the SSM layers of SE hybrids): the causal conv reads the last K - 1
  inputs of the previous shard (a halo), and the scan starts from the state the earlier shards
  leave. Each rank scans its shard from zero, the ranks all-gather (final state, total decay),
  and each combines the earlier shards' states into its initial state and scans again from it.

Every exchange is an all-gather whose backward sums the gradient over the ranks and keeps the
own part, so forward, loss and every gradient equal one process on the whole sequence. A model
with another mixer raises NotImplementedError naming it (see ``supported_mixers``). Where the
keys and values of the earlier shards are gathered whole (FoX, RAT+, full softmax and SE layers),
each rank holds the keys of the sequence up to its shard: exact, but not yet the memory of a
ring, which passes them block by block.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..layers.backbone import DecoderLayer
from ..layers.loss import shifted_labels


@dataclass(frozen=True)
class ContextParallelGroup:
    """The ranks one sequence is split over, and this process's place among them."""

    group: dist.ProcessGroup
    rank: int
    world_size: int

    @classmethod
    def from_group(cls, group: dist.ProcessGroup | None = None) -> ContextParallelGroup:
        group = group or dist.group.WORLD
        return cls(group, dist.get_rank(group), dist.get_world_size(group))

    @classmethod
    def from_mesh(cls, mesh, mesh_dim: str | int | None = None) -> ContextParallelGroup:
        """The group of one dimension of a DeviceMesh (the only one of a 1-D mesh)."""
        return cls.from_group(mesh.get_group(mesh_dim) if mesh_dim is not None else mesh.get_group())

    def shard(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's contiguous part of ``tensor`` along ``dim`` (the sequence)."""
        length = tensor.shape[dim]
        if length % self.world_size:
            raise ValueError(
                f"context parallelism: the sequence length {length} must divide evenly over {self.world_size} ranks; "
                "pad the rows (labels -100) to a multiple."
            )
        return tensor.chunk(self.world_size, dim)[self.rank].contiguous()

    def shard_labels(self, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """The targets of this rank's tokens: ``labels`` shifted left over the whole sequence, then
        split (pass them as ``shift_labels``)."""
        return self.shard(shifted_labels(labels, ignore_index))

    def count_targets(self, shift_labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """The group's number of counted targets (pass it as ``num_items_in_batch``)."""
        count = (shift_labels != ignore_index).sum()
        dist.all_reduce(count, group=self.group)
        return count

    def all_reduce_gradients(self, model: nn.Module) -> None:
        """Sum every parameter's gradient over the group (each rank holds its shard's part)."""
        for param in model.parameters():
            if param.grad is not None:
                dist.all_reduce(param.grad, group=self.group)

    def all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along ``dim`` in rank order, differentiable."""
        return _AllGather.apply(tensor, dim, self)

    def from_previous_ranks(self, tensor: torch.Tensor) -> torch.Tensor:
        """[ranks, ...] every rank's ``tensor`` stacked (differentiable), for mixers that combine
        the earlier shards' values. Every rank uses every entry (with zero weights where it must
        not), so each rank's backward reaches the same collectives."""
        return self.all_gather(tensor.unsqueeze(0), 0)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, dim, cp):
        ctx.dim, ctx.cp = dim, cp
        parts = [torch.empty_like(tensor) for _ in range(cp.world_size)]
        dist.all_gather(parts, tensor.contiguous(), group=cp.group)
        return torch.cat(parts, dim)

    @staticmethod
    def backward(ctx, grad):
        # Every rank's use of this rank's part contributes to its gradient: sum, keep the own slice.
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.cp.group)
        return grad.chunk(ctx.cp.world_size, ctx.dim)[ctx.cp.rank], None, None


# ---------------------------------------------------------------------------------------- RAT


def _rat_forward(mixer, cp: ContextParallelGroup, hidden_states, context, cache_layer=None, **unused):
    from ..kernels._common import expand_groups
    from ..kernels.chunk_attention import chunk_end_attention, chunk_ends
    from ..kernels.fused_norm import rotary as rotate
    from ..layers.rotary import rotary_tables

    _check_plain(mixer, context, cache_layer)
    batch, seq, _ = hidden_states.shape
    heads, dim, L, groups = mixer.num_heads, mixer.head_dim, mixer.chunk_size, mixer.num_qk_groups
    if seq % L:
        raise ValueError(f"context parallelism with RAT: each shard ({seq} tokens) must hold whole chunks of {L}.")
    q, k, v, gate_logits, gate_z = (proj(hidden_states) for proj in (mixer.q_proj, mixer.k_proj, mixer.v_proj, mixer.g_proj, mixer.z_proj))
    q, k = q.view(batch, seq, groups, dim), k.view(batch, seq, groups, dim)
    v, gate_logits = v.view(batch, seq, heads, dim), gate_logits.view(batch, seq, heads, dim)
    start = cp.rank * seq
    positions = torch.arange(start, start + seq, device=hidden_states.device)[None]
    chunk_index = torch.div(positions, L, rounding_mode="floor")
    cos_sin = rotary_tables(mixer.rotary, context, chunk_index, tag=("context parallel chunk", L, start))
    # Chunk-local recurrences: a shard of whole chunks starts at a restart.
    k_tilde, v_tilde = mixer._recurrences(k, v, gate_logits, start, positions, None)
    k_rot = rotate(k_tilde, cos_sin, backend=mixer.backend)
    q = expand_groups(rotate(q, cos_sin, backend=mixer.backend), heads)
    k_ends = cp.all_gather(chunk_ends(k_rot, L), dim=1)  # every chunk's end, in order
    v_ends = cp.all_gather(chunk_ends(v_tilde, L), dim=1)
    y = chunk_end_attention(q, k_rot, v_tilde, k_ends, v_ends, query_chunk=chunk_index.expand(batch, seq), backend=mixer.backend)
    return mixer._output(gate_z, y)


# ------------------------------------------------------------------------------ SE attention


def _se_attention_forward(mixer, cp: ContextParallelGroup, hidden_states, context, cache_layer=None,
                          attention_mode=None, se_chunk_size=None, **unused):
    from ..kernels.span_expanded_attention import MODES, RETRIEVAL_MODES, retrieved_block_table, span_expanded_mask
    from ..kernels.span_expanded_attention.reference import masked_attention, selection_for_sequence
    from ..layers.rotary import rotary_tables

    _check_plain(mixer, context, cache_layer)
    mode = mixer.settings.mode if attention_mode is None else attention_mode
    if mode not in MODES or mode == "se_random":
        raise NotImplementedError(f"context parallelism with SE attention: mode {mode!r} has no exchange yet.")
    settings = mixer.settings
    if se_chunk_size is None and mixer.training and len(settings.chunk_sizes) > 1 and mode in RETRIEVAL_MODES:
        raise ValueError("context parallelism with SE attention: train with one se_chunk_sizes entry (every rank must chunk alike).")
    chunk_size = mixer._chunk_size(se_chunk_size, mode, cached=False)
    batch, seq, _ = hidden_states.shape
    q = mixer.q_proj(hidden_states).view(batch, seq, mixer.num_heads, mixer.head_dim)
    k = mixer.k_proj(hidden_states).view(batch, seq, mixer.num_kv_heads, mixer.head_dim)
    v = mixer.v_proj(hidden_states).view(batch, seq, mixer.num_kv_heads, mixer.head_dim)
    start, end = cp.rank * seq, (cp.rank + 1) * seq
    positions = torch.arange(start, end, device=q.device)[None]
    cos_sin = rotary_tables(mixer.rotary, context, positions, tag=("context parallel positions", start))
    q, k = mixer._rotate(q, cos_sin), mixer._rotate(k, cos_sin)
    # The keys and values of every shard up to this one; the retrieval (which blocks each group of
    # queries reads) is chosen from the queries and keys before, gathered without gradient.
    keys, values = cp.all_gather(k, dim=1)[:, :end], cp.all_gather(v, dim=1)[:, :end]
    retrieved = None
    if mode in RETRIEVAL_MODES:
        with torch.no_grad():
            queries = cp.all_gather(q.detach(), dim=1)[:, :end]
            indices, valid, _ = selection_for_sequence(
                queries, keys.detach(), values.detach(), mode=mode, chunk_size=chunk_size, block_size=settings.block_size,
                top_k=settings.top_k, select_every=settings.select_every, seed=settings.seed,
            )
            retrieved = retrieved_block_table(indices, valid, end // settings.block_size)
    mask = span_expanded_mask(
        mode, seq, end, query_start=start, chunk_size=chunk_size, block_size=settings.block_size,
        select_every=settings.select_every, window=settings.window, retrieved=retrieved,
    ).to(q.device)
    out = masked_attention(q, keys, values, mask)
    return mixer.o_proj(out.reshape(batch, seq, -1))


# ------------------------------------------------------------------------------------ Mamba-2


def _mamba2_forward(mixer, cp: ContextParallelGroup, hidden_states, context, cache_layer=None, **unused):
    from ..kernels.causal_conv1d import causal_conv1d
    from ..kernels.ssd_scan import ssd_scan
    from ..models.se_hybrid.modeling_se_hybrid import _mamba_backend

    _check_plain(mixer, context, cache_layer)
    batch, seq, _ = hidden_states.shape
    dtype = hidden_states.dtype
    backend = _mamba_backend(mixer)
    gate, xBC, dt = mixer.in_proj(hidden_states).split([mixer.intermediate_size, mixer.conv_dim, mixer.num_heads], dim=-1)
    K = mixer.conv_kernel_size
    if seq < K:
        raise ValueError(f"context parallelism with Mamba-2: each shard needs at least the conv width {K} tokens; got {seq}.")
    # Halo: the conv's state is the previous shard's last K inputs (zeros before the first shard).
    tails = cp.from_previous_ranks(xBC[:, -K:].transpose(1, 2))  # [ranks, batch, channels, K]
    conv_state = torch.einsum("r,rbck->bck", _previous_rank_only(cp, xBC.device).to(tails.dtype), tails)
    xBC = causal_conv1d(xBC, mixer.conv1d.weight[:, 0], mixer.conv1d.bias, conv_state, mixer.activation, backend=backend)
    group_width = mixer.n_groups * mixer.ssm_state_size
    x, B, C = xBC.split([mixer.intermediate_size, group_width, group_width], dim=-1)
    x = x.reshape(batch, seq, mixer.num_heads, mixer.head_dim)
    B = B.reshape(batch, seq, mixer.n_groups, mixer.ssm_state_size)
    C = C.reshape(batch, seq, mixer.n_groups, mixer.ssm_state_size)
    A = -torch.exp(mixer.A_log.float())
    scan = dict(D=mixer.D, dt_bias=mixer.dt_bias, dt_softplus=True, dt_limit=mixer.time_step_limit,
                chunk_size=mixer.chunk_size, backend=backend)
    # The shard's own final state from zero, and how much of a state entering it survives to its end.
    _, own_state = ssd_scan(x, dt, A, B, C, return_final_state=True, **scan)
    dt_eff = torch.nn.functional.softplus(dt.float() + mixer.dt_bias.float()).clamp(*mixer.time_step_limit)
    log_decay = (dt_eff * A).sum(dim=1)  # [batch, heads]
    states = cp.from_previous_ranks(own_state)  # [ranks, batch, heads, P, N]
    log_decays = cp.from_previous_ranks(log_decay)  # [ranks, batch, heads]
    # State entering shard r: h_r = sum over j < r of exp(log decay of shards j+1 .. r-1) h_j.
    inclusive = log_decays.cumsum(0)  # sum of the log decays of shards 0 .. j
    before_own = inclusive[cp.rank] - log_decays[cp.rank]  # shards 0 .. r-1
    earlier = (torch.arange(cp.world_size, device=x.device) < cp.rank)[:, None, None]
    exponent = torch.where(earlier, before_own - inclusive, float("-inf"))  # later shards: weight 0
    initial_state = torch.einsum("rbh,rbhpn->bhpn", torch.exp(exponent), states)
    y = ssd_scan(x, dt, A, B, C, initial_state=initial_state, **scan)
    return mixer._norm_and_project(y, gate, backend, dtype)


# ---------------------------------------------------------------------------------------- FoX


def _fox_forward(mixer, cp: ContextParallelGroup, hidden_states, context, cache_layer=None, **unused):
    from ..kernels.forgetting_attention import forgetting_attention_with_cache
    from ..layers.fused_norms import norm_backend, qk_norm_rotary
    from ..layers.rotary import apply_rotary, rotary_tables

    _check_plain(mixer, context, cache_layer)
    batch, seq, _ = hidden_states.shape
    heads, kv_heads, dim = mixer.num_heads, mixer.num_kv_heads, mixer.head_dim
    q, k, v, gate, k_shift_logits, v_shift_logits = mixer._projections(hidden_states)
    q, k, v = q.view(batch, seq, heads, dim), k.view(batch, seq, kv_heads, dim), v.view(batch, seq, kv_heads, dim)
    log_f = mixer.log_forget(hidden_states)
    previous = _previous_rank_only(cp, q.device)
    norms = norm_backend(mixer.backend, batch * seq)
    if mixer.k_shift is not None:  # KV-shift reads the previous shard's last raw key and value
        prev_k = torch.einsum("r,rbhd->bhd", previous, cp.from_previous_ranks(k[:, -1]))
        prev_v = torch.einsum("r,rbhd->bhd", previous, cp.from_previous_ranks(v[:, -1]))
        k = mixer.k_shift(hidden_states, k, prev_k, k_shift_logits, backend=norms)
        v = mixer.v_shift(hidden_states, v, prev_v, v_shift_logits, backend=norms)
    if mixer.q_norm is not None:
        q, k = qk_norm_rotary(q, k, mixer.q_norm, mixer.k_norm, None, norms)
    if mixer.rotary is not None:
        start = cp.rank * seq
        positions = torch.arange(start, start + seq, device=q.device)[None]
        cos_sin = rotary_tables(mixer.rotary, context, positions, tag=("context parallel positions", start))
        q, k = apply_rotary(q, cos_sin), apply_rotary(k, cos_sin)
    # c = cumsum(log f) over the whole sequence: the shard's own running sum plus the earlier shards' totals.
    totals = cp.from_previous_ranks(log_f.sum(dim=1))  # [ranks, batch, heads]
    earlier = (torch.arange(cp.world_size, device=q.device) < cp.rank).to(totals.dtype)
    c = log_f.cumsum(dim=1) + torch.einsum("r,rbh->bh", earlier, totals)[:, None]
    # Every key, value and c up to this shard's end (the later shards' are gathered, and unused).
    end = (cp.rank + 1) * seq
    keys, values, c_keys = (cp.all_gather(t, dim=1)[:, :end] for t in (k, v, c))
    o = forgetting_attention_with_cache(q, keys, values, c, c_keys, None, backend=mixer.backend)
    return mixer.output(o, gate, norms)


# --------------------------------------------------------------------------------------- RAT+


def _rat_plus_forward(mixer, cp: ContextParallelGroup, hidden_states, context, cache_layer=None, sparse_config=None, **unused):
    from ..kernels.fused_norm import rotary
    from ..kernels.gated_recurrence import gated_recurrence
    from ..kernels.output_gate import sigmoid_gate
    from ..layers.rat_plus_attention import DENSE, select_kv_heads
    from ..layers.rotary import rotary_tables

    _check_plain(mixer, context, cache_layer)
    batch, seq, _ = hidden_states.shape
    heads, kv, dim = mixer.num_heads, mixer.num_kv_heads, mixer.head_dim
    groups = (sparse_config or DENSE).layer_groups(mixer.layer_idx, heads)
    if any(pattern.kind == "topk" for pattern, _ in groups):
        raise NotImplementedError("context parallelism with RAT+: top-k block patterns have no exchange yet (dense and dilated do).")
    rep = heads // kv
    group_kv = [sorted({h // rep for h in group_heads}) for _, group_heads in groups]
    q, k, v, gate_z = (proj(hidden_states) for proj in (mixer.q_proj, mixer.k_proj, mixer.v_proj, mixer.z_proj))
    q, k, v = q.view(batch, seq, heads, dim), k.view(batch, seq, kv, dim), v.view(batch, seq, kv, dim)
    start, end = cp.rank * seq, (cp.rank + 1) * seq
    unused_gathers = []
    if mixer.use_recurrence:
        # The recurrence runs over the whole sequence: the state entering this shard is the earlier
        # shards' final states (each from zero) carried through the later shards' gate products.
        gate = torch.sigmoid(mixer.g_proj(hidden_states).float()).view(batch, seq, kv, dim)
        products = cp.from_previous_ranks(gate.prod(dim=1))  # [ranks, batch, kv, dim]
        tilde = []
        for x in (k, v):
            finals = cp.from_previous_ranks(gated_recurrence(x, gate, 0, 0, None, backend=mixer.backend, out_dtype=torch.float32)[:, -1])
            state = torch.zeros_like(finals[0])
            for j in range(cp.rank):
                state = products[j] * state + finals[j]
            tilde.append(gated_recurrence(x, gate, 0, 0, state, backend=mixer.backend, out_dtype=torch.float32))
            unused_gathers.append(finals)
        unused_gathers.append(products)
        k_tilde, v_tilde = tilde
    else:
        k_tilde, v_tilde = k.float(), v.float()
    positions = torch.arange(start, end, device=q.device)[None]
    cos_sin = rotary_tables(mixer.rotary, context, positions, tag=("context parallel positions", start))
    rope_backend = mixer.backend if mixer.backend in ("reference", "triton") else "auto"
    q = rotary(q, cos_sin, backend=rope_backend)
    k_rot = rotary(k_tilde.to(q.dtype), cos_sin, backend=rope_backend)
    # The keys and values of every shard up to this one (the patterns read the earlier ones through
    # their dilation, window and sinks; dense groups read them all).
    keys = cp.all_gather(k_rot, dim=1)[:, :end]
    values = cp.all_gather(v_tilde.to(q.dtype), dim=1)[:, :end]
    q_pos = positions.expand(batch, seq)
    k_pos = torch.arange(end, device=q.device)[None].expand(batch, end)
    y = q.new_empty(batch, seq, heads, dim) if len(groups) > 1 else None
    for (pattern, group_heads), kv_heads in zip(groups, group_kv):
        q_group = q if len(groups) == 1 else q[:, :, list(group_heads)]
        pick = lambda x: select_kv_heads(x, kv_heads, mixer._index_tensor)  # noqa: E731
        out = mixer._group_attention(pattern, group_heads, kv_heads, q_group, pick(keys), pick(values), q_pos, k_pos, None, False)
        if y is None:
            y = out
        else:
            y[:, :, list(group_heads)] = out
    out = mixer.o_proj(sigmoid_gate(gate_z, y.reshape(gate_z.shape), backend=mixer.backend))
    return _keep_in_graph(out, unused_gathers if cp.rank == 0 else [])


# ---------------------------------------------------------------------------------- RATTENTION


def _window_mask(start: int, seq: int, held: int, window: int | None, device) -> torch.Tensor:
    """[1, 1, seq, held + seq] bool: query start + i sees key start - held + j when it is not later
    and (with ``window``) fewer than ``window`` positions back (the token itself counts)."""
    query = torch.arange(start, start + seq, device=device)[:, None]
    key = torch.arange(start - held, start + seq, device=device)[None, :]
    visible = key <= query
    if window is not None:
        visible = visible & (query - key < window)
    return visible[None, None]


def _rattention_local_forward(mixer, cp: ContextParallelGroup, hidden_states, context, cache_layer=None, **unused):
    from ..kernels.residual_linear_attention import residual_linear_attention
    from ..kernels.residual_linear_attention.reference import feature_map_fn
    from ..layers.fused_norms import norm_backend, sum_branch_norms
    from ..layers.residual_linear_attention import _attend
    from ..layers.rotary import rotary_tables

    _check_plain(mixer, context, cache_layer)
    batch, seq, _ = hidden_states.shape
    q, k, v = mixer.project(hidden_states)
    w, start = mixer.window_size, cp.rank * seq
    halo = w + 1  # the window of the shard's first token: the previous shard's last w + 1 tokens
    if seq < halo:
        raise ValueError(f"context parallelism with RATTENTION: each shard ({seq} tokens) needs at least window_size + 1 = {halo}.")
    held = halo if cp.rank > 0 else 0
    previous = _previous_rank_only(cp, q.device)

    def from_previous(t):  # [batch, halo, ...] of the previous shard (zeros on the first rank)
        return torch.einsum("r,rb...->b...", previous.to(t.dtype), cp.from_previous_ranks(t[:, seq - halo:]))

    o_swa = o_rla = None
    unused_halos = []
    if mixer.use_swa:
        positions = torch.arange(start, start + seq, device=q.device)[None]
        cos_sin = rotary_tables(mixer.rotary, context, positions, tag=("context parallel positions", start))
        q_swa, k_swa = mixer.normed(q, k, cos_sin)
        halo_k, halo_v = from_previous(k_swa), from_previous(v)
        keys, values = torch.cat([halo_k, k_swa], 1)[:, halo - held:], torch.cat([halo_v, v], 1)[:, halo - held:]
        mask = _window_mask(start, seq, held, w + 1, q.device)
        o_swa = _attend(q_swa, keys, values, mask, mixer.num_heads, mixer.num_kv_heads)
        unused_halos += [halo_k, halo_v]
    if mixer.use_rla:
        # RLA state entering the window: every earlier token's phi(k) v^T, summed over the earlier
        # shards, less the halo's (still in the window). The sums are additive: no decay.
        phi = feature_map_fn(k, mixer.feature_map)
        own_sum = torch.einsum("bthf,bthd->bhfd", phi, v.float())
        earlier = (torch.arange(cp.world_size, device=q.device) < cp.rank).to(own_sum.dtype)
        halo_raw, halo_v = from_previous(k), from_previous(v)
        halo_sum = torch.einsum("bthf,bthd->bhfd", feature_map_fn(halo_raw, mixer.feature_map), halo_v.float())
        state = torch.einsum("r,rbhfd->bhfd", earlier, cp.from_previous_ranks(own_sum)) - halo_sum
        q_ext = torch.cat([q.new_zeros(batch, held, *q.shape[2:]), q], dim=1)
        raw = torch.cat([halo_raw, k], 1)[:, halo - held:]
        vals = torch.cat([halo_v, v], 1)[:, halo - held:]
        o_rla, _ = residual_linear_attention(q_ext, raw, vals, w, mixer.feature_map, state, backend=mixer.backend)
        o_rla = o_rla[:, held:]
    out = sum_branch_norms(o_swa, mixer.swa_norm, o_rla, mixer.rla_norm, norm_backend(mixer.backend, batch * seq))
    return _keep_in_graph(mixer.o_proj(out.reshape(batch, seq, -1)), unused_halos if held == 0 else [])


def _rattention_global_forward(mixer, cp: ContextParallelGroup, hidden_states, context, cache_layer=None, **unused):
    from ..layers.residual_linear_attention import _attend

    _check_plain(mixer, context, cache_layer)
    batch, seq, _ = hidden_states.shape
    q, k, v = mixer.project(hidden_states)
    q, k = mixer.normed(q, k)
    end = (cp.rank + 1) * seq
    keys, values = cp.all_gather(k, dim=1)[:, :end], cp.all_gather(v, dim=1)[:, :end]
    mask = _window_mask(cp.rank * seq, seq, cp.rank * seq, None, q.device)
    out = _attend(q, keys, values, mask, mixer.num_heads, mixer.num_kv_heads)
    return mixer.o_proj(out.reshape(batch, seq, -1))


# ------------------------------------------------------------------------- softmax attention


def _softmax_forward(mixer, cp: ContextParallelGroup, hidden_states, context, cache_layer=None, **unused):
    from torch.nn import functional as F

    from ..layers.rotary import apply_rotary, rotary_tables

    _check_plain(mixer, context, cache_layer)
    batch, seq, _ = hidden_states.shape
    heads, kv_heads, dim = mixer.num_heads, mixer.num_kv_heads, mixer.head_dim
    q = mixer.q_proj(hidden_states).view(batch, seq, heads, dim)
    k = mixer.k_proj(hidden_states).view(batch, seq, kv_heads, dim)
    v = mixer.v_proj(hidden_states).view(batch, seq, kv_heads, dim)
    start = cp.rank * seq
    positions = torch.arange(start, start + seq, device=q.device)[None]
    cos_sin = rotary_tables(mixer.rotary, context, positions, tag=("context parallel positions", start))
    q, k = apply_rotary(q, cos_sin), apply_rotary(k, cos_sin)
    window = mixer.sliding_window
    unused_halos = []
    if window is None:  # full attention: the keys and values of every shard up to this one
        held = start
        keys, values = cp.all_gather(k, dim=1)[:, : start + seq], cp.all_gather(v, dim=1)[:, : start + seq]
    else:  # a window of w tokens (itself included) reaches w - 1 tokens into the previous shard
        halo = window - 1
        if seq < halo:
            raise ValueError(f"context parallelism with a sliding window of {window}: each shard needs at least {halo} tokens.")
        held = halo if cp.rank > 0 else 0
        previous = _previous_rank_only(cp, q.device)
        halo_k, halo_v = (torch.einsum("r,rb...->b...", previous.to(t.dtype), cp.from_previous_ranks(t[:, seq - halo:])) for t in (k, v))
        keys, values = torch.cat([halo_k, k], 1)[:, halo - held:], torch.cat([halo_v, v], 1)[:, halo - held:]
        unused_halos = [halo_k, halo_v] if held == 0 else []
    mask = _window_mask(start, seq, held, window, q.device)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask,
        scale=mixer.scaling, enable_gqa=heads != kv_heads,
    ).transpose(1, 2)
    return _keep_in_graph(mixer.o_proj(out.reshape(batch, seq, -1)), unused_halos)


# --------------------------------------------------------------------------------- plumbing


def _previous_rank_only(cp: ContextParallelGroup, device) -> torch.Tensor:
    """[ranks] weights picking the previous rank's entry of from_previous_ranks (all zero on rank 0)."""
    weights = torch.zeros(cp.world_size, device=device)
    if cp.rank > 0:
        weights[cp.rank - 1] = 1
    return weights


def _keep_in_graph(out: torch.Tensor, tensors) -> torch.Tensor:
    """``out``, with gathered tensors a rank does not use joined to its graph at zero weight: every
    rank's backward must reach the same collectives (the all-gathers' gradient sums)."""
    for tensor in tensors:
        out = out + 0.0 * tensor.sum()
    return out


def _check_plain(mixer, context, cache_layer) -> None:
    if cache_layer is not None or context.past_length or context.key_valid is not None:
        raise ValueError(
            f"context parallelism ({type(mixer).__name__}): training forwards only, without a cache, "
            "padding or attention_mask zeros (split unpadded rows; mask targets with -100 instead)."
        )


def supported_mixers() -> dict[type, callable]:
    """Mixer class -> its context-parallel forward(mixer, cp, hidden_states, context, cache_layer)."""
    from ..layers.attention import SoftmaxAttention
    from ..layers.forgetting_attention import ForgettingAttention
    from ..layers.rat_attention import RatAttention
    from ..layers.rat_plus_attention import RatPlusAttention
    from ..layers.residual_linear_attention import RattentionGlobalAttention, RattentionLocalAttention
    from ..layers.span_expanded_attention import SpanExpandedAttention
    from ..models.se_hybrid.modeling_se_hybrid import SEMambaMixer

    return {
        RatAttention: _rat_forward, SEMambaMixer: _mamba2_forward, ForgettingAttention: _fox_forward,
        RattentionLocalAttention: _rattention_local_forward, RattentionGlobalAttention: _rattention_global_forward,
        SoftmaxAttention: _softmax_forward, RatPlusAttention: _rat_plus_forward,
        SpanExpandedAttention: _se_attention_forward,
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
    try:
        yield model
    finally:
        for mixer in mixers:
            del mixer.forward
        for m in models:
            del m.context_parallel_group
