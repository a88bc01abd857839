"""Hopper kernels of Forgetting Attention (Gluon): the forward (kernels/forgetting_attention/hopper.py)
gives the same outputs and log-sum-exp as the reference math, and the backward (hopper_backward.py,
dQ by TMA reduce-add) the same gradients, on dense and packed sequences of odd lengths, GQA, both
head sizes and both 16-bit dtypes.

Gluon kernels do not run in Triton's CPU interpreter: on the CPU the kernel is compiled for sm_90
(it builds, uses wgmma, its partitions rebalance registers, it fits shared memory); the `gpu`
tests run it on a Hopper GPU against float64 restatements and through the public op.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
import triton

from hf_hybrid.kernels.forgetting_attention import (
    cumulative_log_forget_by_head,
    forgetting_attention,
    forgetting_attention_reference,
)
from hf_hybrid.kernels.forgetting_attention import hopper, hopper_backward
from sm90_check import LOAD_SM90_RESOURCES

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_gluon = pytest.mark.skipif(hopper.gluon is None, reason="this Triton has no Gluon")


SHAPES = [
    (2, 1000, 4, 4, 128, None),                  # odd length, two sequences
    (1, 4096, 4, 2, 128, None),                  # GQA 2:1, many key blocks
    (1, 3001, 4, 2, 64, [300, 1, 777, 128, 1795]),  # packed, a one-token sequence, head_dim 64
    (1, 1, 2, 1, 128, None),                     # a single token
]


def _needs_hopper():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs a Hopper GPU")


def _inputs(b, t, hq, hkv, d, dtype, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(b, t, hq, d, generator=g).to(DEVICE, dtype)
    k = torch.randn(b, t, hkv, d, generator=g).to(DEVICE, dtype)
    v = torch.randn(b, t, hkv, d, generator=g).to(DEVICE, dtype)
    log_f = F.logsigmoid(torch.randn(b, t, hq, generator=g) * 2 + 1.0).to(DEVICE)
    return q, k, v, log_f


def _reference_lse(q, k, log_f, scale, cu_seqlens):
    """log2-sum-exp2 of the true logits per (head, token), as the kernels store it, in float64."""
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


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def test_dispatch_rules():
    """Windows, float32, other head sizes and the CPU never take the Hopper kernel."""
    q = torch.zeros(1, 4, 1, 128, dtype=torch.bfloat16)
    assert not hopper.hopper_forward_applies(q, 8)
    assert not hopper.hopper_forward_applies(q.float(), None)
    assert not hopper.hopper_forward_applies(q[..., :96], None)
    assert not hopper.hopper_forward_applies(q, None)  # CPU
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9:
        assert hopper.hopper_forward_applies(q.cuda(), None)


def test_backward_dispatch_rules():
    """The Hopper backward is the default for causal 16-bit inputs of head_dim 64 / 128 on sm_90 only,
    stepping aside for deterministic algorithms (its dQ sums with float atomics)."""
    q = torch.zeros(1, 4, 1, 128, dtype=torch.bfloat16)
    assert not hopper_backward.hopper_backward_applies(q, 8)
    assert not hopper_backward.hopper_backward_applies(q.float(), None)
    assert not hopper_backward.hopper_backward_applies(q[..., :96], None)
    assert not hopper_backward.hopper_backward_applies(q, None)  # CPU
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9:
        assert hopper_backward.hopper_backward_applies(q.cuda(), None)
        torch.use_deterministic_algorithms(True)
        try:
            assert not hopper_backward.hopper_backward_applies(q.cuda(), None)
        finally:
            torch.use_deterministic_algorithms(False)


@needs_gluon
@pytest.mark.parametrize("report", ["fox_hopper_report", "fox_hopper_backward_report"])
@pytest.mark.parametrize("head_dim", hopper.HEAD_DIMS)
def test_compiles_for_sm90(report, head_dim):
    """The shipped configuration builds for the H100 with wgmma, the partitions rebalance their
    registers (setmaxnreg), ptxas keeps the wgmma asynchronous (ptxas of Triton 3.6, the GPU image,
    and of 3.9 serialised the backward's products while compute warpgroup 0 had 232 registers) and shared
    memory fits Hopper's 227 KB. Under Triton 3.6 the forward also keeps its loop's values in registers;
    newer Triton allocates differently."""
    # A process of its own without TRITON_INTERPRET: the interpreter (which conftest turns on
    # without CUDA) replaces Triton's own jit helpers, and Gluon's compiler cannot call those.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = LOAD_SM90_RESOURCES + f"import json; from sm90_resources import {report}; print(json.dumps({report}(({head_dim},))))"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    (row,) = json.loads(done.stdout.strip().splitlines()[-1])
    assert "error" not in row, row.get("error")
    assert row["wgmma"] and row["setmaxnreg"]
    assert not row["wgmma_serialized"]
    assert row["shared_bytes"] <= 227 * 1024
    if triton.__version__.startswith("3.6"):
        # Forward: one 4-byte value, stored at entry and read back once per work item outside the
        # key-block loop. Backward: a few scalars; with K / V's shared-memory descriptors hoisted out
        # of the step loop (no _opaque_zero) it spilled 128-232 bytes and reloaded them before each
        # product, 19% slower with two key blocks per program.
        assert row["stack_bytes"] <= (8 if report == "fox_hopper_report" else 48)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dq_scaled_to_the_output_dtype_in_one_pass(dtype):
    """The backward's last step: dQ's float32 sum times the softmax scale, rounded once to the
    inputs' dtype (as torch.mul(acc, scale) in float32 then .to(dtype)), over a size that is not a
    multiple of the kernel's block."""
    acc = torch.randn(3, 5, 3 * 1000 + 7, device=DEVICE)
    like = torch.empty(acc.shape, device=DEVICE, dtype=dtype)
    out = hopper_backward._scale_to_output(acc, 0.0884, like)
    expected = (acc * 0.0884).to(dtype)
    assert out.dtype == dtype and out.shape == acc.shape
    if os.environ.get("TRITON_INTERPRET") == "1" and dtype == torch.bfloat16:
        # The CPU interpreter's numpy bfloat16 truncates where the GPU rounds to nearest: one unit
        # in the last place at most.
        assert ((out.float() - expected.float()).abs() <= expected.float().abs() * 2.0 ** -7).all()
    else:
        assert torch.equal(out, expected)


def test_cache_scan_reads_only_wgmma_kernels_and_refuses_what_ptxas_cannot_read(tmp_path):
    """``python -m benchmarks.sm90 --scan-cache DIR``: kernels without wgmma are not assembled,
    and a PTX that ptxas rejects raises instead of counting as "not serialised"."""
    pytest.importorskip("triton.backends.nvidia")
    from sm90_resources import serialised_wgmma_in_cache

    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "k.ptx").write_text(".version 8.0\n.target sm_90a\n.address_size 64\n")
    assert serialised_wgmma_in_cache(str(tmp_path)) == {}
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "k.ptx").write_text("wgmma.mma_async but no PTX header\n")
    with pytest.raises(RuntimeError, match="ptxas could not assemble"):
        serialised_wgmma_in_cache(str(tmp_path))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b, t, hq, hkv, d, lengths", SHAPES)
