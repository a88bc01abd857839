"""Forgetting Attention one block pair at a time (kernels/forgetting_attention/blocks.py), the unit
of context parallelism's ring: the blocks merged by their log-sum-exps give the whole sequence's
output, each block's backward from the merged statistics gives its exact share of every
gradient (log f included), and the Triton kernels (CPU interpreter here) equal the reference.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_hybrid.kernels._backend import triton_interpreting
from hf_hybrid.kernels.forgetting_attention import cumulative_log_forget, forgetting_attention_reference
from hf_hybrid.kernels.forgetting_attention.blocks import forgetting_block_attention, forgetting_block_attention_backward

needs_triton = pytest.mark.skipif(not torch.cuda.is_available() and not triton_interpreting(), reason="needs CUDA or TRITON_INTERPRET=1")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def inputs(batch, blocks, seq, hq, hkv, dim, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = blocks * seq
    q = torch.randn(batch, total, hq, dim, generator=g)
    k = torch.randn(batch, total, hkv, dim, generator=g)
    v = torch.randn(batch, total, hkv, dim, generator=g)
    log_f = F.logsigmoid(torch.randn(batch, total, hq, generator=g) * 2 + 1.5)
    do = torch.randn(batch, total, hq, dim, generator=g)
    return [t.to(DEVICE, dtype if t.dim() == 4 else torch.float32) for t in (q, k, v, log_f, do)]


def blockwise(q, k, v, log_f, do, seq, backend):
    """Output and (dq, dk, dv, dlog_f) of the whole sequence computed block pair by block pair."""
    scale = q.shape[-1] ** -0.5
    c = cumulative_log_forget(log_f)
    blocks = q.shape[1] // seq
    part = lambda t, j: t[:, j * seq : (j + 1) * seq]  # noqa: E731
    grads = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (q, k, v, c)]
    outs = []
    for r in range(blocks):
        results = []
        for j in range(r + 1):
            results.append(forgetting_block_attention(part(q, r), part(k, j), part(v, j), part(c, r), part(c, j),
                                                      causal=j == r, scale=scale, backend=backend))
        lse = torch.logsumexp(torch.stack([lse for _, lse in results]), 0)
        o = sum(torch.exp(l - lse).transpose(1, 2)[..., None] * o.float() for o, l in results)
        outs.append(o)
        delta = (part(do, r).float() * o.to(q.dtype).float()).sum(-1).transpose(1, 2)
        for j in range(r + 1):
            dq, dk, dv, dc_q, dc_k = forgetting_block_attention_backward(
                part(do, r), part(q, r), part(k, j), part(v, j), part(c, r), part(c, j), o, lse, delta,
                causal=j == r, scale=scale, backend=backend)
            for grad, value, block in ((grads[0], dq, r), (grads[1], dk, j), (grads[2], dv, j), (grads[3], dc_q, r)):
                part(grad, block).add_(value.float())
            if dc_k is not None:
                part(grads[3], j).add_(dc_k)
    dlog_f = grads[3].flip(1).cumsum(1).flip(1)  # c = cumsum(log f)
    return torch.cat(outs, 1), (*grads[:3], dlog_f)


def whole(q, k, v, log_f, do):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, log_f)]
    out = forgetting_attention_reference(*leaves)
    return out, torch.autograd.grad(out, leaves, do)


@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 2)])
def test_blocks_merged_equal_the_whole_sequence(hq, hkv):
    q, k, v, log_f, do = inputs(2, 3, 8, hq, hkv, 16, torch.float64)
    out, grads = blockwise(q, k, v, log_f, do, 8, "reference")
    want, want_grads = whole(q, k, v, log_f, do)
    # float64 inputs; c = cumsum(log f) is float32 in both (the two round c_i - c_j differently)
    torch.testing.assert_close(out.double(), want, atol=1e-6, rtol=1e-6)
    for name, got, ref in zip(("dq", "dk", "dv", "dlog_f"), grads, want_grads):
        torch.testing.assert_close(got.double(), ref.double(), atol=1e-5, rtol=1e-6, msg=name)


@needs_triton
@pytest.mark.parametrize("seq,hq,hkv", [(16, 2, 2), (21, 4, 2)])  # 21: ragged tiles of 16
def test_triton_blocks_equal_the_reference(seq, hq, hkv):
    q, k, v, log_f, do = inputs(2, 2, seq, hq, hkv, 16, seed=seq)
    out, grads = blockwise(q, k, v, log_f, do, seq, "triton")
    want, want_grads = blockwise(q, k, v, log_f, do, seq, "reference")
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-5)
    for name, got, ref in zip(("dq", "dk", "dv", "dlog_f"), grads, want_grads):
        torch.testing.assert_close(got, ref, atol=5e-5, rtol=1e-4, msg=name)



def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / (b.norm() + 1e-6)).item()


@pytest.mark.gpu
@pytest.mark.parametrize("seq,hq,hkv,d,dtype", [(1024, 4, 2, 64, torch.bfloat16), (777, 2, 1, 128, torch.bfloat16),
                                                (300, 2, 2, 256, torch.bfloat16), (515, 2, 1, 64, torch.float32)])
def test_gpu_triton_blocks(seq, hq, hkv, d, dtype):
    """Compiled kernels at ring-sized blocks: relative error against the float32 reference on the
    same inputs < 1e-2 for the output and 2e-2 for gradients in bf16 (FoX's documented tolerance),
    1e-4 in float32."""
    q, k, v, log_f, do = inputs(2, 3, seq, hq, hkv, d, dtype, seed=seq)
    out, grads = blockwise(q, k, v, log_f, do, seq, "triton")
    want, want_grads = blockwise(q, k, v, log_f, do, seq, "reference")
    for name, got, ref in zip(("o", "dq", "dk", "dv", "dlog_f"), (out, *grads), (want, *want_grads)):
        tolerance = 1e-4 if dtype == torch.float32 else 1e-2 if name == "o" else 2e-2
        assert rel_err(got, ref) < tolerance, (name, rel_err(got, ref))
