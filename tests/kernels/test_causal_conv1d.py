"""causal_conv1d: the reference against transformers' Bamba conv (the math we must keep), carried
state, and the Triton kernels (interpreter on CPU) against the reference, forward and backward."""
from __future__ import annotations

import pytest
import torch
from transformers.models.bamba import modeling_bamba

from hf_hybrid.kernels.causal_conv1d import (
    causal_conv1d,
    causal_conv1d_reference,
    causal_conv1d_step,
    causal_conv1d_step_reference,
)

pytestmark = pytest.mark.filterwarnings("ignore:.*falling back.*")


def inputs(batch=2, seq=11, channels=13, width=4, dtype=torch.float32, seed=0, state=True):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, channels, generator=gen).to(dtype)
    weight = (torch.randn(channels, width, generator=gen) * 0.5).to(dtype)
    bias = torch.randn(channels, generator=gen).to(dtype)
    initial = torch.randn(batch, channels, width, generator=gen).to(dtype) if state else None
    return x, weight, bias, initial


@pytest.mark.parametrize("activation", [None, "silu"])
def test_reference_matches_bamba_conv(activation):
    x, weight, bias, _ = inputs(seq=9, width=3, state=False)
    expected = modeling_bamba.causal_conv1d_fn(x.transpose(1, 2), weight, bias, activation=activation).transpose(1, 2)
    torch.testing.assert_close(causal_conv1d_reference(x, weight, bias, activation=activation), expected, rtol=1e-6, atol=1e-6)


def test_step_reference_matches_bamba_update():
    x, weight, bias, state = inputs(seq=1)
    ours, theirs = state.clone(), state.clone()
    out = causal_conv1d_step_reference(x[:, 0], ours, weight, bias, "silu")
    expected = modeling_bamba.causal_conv1d_update(x[:, 0, :, None], theirs, weight, bias, activation="silu")[..., 0]
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_carried_state_continues_the_sequence(backend):
    """Segments with the carried state, then single steps, reproduce one pass over the whole sequence."""
    x, weight, bias, _ = inputs(seq=13, state=False)
    full, full_state = causal_conv1d(x, weight, bias, None, "silu", True, backend=backend)
    first, state = causal_conv1d(x[:, :2], weight, bias, None, "silu", True, backend=backend)  # shorter than K
    second, state = causal_conv1d(x[:, 2:9], weight, bias, state, "silu", True, backend=backend)
    steps = [causal_conv1d_step(x[:, t], state, weight, bias, "silu", backend=backend) for t in range(9, 13)]
    torch.testing.assert_close(torch.cat([first, second, torch.stack(steps, 1)], 1), full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, full_state)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("seq, width, with_state, activation", [(11, 4, True, "silu"), (7, 3, False, None), (1, 4, True, "silu")])
def test_triton_matches_reference_forward_and_backward(dtype, tol, seq, width, with_state, activation):
    x, weight, bias, initial = inputs(seq=seq, width=width, dtype=dtype, state=with_state)
    leaves = [t.requires_grad_() for t in (x, weight, bias, initial) if t is not None]
    grad_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(5)).to(dtype)
    results = {}
    for backend in ("reference", "triton"):
        out, final = causal_conv1d(x, weight, bias, initial, activation, True, backend=backend)
        results[backend] = (out, final, *torch.autograd.grad((out.float() * grad_out.float()).sum(), leaves))
    for name, ref, tri in zip(["out", "final_state", "dx", "dweight", "dbias", "dstate"], results["reference"], results["triton"]):
        assert tri.dtype == ref.dtype, name
        torch.testing.assert_close(tri.float(), ref.float(), rtol=tol, atol=tol, msg=name)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_triton_step_matches_reference(dtype, tol):
    x, weight, bias, state = inputs(seq=1, dtype=dtype)
    ref_state, tri_state = state.clone(), state.clone()
    ref = causal_conv1d_step(x[:, 0], ref_state, weight, bias, "silu", backend="reference")
    out = torch.empty_like(ref)
    tri = causal_conv1d_step(x[:, 0], tri_state, weight, bias, "silu", out=out, backend="triton")
    assert tri.data_ptr() == out.data_ptr()  # written in place, nothing allocated
    torch.testing.assert_close(tri.float(), ref.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(tri_state, ref_state)


def test_strided_channel_slice_is_accepted():
    """The mixer passes a slice of the in_proj output (row stride > channels); 37 channels span
    several channel blocks of the kernels."""
    x, weight, bias, state = inputs(channels=50)
    view, weight, bias, state = x[..., 3:40], weight[:37], bias[:37], state[:, :37]
    expected = causal_conv1d(view.contiguous(), weight, bias, state, "silu", backend="reference")
    torch.testing.assert_close(causal_conv1d(view, weight, bias, state, "silu", backend="triton"), expected)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(weight=torch.randn(12, 4)), "weight must be"),
        (dict(bias=torch.randn(3)), "bias must be"),
        (dict(initial_state=torch.randn(2, 13, 3)), "initial_state must be"),
        (dict(activation="relu"), "activation must be"),
        (dict(x=torch.randn(2, 13)), "x must be"),
    ],
)
def test_bad_arguments_name_the_parameter(change, match):
    x, weight, bias, state = inputs()
    args = dict(x=x, weight=weight, bias=bias, initial_state=state, activation="silu") | change
    with pytest.raises(ValueError, match=match):
        causal_conv1d(**args)


def test_triton_backend_without_cuda_or_interpreter_is_an_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x, weight, bias, _ = inputs(state=False)
    with pytest.raises(RuntimeError, match="backend='reference'"):
        causal_conv1d(x, weight, bias, backend="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_gpu_triton_matches_reference(dtype, tol):
    x, weight, bias, initial = (t.cuda() for t in inputs(seq=1000, channels=300, dtype=dtype))
    leaves = [t.requires_grad_() for t in (x, weight, bias, initial)]
    results = {}
    for backend in ("reference", "triton"):
        out, final = causal_conv1d(x, weight, bias, initial, "silu", True, backend=backend)
        results[backend] = (out, final, *torch.autograd.grad(out.float().square().sum(), leaves))
    for name, ref, tri in zip(["out", "final", "dx", "dw", "db", "dstate"], results["reference"], results["triton"]):
        scale = ref.float().abs().max().clamp(min=1)
        torch.testing.assert_close(tri.float() / scale, ref.float() / scale, rtol=tol, atol=tol, msg=name)
