"""Forgetting Attention on PyTorch's dense fused attention (cuDNN on Hopper), the forget bias
carried by extra head dimensions.

FoX's score is s_ij = scale q_i . k_j + c_i - c_j (c = cumsum(log f), reference.py). A softmax
row does not change when a constant is added to it, so c_i can be dropped, and -c_j is one more
product term: with

    q'_i = [q_i, 1, 1, 1, 0, 0, 0, 0]        k'_j = [k_j, p1_j, p2_j, p3_j, 0, 0, 0, 0]

where p1 + p2 + p3 = -c_j / scale (three bf16 values holding c_j to float32 precision, since a
single bf16 would round a long sequence's c of -1000s by several units), scale q'_i . k'_j =
s_ij - c_i. One causal attention call over head size D + 8 (values keep D) is then FoX exactly up
to the float32 rounding of the scores. The log-sum-exp it returns lacks the c_i term.

Forward only (inference, prefill). Its backward would give dq, dk, dv, and the forget gate's
gradient as dc_j = -sum_i dS_ij = -dk'_j[D] / scale, but that column sum comes back rounded to
bf16 and d log f_l = sum_{t >= l} dc_t adds T such roundings: measured at T = 4K against the
float32 reference, 6% relative error with mild forgetting and 35% with strong (the Triton
backward accumulates it in float32). Training keeps the Triton kernels.

The forward is faster than the portable Triton kernel (``python -m hf_hybrid.bench.forgetting_attention``,
row ``ours_sdpa``; docs/benchmarks/fox.md). Used for bf16 on CUDA without gradients, a window or
packed sequences, from MIN_LEN tokens, on GPUs other than Hopper: there the Gluon forward
(hopper.py) is faster still. fp16 stays on Triton (-c / scale can pass
fp16's range) and so does fp32. ``HF_HYBRID_FOX_ATTENTION=sdpa`` forces this route.
"""
from __future__ import annotations

import torch

from .._custom_ops import kernel_op, needs_grad
from .._lse_attention import attention_with_kind, kernel_kind, path_switch
from .hopper import hopper_forward_applies

EXTRA = 8  # head dimensions added for the bias: 3 used, padded to a multiple of 8
# "triton": FoX on the Triton kernels always; "sdpa": without gradients, on this path from any length
ENV_SWITCH = "HF_HYBRID_FOX_ATTENTION"
MIN_LEN = 2048
_HEAD_DIMS = (64, 128)


def applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_f: torch.Tensor, window_size, cu_seqlens) -> bool:
    """Whether ``forgetting_attention``'s automatic choice takes this path on CUDA."""
    switch = path_switch(ENV_SWITCH)
    if switch == "triton" or not q.is_cuda or window_size is not None or cu_seqlens is not None:
        return False
    if switch == "" and hopper_forward_applies(q, window_size):
        return False  # on Hopper the Gluon forward is faster than this route (module docstring)
    if needs_grad(q, k, v, log_f):
        return False
    if q.dtype != torch.bfloat16 or k.dtype != q.dtype or q.shape[-1] not in _HEAD_DIMS:
        return False
    if q.shape[1] < (2 if switch == "sdpa" else MIN_LEN):
        return False
    return kernel_kind(q.transpose(1, 2)) == "cudnn"  # [batch, heads, len, dim], as the dense call sees it


def augment_grid(batch: int, seq: int, heads: int, block_t: int) -> tuple[int]:
    """Every (batch x head, tile of block_t tokens) pair on grid axis 0, tiles fastest (batch x
    heads passes axis 1's limit of 65,535 at large batch)."""
    return (-(-seq // block_t) * batch * heads,)


def _augmented(q, k, c_by_head, scale):
    """(q', k') [B, T, HQ, D + EXTRA] as the module docstring defines them."""
    from .sdpa_triton import BLOCK_T, WARPS, _augment_kernel

    batch, seq, heads, dim = q.shape
    qa = q.new_empty(batch, seq, heads, dim + EXTRA)
    ka = torch.empty_like(qa)
    _augment_kernel[augment_grid(batch, seq, heads, BLOCK_T)](
        q, k, c_by_head.contiguous(), qa, ka, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        seq, heads, heads // k.shape[2], -1.0 / scale, HEAD_DIM=dim, EXTRA=EXTRA, BLOCK_T=BLOCK_T, num_warps=WARPS,
    )
    return qa.transpose(1, 2), ka.transpose(1, 2)


def _values(q, v, kind):
    """v per query head [B, HQ, T, D] (grouped heads repeated); zero-padded to q's width for the
    kernels that need equal head sizes (CPU flash, math)."""
    rep = q.shape[2] // v.shape[2]
    v = v if rep == 1 else v.repeat_interleave(rep, dim=2)
    if kind != "cudnn":
        v = torch.nn.functional.pad(v, (0, EXTRA))
    return v.transpose(1, 2)


def _check(q, k, v, c_by_head):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"forgetting_attention (sdpa): {name} needs a unit stride in head_dim; got {t.stride()}.")
    if c_by_head.dtype != torch.float32:
        raise ValueError(f"forgetting_attention (sdpa): c_by_head must be float32; got {c_by_head.dtype}.")


@kernel_op("forgetting_attention_sdpa")
def forgetting_attention_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, c_by_head: torch.Tensor, scale: float,
) -> torch.Tensor:
    """o [B, T, HQ, D]; c_by_head [HQ, B * T] float32 (no autograd formula: forward only)."""
    _check(q, k, v, c_by_head)
    qa, ka = _augmented(q, k, c_by_head, scale)
    # Chosen (and self-checked) at q's own head size, as `applies` chose it. cuDNN takes values
    # narrower than q', k'; the other kernels get them padded (_values).
    kind = kernel_kind(q.transpose(1, 2))
    out, _, _ = attention_with_kind(kind, qa, ka, _values(q, v, kind), True, scale)
    return out.transpose(1, 2)[..., : q.shape[-1]].contiguous()


@forgetting_attention_sdpa.register_fake
def _(q, k, v, c_by_head, scale):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)