def test_forward_matches_float64(dtype, b, t, hq, hkv, d, lengths):
    _needs_hopper()
    q, k, v, log_f = _inputs(b, t, hq, hkv, d, dtype, seed=t)
    cu_seqlens = None if lengths is None else torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=DEVICE)
    scale = d ** -0.5
    cu = torch.arange(0, (b + 1) * t, t, device=DEVICE, dtype=torch.int32) if cu_seqlens is None else cu_seqlens.int()
    max_len = int((cu[1:] - cu[:-1]).max())
    c_t = cumulative_log_forget_by_head(log_f, cu_seqlens)
    o, lse = hopper.forward(q.reshape(b * t, hq, d), k.reshape(b * t, hkv, d), v.reshape(b * t, hkv, d), c_t, cu,
                            max_len, scale)
    ref = forgetting_attention_reference(q.double(), k.double(), v.double(), log_f.double(), scale, None, cu_seqlens)
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    assert _rel(o.view(b, t, hq, d), ref) < 1e-2
    ref_lse = _reference_lse(q, k, log_f, scale, cu_seqlens)
    assert (lse.double() - ref_lse).abs().max().item() < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("t, lengths", [(4096, None), (3000, [1000, 1, 1499, 500])])
def test_public_op_takes_hopper_kernel(t, lengths, monkeypatch):
    """On sm_90 the public op's forward is the Gluon kernel: the same output as the portable kernel
    (the dispatch predicate patched off) and the reference, and the gradients from its saved LSE unchanged."""
    _needs_hopper()
    q, k, v, log_f = _inputs(1 if lengths else 2, t, 16, 8, 128, torch.bfloat16, seed=3)
    cu_seqlens = None if lengths is None else torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=DEVICE)
    assert hopper.hopper_forward_applies(q, None)
    calls = []
    monkeypatch.setattr(hopper, "_fwd_kernel", _Spy(hopper._fwd_kernel, calls))
    leaves = [x.detach().requires_grad_() for x in (q, k, v, log_f)]
    o = forgetting_attention(*leaves, cu_seqlens=cu_seqlens, backend="triton")
    assert calls, "the Hopper kernel did not run"
    grads = torch.autograd.grad(o, leaves, torch.ones_like(o))
    _portable_forward(monkeypatch)
    o_port = forgetting_attention(*leaves, cu_seqlens=cu_seqlens, backend="triton")
    grads_port = torch.autograd.grad(o_port, leaves, torch.ones_like(o_port))
    ref = forgetting_attention_reference(q.float(), k.float(), v.float(), log_f, None, None, cu_seqlens)
    assert _rel(o, ref) < 1e-2
    assert _rel(o, o_port) < 1e-2
    for g, gp in zip(grads, grads_port):
        assert _rel(g, gp) < 2e-2


