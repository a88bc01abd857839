"""Forgetting Attention (FoX): softmax attention with a scalar forget gate per head.

    o_i = sum_j softmax_j(scale q_i . k_j + c_i - c_j) v_j,   c = cumsum(log f) per head,

over causal keys (optionally a sliding window, optionally packed sequences). See reference.py
for the full statement, triton.py for the FlashAttention-style kernels and decode.py for new
queries against a cache.
"""
from __future__ import annotations

import torch

from .._backend import resolve_backend, triton_interpreting
from .._query_blocks import attend_in_query_blocks, query_block_size
from .._custom_ops import KernelContext, fake_like, kernel_op, needs_grad
from .decode import (
    forgetting_attention_decode_reference,
    forgetting_attention_with_cache_reference,
    forgetting_attention_with_cache_sdpa,
)
from .sdpa import _HEAD_DIMS as _SDPA_HEAD_DIMS
from .sdpa import applies as sdpa_applies
from .sdpa import forgetting_attention_sdpa
from .reference import (
    cumulative_log_forget,
    masked_softmax_attention,
    cumulative_log_forget_by_head,
    forgetting_attention_reference,
    row_boundaries,
    visibility_mask,
)

__all__ = [
    "cumulative_log_forget",
    "cumulative_log_forget_by_head",
    "forgetting_attention",
    "forgetting_attention_decode",
    "forgetting_attention_decode_reference",
    "forgetting_attention_query_blocks",
    "forgetting_attention_reference",
    "forgetting_attention_with_cache",
    "forgetting_attention_with_cache_reference",
    "visibility_mask",
]

_OP = "forgetting_attention"
_TRITON_HEAD_DIMS = (16, 32, 64, 128, 256)


def _check_heads(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"{op}: q, k, v must be [batch, seq, heads, head_dim]; got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}."
        )
    if k.shape != v.shape:
        raise ValueError(f"{op}: k and v must have equal shapes; got {tuple(k.shape)} and {tuple(v.shape)}.")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"{op}: q {tuple(q.shape)} and k {tuple(k.shape)} must share batch and head_dim."
        )
    if k.shape[2] == 0 or q.shape[2] % k.shape[2] != 0:
        raise ValueError(
            f"{op}: the number of query heads ({q.shape[2]}) must be a multiple of the number of "
            f"key/value heads ({k.shape[2]}) for grouped-query attention."
        )


def _check_packed(op: str, q: torch.Tensor, cu_seqlens: torch.Tensor | None) -> None:
    """cu_seqlens: None, or int [N+1] boundaries of packed sequences in a batch of one row."""
    if cu_seqlens is None:
        return
    if q.shape[0] != 1:
        raise ValueError(f"{op}: cu_seqlens needs packed inputs with batch 1; got batch {q.shape[0]}.")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
        raise ValueError(f"{op}: cu_seqlens must be a 1-D integer tensor [num_seqs + 1]; got {tuple(cu_seqlens.shape)} {cu_seqlens.dtype}.")
    if not torch.compiler.is_compiling():  # a host sync; compiled, the Triton op checks it when it runs
        _check_cu_seqlens_values(cu_seqlens, q.shape[1])


def _check_decode_length(op: str, length: torch.Tensor, batch: int, device: torch.device) -> None:
    if length.dim() != 1 or length.numel() not in (1, batch) or length.dtype.is_floating_point or length.device != device:
        raise ValueError(f"{op}: length must be an integer tensor of shape [1] or [{batch}] on {device}; "
                         f"got {tuple(length.shape)} {length.dtype} on {length.device}.")


def _check_cu_seqlens_values(cu_seqlens: torch.Tensor, seq: int) -> None:
    if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != seq or bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
        raise ValueError(
            f"{_OP}: cu_seqlens must start at 0, never decrease and end at the sequence length {seq}; "
            f"got {cu_seqlens.tolist()}."
        )


def _check_window(op: str, window_size) -> None:
    if window_size is not None and (not isinstance(window_size, int) or window_size < 1):
        raise ValueError(f"{op}: window_size must be None or an int >= 1 (tokens, self included); got {window_size!r}.")


