"""TMA forward of Forgetting Attention (kernels/forgetting_attention/hopper.py, opt-in): the
same outputs and log-sum-exp as the reference math, on dense and packed sequences of odd lengths.

CPU runs the kernel in Triton's interpreter (tiny tiles); the `gpu` test runs the autotuned
kernel at real lengths on a Hopper GPU through the public op (HF_HYBRID_FOX_HOPPER=1).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_hybrid.kernels._backend import triton_interpreting
from hf_hybrid.kernels.forgetting_attention import (
    cumulative_log_forget_by_head,
    forgetting_attention,
    forgetting_attention_reference,
)
from hf_hybrid.kernels.forgetting_attention import hopper

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernel = pytest.mark.skipif(
    DEVICE == "cpu" and not triton_interpreting(), reason="needs CUDA or TRITON_INTERPRET=1"
)


def _inputs(b, t, hq, hkv, d, dtype, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(b, t, hq, d, generator=g).to(DEVICE, dtype)
    k = torch.randn(b, t, hkv, d, generator=g).to(DEVICE, dtype)
    v = torch.randn(b, t, hkv, d, generator=g).to(DEVICE, dtype)
    log_f = F.logsigmoid(torch.randn(b, t, hq, generator=g) * 2 + 1.0).to(DEVICE)
    return q, k, v, log_f


def _reference_lse(q, k, log_f, scale, cu_seqlens):
    """log2-sum-exp2 of the true logits per (head, token), as the kernels store it."""
    b, t, hq, d = q.shape
    kx = k.repeat_interleave(hq // k.shape[2], dim=2).double()
    c = cumulative_log_forget_by_head(log_f, cu_seqlens).double().view(hq, b, t).permute(1, 2, 0)
    logits = torch.einsum("bihd,bjhd->bhij", q.double(), kx) * scale + c.transpose(1, 2)[..., :, None] - c.transpose(1, 2)[..., None, :]
    i = torch.arange(t, device=q.device)
    visible = i[:, None] >= i[None, :]
    if cu_seqlens is not None:
        seg = torch.bucketize(i, cu_seqlens[1:].to(i.device), right=True)
        visible = visible & (seg[:, None] == seg[None, :])
    logits = logits.masked_fill(~visible, float("-inf"))
    return (torch.logsumexp(logits, -1) / torch.log(torch.tensor(2.0, dtype=torch.float64))).permute(1, 0, 2).reshape(hq, b * t)


def _run(q, k, v, log_f, cu_seqlens):
    b, t, hq, d = q.shape
    scale = d ** -0.5
    cu = torch.arange(0, (b + 1) * t, t, device=q.device, dtype=torch.int32) if cu_seqlens is None else cu_seqlens.to(q.device, torch.int32)
    max_len = t if cu_seqlens is None else int((cu[1:] - cu[:-1]).max())
    c_t = cumulative_log_forget_by_head(log_f, cu_seqlens)
    o, lse = hopper.forward(q.reshape(b * t, hq, d), k.reshape(b * t, -1, d), v.reshape(b * t, -1, d), c_t, cu, max_len,
                            scale, dense=cu_seqlens is None)
    return o.view(b, t, hq, d), lse, scale


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b, t, hq, hkv, packed", [(2, 37, 2, 1, False), (1, 45, 2, 2, True), (1, 1, 1, 1, False)])
def test_forward_matches_reference(dtype, b, t, hq, hkv, packed):
    q, k, v, log_f = _inputs(b, t, hq, hkv, 16, dtype, seed=t)
    cu_seqlens = torch.tensor([0, 5, 22, 23, t], device=DEVICE) if packed else None
    o, lse, scale = _run(q, k, v, log_f, cu_seqlens)
    ref = forgetting_attention_reference(q.float(), k.float(), v.float(), log_f, scale, None, cu_seqlens)
    assert torch.isfinite(o).all()
    assert _rel(o, ref) < 1e-2
    ref_lse = _reference_lse(q.float(), k.float(), log_f, scale, cu_seqlens)
    assert (lse.double() - ref_lse.to(lse.device)).abs().max().item() < 2e-2


@needs_kernel
@pytest.mark.parametrize("lengths, dense", [((8, 8), True), ((37, 37), True), ((5, 17, 1, 9), False)])
def test_forget_descriptor_rows(lengths, dense):
    """One row per (head, sequence) starting at its key 0, rows padded to 16-byte strides."""
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    c = torch.randn(3, int(cu[-1]))
    max_len = max(lengths)
    desc = hopper._c_descriptor(c, cu, max_len, dense)
    assert desc.strides[0] % 4 == 0 and desc.shape == [3 * len(lengths), max_len]
    rows = desc.base.view(3, len(lengths), desc.strides[0])
    for s, n in enumerate(lengths):
        assert torch.equal(rows[:, s, :n], c[:, int(cu[s]):int(cu[s]) + n])


def test_dispatch_rules(monkeypatch):
    """Opt-in only; windows and float32 never take the TMA path; neither does the CPU."""
    q = torch.zeros(1, 4, 1, 16, dtype=torch.bfloat16)
    monkeypatch.setenv("HF_HYBRID_FOX_HOPPER", "1")
    assert not hopper.hopper_forward_applies(q, 8)
    assert not hopper.hopper_forward_applies(q.float(), None)
    assert not hopper.hopper_forward_applies(q, None)  # CPU / interpreter


def test_tuned_configs_are_not_warp_specialised():
    """Warp-specialised configs deadlock under Triton 3.6 (module docstring): never autotuned."""
    assert hopper.TUNED_CONFIGS and not any(ws for *_, ws in hopper.TUNED_CONFIGS)
    assert all(ws for *_, ws in hopper.WARP_SPECIALIZED_CONFIGS)


@pytest.mark.gpu
@pytest.mark.parametrize("t, packed", [(4096, False), (3000, True)])
def test_public_op_on_hopper_matches_portable_kernel(t, packed, monkeypatch):
    """On sm_90 with HF_HYBRID_FOX_HOPPER=1 the public op's forward is the TMA kernel: the same
    output as the portable kernel and the float32 reference, gradients unchanged."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs a Hopper GPU")
    q, k, v, log_f = _inputs(1 if packed else 2, t, 16, 8, 128, torch.bfloat16, seed=3)
    cu_seqlens = torch.tensor([0, 1000, 1001, 2500, t], device=DEVICE) if packed else None
    monkeypatch.setenv("HF_HYBRID_FOX_HOPPER", "1")
    assert hopper.hopper_forward_applies(q, None)
    leaves = [x.detach().requires_grad_() for x in (q, k, v, log_f)]
    o = forgetting_attention(*leaves, cu_seqlens=cu_seqlens)
    grads = torch.autograd.grad(o, leaves, torch.ones_like(o))
    monkeypatch.setenv("HF_HYBRID_FOX_HOPPER", "0")
    o_port = forgetting_attention(*leaves, cu_seqlens=cu_seqlens)
    grads_port = torch.autograd.grad(o_port, leaves, torch.ones_like(o_port))
    ref = forgetting_attention_reference(q.float(), k.float(), v.float(), log_f, None, None, cu_seqlens)
    assert _rel(o, ref) < 1e-2
    assert _rel(o, o_port) < 1e-2
    for g, gp in zip(grads, grads_port):
        assert _rel(g, gp) < 2e-2
