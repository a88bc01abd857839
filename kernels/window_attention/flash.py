"""Sliding-window attention through the FlashAttention-2 kernels that ship inside PyTorch
(``aten::_flash_attention_forward`` / ``_flash_attention_backward`` with their native window:
query i sees keys j with i - (W - 1) <= j <= i). Tiles outside the band are skipped by the kernel,
like the Triton kernels' (kernels/window_attention), so the GPU time is about the same; but
nothing is compiled at a first use and a call costs less host time (two aten calls).

Packed rows and dense batches go through the same variable-length call: a dense [B, T] batch is
B packed sequences of T tokens. Math: reference.py.
"""
from __future__ import annotations

import torch

from ..forgetting_attention.reference import row_boundaries

FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256


_AVAILABLE: list[bool] = []  # filled on the first call


@torch.compiler.assume_constant_result  # fixed per process: torch.compile takes the value, traces nothing
def flash_window_available() -> bool:
    """Whether this torch's FlashAttention op takes a window (its schema names window_size_left)
    and the current GPU is one FlashAttention-2 runs on (sm_80 and newer)."""
    if not _AVAILABLE:
        try:
            has_window = "window_size_left" in str(torch.ops.aten._flash_attention_forward.default._schema)
            _AVAILABLE.append(has_window and torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0))
        except (AttributeError, RuntimeError):  # an older torch, or no usable driver
            _AVAILABLE.append(False)
    return _AVAILABLE[0]


def flash_window_applies(q: torch.Tensor) -> bool:
    """Whether :func:`flash_window_attention` takes this query (k and v of its dtype): CUDA, fp16 /
    bf16 (float32 inputs compute in float32, in the Triton kernels), a head_dim FlashAttention-2 is
    built for, flash SDPA left on (``torch.backends.cuda.enable_flash_sdp``) and a torch whose op
    has the window."""
    return (
        q.is_cuda and q.dtype in FLASH_DTYPES and q.shape[-1] % 8 == 0 and q.shape[-1] <= FLASH_MAX_HEAD_DIM
        and torch.backends.cuda.flash_sdp_enabled() and flash_window_available()
    )


def _packed(x: torch.Tensor) -> torch.Tensor:
    """[B, T, H, D] -> [B * T, H, D] with a contiguous last dimension (a view where possible)."""
    b, t, h, d = x.shape
    return x.reshape(b * t, h, d) if x.stride(-1) == 1 else x.contiguous().view(b * t, h, d)


class _FlashWindowAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_len: int, window_size: int, scale: float):
        qf, kf, vf = _packed(q), _packed(k), _packed(v)
        out, lse, rng_state, _, _ = torch.ops.aten._flash_attention_forward(
            qf, kf, vf, cu_seqlens, cu_seqlens, max_len, max_len, 0.0, False, False,
            scale=scale, window_size_left=window_size - 1, window_size_right=0,
        )
        ctx.save_for_backward(qf, kf, vf, out, lse, cu_seqlens, rng_state)
        ctx.meta = (max_len, window_size, scale, q.shape, k.shape)
        return out.view(q.shape)

    @staticmethod
    def backward(ctx, do):
        qf, kf, vf, out, lse, cu_seqlens, rng_state = ctx.saved_tensors
        max_len, window_size, scale, q_shape, k_shape = ctx.meta
        unused = torch.empty(0, device=qf.device)  # the philox offset slot: no dropout here
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            _packed(do), qf, kf, vf, out, lse, cu_seqlens, cu_seqlens, max_len, max_len, 0.0, False,
            rng_state, unused, scale=scale, window_size_left=window_size - 1, window_size_right=0,
        )
        return dq.view(q_shape), dk.view(k_shape), dv.view(k_shape), None, None, None, None


def flash_window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window_size: int,
    scale: float,
    cu_seqlens: torch.Tensor | None = None,
    max_len: int | None = None,
) -> torch.Tensor:
    """Causal attention over a window of ``window_size`` tokens (the token itself included).

    q [B,T,HQ,D]; k, v [B,T,HKV,D] (GQA). cu_seqlens: int32 boundaries of packed sequences (B = 1)
    with ``max_len`` their longest; None takes each row as one sequence. Differentiable in q, k, v.
    The caller checks :func:`flash_window_applies`.
    """
    batch, seq = q.shape[:2]
    if cu_seqlens is None:
        cu_seqlens, max_len = row_boundaries(batch, seq, q.device), seq
    return _FlashWindowAttention.apply(q, k, v, cu_seqlens.to(torch.int32), int(max_len), int(window_size), float(scale))