class _Spy:
    """Records launches of a kernel and forwards them."""

    def __init__(self, kernel, calls):
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        self.calls.append(grid)
        return self.kernel[grid]


def _portable_forward(monkeypatch):
    """From here on the forward takes the portable kernel (the Triton wrapper and the SDPA route
    both ask the Hopper predicate)."""
    from hf_hybrid.kernels.forgetting_attention import sdpa, triton as fa

    monkeypatch.setattr(fa, "hopper_forward_applies", lambda *args: False)
    monkeypatch.setattr(sdpa, "hopper_forward_applies", lambda *args: False)


def _portable_backward(monkeypatch, *args):
    """The portable two-kernel backward for these arguments (the Hopper predicate patched off for the call)."""
    from hf_hybrid.kernels.forgetting_attention import triton as fa

    with monkeypatch.context() as patch:
        patch.setattr(fa, "hopper_backward_applies", lambda *args: False)
        return fa._backward(*args)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b, t, hq, hkv, d, lengths", SHAPES)
def test_backward_matches_float64_and_the_portable_kernels(dtype, b, t, hq, hkv, d, lengths, monkeypatch):
    """dq, dk, dv and d log f of the public op (Hopper forward + backward) against autograd through
    the float64 reference (bound 1e-2), and the raw gradients against the portable two kernels."""
    _needs_hopper()
    from hf_hybrid.kernels.forgetting_attention import triton as fa

    q, k, v, log_f = _inputs(b, t, hq, hkv, d, dtype, seed=t + 1)
    do = torch.randn_like(q)
    cu_seqlens = None if lengths is None else torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=DEVICE)
    leaves = [x.detach().requires_grad_() for x in (q, k, v, log_f)]
    grads = torch.autograd.grad(forgetting_attention(*leaves, cu_seqlens=cu_seqlens, backend="triton"), leaves, do)
    ref_leaves = [x.detach().double().requires_grad_() for x in (q, k, v, log_f)]
    ref = forgetting_attention_reference(*ref_leaves, None, None, cu_seqlens)
    ref_grads = torch.autograd.grad(ref, ref_leaves, do.double())
    for name, g, r in zip(("dq", "dk", "dv", "dlog_f"), grads, ref_grads):
        assert torch.isfinite(g).all(), name
        if r.abs().max() > 0:
            assert _rel(g, r) < 1e-2, (name, _rel(g, r))
    # The raw kernels: Hopper against the portable pair on the same forward outputs.
    cu = torch.arange(0, (b + 1) * t, t, device=DEVICE, dtype=torch.int32) if cu_seqlens is None else cu_seqlens.int()
    max_len = int((cu[1:] - cu[:-1]).max())
    c_t = cumulative_log_forget_by_head(log_f, cu_seqlens)
    flat = [x.reshape(b * t, x.shape[2], d) for x in (q, k, v, do)]
    o, lse = fa._forward(flat[0], flat[1], flat[2], c_t, cu, max_len, d ** -0.5, None)
    args = (flat[3], *flat[:3], c_t, o, lse, cu, max_len, d ** -0.5, None)
    hopper_grads = fa._backward(*args)
    portable = _portable_backward(monkeypatch, *args)
    for name, g, r in zip(("dq", "dk", "dv", "dc"), hopper_grads, portable):
        if r.abs().max() > 0:
            assert _rel(g, r) < 5e-3, (name, _rel(g, r))


