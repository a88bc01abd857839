"""Attention forward that also returns the log-sum-exp, and the matching backward, on PyTorch's
own fused kernels.

Why private ops: SE-Attn's output (one softmax over retrieved blocks and the own chunk) and RAT's
(chunk ends and the token's own key, kernels/chunk_attention/sdpa_ends.py) are one softmax over
two key sets. We run a set as its own fused attention, merge the partial outputs by their
log-sum-exps, and in the backward call each kernel's backward with the *merged* output and
log-sum-exp. An attention backward only needs P = exp(s - lse) and rowsum(dO * O), so with the
merged statistics each call returns exactly that key set's share of the gradient (the
ring-attention identity). The public ``scaled_dot_product_attention`` returns no log-sum-exp,
hence ``torch.ops.aten``.

Grouped queries (more query heads than key heads, query head i reading key head i // groups) run
natively on cuDNN; the other kernels get keys repeated per query head and sum their gradients.

Kernels, by device and dtype:
* CUDA fp16/bf16: cuDNN attention (what SDPA itself picks on Hopper, ~2x FlashAttention-2 there),
  after a one-time self-check against FlashAttention-2 per (device, dtype, head_dim); if cuDNN is
  missing, raises, or disagrees, FlashAttention-2 is used instead.
* CPU: the flash CPU kernel (any float dtype, float64 included).
* other CUDA dtypes (float32): a plain-PyTorch version of the same two functions ("math"),
  exact but materialising each call's [len_q, len_k] scores: for tests, not for speed.

All tensors here are [n, heads, len, head_dim] (any strides with a unit last stride); lse is
[n, heads, len] float32 (float64 for float64 inputs).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..options import get as option

aten = torch.ops.aten


@dataclass
class Saved:
    kind: str
    extras: tuple = ()


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64 (tight tests); everything else accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _groups(q, k) -> int:
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"attention_with_lse: query heads ({q.shape[1]}) must be a multiple of key heads ({k.shape[1]}).")
    return q.shape[1] // k.shape[1]


def _forward(kind: str, q, k, v, causal: bool, scale: float):
    n, heads, length = q.shape[:3]
    groups = _groups(q, k)
    if groups > 1 and kind != "cudnn":
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    if kind == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse.to(accumulate_dtype(q.dtype)), Saved(kind)
    if kind == "flash":
        res = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset = res[:8]
        return out, lse, Saved(kind, (cum_q, cum_k, max_q, max_k, seed, offset))
    if kind == "cudnn":
        res = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset = res[:8]
        # cuDNN may keep a trailing unit dimension on its statistics; remember the shape for backward.
        return out, lse.reshape(n, heads, length).float(), Saved(kind, (tuple(lse.shape), cum_q, cum_k, max_q, max_k, seed, offset))
    scores = _math_scores(q, k, causal, scale)
    lse = scores.logsumexp(dim=-1)
    out = torch.einsum("nhts,nhsd->nhtd", torch.exp(scores - lse[..., None]), v.to(scores.dtype))
    return out.to(q.dtype), lse, Saved(kind)


def _backward(saved: Saved, grad_out, q, k, v, out, lse, causal: bool, scale: float):
    groups = _groups(q, k)
    if groups > 1 and saved.kind != "cudnn":
        wide = (k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1))
        dq, dk, dv = _backward(saved, grad_out, q, *wide, out, lse, causal, scale)
        return dq, *(g.unflatten(1, (k.shape[1], groups)).sum(2) for g in (dk, dv))
    kind = saved.kind
    if kind == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse.to(accumulate_dtype(q.dtype)).contiguous(), 0.0, causal, scale=scale
        )
    if kind == "flash":
        cum_q, cum_k, max_q, max_k, seed, offset = saved.extras
        return aten._scaled_dot_product_flash_attention_backward(
            grad_out, q, k, v, out, lse.contiguous(), cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale
        )
    if kind == "cudnn":
        lse_shape, cum_q, cum_k, max_q, max_k, seed, offset = saved.extras
        return aten._scaled_dot_product_cudnn_attention_backward(
            grad_out, q, k, v, out, lse.reshape(lse_shape).contiguous(), seed, offset, None, cum_q, cum_k, max_q, max_k,
            0.0, causal, scale=scale,
        )[:3]
    probs = torch.exp(_math_scores(q, k, causal, scale) - lse[..., None])
    acc = probs.dtype
    grad_acc = grad_out.to(acc)
    dv = torch.einsum("nhts,nhtd->nhsd", probs, grad_acc)
    row = (grad_acc * out.to(acc)).sum(-1, keepdim=True)  # rowsum(dO * O)
    dscores = probs * (torch.einsum("nhtd,nhsd->nhts", grad_acc, v.to(acc)) - row) * scale
    dq = torch.einsum("nhts,nhsd->nhtd", dscores, k.to(acc))
    dk = torch.einsum("nhts,nhtd->nhsd", dscores, q.to(acc))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _math_scores(q, k, causal, scale):
    acc = accumulate_dtype(q.dtype)
    scores = torch.einsum("nhtd,nhsd->nhts", q.to(acc), k.to(acc)) * scale
    if causal:
        keep = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    return scores


@functools.lru_cache(maxsize=None)
def _cudnn_agrees(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Run cuDNN and FlashAttention-2 on small random problems laid out like ours (runs of a
    [batch, seq, heads, dim] tensor) and keep cuDNN only if outputs, lse and gradients agree."""
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        base = torch.randn(2, 256, 2, head_dim, device=device, dtype=dtype, generator=gen)
        runs = base.view(2, 2, 128, 2, head_dim).transpose(2, 3).reshape(4, 2, 128, head_dim)
        keys = torch.randn(4, 2, 256, head_dim, device=device, dtype=dtype, generator=gen)
        scale = head_dim**-0.5
        grouped = torch.randn(2, 8, 200, head_dim, device=device, dtype=dtype, generator=gen)
        for q, k, causal in ((runs, runs, True), (runs, keys, False), (grouped, grouped[:, ::4], True)):
            grad = torch.randn_like(q)
            results = {}
            for kind in ("flash", "cudnn"):
                out, lse, _ = _forward(kind, q, k, k, causal, scale)
                # the backward from shapes alone, as callers that keep no Saved run it
                grads = _backward(rebuilt_saved(kind, q, k), grad, q, k, k, out, lse, causal, scale)
                results[kind] = (out, lse, *grads)
            for a, b in zip(results["flash"], results["cudnn"]):
                if a.shape != b.shape or not torch.allclose(a.float(), b.float(), atol=3e-2, rtol=3e-2):
                    return False
        return True
    except Exception:  # missing cuDNN frontend, unsupported shape or build: fall back to flash
        return False


