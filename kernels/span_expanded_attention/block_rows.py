"""Triton kernels that move SE-Attn's retrieved blocks (the fast path's gather and its backward).

K, V and their gradients are [b, T', h, d] with a unit last stride. A retrieved *item* is one block
j (tokens jS .. jS + S - 1) of one head: an [S, d] tile whose rows lie h * d elements apart. Items
are numbered in the retrieval call's order: ``blocks`` [b, groups, h, n] holds the block of each
item, and item i's keys are rows i S .. i S + S - 1 of the [b * groups, h, n S, d] key tensor.

* :func:`gather_blocks` copies every item's tile of K and of V into that layout, one program per
  item and slice of rows (TILE_ELEMENTS), both tensors in one launch. It reads each retrieved
  tile once (repeats mostly hit in L2) and writes the gathered keys once: the bytes of the
  index_select it replaces, in whole 256-byte rows per tile instead of one index per row.
* :func:`add_blocks_` is the gather's backward: it adds every item's [S, d] gradient tile into
  dK / dV at its block. :func:`block_contributors` first inverts ``blocks`` (a stable sort by
  destination plus CSR offsets from searchsorted; on the GPU, no host sync), so one program owns
  (a slice of rows of) one destination block of one head, sums its contributors in float32 in
  increasing item order and writes the block once. No atomics: the result is deterministic, and
  blocks that no item retrieved are neither read nor written.

Each kernel has a plain PyTorch reference (``*_reference``) that the tests compare against.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# Elements of one operand tile per program: half of a 32 x 128 block (the paper's S and head_dim),
# two 16-byte vectors per thread and operand at 4 warps. Compiled for sm_90 with the launch's
# alignment specialisation (16-byte pointers and strides): gather 28 registers, add 64 (a whole
# block per program: 48 and 127); without it (scalar loads, tests/kernels/sm90_resources.py) 94 and
# 168; never a spill. Both kernels are memory-bound: small resident programs hide the latency of
# the dependent index -> tile loads.
TILE_ELEMENTS = 2048
NUM_WARPS = 4


@triton.jit
def _tile_offsets(first_row, row_stride, rows, dims, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Offsets and mask of an [ROWS, BLOCK_D] slice of a block tile whose row r starts at
    (first_row + r) * row_stride (the mask folds away when S and d are powers of two)."""
    offsets = (first_row + rows).to(tl.int64)[:, None] * row_stride + dims[None, :]
    mask = (rows < BLOCK_SIZE)[:, None] & (dims < HEAD_DIM)[None, :]
    return offsets, mask


