"""SE-Attn's block kernels (kernels/span_expanded_attention/block_rows.py): the gather and the
deterministic block scatter-add against their PyTorch references and the row-wise fallback, the
whole SE op on the kernels against the dense reference, and an sm_90 compile.

Under the CPU interpreter Triton rounds float32 -> bfloat16 toward zero (the GPU rounds to nearest),
so bfloat16 sums may differ from the reference by one unit in the last place."""
from __future__ import annotations

import pytest
import torch

from hf_hybrid.kernels.span_expanded_attention import block_rows, chunked, span_expanded_attention
from hf_hybrid.kernels.span_expanded_attention.block_rows import (
    add_blocks_,
    add_blocks_reference_,
    block_contributors,
    gather_blocks,
    gather_blocks_reference,
)
from hf_hybrid.kernels.span_expanded_attention.chunked import _add_rows_, _block_rows, _gather_rows

from sm90_check import sm90_compile
from test_span_expanded_attention import SHAPES, TOLERANCES, _compare_backends, _inputs, _se_kwargs

DTYPES = [torch.float64, torch.float32, torch.bfloat16]
BF16_ULP = 2.0**-7  # relative spacing of bfloat16 numbers: one rounding step

# (batch, tokens, heads, head_dim, S, groups, slots): batch 2, odd group counts, a partial last
# block, S and head_dim that are not powers of two (masked tiles).
LAYOUTS = [(2, 37, 3, 16, 3, 5, 4), (1, 40, 2, 24, 4, 3, 2), (2, 64, 4, 8, 8, 7, 3)]


def _random(shape, dtype, gen):
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def _blocks(batch, tokens, heads, block_size, groups, slots, gen, num_blocks=None):
    """Random blocks [b, groups, h, n] among the first num_blocks whole blocks (few: many repeats)."""
    num_blocks = tokens // block_size if num_blocks is None else num_blocks
    return torch.randint(0, num_blocks, (batch, groups, heads, slots), generator=gen)


def _assert_sums_close(got, expected):
    if got.dtype == torch.bfloat16:
        torch.testing.assert_close(got, expected, rtol=BF16_ULP, atol=1e-6)
    else:
        torch.testing.assert_close(got, expected, rtol=1e-12 if got.dtype == torch.float64 else 1e-6, atol=1e-6)


def test_block_contributors_list_every_item_once_in_item_order():
    gen = torch.Generator().manual_seed(0)
    batch, groups, heads, slots, num_blocks = 2, 5, 3, 4, 6
    blocks = _blocks(batch, num_blocks, heads, 1, groups, slots, gen)
    items, starts = block_contributors(blocks, num_blocks)
    assert items.dtype == starts.dtype == torch.int32 and starts[-1] == blocks.numel()
    flat = blocks.reshape(-1).tolist()
    for b in range(batch):
        for h in range(heads):
            for j in range(num_blocks):
                d = (b * heads + h) * num_blocks + j
                expected = [
                    i for i, block in enumerate(flat)
                    if block == j and i // (heads * slots) // groups == b and i // slots % heads == h
                ]
                assert items[starts[d]:starts[d + 1]].tolist() == expected


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gather_equals_reference_and_row_gather(layout, dtype):
    batch, tokens, heads, dim, block_size, groups, slots = layout
    gen = torch.Generator().manual_seed(1)
    k, v = (_random((batch, tokens, heads, dim), dtype, gen) for _ in range(2))
    blocks = _blocks(batch, tokens, heads, block_size, groups, slots, gen)
    kr, vr = gather_blocks(k, v, blocks, block_size)
    assert kr.shape == (batch * groups, heads, slots * block_size, dim) and kr.is_contiguous()
    assert torch.equal(kr, gather_blocks_reference(k, blocks, block_size))
    assert torch.equal(vr, gather_blocks_reference(v, blocks, block_size))
    rows = _block_rows(blocks, tokens, block_size)  # the CPU fallback reads the same keys
    assert torch.equal(kr, _gather_rows(k, rows, slots * block_size))