def forgetting_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_f: torch.Tensor,
    *,
    scale: float | None = None,
    window_size: int | None = None,
    cu_seqlens: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Causal Forgetting Attention; differentiable in q, k, v and log_f.

    q [B,T,HQ,D]; k, v [B,T,HKV,D] with HQ % HKV == 0 (GQA); log_f [B,T,HQ] the log forget gate
    (<= 0, any float dtype, summed in float32). scale defaults to D ** -0.5. window_size W: key j
    is visible to query i iff 0 <= i - j < W. cu_seqlens: int [N+1] sequence boundaries of packed
    inputs (B must be 1); nothing crosses a boundary. Returns o [B,T,HQ,D] in q's dtype.
    backend: "auto" (Triton on CUDA, reference elsewhere; without gradients in bf16, no window or
    packing, from sdpa.MIN_LEN tokens, cuDNN with the forget bias as extra head dimensions, sdpa.py),
    "reference", "triton" or "sdpa" (that forward-only path; on CPU PyTorch's flash kernel, for
    float32 on CUDA plain PyTorch attention that materialises the scores, for tests).
    """
    _check_heads(_OP, q, k, v)
    if k.shape[1] != q.shape[1]:
        raise ValueError(
            f"{_OP}: q and k must have the same sequence length (got {q.shape[1]} and {k.shape[1]}); "
            "for queries at the end of a longer cache use forgetting_attention_with_cache."
        )
    if log_f.shape != q.shape[:3]:
        raise ValueError(f"{_OP}: log_f must be [batch, seq, q_heads] = {tuple(q.shape[:3])}; got {tuple(log_f.shape)}.")
    if not log_f.is_floating_point():
        raise ValueError(f"{_OP}: log_f must be a float tensor (log of the forget gate); got {log_f.dtype}.")
    _check_window(_OP, window_size)
    _check_packed(_OP, q, cu_seqlens)
    impl = resolve_backend(backend, q.device, _OP, extra=("sdpa",))
    if impl == "sdpa" or (impl == "triton" and backend == "auto" and sdpa_applies(q, k, v, log_f, window_size, cu_seqlens)):
        return _forgetting_attention_sdpa(q, k, v, log_f, scale, window_size, cu_seqlens)
    triton_ok = q.shape[3] in _TRITON_HEAD_DIMS and q.dtype in (torch.float16, torch.bfloat16, torch.float32)
    if backend == "auto" and not triton_ok:
        impl = "reference"  # "auto" picks what can run; an explicit "triton" explains below
    if impl == "triton":
        if q.shape[3] not in _TRITON_HEAD_DIMS:
            raise ValueError(
                f"{_OP}: the Triton kernel supports head_dim in {_TRITON_HEAD_DIMS}; got {q.shape[3]}. "
                "Pass backend='reference' or use a supported head_dim."
            )
        if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or k.dtype != q.dtype or v.dtype != q.dtype:
            raise ValueError(f"{_OP}: q, k, v must share one dtype among fp16/bf16/fp32; got {q.dtype}, {k.dtype}, {v.dtype}.")
        if q.shape[1] == 0:
            return torch.empty_like(q)
        scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
        c_by_head = _cumulative_log_forget(log_f, cu_seqlens)
        return forgetting_attention_fwd(q, k, v, c_by_head, cu_seqlens, scale, window_size)[0]
    return forgetting_attention_query_blocks(q, k, v, log_f, scale, window_size, cu_seqlens)


def forgetting_attention_query_blocks(q, k, v, log_f, scale=None, window_size=None, cu_seqlens=None,
                                      query_block: int | None = None) -> torch.Tensor:
    """The reference's math over blocks of ``query_block`` queries (default: a block's scores within
    _query_blocks.SCORE_BUDGET), so memory grows linearly in T: c = cumsum(log f) once, then per
    block the bias c_i - c_j, :func:`visibility_mask` rows and the masked softmax over the keys up
    to the block's end."""
    seq = q.shape[1]
    block = query_block_size(seq, seq, q.shape[0] * q.shape[2]) if query_block is None else query_block
    if block >= seq:
        return forgetting_attention_reference(q, k, v, log_f, scale, window_size, cu_seqlens)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    c = cumulative_log_forget(log_f, cu_seqlens)  # [B, T, HQ] float32, differentiable

    def attend(start, q_block, c_block, k_seen, v_seen, c_seen):
        bias = c_block.permute(0, 2, 1)[..., :, None] - c_seen.permute(0, 2, 1)[..., None, :]
        visible = visibility_mask(q_block.shape[1], k_seen.shape[1], start, window_size, cu_seqlens, q.device)
        return masked_softmax_attention(q_block, k_seen, v_seen, bias.masked_fill(~visible, 0.0), visible, scale)

    return attend_in_query_blocks(attend, [q, c], [k, v, c], block=block, causal=True)


