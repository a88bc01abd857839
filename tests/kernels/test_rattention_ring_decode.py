"""RATTENTION's local decode step on a full window ring, RLA half (kernels/residual_linear_attention/
ring_decode*.py): the one-launch Triton kernel against the op-by-op reference, for every feature
map, GQA, fp32 / bf16, and the slot wrapping around the ring."""
from __future__ import annotations

import pytest
import torch

from hf_hybrid.kernels.residual_linear_attention import feature_dim, ring_decode, ring_decode_reference

from sm90_check import sm90_compile

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: Triton's interpreter
BATCH, WINDOW = 2, 5


def step_inputs(dtype, heads, kv_heads, dim, feature_map, column, seed=0):
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    ring = lambda: rand(BATCH, WINDOW + 1, kv_heads, dim).to(dtype)  # noqa: E731
    inputs = dict(
        q=rand(BATCH, heads, dim).to(dtype), k=rand(BATCH, kv_heads, dim).to(dtype),
        k_swa=rand(BATCH, kv_heads, dim).to(dtype), v=rand(BATCH, kv_heads, dim).to(dtype),
        state=rand(BATCH, kv_heads, feature_dim(feature_map, dim), dim).abs(),
        ring_keys=ring(), ring_values=ring(), ring_raw_keys=ring(),
        next_column=torch.tensor([column]), feature_map=feature_map,
    )
    return {name: t.to(DEVICE) if isinstance(t, torch.Tensor) else t for name, t in inputs.items()}


def check(inputs, tol):
    expected_inputs = {n: t.clone() if isinstance(t, torch.Tensor) else t for n, t in inputs.items()}
    expected = ring_decode_reference(**expected_inputs)
    o = ring_decode(**inputs, backend="triton")
    torch.testing.assert_close(o, expected, rtol=tol, atol=tol)
    for name in ("state", "ring_keys", "ring_values", "ring_raw_keys"):
        torch.testing.assert_close(inputs[name], expected_inputs[name], rtol=tol, atol=tol, msg=name)
    assert torch.equal(inputs["next_column"], expected_inputs["next_column"])  # the caller advances it


@pytest.mark.parametrize("feature_map", ["softmax", "relu", "identity"])
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (6, 2)])
@pytest.mark.parametrize("column", [6, 17])  # slot 0; slot 5 (the last), wrapped twice
def test_kernel_matches_reference(feature_map, heads, kv_heads, column):
    check(step_inputs(torch.float32, heads, kv_heads, 16, feature_map, column), 1e-5)


@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (6, 2)])
def test_kernel_matches_reference_bf16(heads, kv_heads):
    check(step_inputs(torch.bfloat16, heads, kv_heads, 16, "softmax", 17), 2e-2)


def test_state_tiles_of_a_wide_head():
    """head_dim 128: the state in two [128, 64] column tiles per half."""
    check(step_inputs(torch.float32, 4, 2, 128, "softmax", 9), 1e-5)


def test_bad_inputs_are_named():
    inputs = step_inputs(torch.float32, 2, 2, 16, "softmax", 6)
    with pytest.raises(ValueError, match="state"):
        ring_decode(**{**inputs, "state": inputs["state"].to(torch.bfloat16)}, backend="triton")
    with pytest.raises(ValueError, match="ring_values"):
        ring_decode(**{**inputs, "ring_values": inputs["ring_values"][:, :3]}, backend="triton")
    with pytest.raises(ValueError, match="k_swa"):
        ring_decode(**{**inputs, "k_swa": inputs["k_swa"][:, :1]}, backend="triton")


def test_kernel_compiles_for_sm90_without_spills():
    bf, f32 = "*bf16", "*fp32"
    pointers = dict(Q=bf, K=bf, KS=bf, V=bf, S=f32, RK=bf, RV=bf, RR=bf, NEXT="*i64", O=bf)
    constexprs = dict(HS=16, GROUP=1, GROUP_P2=1, D=128, BV=64, NH=2, FEATURE=0)
    rows = sm90_compile("hf_hybrid.kernels.residual_linear_attention.ring_decode_triton",
                        {"_ring_decode_kernel": (pointers, constexprs, 8)})
    assert rows["_ring_decode_kernel"]["stack_bytes"] == 0, rows
