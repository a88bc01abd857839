"""Causal sliding-window softmax attention (the window layers of RAT-SWA, RATTENTION's local
branch), two ways on the GPU: for fp16 / bf16, the FlashAttention-2 kernels inside PyTorch with
their native window (flash.py: nothing to compile at a first use, little host time per call); for
float32 and where those do not apply, Forgetting Attention's Triton kernels with the forget gate
compiled out. Both skip the tiles outside the window and compile nothing per shape. And its decode
step, one query per row against a cache's fixed buffers (FoX's split-K decode kernel without the
gate), which the softmax layers' graphed decode step runs. Math in reference.py.
"""
from __future__ import annotations

import torch

from .._backend import resolve_backend
from .._custom_ops import KernelContext, fake_like, kernel_op
from ..forgetting_attention import _TRITON_HEAD_DIMS as _FOX_TRITON_HEAD_DIMS
from ..forgetting_attention import _check_decode_length, _check_heads, _check_packed, _check_window, _packing
from .flash import flash_window_applies, flash_window_attention
from .reference import window_attention_decode_reference, window_attention_reference

__all__ = [
    "TRITON_HEAD_DIMS",
    "flash_window_applies",
    "flash_window_attention",
    "window_attention",
    "window_attention_applies",
    "window_attention_decode_applies",
    "window_attention_decode",
    "window_attention_decode_reference",
    "window_attention_reference",
]

_OP = "window_attention"
TRITON_HEAD_DIMS = _FOX_TRITON_HEAD_DIMS  # the same kernels


def _triton_applies(q: torch.Tensor) -> bool:
    return q.is_cuda and q.shape[-1] in TRITON_HEAD_DIMS and q.dtype in (torch.float16, torch.bfloat16, torch.float32)


def window_attention_applies(q: torch.Tensor) -> bool:
    """Whether ``backend="auto"`` runs a GPU kernel for this query (FlashAttention-2 or Triton):
    CUDA, a head_dim and a float dtype one of them takes."""
    return flash_window_applies(q) or _triton_applies(q)


def window_attention_decode_applies(q: torch.Tensor) -> bool:
    """Whether ``backend="auto"`` runs the split-K Triton decode kernel for this query."""
    return _triton_applies(q)


def _implementation(op: str, backend: str, q: torch.Tensor, with_flash: bool = True) -> str:
    """"flash", "triton" or "reference" for ``backend``: "auto" takes FlashAttention-2 where
    flash_window_applies (``with_flash``: an op that has that way), else the Triton kernels where
    they are built for the query, else the reference; "flash" or "triton" where they cannot run is
    an error."""
    if backend == "flash":
        if not with_flash:
            raise ValueError(f"{op}: backend='flash' is not one of ('auto', 'reference', 'triton') for this op.")
        if not flash_window_applies(q):
            raise ValueError(
                f"{op}: backend='flash' needs CUDA fp16 / bf16 inputs with head_dim a multiple of 8 up to 256, an "
                f"sm_80+ GPU, flash SDPA enabled and a torch whose FlashAttention op takes a window; got "
                f"{q.dtype} head_dim {q.shape[-1]} on {q.device}. Pass backend='auto'."
            )
        return "flash"
    impl = resolve_backend(backend, q.device, op)
    if impl == "triton" and backend == "auto":
        if with_flash and flash_window_applies(q):
            return "flash"
        return "triton" if _triton_applies(q) else "reference"
    if impl == "triton" and q.shape[3] not in TRITON_HEAD_DIMS:
        raise ValueError(f"{op}: the Triton kernels take head_dim in {TRITON_HEAD_DIMS}; got {q.shape[3]}. Pass backend='reference'.")
    return impl