def _cumulative_log_forget(log_f: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """c by head for the Triton kernels: one Triton scan each way (cumulative.py), or the reference's
    torch scan under torch.compile (which traces it) and where Triton cannot run."""
    if torch.compiler.is_compiling() or not (log_f.is_cuda or triton_interpreting()):
        return cumulative_log_forget_by_head(log_f, cu_seqlens)
    from .cumulative import cumulative_log_forget_by_head_triton

    return cumulative_log_forget_by_head_triton(log_f, cu_seqlens)


def _forgetting_attention_sdpa(q, k, v, log_f, scale, window_size, cu_seqlens):
    if window_size is not None or cu_seqlens is not None:
        raise ValueError(
            f"{_OP}: backend='sdpa' runs whole causal sequences only; got window_size={window_size}, "
            f"cu_seqlens={'given' if cu_seqlens is not None else None}. Pass backend='auto' or 'triton'."
        )
    if q.shape[3] not in _SDPA_HEAD_DIMS:
        raise ValueError(f"{_OP}: backend='sdpa' supports head_dim in {_SDPA_HEAD_DIMS}; got {q.shape[3]}.")
    if needs_grad(q, k, v, log_f):
        raise ValueError(
            f"{_OP}: backend='sdpa' is forward-only (its forget-gate gradient would come from bf16 column sums, "
            "inaccurate at long lengths); call it under torch.no_grad() or pass backend='auto' / 'triton' to train."
        )
    if q.shape[1] == 0:
        return torch.empty_like(q)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    return forgetting_attention_sdpa(q, k, v, cumulative_log_forget_by_head(log_f), scale)


def forgetting_attention_with_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    c_q: torch.Tensor,
    c_k: torch.Tensor,
    key_mask: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    window_size: int | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Forgetting Attention of Tq new queries that are the last Tq of Tk cached keys.

    q [B,Tq,HQ,D]; k, v [B,Tk,HKV,D] (Tk >= Tq, cache plus the new tokens); c_q [B,Tq,HQ] and
    c_k [B,Tk,HQ] the cumulative log forget of the queries and of every key (one running sum, so
    c_q equals the last Tq entries of c_k); key_mask [B,Tk] bool, False for padding. Query t sits
    at key position Tk - Tq + t. Exact (float32 softmax), not differentiated by a kernel.
    backend: "auto" (SDPA on CUDA, reference elsewhere), "reference", "sdpa", or "triton" (= the
    GPU path, SDPA with a float32 bias).
    """
    op = "forgetting_attention_with_cache"
    _check_heads(op, q, k, v)
    b, tq, hq = q.shape[:3]
    tk = k.shape[1]
    if tk < tq:
        raise ValueError(f"{op}: the cache must hold the new tokens too: k has {tk} positions, q has {tq}.")
    if c_q.shape != (b, tq, hq):
        raise ValueError(f"{op}: c_q must be [batch, q_len, q_heads] = {(b, tq, hq)}; got {tuple(c_q.shape)}.")
    if c_k.shape != (b, tk, hq):
        raise ValueError(f"{op}: c_k must be [batch, k_len, q_heads] = {(b, tk, hq)}; got {tuple(c_k.shape)}.")
    if key_mask is not None and tuple(key_mask.shape) != (b, tk):
        raise ValueError(f"{op}: key_mask must be [batch, k_len] = {(b, tk)}; got {tuple(key_mask.shape)}.")
    _check_window(op, window_size)
    impl = resolve_backend(backend, q.device, op, extra=("sdpa",))
    if impl == "triton" and tq == 1 and q.shape[-1] in _TRITON_HEAD_DIMS:
        # One query per row (a decode step): the split-K kernel, at key position tk - 1.
        length = torch.full((1,), tk, dtype=torch.int64, device=q.device)
        return forgetting_attention_decode_op(q, k, v, c_q, c_k, length, key_mask, scale, window_size)
    if impl == "triton":
        impl = "sdpa"
    if impl == "sdpa":
        return forgetting_attention_with_cache_sdpa(q, k, v, c_q, c_k, key_mask, scale, window_size)
    if tq == tk:  # a whole (padded) segment: its rows over blocks of queries, memory linear in T
        return _with_cache_query_blocks(q, k, v, c_q, c_k, key_mask, scale, window_size)
    return forgetting_attention_with_cache_reference(q, k, v, c_q, c_k, key_mask, scale, window_size)


def _with_cache_query_blocks(q, k, v, c_q, c_k, key_mask, scale, window_size, query_block: int | None = None):
    """:func:`forgetting_attention_with_cache_reference` for queries aligned with the keys (Tq = Tk),
    over blocks of queries: block [s, e) is the same call on the keys [0, e), whose last e - s
    positions are those queries."""
    seq = q.shape[1]
    block = query_block_size(seq, seq, q.shape[0] * q.shape[2]) if query_block is None else query_block
    shared = [k, v, c_k] + ([] if key_mask is None else [key_mask])

    def attend(start, q_block, c_block, k_seen, v_seen, c_seen, mask_seen=None):
        return forgetting_attention_with_cache_reference(q_block, k_seen, v_seen, c_block, c_seen, mask_seen, scale, window_size)

    return attend_in_query_blocks(attend, [q, c_q], shared, block=block, causal=True)


def forgetting_attention_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    c_q: torch.Tensor,
    c_k: torch.Tensor,
    length: torch.Tensor,
    key_mask: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    window_size: int | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Forgetting Attention of one query per row against fixed-capacity key buffers (a decode step).

    q [B,1,HQ,D]; k, v [B,T,HKV,D] of which the first n = length columns are filled (the query is
    key n - 1; the rest is never read); c_q [B,1,HQ] and c_k [B,T,HQ] as in
    :func:`forgetting_attention_with_cache`; length int [1] or [B] on q's device (a device counter:
    a CUDA graph replays the same call at every step); key_mask [B,T] bool, False for padding.
    Exact: float32 scores and bias for any input dtype. backend: "auto" (the split-K Triton kernel on
    CUDA, reference elsewhere), "reference" or "triton".
    """
    op = "forgetting_attention_decode"
    _check_heads(op, q, k, v)
    b, tq, hq, dim = q.shape
    tk = k.shape[1]
    if tq != 1:
        raise ValueError(f"{op}: expects one query per row (q [batch, 1, heads, head_dim]); got {tq} queries: "
                         "use forgetting_attention_with_cache for several.")
    if c_q.shape != (b, 1, hq) or c_k.shape != (b, tk, hq):
        raise ValueError(f"{op}: c_q must be {(b, 1, hq)} and c_k {(b, tk, hq)}; got {tuple(c_q.shape)} and {tuple(c_k.shape)}.")
    _check_decode_length(op, length, b, q.device)
    if key_mask is not None and (tuple(key_mask.shape) != (b, tk) or key_mask.dtype != torch.bool):
        raise ValueError(f"{op}: key_mask must be a bool [batch, keys] = {(b, tk)} tensor; got {tuple(key_mask.shape)} {key_mask.dtype}.")
    _check_window(op, window_size)
    impl = resolve_backend(backend, q.device, op)
    if impl == "triton" and dim not in _TRITON_HEAD_DIMS:
        if backend == "triton":
            raise ValueError(f"{op}: the Triton kernel takes head_dim in {_TRITON_HEAD_DIMS}, got {dim}; pass backend='reference'.")
        raise ValueError(f"{op}: head_dim {dim} has no Triton kernel (supported: {_TRITON_HEAD_DIMS}); "
                         "pass backend='reference' to run the PyTorch reference on the GPU knowingly.")
    if impl == "triton":
        return forgetting_attention_decode_op(q, k, v, c_q, c_k, length, key_mask, scale, window_size)
    return forgetting_attention_decode_reference(q, k, v, c_q, c_k, length, key_mask, scale, window_size)


@kernel_op("forgetting_attention_decode")
def forgetting_attention_decode_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, c_q: torch.Tensor, c_k: torch.Tensor, length: torch.Tensor,
    key_mask: torch.Tensor | None, scale: float | None, window_size: int | None,
) -> torch.Tensor:
    from .decode_triton import forgetting_attention_decode_triton

    return forgetting_attention_decode_triton(q, k, v, c_q, c_k, length, key_mask, scale, window_size)


