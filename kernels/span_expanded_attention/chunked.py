"""Fast SE-Attn on fused attention kernels; never builds a T x T score matrix.

Work per mode (T tokens, chunks of M, k retrieved blocks of S tokens, groups of G queries):

* ``full``      one causal SDPA call (the baseline).
* ``se_nomem``  chunks stacked on the batch axis, one causal SDPA call: T x M / 2 scores.
* ``swa``       windows stacked on the batch axis; each attends to [previous window ; itself]
                under a band mask (T x 2W scores, memory-efficient kernel).
* ``se`` / ``se_random``: two fused calls merged by log-sum-exp inside one autograd Function:
    1. own chunk, causal, chunks stacked on the batch axis (cuDNN or FlashAttention-2 on CUDA,
       see kernels/_lse_attention.py);
    2. each group's G queries against its kS gathered block keys, groups stacked on the batch
       axis, no mask (only slots that hold a real past block are included: chunk i has
       min(k, floor(iM/S)) of them, so chunk 0 skips this call and, when M < kS, a few early
       chunks run it with fewer keys). Those counts follow from the shapes, so the forward never
       waits for the GPU (no host sync).
  Retrieval itself costs T/S block summaries (S x S each) and a [groups x blocks] score matrix.

Memory traffic around the fused calls, per K and V (X = one [b, T, h, d] tensor; the gathered
keys are about kS/G X): the retrieved blocks are copied once into exactly the layout the retrieval
call reads, and their gradients are added straight into the chunk call's dK (no zero-filled
buffer, no second copy). On CUDA both run as the Triton kernels of block_rows.py, which move
whole [S, d] block tiles: the gather reads the retrieved tiles and writes the gathered keys once
(a [b, h, blocks, S d] view for a row-wise index_select would first need a transposed copy of
K, 2X more), and the backward sums each block's contributors in float32 in a fixed order and
writes each retrieved block of dK once (deterministic; no atomics). Elsewhere (CPU, no Triton)
the same moves are ``index_select`` / ``index_add_`` over head_dim rows.

Selection is shared with the reference (:func:`reference.selection_for_sequence`), so both paths
retrieve the same blocks and differ only by floating-point rounding.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from .._backend import triton_available
from .._lse_attention import attention_with_lse, attention_with_lse_backward
from .reference import RETRIEVAL_MODES, expand_kv_heads, selection_for_sequence


def _stage(name: str):
    """A profiler range ``se::<name>`` while torch.profiler records (a no-op otherwise)."""
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(f"se::{name}")
    return contextlib.nullcontext()


def _pad_to(x: torch.Tensor, length: int) -> torch.Tensor:
    return x if x.shape[1] == length else F.pad(x, (0, 0, 0, 0, 0, length - x.shape[1]))


def _to_runs(x: torch.Tensor, run: int) -> torch.Tensor:
    """[b, t, h, ...] -> [b * (t // run), h, run, ...]: runs of ``run`` positions on the batch axis
    (a view when x is contiguous, which is the layout FlashAttention/cuDNN read directly)."""
    b, t, h = x.shape[:3]
    return x.view(b, t // run, run, h, *x.shape[3:]).transpose(2, 3).reshape(-1, h, run, *x.shape[3:])


def _from_runs(x: torch.Tensor, batch: int) -> torch.Tensor:
    """Inverse of :func:`_to_runs`: [b * n, h, run, ...] -> [b, n * run, h, ...] (a view for the
    fused kernels' outputs, which they lay out like their [b, t, h, d] inputs)."""
    n, h, run = x.shape[0] // batch, x.shape[1], x.shape[2]
    return x.view(batch, n, h, run, *x.shape[3:]).transpose(2, 3).reshape(batch, n * run, h, *x.shape[3:])


def _rows(x: torch.Tensor, first: int, last: int, run: int) -> torch.Tensor:
    """Groups [first, last) of x [b, t, h, ...] as [b, groups, run, h, ...] (a view)."""
    return x[:, first * run:last * run].unflatten(1, (last - first, run))


def _rows_as_runs(x: torch.Tensor, first: int, last: int, run: int) -> torch.Tensor:
    """Groups [first, last) of x [b, t, h, d] as attention batch entries [b * groups, h, run, d]."""
    rows = _rows(x, first, last, run)
    return rows.transpose(2, 3).reshape(-1, x.shape[2], run, x.shape[3])


# ---------------------------------------------------------------------------------------------
# Which groups retrieve how many blocks, and where their keys live
# ---------------------------------------------------------------------------------------------


def _retrieval_parts(num_chunks: int, chunk_size: int, block_size: int, slots: int) -> tuple:
    """Runs of chunks whose groups retrieve the same number (> 0) of valid blocks:
    ((valid slots, first chunk, last chunk), ...). Chunk i has min(k', floor(iM/S)) valid slots,
    k' = ``slots`` per group (see :func:`reference.select_blocks`): known from shapes alone."""
    parts = []
    for chunk in range(num_chunks):
        valid = min(slots, chunk * chunk_size // block_size)
        if valid == 0:
            continue
        if parts and parts[-1][0] == valid:
            parts[-1][2] = chunk + 1
        else:
            parts.append([valid, chunk, chunk + 1])
    return tuple(tuple(p) for p in parts)


def _retrieved_blocks(indices: torch.Tensor, first_group: int) -> torch.Tensor:
    """The block each gathered item reads: indices [b, h, groups, k'] -> [b, groups', h, k']
    contiguous for groups ``first_group``.., items in the order the retrieval call reads them."""
    return indices[:, :, first_group:].transpose(1, 2).contiguous()


def _block_rows(blocks: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """Row numbers, in x.view(-1, head_dim) for x [b, length, h, d] contiguous, of the keys of the
    items blocks [b, groups, h, n] -> [b * groups * h * n * S] in the order the retrieval call reads
    them ([b * groups, h, n * S, d])."""
    batch, _, heads = blocks.shape[:3]
    device = blocks.device
    first_position = blocks * block_size + (torch.arange(batch, device=device) * length)[:, None, None, None]
    first_row = first_position * heads + torch.arange(heads, device=device)[:, None]
    return (first_row[..., None] + torch.arange(block_size, device=device) * heads).reshape(-1)


def _gather_rows(x: torch.Tensor, rows: torch.Tensor, keys_per_group: int) -> torch.Tensor:
    """x [b, t, h, d] contiguous, rows from :func:`_block_rows` -> [b * groups', h, k' * S, d]:
    one copy of whole head_dim rows straight into the retrieval call's layout."""
    heads, dim = x.shape[2:]
    return x.view(-1, dim).index_select(0, rows).view(-1, heads, keys_per_group, dim)


def _add_rows_(x: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    """x.view(-1, d)[rows] += values with repeated rows accumulating (the gather's backward).

    On CUDA, index_add_ accumulates repeated rows with atomics, so dK/dV can differ in the last
    bits from run to run; under torch.use_deterministic_algorithms(True) PyTorch takes its
    deterministic (slower) path. The fallback only: with Triton, CUDA runs block_rows.add_blocks_."""
    dim = x.shape[-1]
    x.view(-1, dim).index_add_(0, rows, values.reshape(-1, dim))


def _use_block_kernels(device: torch.device) -> bool:
    """Whether retrieved blocks move through block_rows.py's Triton kernels (CUDA with Triton) or
    through index_select / index_add_ (CPU, meta, no Triton). Tests force the kernels on CPU under
    the Triton interpreter by patching this."""
    return device.type == "cuda" and triton_available()


def _gather_blocks(k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor, plan: _Plan) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [b, T', h, d] contiguous, blocks from :func:`_retrieved_blocks` -> (kr, vr), each
    [b * groups', h, k' S, d]: the retrieval call's keys and values."""
    if plan.block_kernels:
        from .block_rows import gather_blocks

        return gather_blocks(k, v, blocks, plan.block_size)
    rows = _block_rows(blocks, k.shape[1], plan.block_size)
    return tuple(_gather_rows(x, rows, plan.slots * plan.block_size) for x in (k, v))


def _add_block_gradients_(dk, dv, dk_items, dv_items, blocks: torch.Tensor, plan: _Plan) -> None:
    """dk, dv [b, T', h, d] contiguous += the retrieval call's dK / dV (dk_items, dv_items
    [b * groups, h, n S, d]) at the blocks [b, groups, h, n] the items read."""
    if plan.block_kernels:
        from .block_rows import add_blocks_

        add_blocks_(dk, dv, dk_items, dv_items, blocks, plan.block_size)
        return
    rows = _block_rows(blocks, dk.shape[1], plan.block_size)
    _add_rows_(dk, rows, dk_items)
    _add_rows_(dv, rows, dv_items)


@dataclass(frozen=True)
class _Plan:
    """The static layout of one ``se``/``se_random`` call (what the autograd Function needs)."""

    chunk_size: int
    select_every: int
    block_size: int
    slots: int  # k': retrieval slots per group, valid or not
    parts: tuple  # ((valid slots, first chunk, last chunk), ...), from _retrieval_parts
    scale: float
    block_kernels: bool  # gather / add gradients with block_rows.py's kernels, from _use_block_kernels

    @property
    def groups_per_chunk(self) -> int:
        return self.chunk_size // self.select_every

    @property
    def first_group(self) -> int:
        """The first group whose keys are gathered (earlier chunks retrieve nothing)."""
        return self.parts[0][1] * self.groups_per_chunk

    def groups(self, part) -> tuple[int, int]:
        return part[1] * self.groups_per_chunk, part[2] * self.groups_per_chunk

    def select(self, gathered: torch.Tensor, batch: int, part) -> torch.Tensor:
        """Gathered [b * groups', h, k' S, ...] -> the part's valid slots [b * groups, h, slots S, ...]
        (a view unless b > 1 and the part is not all the gathered groups)."""
        first, last = (g - self.first_group for g in self.groups(part))
        per_row = gathered.unflatten(0, (batch, -1))[:, first:last, :, : part[0] * self.block_size]
        return per_row.flatten(0, 1)

    def select_blocks(self, blocks: torch.Tensor, part) -> torch.Tensor:
        """Blocks [b, groups', h, k'] from :func:`_retrieved_blocks` -> the part's valid items
        [b, groups, h, slots], in the order of :meth:`select`'s keys (a view)."""
        first, last = (g - self.first_group for g in self.groups(part))
        return blocks[:, first:last, :, : part[0]]


def _lse_by_group(lse: torch.Tensor, batch: int, plan: _Plan, part) -> torch.Tensor:
    """Chunk-call lse [b * n, h, M] -> the part's chunks as [b, chunks, M / G, h, G], the
    retrieval call's [b * groups, h, G] order (a view: writes land in lse)."""
    by_chunk = lse.unflatten(0, (batch, -1))[:, part[1]:part[2]]  # [b, chunks, h, M]
    return by_chunk.unflatten(3, (plan.groups_per_chunk, plan.select_every)).transpose(2, 3)


class _MergedChunkAttention(torch.autograd.Function):
    """One softmax over [retrieved blocks of the query's group ; own chunk causally].

    q, k, v [b, T', h, d] contiguous (T' a multiple of M, heads already expanded); blocks from
    :func:`_retrieved_blocks` for the groups from ``plan.first_group`` on. The retrieved keys are
    gathered here and their gradients added into dK/dV here, so K and V are the only key inputs.
    """

    @staticmethod
    def forward(ctx, q, k, v, blocks, plan: _Plan):
        batch, _, heads, dim = q.shape
        M, G = plan.chunk_size, plan.select_every
        with _stage("chunk_attention"):
            out1, lse, saved1 = attention_with_lse(*(_to_runs(x, M) for x in (q, k, v)), True, plan.scale)
        out = _from_runs(out1, batch)  # [b, T', h, d]; merged into in place below
        with _stage("gather"):
            kr, vr = _gather_blocks(k, v, blocks, plan)
        saved2, merged_lse = [], []
        for part in plan.parts:
            first, last = plan.groups(part)
            with _stage("retrieval_attention"):
                out2, lse2, saved = attention_with_lse(
                    _rows_as_runs(q, first, last, G), plan.select(kr, batch, part), plan.select(vr, batch, part),
                    False, plan.scale,
                )
            with _stage("merge"):
                lse1 = _lse_by_group(lse, batch, plan, part)
                lse2 = lse2.view(lse1.shape)
                total = torch.logaddexp(lse2, lse1)  # the union's lse, in the retrieval call's order
                # softmax over the union: out = out1 + w * (out2 - out1) with w = exp(lse2 - total).
                weight = torch.exp(lse2 - total).flatten(1, 2).transpose(2, 3)  # [b, groups, G, h]
                out2 = out2.view(batch, last - first, heads, G, dim).transpose(2, 3)
                _rows(out, first, last, G).lerp_(out2, weight.to(out.dtype)[..., None])
                lse1.copy_(total)  # the chunk call's backward reads the merged lse from its own buffer
            saved2.append(saved)
            merged_lse.append(total.view(-1, heads, G))
        ctx.save_for_backward(q, k, v, blocks, kr, vr, out, lse, *merged_lse)
        ctx.meta = (plan, saved1, saved2)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, blocks, kr, vr, out, lse, *merged_lse = ctx.saved_tensors
        plan, saved1, saved2 = ctx.meta
        batch, _, heads, dim = q.shape
        M, G = plan.chunk_size, plan.select_every
        grad_out = grad_out.contiguous()
        with _stage("chunk_attention_backward"):
            grads = attention_with_lse_backward(*(_to_runs(x, M) for x in (grad_out, q, k, v, out)), lse, saved1, True, plan.scale)
        # [b, T', h, d] contiguous (a view for the fused kernels): the retrieval gradients are added in place.
        dq, dk, dv = (_from_runs(x, batch).contiguous() for x in grads)
        for part, saved, total in zip(plan.parts, saved2, merged_lse):
            first, last = plan.groups(part)
            with _stage("retrieval_attention_backward"):
                dq2, dk2, dv2 = attention_with_lse_backward(
                    _rows_as_runs(grad_out, first, last, G), _rows_as_runs(q, first, last, G),
                    plan.select(kr, batch, part), plan.select(vr, batch, part),
                    _rows_as_runs(out, first, last, G), total, saved, False, plan.scale,
                )
            with _stage("add_retrieval_gradients"):
                _rows(dq, first, last, G).add_(dq2.view(batch, last - first, heads, G, dim).transpose(2, 3))
                _add_block_gradients_(dk, dv, dk2, dv2, plan.select_blocks(blocks, part), plan)
        return dq, dk, dv, None, None


def span_expanded_attention_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mode: str,
    chunk_size: int,
    block_size: int,
    top_k: int,
    select_every: int,
    window: int | None,
    seed: int,
    scale: float | None,
) -> torch.Tensor:
    """Same function as :func:`reference.span_expanded_attention_reference`; inputs already checked."""
    batch, seq, heads, dim = q.shape
    scale = dim**-0.5 if scale is None else scale
    k_full, v_full = expand_kv_heads(k, heads), expand_kv_heads(v, heads)
    if mode == "full":
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k_full.transpose(1, 2), v_full.transpose(1, 2), is_causal=True, scale=scale)
        return out.transpose(1, 2)
    if mode == "swa":
        return _sliding_window(q, k_full, v_full, window, scale)
    padded = -(-seq // chunk_size) * chunk_size
    qp, kp, vp = (_pad_to(x, padded).contiguous() for x in (q, k_full, v_full))
    parts = ()
    if mode in RETRIEVAL_MODES:
        with _stage("select"):
            indices, _, _ = selection_for_sequence(
                q, k, v, mode=mode, chunk_size=chunk_size, block_size=block_size, top_k=top_k,
                select_every=select_every, seed=seed, scale=scale,
            )
        parts = _retrieval_parts(padded // chunk_size, chunk_size, block_size, indices.shape[-1])
    if not parts:  # se_nomem, or nothing to retrieve yet
        out = F.scaled_dot_product_attention(*(_to_runs(x, chunk_size) for x in (qp, kp, vp)), is_causal=True, scale=scale)
        return _from_runs(out, batch)[:, :seq]
    plan = _Plan(chunk_size, select_every, block_size, indices.shape[-1], parts, scale, _use_block_kernels(q.device))
    with _stage("select"):
        blocks = _retrieved_blocks(indices, plan.first_group)
    out = _MergedChunkAttention.apply(qp, kp, vp, blocks, plan)
    return out[:, :seq]


def _sliding_window(q, k, v, window, scale):
    """Each window of W queries attends to [previous window ; own window] with p - W < s <= p."""
    batch, seq, heads, dim = q.shape
    padded = -(-seq // window) * window
    qp, kp, vp = (_pad_to(x, padded) for x in (q, k, v))
    runs = padded // window

    def with_previous(x):
        prev = F.pad(x, (0, 0, 0, 0, window, 0))[:, :padded]
        return torch.cat([_to_runs(prev, window), _to_runs(x, window)], dim=2)

    rel_q = torch.arange(window, device=q.device)[:, None]
    rel_k = torch.arange(-window, window, device=q.device)[None, :]
    band = (rel_k <= rel_q) & (rel_k > rel_q - window)
    first = band & (rel_k >= 0)  # the first window has no previous one
    mask = torch.stack([first] + [band] * (runs - 1))[:, None]  # [runs, 1, W, 2W]
    mask = mask.repeat(batch, 1, 1, 1)
    out = F.scaled_dot_product_attention(_to_runs(qp, window), with_previous(kp), with_previous(vp), attn_mask=mask, scale=scale)
    return _from_runs(out, batch)[:, :seq]
