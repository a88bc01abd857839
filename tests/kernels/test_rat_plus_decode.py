"""RAT+'s decode step on a static store (kernels/chunk_attention/rat_plus_decode*.py): the Triton
kernels against the op-by-op reference, for the dense layout and dilated layouts with and without
local window and sinks, at positions where a block end or a sink leaves the ring."""
from __future__ import annotations

import pytest
import torch

from hf_hybrid.kernels.chunk_attention import StoreLayout, rat_plus_decode_step
from hf_hybrid.layers.rotary import RotaryEmbedding

from sm90_check import sm90_report

BATCH, HEADS, KV_HEADS, DIM = 2, 4, 2, 16
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: Triton's interpreter

LAYOUTS = {
    # columns [sinks | ends | ring], as StaticDilatedStore builds them for a capacity of 40 tokens
    "dense": StoreLayout.dense(40),
    "d4_w2_i2": StoreLayout(first_end=2, first_ring=2 + 11, ring=3, dilation=4, window=2, sinks=2),
    "d3_w0_i0": StoreLayout(first_end=0, first_ring=14, ring=1, dilation=3, window=0, sinks=0),
    "d4_w5_i3": StoreLayout(first_end=3, first_ring=3 + 11, ring=6, dilation=4, window=5, sinks=3),
}


def columns(layout: StoreLayout) -> int:
    return layout.ring if not layout.dilation else layout.first_ring + layout.ring


def step_inputs(layout, position, dtype, recurrence=True, rope=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    cols = columns(layout)
    stored = torch.randint(-1, position, (BATCH, cols), generator=g)
    stored[:, ::3] = -1
    pos = torch.tensor([position])
    return dict(
        q=rand(BATCH, 1, HEADS, DIM).to(dtype), k=rand(BATCH, 1, KV_HEADS, DIM).to(dtype),
        v=rand(BATCH, 1, KV_HEADS, DIM).to(dtype),
        gate_logits=rand(BATCH, 1, KV_HEADS, DIM).to(dtype) if recurrence else None,
        state_key=rand(BATCH, KV_HEADS, DIM) if recurrence else None,
        state_value=rand(BATCH, KV_HEADS, DIM) if recurrence else None,
        position=pos, cos_sin=RotaryEmbedding(DIM, 10000.0)(pos.view(1, 1)) if rope else None,
        keys=rand(BATCH, cols, KV_HEADS, DIM).to(dtype), values=rand(BATCH, cols, KV_HEADS, DIM).to(dtype),
        stored=stored, layout=layout,
        sink_valid=torch.rand(BATCH, layout.sinks, generator=g) > 0.3 if layout.sinks else None,
    )


def on_device(inputs):
    moved = {name: t.to(DEVICE) if isinstance(t, torch.Tensor) else t for name, t in inputs.items()}
    if moved["cos_sin"] is not None:
        moved["cos_sin"] = tuple(t.to(DEVICE) for t in moved["cos_sin"])
    return moved


def clone(inputs):
    return {name: t.clone() if isinstance(t, torch.Tensor) else t for name, t in inputs.items()}


def check_step(inputs, tol):
    inputs = on_device(inputs)
    expected_inputs, kernel_inputs = clone(inputs), clone(inputs)
    expected = rat_plus_decode_step(**expected_inputs, backend="reference")
    y = rat_plus_decode_step(**kernel_inputs, backend="triton")
    torch.testing.assert_close(y, expected, rtol=tol, atol=tol)
    assert torch.equal(kernel_inputs["stored"], expected_inputs["stored"])
    for name in ("state_key", "state_value", "keys", "values"):
        if expected_inputs[name] is not None:
            torch.testing.assert_close(kernel_inputs[name], expected_inputs[name], rtol=tol, atol=tol, msg=name)


# 8: the token at 2 leaves a W=5 ring; 11 / 12: a block end (3, 7) leaves the W=2 / W=4 ring; 30: sinks long gone
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("position", [3, 8, 11, 12, 30])
def test_kernels_match_reference(layout, position):
    check_step(step_inputs(LAYOUTS[layout], position, torch.float32), 1e-5)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_kernels_match_reference_bf16(layout):
    check_step(step_inputs(LAYOUTS[layout], 11, torch.bfloat16), 2e-2)


@pytest.mark.parametrize("recurrence,rope", [(False, True), (True, False)])
def test_without_recurrence_or_rope(recurrence, rope):
    check_step(step_inputs(LAYOUTS["d4_w2_i2"], 11, torch.float32, recurrence, rope), 1e-5)


def test_long_store_is_split_and_merged():
    """A store of 200 columns: several splits per (row, head), merged by the second pass."""
    layout = StoreLayout(first_end=4, first_ring=4 + 180, ring=9, dilation=4, window=8, sinks=4)
    check_step(step_inputs(layout, 700, torch.float32), 1e-5)


@pytest.mark.parametrize("columns", ["short", "long"])  # one split; several, merged by the second pass
def test_output_gate_is_applied_by_the_last_pass(columns):
    layout = LAYOUTS["d4_w2_i2"] if columns == "short" else StoreLayout(4, 4 + 180, 9, 4, 8, 4)
    inputs = step_inputs(layout, 11 if columns == "short" else 700, torch.float32)
    inputs["output_gate"] = torch.randn(BATCH, 1, HEADS, DIM, generator=torch.Generator().manual_seed(5))
    check_step(inputs, 1e-5)


def test_sinks_show_once_they_leave_the_ring():
    """Position p = I + W: every held sink (no block end) is visible after the step, and a sink that
    is a block end (position D - 1) shows only in its block-end column."""
    layout = LAYOUTS["d4_w2_i2"]
    inputs = step_inputs(layout, layout.sinks + layout.window, torch.float32)
    inputs["sink_valid"].fill_(True)
    inputs = on_device(inputs)
    rat_plus_decode_step(**inputs, backend="triton")
    assert inputs["stored"][:, : layout.sinks].tolist() == [list(range(layout.sinks))] * BATCH


def test_bad_inputs_are_named():
    inputs = on_device(step_inputs(LAYOUTS["d4_w2_i2"], 5, torch.float32))
    with pytest.raises(ValueError, match="state_key"):
        rat_plus_decode_step(**{**inputs, "state_key": inputs["state_key"].to(torch.bfloat16)}, backend="triton")
    with pytest.raises(ValueError, match="stored"):
        rat_plus_decode_step(**{**inputs, "stored": inputs["stored"].int()}, backend="triton")
    with pytest.raises(ValueError, match="sink_valid"):
        rat_plus_decode_step(**{**inputs, "sink_valid": None}, backend="triton")
    with pytest.raises(ValueError, match="head_dim"):
        odd = on_device(step_inputs(LAYOUTS["dense"], 5, torch.float32))
        odd = {name: t[..., :12].contiguous() if name in ("q", "k", "v", "gate_logits", "state_key", "state_value", "keys", "values") and t is not None else t
               for name, t in odd.items()}
        odd["cos_sin"] = None
        rat_plus_decode_step(**odd, backend="triton")


def test_kernels_compile_for_sm90_without_spills():
    rows = sm90_report("rat_plus_decode_report()")
    assert rows and all(row["stack_bytes"] == 0 for row in rows), rows
