"""Fused per-head norms of RATTENTION's local layer (and any QK-norm + RoPE attention).

    rms_norm_rotary(x)        = RoPE(RMSNorm_h(x))          QK-norm then rotate-half RoPE
    rotary(x)                 = RoPE(x)                     the same kernel without the norm
    branch_norm_sum(a, b)     = RMSNorm_a,h(a) + RMSNorm_b,h(b)   the SWA + RLA output norms

x, a, b: [batch, seq, heads, head_dim]; weights [heads, head_dim]; float32 math. The Triton path
reads each row once and writes it once (forward and backward), instead of the ~10 elementwise
PyTorch kernels and float32 temporaries per norm. See reference.py for the math and the one
rounding difference, triton.py for the kernels.
"""
from __future__ import annotations

import torch

from .._backend import resolve_backend
from .._common import last_dim_contiguous
from .._custom_ops import KernelContext, fake_like, kernel_op, optional, placeholder
from .reference import (
    branch_norm_sum_reference,
    rms_norm_reference,
    rms_norm_rotary_reference,
    rotary_reference,
    split_eps,
)

__all__ = [
    "branch_norm_sum",
    "branch_norm_sum_reference",
    "rms_norm_reference",
    "rms_norm_rotary",
    "rms_norm_rotary_reference",
    "rotary",
    "rotary_reference",
]

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TRITON_MAX_HEAD_DIM = 1024  # = triton.MAX_HEAD_DIM (kept here so the check needs no Triton import)


# ---------------------------------------------------------------- input checks