def window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    window_size: int,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Causal softmax attention where query i sees keys j with 0 <= i - j < window_size (the token
    itself included). Differentiable in q, k, v.

    q [B,T,HQ,D]; k, v [B,T,HKV,D] with HQ % HKV == 0 (GQA). cu_seqlens: int [N+1] boundaries of
    packed sequences (B must be 1); nothing crosses one. scale defaults to D ** -0.5. backend:
    "auto" (on CUDA: FlashAttention-2 for fp16 / bf16 where flash_window_applies, else Triton for
    head_dim in TRITON_HEAD_DIMS; the reference elsewhere), "flash", "triton", "reference".
    """
    _check_heads(_OP, q, k, v)
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"{_OP}: q and k must have the same sequence length; got {q.shape[1]} and {k.shape[1]}.")
    if isinstance(window_size, bool) or not isinstance(window_size, int) or window_size < 1:
        raise ValueError(f"{_OP}: window_size must be an int >= 1 (tokens, self included); got {window_size!r}.")
    _check_packed(_OP, q, cu_seqlens)
    impl = _implementation(_OP, backend, q)
    if impl == "reference":
        return window_attention_reference(q, k, v, window_size, scale, cu_seqlens)
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"{_OP}: q, k, v must share one dtype among fp16/bf16/fp32; got {q.dtype}, {k.dtype}, {v.dtype}.")
    if q.shape[1] == 0:
        return torch.empty_like(q)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if impl == "flash":
        return flash_window_attention(q, k, v, window_size, scale, *_packing(q, cu_seqlens))
    return window_attention_fwd(q, k, v, cu_seqlens, scale, window_size)[0]


def window_attention_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    length: torch.Tensor,
    *,
    scale: float | None = None,
    window_size: int | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Softmax attention of one query per row against fixed-capacity key buffers (a decode step).

    q [B,1,HQ,D]; k, v [B,T,HKV,D] (any strides with a contiguous last dimension: a cache's
    buffers, e.g. a [B,HKV,T,D] buffer transposed); the query is key n - 1 (n = length, an integer
    tensor [1] or [B] on q's device, so a CUDA graph replays the same call at every step) and sees
    the keys j < n, with ``window_size`` W also n - 1 - j < W. Columns from n on are never read;
    n >= T reads every slot (a ring). Float32 scores. backend: "auto" (the split-K Triton kernel on
    CUDA for head_dim in TRITON_HEAD_DIMS, the reference elsewhere), "triton", "reference".
    """
    op = "window_attention_decode"
    _check_heads(op, q, k, v)
    if q.shape[1] != 1:
        raise ValueError(f"{op}: expects one query per row (q [batch, 1, heads, head_dim]); got {q.shape[1]} queries.")
    _check_decode_length(op, length, q.shape[0], q.device)
    _check_window(op, window_size)
    if _implementation(op, backend, q, with_flash=False) == "reference":
        return window_attention_decode_reference(q, k, v, length, scale, window_size)
    return window_attention_decode_op(q, k, v, length, scale, window_size)


# ---------------------------------------------------------------- custom ops (see .._custom_ops)


@kernel_op("window_attention_decode")
def window_attention_decode_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: torch.Tensor, scale: float | None, window_size: int | None,
) -> torch.Tensor:
    from ..forgetting_attention.decode_triton import forgetting_attention_decode_triton

    return forgetting_attention_decode_triton(q, k, v, None, None, length, None, scale, window_size)


@window_attention_decode_op.register_fake
def _(q, k, v, length, scale, window_size):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


@kernel_op("window_attention_fwd")
def window_attention_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor | None, scale: float, window_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [B, T, HQ, D], lse [HQ, B * T] float32, log2 units)."""
    from ..forgetting_attention import _packing
    from ..forgetting_attention.triton import _ForgettingAttention

    cu, max_len = _packing(q, cu_seqlens)
    ctx = KernelContext()
    q, k, v = (t.contiguous() for t in (q, k, v))
    o = _ForgettingAttention.forward(ctx, q, k, v, None, scale, window_size, cu, max_len)
    return o, ctx.saved_tensors[5]


@window_attention_fwd.register_fake
def _(q, k, v, cu_seqlens, scale, window_size):
    b, t, hq, _ = q.shape
    return torch.empty(q.shape, dtype=q.dtype, device=q.device), q.new_empty(hq, b * t, dtype=torch.float32)


@kernel_op("window_attention_bwd")
def window_attention_bwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor | None,
    o: torch.Tensor, lse: torch.Tensor, do: torch.Tensor, scale: float, window_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from ..forgetting_attention import _packing
    from ..forgetting_attention.triton import _ForgettingAttention

    b, t, hq, d = q.shape
    cu, max_len = _packing(q, cu_seqlens)
    flat = tuple(x.contiguous().view(b * t, x.shape[2], d) for x in (q, k, v, o))
    saved = (*flat[:3], None, flat[3], lse, cu)
    ctx = KernelContext(saved, meta=(b, t, scale, window_size, max_len))
    return _ForgettingAttention.backward(ctx, do)[:3]


@window_attention_bwd.register_fake
def _(q, k, v, cu_seqlens, o, lse, do, scale, window_size):
    return fake_like(q, k, v)


def _setup(ctx, inputs, output):
    q, k, v, cu_seqlens, scale, window_size = inputs
    ctx.save_for_backward(q, k, v, cu_seqlens, *output)
    ctx.args = (scale, window_size)


def _backward(ctx, do, _dlse):
    grads = window_attention_bwd(*ctx.saved_tensors, do, *ctx.args)
    return (*grads, None, None, None)


window_attention_fwd.register_autograd(_backward, setup_context=_setup)