@forgetting_attention_decode_op.register_fake
def _(q, k, v, c_q, c_k, length, key_mask, scale, window_size):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


# ---------------------------------------------------------------- custom ops (see .._custom_ops)


def _packing(q: torch.Tensor, cu_seqlens: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """(int32 sequence boundaries, longest sequence): dense rows are B packed sequences of T."""
    b, t = q.shape[:2]
    if cu_seqlens is None:
        return row_boundaries(b, t, q.device), t
    _check_cu_seqlens_values(cu_seqlens, t)
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max().item()) if cu.numel() > 1 else 0


@kernel_op("forgetting_attention_fwd")
def forgetting_attention_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, c_by_head: torch.Tensor, cu_seqlens: torch.Tensor | None,
    scale: float, window_size: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [B, T, HQ, D], lse [HQ, B * T] float32); c_by_head [HQ, B * T] the cumulative log forget."""
    from .triton import _ForgettingAttention

    cu, max_len = _packing(q, cu_seqlens)
    ctx = KernelContext()
    tensors = (t.contiguous() for t in (q, k, v, c_by_head))
    o = _ForgettingAttention.forward(ctx, *tensors, scale, window_size, cu, max_len)
    return o, ctx.saved_tensors[5]


@forgetting_attention_fwd.register_fake
def _(q, k, v, c_by_head, cu_seqlens, scale, window_size):
    b, t, hq, _ = q.shape
    return torch.empty(q.shape, dtype=q.dtype, device=q.device), q.new_empty(hq, b * t, dtype=torch.float32)


@kernel_op("forgetting_attention_bwd")
def forgetting_attention_bwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, c_by_head: torch.Tensor, cu_seqlens: torch.Tensor | None,
    o: torch.Tensor, lse: torch.Tensor, do: torch.Tensor, scale: float, window_size: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from .triton import _ForgettingAttention

    b, t, hq, d = q.shape
    cu, max_len = _packing(q, cu_seqlens)
    flat = tuple(x.contiguous().view(b * t, x.shape[2], d) for x in (q, k, v, o))
    saved = (*flat[:3], c_by_head.contiguous(), flat[3], lse, cu)
    ctx = KernelContext(saved, meta=(b, t, scale, window_size, max_len))
    return _ForgettingAttention.backward(ctx, do)[:4]


@forgetting_attention_bwd.register_fake
def _(q, k, v, c_by_head, cu_seqlens, o, lse, do, scale, window_size):
    return fake_like(q, k, v, c_by_head)


def _setup(ctx, inputs, output):
    q, k, v, c_by_head, cu_seqlens, scale, window_size = inputs
    ctx.save_for_backward(q, k, v, c_by_head, cu_seqlens, *output)
    ctx.args = (scale, window_size)


def _backward(ctx, do, _dlse):
    grads = forgetting_attention_bwd(*ctx.saved_tensors, do, *ctx.args)
    return (*grads, None, None, None)


forgetting_attention_fwd.register_autograd(_backward, setup_context=_setup)