def _check_rows(op: str, name: str, x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or not x.is_floating_point():
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{op}: {name} must be a floating [batch, seq, heads, head_dim] tensor; got {shape}.")


def _check_weight(op: str, name: str, weight, x: torch.Tensor, x_name: str) -> None:
    if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != tuple(x.shape[2:]):
        shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else weight
        raise ValueError(
            f"{op}: {name} must be [heads, head_dim] = {tuple(x.shape[2:])}, matching the last two dims of "
            f"{x_name} {tuple(x.shape)}; got {shape}."
        )


def _check_eps(op: str, eps, pair_ok: bool) -> None:
    pair = isinstance(eps, (tuple, list))
    values = tuple(eps) if pair else (eps,)
    bad_value = any(isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 for v in values)
    if bad_value or (pair and (not pair_ok or len(values) != 2)):
        wanted = "a float >= 0 or an (eps_a, eps_b) pair" if pair_ok else "a float >= 0"
        raise ValueError(f"{op}: eps must be {wanted}; got {eps!r}.")


def _check_devices(op: str, reference: torch.Tensor, **tensors) -> None:
    others = {name: t.device for name, t in tensors.items() if t is not None and t.device != reference.device}
    if others:
        raise ValueError(f"{op}: every tensor must be on {reference.device}; got {others}.")


def _check_cos_sin(op: str, cos_sin, x: torch.Tensor) -> None:
    if cos_sin is None:
        return
    if not (isinstance(cos_sin, (tuple, list)) and len(cos_sin) == 2 and all(isinstance(t, torch.Tensor) for t in cos_sin)):
        raise ValueError(f"{op}: cos_sin must be None or a (cos, sin) pair of tensors; got {type(cos_sin).__name__}.")
    batch, seq, _, dim = x.shape
    if dim % 2:
        raise ValueError(f"{op}: head_dim must be even for RoPE (rotate-half splits it in two); got {dim}.")
    target = (batch, seq, 1, dim)
    for name, t in zip(("cos", "sin"), cos_sin):
        # broadcast_shapes(t.shape, target) == target, without torch's Python reference of it (host
        # time on every training call)
        fits = t.dim() <= len(target) and all(s in (1, want) for s, want in zip(reversed(t.shape), reversed(target)))
        if not fits:
            raise ValueError(
                f"{op}: cos_sin's {name} must broadcast to [batch, seq, 1, head_dim] = {target} "
                f"(as RotaryEmbedding returns, [batch or 1, seq, 1, head_dim]); got {tuple(t.shape)}."
            )


def _triton_problem(x: torch.Tensor, cos_sin) -> str | None:
    """Why the Triton kernel cannot take these inputs (None: it can)."""
    if x.dtype not in TRITON_DTYPES:
        return f"dtype {x.dtype} (supported: {TRITON_DTYPES})"
    if x.shape[-1] > TRITON_MAX_HEAD_DIM:
        return f"head_dim {x.shape[-1]} > {TRITON_MAX_HEAD_DIM}"
    if cos_sin is not None and any(t.requires_grad for t in cos_sin):
        return "cos/sin that require grad (the kernel gives them no gradient; detach them)"
    return None


def _pick_impl(op: str, backend: str, x: torch.Tensor, cos_sin=None) -> str:
    """"triton" or "reference"; "auto" falls back to the reference where the kernel does not apply."""
    impl = resolve_backend(backend, x.device, op)
    if impl != "triton":
        return impl
    problem = _triton_problem(x, cos_sin)
    if problem is not None and backend == "triton":
        raise ValueError(f"{op}: backend='triton' does not support {problem}; pass backend='reference'.")
    if problem is not None or x.numel() == 0:
        return "reference"
    return "triton"


# ---------------------------------------------------------------- public ops


def rms_norm_rotary(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Per-head RMSNorm over head_dim, then rotate-half RoPE: RoPE(w_h * x / rms(x)).

    x [B, T, H, D] (a strided view is fine while its last dim is contiguous); weight [H, D];
    cos_sin: (cos, sin) broadcastable to [B, T, 1, D] (RotaryEmbedding's float32 tables; D even),
    or None for the norm alone. Returns [B, T, H, D] in x's dtype, differentiable in x and weight.
    backend: "auto" (Triton on CUDA, the reference elsewhere), "triton", "reference". The Triton
    kernel rounds once at the output; the reference (= the layers today) also rounds between the
    norm and the RoPE.
    """
    op = "rms_norm_rotary"
    _check_rows(op, "x", x)
    _check_weight(op, "weight", weight, x, "x")
    _check_eps(op, eps, pair_ok=False)
    _check_cos_sin(op, cos_sin, x)
    cos, sin = cos_sin if cos_sin is not None else (None, None)
    _check_devices(op, x, weight=weight, cos=cos, sin=sin)
    if _pick_impl(op, backend, x, cos_sin) == "reference":
        return rms_norm_rotary_reference(x, weight, eps, cos_sin)
    if cos_sin is None:  # the norm alone: the one-branch norm kernel
        return branch_norm_sum_fwd(x, weight, None, None, float(eps), float(eps))
    return rms_norm_rotary_fwd(x, weight, cos, sin, float(eps))


def rotary(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor] | None, *, backend: str = "auto") -> torch.Tensor:
    """Rotate-half RoPE of x [B, T, H, D] with (cos, sin) broadcastable to [B, T, 1, D] (None:
    x itself). Float32 math, one rounding (= rotary_reference); differentiable in x. On CUDA one
    Triton pass instead of PyTorch's chain of float32 element-wise kernels."""
    op = "rotary"
    _check_rows(op, "x", x)
    _check_cos_sin(op, cos_sin, x)
    if cos_sin is None:
        return x
    _check_devices(op, x, cos=cos_sin[0], sin=cos_sin[1])
    if _pick_impl(op, backend, x, cos_sin) == "reference":
        return rotary_reference(x, cos_sin)
    return rms_norm_rotary_fwd(x, None, cos_sin[0], cos_sin[1], 0.0)


def branch_norm_sum(
    a: torch.Tensor | None,
    weight_a: torch.Tensor | None,
    b: torch.Tensor | None,
    weight_b: torch.Tensor | None,
    eps: float | tuple[float, float],
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """RMSNorm_a(a) + RMSNorm_b(b), each a per-head RMSNorm over head_dim with its own weight.

    a, b [B, T, H, D] of one shape and dtype (strided views are fine); weight_a, weight_b [H, D].
    Either branch may be None (pass its weight as None too): the result is then the other norm
    alone. eps: one float, or (eps_a, eps_b). Returns [B, T, H, D] in the inputs' dtype,
    differentiable in a, b and both weights. backend as for :func:`rms_norm_rotary`.
    """
    op = "branch_norm_sum"
    if a is None and b is None:
        raise ValueError(f"{op}: a and b cannot both be None; pass at least one branch.")
    for name, x, w_name, w in (("a", a, "weight_a", weight_a), ("b", b, "weight_b", weight_b)):
        if x is None:
            if w is not None:
                raise ValueError(f"{op}: {w_name} is given but {name} is None; pass both or neither.")
            continue
        _check_rows(op, name, x)
        _check_weight(op, w_name, w, x, name)
    if a is not None and b is not None and (a.shape != b.shape or a.dtype != b.dtype):
        raise ValueError(
            f"{op}: a and b must share shape and dtype; got {tuple(a.shape)} {a.dtype} and {tuple(b.shape)} {b.dtype}."
        )
    _check_eps(op, eps, pair_ok=True)
    present = a if a is not None else b
    _check_devices(op, present, a=a, weight_a=weight_a, b=b, weight_b=weight_b)
    if _pick_impl(op, backend, present) == "reference":
        return branch_norm_sum_reference(a, weight_a, b, weight_b, eps)
    eps_a, eps_b = split_eps(eps)
    if a is None:  # one branch: the kernel's first slot
        a, weight_a, eps_a, b, weight_b = b, weight_b, eps_b, None, None
    return branch_norm_sum_fwd(a, weight_a, b, weight_b, eps_a, eps_b)


# ---------------------------------------------------------------- custom ops (see .._custom_ops)


def _rope_inputs(x, weight, cos, sin):
    """What _RmsNormRotary's kernels read (and its forward saves): rows with a contiguous last dim,
    the weight (x itself as the never-read placeholder without a norm), cos/sin per token."""
    from .triton import _expand_rotary

    batch, seq, _, dim = x.shape
    x = last_dim_contiguous(x)
    weight = weight.contiguous() if weight is not None else x
    return x, weight, _expand_rotary(cos, batch, seq, dim), _expand_rotary(sin, batch, seq, dim)


@kernel_op("rms_norm_rotary_fwd")
def rms_norm_rotary_fwd(
    x: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, eps: float
) -> torch.Tensor:
    """RoPE(RMSNorm(x)) with weight, RoPE(x) with weight None."""
    from .triton import _RmsNormRotary

    return _RmsNormRotary.forward(KernelContext(), x, weight, cos, sin, eps, {})


@rms_norm_rotary_fwd.register_fake
def _(x, weight, cos, sin, eps):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@kernel_op("rms_norm_rotary_bwd")
def rms_norm_rotary_bwd(
    x: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, dy: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    from .triton import _RmsNormRotary

    ctx = KernelContext(_rope_inputs(x, weight, cos, sin), eps=eps, tune={}, has_norm=weight is not None)
    dx, dweight = _RmsNormRotary.backward(ctx, dy)[:2]
    return dx, placeholder(x) if dweight is None else dweight


@rms_norm_rotary_bwd.register_fake
def _(x, weight, cos, sin, dy, eps):
    return fake_like(x, weight)


def _rope_setup(ctx, inputs, output):
    x, weight, cos, sin, eps = inputs
    ctx.save_for_backward(x, weight, cos, sin)
    ctx.eps = eps


def _rope_backward(ctx, dy):
    x, weight, cos, sin = ctx.saved_tensors
    dx, dweight = rms_norm_rotary_bwd(x, weight, cos, sin, dy, ctx.eps)
    return dx, optional(dweight, weight is not None), None, None, None


rms_norm_rotary_fwd.register_autograd(_rope_backward, setup_context=_rope_setup)


def _branch_inputs(a, weight_a, b, weight_b):

    a, weight_a = last_dim_contiguous(a), weight_a.contiguous()
    if b is not None:
        b, weight_b = last_dim_contiguous(b), weight_b.contiguous()
    return a, weight_a, b, weight_b


@kernel_op("branch_norm_sum_fwd")
def branch_norm_sum_fwd(
    a: torch.Tensor, weight_a: torch.Tensor, b: torch.Tensor | None, weight_b: torch.Tensor | None,
    eps_a: float, eps_b: float,
) -> torch.Tensor:
    """RMSNorm_a(a) + RMSNorm_b(b); b (with weight_b) may be None: the norm of a alone."""
    from .triton import _BranchNormSum

    return _BranchNormSum.forward(KernelContext(), a, weight_a, b, weight_b, eps_a, eps_b, {})


@branch_norm_sum_fwd.register_fake
def _(a, weight_a, b, weight_b, eps_a, eps_b):
    return torch.empty(a.shape, dtype=a.dtype, device=a.device)


@kernel_op("branch_norm_sum_bwd")
def branch_norm_sum_bwd(
    a: torch.Tensor, weight_a: torch.Tensor, b: torch.Tensor | None, weight_b: torch.Tensor | None,
    dy: torch.Tensor, eps_a: float, eps_b: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from .triton import _BranchNormSum

    ctx = KernelContext(_branch_inputs(a, weight_a, b, weight_b), eps=(eps_a, eps_b), tune={})
    da, dwa, db, dwb = _BranchNormSum.backward(ctx, dy)[:4]
    if db is None:
        db, dwb = placeholder(a), placeholder(a)
    return da, dwa, db, dwb


@branch_norm_sum_bwd.register_fake
def _(a, weight_a, b, weight_b, dy, eps_a, eps_b):
    return fake_like(a, weight_a, b, weight_b)


def _branch_setup(ctx, inputs, output):
    a, weight_a, b, weight_b, eps_a, eps_b = inputs
    ctx.save_for_backward(a, weight_a, b, weight_b)
    ctx.eps = (eps_a, eps_b)


def _branch_backward(ctx, dy):
    a, weight_a, b, weight_b = ctx.saved_tensors
    da, dwa, db, dwb = branch_norm_sum_bwd(a, weight_a, b, weight_b, dy, *ctx.eps)
    has_b = b is not None
    return da, dwa, optional(db, has_b), optional(dwb, has_b), None, None


branch_norm_sum_fwd.register_autograd(_branch_backward, setup_context=_branch_setup)
