"""The one-kernel RAT decode step (kernels/chunk_attention/rat_decode*.py) against its reference:
the element-wise prologue op by op, then chunk_end_attention_reference over the cache."""
from __future__ import annotations

import pytest
import torch

from hf_hybrid.kernels.chunk_attention import chunk_end_attention_reference
from hf_hybrid.kernels.chunk_attention.rat_decode import rat_decode_inputs_reference
from hf_hybrid.kernels.chunk_attention.rat_decode_triton import rat_decode_step_triton
from hf_hybrid.layers.rotary import RotaryEmbedding

from sm90_check import sm90_report

BATCH, GROUPS, HEADS, DIM, L, SLOTS = 3, 2, 4, 16, 4, 7


def decode_inputs(dtype, position, rope=True, device="cpu"):
    g = torch.Generator().manual_seed(position)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(device=device, dtype=dtype)
    pos = torch.tensor([position], device=device)
    cos_sin = RotaryEmbedding(DIM, 10000.0)((pos // L).view(1, 1)) if rope else None
    return dict(
        q_groups=rand(BATCH, 1, GROUPS, DIM), k_groups=rand(BATCH, 1, GROUPS, DIM), v=rand(BATCH, 1, HEADS, DIM),
        gate_logits=rand(BATCH, 1, HEADS, DIM), gate_bias=rand(HEADS * DIM).float(),
        state_key=rand(BATCH, HEADS, DIM), state_value=rand(BATCH, HEADS, DIM),
        position=pos, chunk_size=L, cos_sin=cos_sin,
    )


def expected_step(inputs, key_buffer, value_buffer):
    q_rot, k_rot, v_new, k_tilde, v_tilde = rat_decode_inputs_reference(**inputs)
    chunk = int(inputs["position"]) // L
    keys, values = key_buffer.clone(), value_buffer.clone()
    keys[:, chunk], values[:, chunk] = k_rot[:, 0], v_new[:, 0]
    query_chunk = torch.full((BATCH, 1), chunk, dtype=torch.long)
    y = chunk_end_attention_reference(q_rot, k_rot, v_new, key_buffer, value_buffer, query_chunk)
    return y, k_tilde, v_tilde, keys, values


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("position", [0, 9, 12, 27])  # first token; mid-chunk; chunk start (no carry); last slot
@pytest.mark.parametrize("rope", [True, False])
def test_kernel_matches_reference_and_writes_cache_in_place(dtype, tol, position, rope, slots=SLOTS):
    inputs = decode_inputs(dtype, position, rope)
    g = torch.Generator().manual_seed(1)
    key_buffer = torch.randn(BATCH, slots, HEADS, DIM, generator=g).to(dtype)
    value_buffer = torch.randn(BATCH, slots, HEADS, DIM, generator=g).to(dtype)
    y_ref, k_tilde, v_tilde, keys_ref, values_ref = expected_step(inputs, key_buffer, value_buffer)

    y = rat_decode_step_triton(**inputs, key_buffer=key_buffer, value_buffer=value_buffer)
    torch.testing.assert_close(y, y_ref, rtol=tol, atol=tol)
    torch.testing.assert_close(inputs["state_key"], k_tilde, rtol=tol, atol=tol)
    torch.testing.assert_close(inputs["state_value"], v_tilde, rtol=tol, atol=tol)
    torch.testing.assert_close(key_buffer, keys_ref, rtol=tol, atol=tol)
    torch.testing.assert_close(value_buffer, values_ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("position", [148, 150])  # chunk 37 of 40 slots: its ends span several splits
def test_long_cache_is_split_and_merged(dtype, tol, position):
    """Chunk ends walked by several programs (three splits in the interpreter) and merged by the
    second pass: the same step, state and slot writes as one walk."""
    test_kernel_matches_reference_and_writes_cache_in_place(dtype, tol, position, rope=True, slots=40)


@pytest.mark.parametrize("slots", [SLOTS, 40])  # one split; several, merged by the second pass
def test_output_gate_is_applied_by_the_last_pass(slots):
    """output_gate: y times sigmoid(gate) in the kernel that writes y (one split) or in the merge."""
    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: Triton's interpreter
    inputs = decode_inputs(torch.float32, 27 if slots == SLOTS else 150, device=device)
    gate = torch.randn(BATCH, 1, HEADS, DIM, generator=torch.Generator().manual_seed(3)).to(device)
    g = torch.Generator().manual_seed(1)
    buffers = [torch.randn(BATCH, slots, HEADS, DIM, generator=g).to(device) for _ in range(2)]
    plain_inputs = {n: t.clone() if isinstance(t, torch.Tensor) else t for n, t in inputs.items()}
    y = rat_decode_step_triton(**plain_inputs, key_buffer=buffers[0].clone(), value_buffer=buffers[1].clone())
    gated = rat_decode_step_triton(**inputs, key_buffer=buffers[0].clone(), value_buffer=buffers[1].clone(), output_gate=gate)
    torch.testing.assert_close(gated, torch.sigmoid(gate) * y, rtol=1e-5, atol=1e-6)


def test_chunk_start_forgets_the_previous_state():
    """At a position that opens a chunk the state before it must not matter (h_prev = 0)."""
    a, b = decode_inputs(torch.float32, 8), decode_inputs(torch.float32, 8)
    b["state_key"].mul_(100.0).add_(3.0)
    b["state_value"].mul_(-7.0)
    buffers = [torch.zeros(BATCH, SLOTS, HEADS, DIM) for _ in range(4)]
    ya = rat_decode_step_triton(**a, key_buffer=buffers[0], value_buffer=buffers[1])
    yb = rat_decode_step_triton(**b, key_buffer=buffers[2], value_buffer=buffers[3])
    torch.testing.assert_close(ya, yb)
    torch.testing.assert_close(a["state_key"], b["state_key"])


def test_bad_shapes_are_named():
    inputs = decode_inputs(torch.float32, 5)
    inputs["state_key"] = inputs["state_key"][:, :2]
    with pytest.raises(ValueError, match="state_key"):
        rat_decode_step_triton(**inputs, key_buffer=torch.zeros(BATCH, SLOTS, HEADS, DIM), value_buffer=torch.zeros(BATCH, SLOTS, HEADS, DIM))
    inputs = decode_inputs(torch.float32, 5)
    with pytest.raises(ValueError, match="value_buffer"):
        rat_decode_step_triton(**inputs, key_buffer=torch.zeros(BATCH, SLOTS, HEADS, DIM), value_buffer=torch.zeros(BATCH, SLOTS, HEADS, 2 * DIM))


def test_kernel_compiles_for_sm90_without_spills():
    rows = sm90_report("rat_decode_report()")
    assert rows and all(row["stack_bytes"] == 0 for row in rows), rows