@triton.jit
def _gather_blocks_kernel(
    K, V, KR, VR, BLOCKS,
    groups, heads, slots,
    s_xb, s_xt, s_xh,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    item = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    dims = tl.arange(0, BLOCK_D)
    block = tl.load(BLOCKS + item).to(tl.int64)
    head = (item // slots) % heads
    batch = item // (heads * slots) // groups
    source, mask = _tile_offsets(block * BLOCK_SIZE, s_xt, rows, dims, BLOCK_SIZE, HEAD_DIM)
    source += batch * s_xb + head * s_xh
    target, _ = _tile_offsets(item * BLOCK_SIZE, HEAD_DIM, rows, dims, BLOCK_SIZE, HEAD_DIM)
    tl.store(KR + target, tl.load(K + source, mask=mask), mask=mask)
    tl.store(VR + target, tl.load(V + source, mask=mask), mask=mask)


@triton.jit
def _add_blocks_kernel(
    DK, DV, DK_ITEMS, DV_ITEMS, ITEMS, STARTS,
    num_blocks, heads, slots,
    s_xb, s_xt, s_xh, s_ir, s_ih, s_it,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    destination = tl.program_id(0)
    start = tl.load(STARTS + destination)
    end = tl.load(STARTS + destination + 1)
    if end > start:  # blocks nobody retrieved keep their gradient untouched (not even rewritten)
        row_head = destination // num_blocks
        block = (destination % num_blocks).to(tl.int64)
        batch = (row_head // heads).to(tl.int64)
        head = (row_head % heads).to(tl.int64)
        rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
        dims = tl.arange(0, BLOCK_D)
        target, mask = _tile_offsets(block * BLOCK_SIZE, s_xt, rows, dims, BLOCK_SIZE, HEAD_DIM)
        target += batch * s_xb + head * s_xh
        # Adding a float32 zero tile promotes the sum to float32 (float64 stays float64).
        zero = tl.zeros([ROWS, BLOCK_D], tl.float32)
        acc_k = tl.load(DK + target, mask=mask, other=0.0) + zero
        acc_v = tl.load(DV + target, mask=mask, other=0.0) + zero
        for position in range(start, end):  # increasing item order: a fixed summation order
            item = tl.load(ITEMS + position).to(tl.int64)
            source, _ = _tile_offsets((item % slots) * BLOCK_SIZE, s_it, rows, dims, BLOCK_SIZE, HEAD_DIM)
            source += item // (heads * slots) * s_ir + head * s_ih
            acc_k += tl.load(DK_ITEMS + source, mask=mask, other=0.0)
            acc_v += tl.load(DV_ITEMS + source, mask=mask, other=0.0)
        tl.store(DK + target, acc_k.to(DK.dtype.element_ty), mask=mask)
        tl.store(DV + target, acc_v.to(DV.dtype.element_ty), mask=mask)


def _tile(block_size: int, head_dim: int) -> tuple[dict, int]:
    """Tile constexprs for [S, d] blocks in row slices of at most TILE_ELEMENTS elements, and the
    number of slices per block."""
    block_d = triton.next_power_of_2(head_dim)
    rows = min(triton.next_power_of_2(block_size), max(1, TILE_ELEMENTS // block_d))
    return dict(BLOCK_SIZE=block_size, HEAD_DIM=head_dim, ROWS=rows, BLOCK_D=block_d), triton.cdiv(block_size, rows)


def _check_pair(op: str, a: torch.Tensor, b: torch.Tensor) -> None:
    if a.shape != b.shape or a.stride() != b.stride() or a.stride(-1) != 1:
        raise ValueError(f"{op}: expected two tensors of one shape and strides with a unit last stride, got "
                         f"{tuple(a.shape)}/{a.stride()} and {tuple(b.shape)}/{b.stride()}.")


def gather_blocks(k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [b, t, h, d] (same strides, unit last stride); blocks [b, groups, h, n], the block each
    item reads -> (kr, vr), each [b * groups, h, n * S, d] contiguous: item i's tile in
    rows i S .. i S + S - 1."""
    _check_pair("gather_blocks", k, v)
    batch, groups, heads, slots = blocks.shape
    head_dim = k.shape[-1]
    shape = (batch * groups, heads, slots * block_size, head_dim)
    kr, vr = k.new_empty(shape), v.new_empty(shape)
    if blocks.numel():
        tile, row_slices = _tile(block_size, head_dim)
        _gather_blocks_kernel[(blocks.numel(), row_slices)](
            k, v, kr, vr, blocks.contiguous(), groups, heads, slots, k.stride(0), k.stride(1), k.stride(2),
            **tile, num_warps=NUM_WARPS,
        )
    return kr, vr


def block_contributors(blocks: torch.Tensor, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Invert the retrieval: blocks [b, groups, h, n] (any strides; items numbered in this order)
    -> (items, starts), int32. The items that read block j of head h in row b are
    items[starts[d]:starts[d + 1]] with d = (b * heads + h) * num_blocks + j, in increasing order."""
    batch, _, heads, _ = blocks.shape
    device = blocks.device
    row_head = torch.arange(batch, device=device)[:, None, None, None] * heads + torch.arange(heads, device=device)[:, None]
    destination = (row_head * num_blocks + blocks).reshape(-1).to(torch.int32)
    ordered, items = torch.sort(destination, stable=True)  # stable: each list stays in item order
    boundaries = torch.arange(batch * heads * num_blocks + 1, device=device, dtype=torch.int32)
    return items.to(torch.int32), torch.searchsorted(ordered, boundaries, out_int32=True)


def add_blocks_(
    dk: torch.Tensor, dv: torch.Tensor, dk_items: torch.Tensor, dv_items: torch.Tensor, blocks: torch.Tensor, block_size: int,
) -> None:
    """dk, dv [b, t, h, d] (same strides, unit last stride) += each item's gradient tile at its block:
    dk_items, dv_items [b * groups, h, n * S, d] (any strides with a unit last one), blocks
    [b, groups, h, n] as for :func:`gather_blocks`. Repeated blocks accumulate in float32 in item
    order and each touched block is rounded once; deterministic."""
    _check_pair("add_blocks_", dk, dv)
    if dk_items.stride() != dv_items.stride() or dk_items.stride(-1) != 1:
        dk_items, dv_items = dk_items.contiguous(), dv_items.contiguous()
    batch, _, heads, slots = blocks.shape
    if not blocks.numel():
        return
    num_blocks = dk.shape[1] // block_size
    items, starts = block_contributors(blocks, num_blocks)
    tile, row_slices = _tile(block_size, dk.shape[-1])
    _add_blocks_kernel[(batch * heads * num_blocks, row_slices)](
        dk, dv, dk_items, dv_items, items, starts, num_blocks, heads, slots,
        dk.stride(0), dk.stride(1), dk.stride(2), dk_items.stride(0), dk_items.stride(1), dk_items.stride(2),
        **tile, num_warps=NUM_WARPS,
    )


# ---------------------------------------------------------------------------------------------
# Plain PyTorch references
# ---------------------------------------------------------------------------------------------


def _block_view(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """[b, t, h, d] -> its whole blocks as [b, blocks, h, S, d] (a view)."""
    num_blocks = x.shape[1] // block_size
    return x[:, : num_blocks * block_size].unflatten(1, (num_blocks, block_size)).transpose(2, 3)


def _item_index(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Advanced indices (row, block, head), each broadcasting to blocks' [b, groups, h, n]."""
    batch, _, heads, _ = blocks.shape
    row = torch.arange(batch, device=blocks.device)[:, None, None, None]
    head = torch.arange(heads, device=blocks.device)[None, None, :, None]
    return row, blocks, head


def gather_blocks_reference(x: torch.Tensor, blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """x [b, t, h, d], blocks [b, groups, h, n] -> [b * groups, h, n * S, d] by advanced indexing."""
    batch, groups, heads, slots = blocks.shape
    tiles = _block_view(x, block_size)[_item_index(blocks)]  # [b, groups, h, n, S, d]
    return tiles.reshape(batch * groups, heads, slots * block_size, x.shape[-1])


def add_blocks_reference_(x: torch.Tensor, items: torch.Tensor, blocks: torch.Tensor, block_size: int) -> None:
    """x [b, t, h, d] += items [b * groups, h, n * S, d] at blocks [b, groups, h, n], accumulated in
    float32 (float64 for float64) and rounded once."""
    batch, groups, heads, slots = blocks.shape
    acc = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    tiles = items.reshape(batch, groups, heads, slots, block_size, x.shape[-1]).to(acc.dtype)
    _block_view(acc, block_size).index_put_(_item_index(blocks), tiles, accumulate=True)
    x.copy_(acc)