def test_wide_heads_split_blocks_into_row_slices(monkeypatch):
    """A tile budget below one block: several programs per block, for the gather and the add."""
    monkeypatch.setattr(block_rows, "TILE_ELEMENTS", 32)  # 2 rows of 16 per program, S = 5 -> 3 slices
    batch, tokens, heads, dim, block_size, groups, slots = 2, 30, 2, 16, 5, 3, 2
    gen = torch.Generator().manual_seed(2)
    k, v = (_random((batch, tokens, heads, dim), torch.float32, gen) for _ in range(2))
    blocks = _blocks(batch, tokens, heads, block_size, groups, slots, gen)
    kr, vr = gather_blocks(k, v, blocks, block_size)
    assert torch.equal(kr, gather_blocks_reference(k, blocks, block_size))
    dk, dv, expected = k.clone(), v.clone(), k.clone()
    add_blocks_(dk, dv, kr, vr, blocks, block_size)
    add_blocks_reference_(expected, kr, blocks, block_size)
    _assert_sums_close(dk, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_add_equals_reference_with_repeats_and_untouched_blocks(layout, dtype):
    """Items of a retrieval part: the middle groups and the first `valid` slots of a gathered
    [b * groups', h, k' S, d] gradient (strided views, as _Plan.select / select_blocks give them);
    blocks drawn among a few, so most repeat and the others are retrieved by nobody."""
    batch, tokens, heads, dim, block_size, groups, slots = layout
    gen = torch.Generator().manual_seed(3)
    blocks = _blocks(batch, tokens, heads, block_size, groups + 2, slots + 1, gen, num_blocks=3)
    gathered = [_random((batch * (groups + 2), heads, (slots + 1) * block_size, dim), dtype, gen) for _ in range(2)]
    part_blocks = blocks[:, 1:-1, :, :slots]
    dk_items, dv_items = (x.unflatten(0, (batch, -1))[:, 1:-1, :, : slots * block_size].flatten(0, 1) for x in gathered)
    dk, dv = (_random((batch, tokens, heads, dim), dtype, gen) for _ in range(2))
    expected_k, expected_v = dk.clone(), dv.clone()
    add_blocks_reference_(expected_k, dk_items, part_blocks, block_size)
    add_blocks_reference_(expected_v, dv_items, part_blocks, block_size)
    before = dk.clone()

    add_blocks_(dk, dv, dk_items, dv_items, part_blocks, block_size)
    _assert_sums_close(dk, expected_k)
    _assert_sums_close(dv, expected_v)
    retrieved = torch.zeros(batch, tokens // block_size, heads, dtype=torch.bool)
    retrieved[torch.arange(batch)[:, None, None, None], part_blocks, torch.arange(heads)[:, None]] = True
    untouched = ~retrieved.repeat_interleave(block_size, 1)
    untouched = torch.cat([untouched, torch.ones(batch, tokens % block_size, heads, dtype=torch.bool)], 1)
    assert untouched.any() and torch.equal(dk[untouched], before[untouched])  # bit for bit

    if dtype == torch.float64:  # the row-wise fallback adds the same items at the same places
        fallback = before.clone()
        _add_rows_(fallback, _block_rows(part_blocks, tokens, block_size), dk_items)
        torch.testing.assert_close(dk, fallback, rtol=1e-12, atol=1e-12)


def test_add_sums_a_long_contributor_list_in_float32():
    """Every item reads block 1 of its head: one program loops over all of a (row, head)'s items.
    Adding 96 bfloat16 tiles one rounding at a time would drift; the kernel rounds once."""
    batch, tokens, heads, dim, block_size, groups, slots = 2, 16, 2, 16, 4, 12, 8
    gen = torch.Generator().manual_seed(4)
    blocks = torch.ones(batch, groups, heads, slots, dtype=torch.long)
    items = [_random((batch * groups, heads, slots * block_size, dim), torch.bfloat16, gen) for _ in range(2)]
    dk, dv = (_random((batch, tokens, heads, dim), torch.bfloat16, gen) for _ in range(2))
    exact = dk.double()
    add_blocks_reference_(exact, items[0].double(), blocks, block_size)
    add_blocks_(dk, dv, *items, blocks, block_size)
    torch.testing.assert_close(dk.double(), exact, rtol=BF16_ULP, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["se", "se_random"])
@pytest.mark.parametrize("shape", SHAPES)
def test_se_op_on_block_kernels_matches_reference(shape, mode, dtype, monkeypatch):
    """The whole op, forward and backward, with the gather and the gradient add on the kernels
    (batch 2, GQA-expanded keys, several retrieval parts for SHAPES[1]): same tolerances as the
    row-wise path."""
    monkeypatch.setattr(chunked, "_use_block_kernels", lambda device: True)
    q, k, v = _inputs(shape["seq"], dtype=dtype, seed=3)
    _compare_backends(q, k, v, _se_kwargs(shape, mode), TOLERANCES[dtype])


def test_block_kernels_and_row_fallback_agree(monkeypatch):
    """float64: the two implementations of the moves give the same outputs and gradients."""
    shape = SHAPES[1]
    q, k, v = _inputs(shape["seq"], seed=5)
    results = []
    for use_kernels in (False, True):
        monkeypatch.setattr(chunked, "_use_block_kernels", lambda device, use=use_kernels: use)
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        out = span_expanded_attention(*leaves, backend="sdpa", **_se_kwargs(shape, "se"))
        results.append((out, *torch.autograd.grad(out.pow(2).sum(), leaves)))
    for name, rowwise, kernels in zip(("out", "dq", "dk", "dv"), *results):
        torch.testing.assert_close(kernels, rowwise, rtol=1e-12, atol=1e-12, msg=name)


def test_kernels_compile_for_sm90_without_spills():
    """The profile's shape (S = 32, head_dim 128, bf16) with the shipped tile and warps."""
    tile, _ = block_rows._tile(32, 128)
    bf = "*bf16"
    kernels = {
        "_gather_blocks_kernel": (dict(K=bf, V=bf, KR=bf, VR=bf, BLOCKS="*i64"), tile, block_rows.NUM_WARPS),
        "_add_blocks_kernel": (
            dict(DK=bf, DV=bf, DK_ITEMS=bf, DV_ITEMS=bf, ITEMS="*i32", STARTS="*i32"), tile, block_rows.NUM_WARPS,
        ),
    }
    rows = sm90_compile(block_rows.__name__, kernels)
    assert set(rows) == set(kernels) and all(row["stack_bytes"] == 0 for row in rows.values()), rows
