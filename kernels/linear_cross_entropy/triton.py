"""Triton linear cross-entropy (math: reference.py): the logits of a chunk of rows at a time, and
the loss and both gradients computed in the forward, so the [N, vocab] logits never exist whole.

Per chunk of C rows: ``logits = hidden[c] @ weight.T`` into one reused [C, vocab] buffer (the
inputs' dtype); one program per row reads its logits twice (an online max / sum-exp pass, then
the gradient pass) and writes ``(softmax - onehot(target)) * scale`` over them in place; then
``grad_hidden[c] = grad_logits @ weight`` and ``grad_weight += grad_logits.T @ hidden[c]`` (float32).

Why not Liger's fused linear cross-entropy, which does the same: it reads the count of counted
targets back to the host (``.item()``) in the forward and compares the upstream gradient with 1 on
the host in the backward. Each read waits for every kernel queued before it, and a training step
whose host issues its kernels only just ahead of the GPU then idles the GPU while the backward is
launched. Here the count stays on the device (``scale`` is read by the kernel), so nothing syncs.

The chunk holds at most CHUNK_BYTES of logits (2,048 rows at a 32K vocabulary in bf16): fewer,
larger matmuls than one-activation-sized chunks, and few float32 accumulations of grad_weight.
A target outside [0, vocab) that is not ignore_index gives a nan loss and nan gradients for its
row (checking it on the host would be the sync this avoids; PyTorch's cross_entropy raises a device
assert).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._compat.triton_launch import launch_cached

CHUNK_BYTES = 128 << 20  # logits per chunk
BLOCK_V = 4096  # vocabulary columns per step of a row's two passes
WARPS = 8


@launch_cached
@triton.jit
def _loss_and_grad_kernel(LOGITS, TARGETS, LOSS, SCALE, stride_row, vocab, ignore_index,
                          BLOCK: tl.constexpr, HAS_GRAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * stride_row
    target = tl.load(TARGETS + row).to(tl.int64)
    counted = target != ignore_index
    in_range = (target >= 0) & (target < vocab)
    cols = tl.arange(0, BLOCK)
    m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), 0)
    total = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
    for start in range(0, vocab, BLOCK):
        x = tl.load(base + start + cols, mask=start + cols < vocab, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        total = total * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
    lse = m + tl.log(total)
    x_target = tl.load(base + tl.where(in_range, target, 0)).to(tl.float32)
    loss = tl.where(in_range, lse - x_target, float("nan"))
    tl.store(LOSS + row, tl.where(counted, loss, 0.0))
    if HAS_GRAD:
        scale = tl.load(SCALE) * counted.to(tl.float32)
        scale = tl.where(counted & ~in_range, float("nan"), scale)
        for start in range(0, vocab, BLOCK):
            offs = start + cols
            ok = offs < vocab
            x = tl.load(base + offs, mask=ok, other=0.0).to(tl.float32)
            grad = (tl.exp(x - lse) - (offs == target).to(tl.float32)) * scale
            tl.store(base + offs, grad.to(LOGITS.dtype.element_ty), mask=ok)


def chunk_rows(rows: int, vocab: int, element_size: int) -> int:
    """Rows per chunk: as many as CHUNK_BYTES of logits hold (a power of two, at least 16)."""
    fit = max(16, CHUNK_BYTES // max(1, vocab * element_size))
    return min(rows, 1 << (fit.bit_length() - 1))


def _accumulate_weight_grad(grad_weight: torch.Tensor, grad_logits: torch.Tensor, hidden: torch.Tensor) -> None:
    """grad_weight (float32) += grad_logits.T @ hidden, the product summed in float32."""
    if hidden.dtype == torch.float32:
        grad_weight.addmm_(grad_logits.t(), hidden)
    elif hidden.is_cuda:  # half-precision operands, float32 accumulator and output
        torch.addmm(grad_weight, grad_logits.t(), hidden, out_dtype=torch.float32, out=grad_weight)
    else:  # Triton's CPU interpreter (tests): no half-precision addmm into float32 on the CPU
        grad_weight.addmm_(grad_logits.t().float(), hidden.float())


class LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index: int, reduction: str, need_hidden: bool, need_weight: bool):
        rows, vocab = hidden.shape[0], weight.shape[0]
        hidden, weight, targets = hidden.contiguous(), weight.contiguous(), targets.contiguous()
        has_grad = need_hidden or need_weight
        counted = (targets != ignore_index).sum(dtype=torch.float32)
        scale = counted.reciprocal() if reduction == "mean" else torch.ones((), device=hidden.device)
        row_loss = torch.empty(rows, device=hidden.device, dtype=torch.float32)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32) if need_weight else None
        chunk = chunk_rows(rows, vocab, hidden.element_size())
        logits_buffer = torch.empty(chunk, vocab, device=hidden.device, dtype=hidden.dtype)
        for start in range(0, rows, chunk):
            end = min(rows, start + chunk)
            logits = logits_buffer[: end - start]
            torch.mm(hidden[start:end], weight.t(), out=logits)
            _loss_and_grad_kernel[(end - start,)](
                logits, targets[start:end], row_loss[start:end], scale, logits.stride(0), vocab, ignore_index,
                BLOCK=min(BLOCK_V, triton.next_power_of_2(vocab)), HAS_GRAD=has_grad, num_warps=WARPS,
            )
            if need_hidden:
                torch.mm(logits, weight, out=grad_hidden[start:end])
            if need_weight:
                _accumulate_weight_grad(grad_weight, logits, hidden[start:end])
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return row_loss.sum() * scale

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden = grad_hidden * grad_loss.to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = (grad_weight * grad_loss).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def linear_cross_entropy_triton(hidden, weight, targets, ignore_index: int = -100, reduction: str = "mean"):
    # Which gradients the forward computes, decided out here: inside forward() grad mode is off, so
    # a copy made there (contiguous()) would not require grad, and under no_grad none is wanted.
    grad = torch.is_grad_enabled()
    return LinearCrossEntropy.apply(hidden, weight, targets, ignore_index, reduction,
                                    grad and hidden.requires_grad, grad and weight.requires_grad)