@torch.compiler.assume_constant_result  # torch.compile: run the self-check once, keep its answer as a constant
def _use_cudnn(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    return _cudnn_agrees(device, dtype, head_dim)


def _kind(q: torch.Tensor) -> str:
    if q.device.type != "cuda":
        return "cpu"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return "math"
    return "cudnn" if _use_cudnn(q.device, q.dtype, int(q.shape[-1])) else "flash"


def path_switch(variable: str) -> str:
    """An op's switch between its Triton kernels and its path on these kernels (hf_hybrid/options.py):
    "" (the automatic choice), "triton" or "sdpa"; any other value raises."""
    value = option(variable)
    return "" if value == "auto" else value


def rebuilt_saved(kind: str, q: torch.Tensor, k: torch.Tensor) -> Saved:
    """What :func:`attention_with_lse` returned as ``saved``, rebuilt from the shapes: these calls
    use no dropout, so the random-number state they hand over is never read (for custom ops,
    whose outputs must be tensors)."""
    n, heads, len_q, len_k = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    if kind not in ("flash", "cudnn"):
        return Saved(kind)
    seed, offset = (torch.zeros((), dtype=torch.int64, device=q.device) for _ in range(2))
    if kind == "flash":
        return Saved(kind, (None, None, len_q, len_k, seed, offset))
    return Saved(kind, ((n, heads, len_q, 1), None, None, len_q, len_k, seed, offset))


def kernel_kind(q: torch.Tensor, k: torch.Tensor | None = None) -> str:
    """Which kernel :func:`attention_with_lse` runs for q against k (cuDNN after its self-check on
    CUDA). cuDNN refuses one query against one key (s_q = s_kv = 1): the plain-PyTorch version,
    exact, takes those."""
    kind = _kind(q)
    if kind == "cudnn" and q.shape[2] == 1 and (k is None or k.shape[2] == 1):
        return "math"
    return kind


def attention_with_kind(kind: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
    """:func:`attention_with_lse` on a named kernel (``kernel_kind`` picks it otherwise)."""
    return _forward(kind, q, k, v, causal, scale)


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
    """(out, lse, saved) for softmax(q k^T scale [+ causal mask]) v; causal needs len_q == len_k."""
    return _forward(kernel_kind(q, k), q, k, v, causal, scale)


def attention_with_lse_backward(grad_out, q, k, v, out, lse, saved: Saved, causal: bool, scale: float):
    """(dq, dk, dv) of the key set (k, v), given the output and lse of the softmax it belongs to."""
    return _backward(saved, grad_out, q, k, v, out, lse, causal, scale)