@pytest.mark.gpu
@pytest.mark.parametrize("d", hopper.HEAD_DIMS)
def test_backward_schedules_agree(d, monkeypatch):
    """The backward's program schedule (a key block and its mirror per program, then single blocks
    at the end: SINGLE_WAVES) changes which program computes a block, not the block's math: every
    split, from all pairs to all single blocks, gives bit-equal dK / dV (dQ and d log f add in a
    run-dependent order: float rounding), and all pairs agree with the portable kernels. Odd packed
    lengths give pairs with a middle block, and sequences shorter than the grid's blocks."""
    _needs_hopper()
    from hf_hybrid.kernels.forgetting_attention import triton as fa

    lengths = [1, 700, 2049, 130, 1300, 1000]
    total = sum(lengths)
    q, k, v, log_f = _inputs(1, total, 4, 2, d, torch.bfloat16, seed=11)
    do = torch.randn_like(q)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=DEVICE, dtype=torch.int32)
    c_t = cumulative_log_forget_by_head(log_f, cu)
    flat = [x.reshape(total, x.shape[2], d) for x in (q, k, v, do)]
    o, lse = fa._forward(flat[0], flat[1], flat[2], c_t, cu, max(lengths), d ** -0.5, None)
    delta = (flat[3].float() * o.float()).sum(-1).t().contiguous()
    runs = {}
    for waves in (0, hopper_backward.SINGLE_WAVES, 10 ** 6):
        monkeypatch.setattr(hopper_backward, "SINGLE_WAVES", waves)
        runs[waves] = hopper_backward.backward(flat[3], *flat[:3], c_t, o, lse, delta, cu, max(lengths), d ** -0.5)
    first = runs[0]
    for waves, grads in runs.items():
        assert torch.equal(grads[1], first[1]) and torch.equal(grads[2], first[2]), waves
        assert _rel(grads[0], first[0]) < 1e-3 and _rel(grads[3], first[3]) < 1e-5, waves
    portable = _portable_backward(monkeypatch, flat[3], *flat[:3], c_t, o, lse, cu, max(lengths), d ** -0.5, None)
    for name, g, r in zip(("dq", "dk", "dv", "dc"), first, portable):
        assert _rel(g, r) < 5e-3, (name, _rel(g, r))


@pytest.mark.gpu
def test_public_op_takes_hopper_backward(monkeypatch):
    _needs_hopper()
    q, k, v, log_f = _inputs(2, 2048, 8, 4, 128, torch.bfloat16, seed=5)
    calls = []
    monkeypatch.setattr(hopper_backward, "_bwd_kernel", _Spy(hopper_backward._bwd_kernel, calls))
    leaves = [x.detach().requires_grad_() for x in (q, k, v, log_f)]
    o = forgetting_attention(*leaves, backend="triton")
    torch.autograd.grad(o, leaves, torch.ones_like(o))
    assert calls, "the Hopper backward did not run"
