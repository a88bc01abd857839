"""The Mamba-2 mixer between its input and output projections: causal conv1d, the SSD scan and the
gated RMSNorm as one differentiable op (math: reference.py; the Triton path: triton.py).

    mamba2_mixer(zxbcdt, conv_weight, conv_bias, A, D, dt_bias, norm_weight, head_dim=..., ...)
        -> (normed, y)

zxbcdt [batch, seq, I + channels + heads] is in_proj's output ([z | xBC | dt_raw], Bamba's and
mamba_ssm's layout); normed [batch, seq, I] goes to out_proj; y [batch, seq, I] is the scan's
output before the norm (not differentiable: for a caller that rebuilds normed from y and z in the
backward instead of keeping it). The op starts from zero states and keeps none (training and
cache-less forwards); with a cache, call the ops one by one.
"""
from __future__ import annotations

import torch

from .._backend import resolve_backend
from .._custom_ops import fake_like, kernel_op, needs_grad, optional, placeholder
from ..causal_conv1d import triton_problem as conv_triton_problem
from ..ssd_scan import fake_kept_states
from ..ssd_scan import triton_problem as ssd_triton_problem
from .reference import mamba2_mixer_reference

__all__ = ["mamba2_mixer", "mamba2_mixer_reference"]

OP = "mamba2_mixer"


def _check(zxbcdt, conv_weight, conv_bias, A, D, dt_bias, norm_weight, keep, head_dim, state_size, norm_group_size):
    if not isinstance(zxbcdt, torch.Tensor) or zxbcdt.dim() != 3 or not zxbcdt.is_floating_point():
        raise ValueError(f"{OP}: zxbcdt must be a floating [batch, seq, width] tensor (in_proj's output); got {getattr(zxbcdt, 'shape', zxbcdt)}.")
    heads = A.shape[0] if isinstance(A, torch.Tensor) and A.dim() == 1 else None
    if heads is None:
        raise ValueError(f"{OP}: A must be [heads] (A = -exp(A_log)); got {getattr(A, 'shape', A)}.")
    inner = heads * head_dim
    channels = conv_weight.shape[0] if isinstance(conv_weight, torch.Tensor) and conv_weight.dim() == 2 else None
    if channels is None or (channels - inner) <= 0 or (channels - inner) % (2 * state_size):
        raise ValueError(
            f"{OP}: conv_weight must be [channels, K] with channels = heads * head_dim ({inner}) + 2 * groups * "
            f"state_size ({state_size}); got {getattr(conv_weight, 'shape', conv_weight)}."
        )
    width = inner + channels + heads
    if zxbcdt.shape[-1] != width:
        raise ValueError(
            f"{OP}: zxbcdt's last dim must be I + channels + heads = {inner} + {channels} + {heads} = {width}; "
            f"got {zxbcdt.shape[-1]} (check head_dim and state_size)."
        )
    for name, t, size in (("D", D, heads), ("dt_bias", dt_bias, heads), ("norm_weight", norm_weight, inner),
                          ("conv_bias", conv_bias, channels)):
        if t is None and name == "conv_bias":
            continue
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (size,):
            raise ValueError(f"{OP}: {name} must be [{size}]; got {getattr(t, 'shape', t)}.")
    if norm_group_size <= 0 or inner % norm_group_size:
        raise ValueError(f"{OP}: norm_group_size ({norm_group_size}) must divide I = {inner}.")
    if keep is not None and (not isinstance(keep, torch.Tensor) or tuple(keep.shape) != tuple(zxbcdt.shape[:2])):
        raise ValueError(f"{OP}: keep must be None or [batch, seq] = {tuple(zxbcdt.shape[:2])} (1 real, 0 padding); got {getattr(keep, 'shape', keep)}.")
    for name, t in (("conv_weight", conv_weight), ("conv_bias", conv_bias), ("A", A), ("D", D), ("dt_bias", dt_bias),
                    ("norm_weight", norm_weight), ("keep", keep)):
        if t is not None and t.device != zxbcdt.device:
            raise ValueError(f"{OP}: {name} is on {t.device} but zxbcdt is on {zxbcdt.device}; put them on one device.")


def _pick(backend: str, zxbcdt: torch.Tensor, conv_weight: torch.Tensor, head_dim: int, state_size: int) -> str:
    impl = resolve_backend(backend, zxbcdt.device, OP)
    if impl != "triton":
        return impl
    dtype = zxbcdt.dtype
    problem = conv_triton_problem(dtype, conv_weight.shape[1]) or ssd_triton_problem(dtype, dtype, head_dim, state_size)
    if problem is not None:
        raise ValueError(f"{OP}: the Triton kernels do not support {problem}; pass backend='reference'.")
    return "triton"


def mamba2_mixer(
    zxbcdt: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    A: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    *,
    head_dim: int,
    state_size: int,
    norm_group_size: int,
    eps: float,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    activation: str | None = "silu",
    keep: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, y) of the Mamba-2 mixer from in_proj's output (see the module docstring and
    reference.py). conv_weight [channels, K] (nn.Conv1d's weight[:, 0]); A, D, dt_bias [heads];
    norm_weight [I]; keep [batch, seq] (1 real token, 0 padding: padding leaves the conv output and
    so never enters the state) or None. Differentiable in zxbcdt and every parameter.
    backend: "auto" (Triton on CUDA), "triton", "reference"."""
    _check(zxbcdt, conv_weight, conv_bias, A, D, dt_bias, norm_weight, keep, head_dim, state_size, norm_group_size)
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"{OP}: activation must be None, 'silu' or 'swish'; got {activation!r}.")
    low, high = (float(v) for v in dt_limit)
    if not low <= high:
        raise ValueError(f"{OP}: dt_limit must be a (min, max) pair with min <= max; got {dt_limit!r}.")
    if _pick(backend, zxbcdt, conv_weight, head_dim, state_size) == "reference" or zxbcdt.shape[1] == 0:
        return mamba2_mixer_reference(
            zxbcdt, conv_weight, conv_bias, A, D, dt_bias, norm_weight, keep, head_dim, state_size, norm_group_size,
            eps, (low, high), activation,
        )
    keep = None if keep is None else keep.to(zxbcdt.dtype)
    normed, y, _, _ = mamba2_mixer_fwd(
        zxbcdt, conv_weight, conv_bias, A, D, dt_bias, norm_weight, keep, head_dim, state_size, norm_group_size,
        float(eps), low, high, activation is not None,
        _keeps_states(zxbcdt, conv_weight, conv_bias, A, D, dt_bias, norm_weight, head_dim, state_size),
    )
    return normed, y


def _keeps_states(zxbcdt, conv_weight, conv_bias, A, D, dt_bias, norm_weight, head_dim, state_size) -> bool:
    """Whether the forward keeps the scan's chunk states and the conv output for a backward (a
    gradient will be needed and the states fit ssd_scan.triton.states_fit)."""
    from ..ssd_scan.triton import states_fit

    if not needs_grad(zxbcdt, conv_weight, conv_bias, A, D, dt_bias, norm_weight):
        return False
    batch, seq, _ = zxbcdt.shape
    return states_fit(batch, seq, A.shape[0], head_dim, state_size, zxbcdt.element_size())


# ---------------------------------------------------------------- custom ops (see .._custom_ops)


@kernel_op("mamba2_mixer_fwd")
def mamba2_mixer_fwd(
    zxbcdt: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None, A: torch.Tensor,
    D: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor, keep: torch.Tensor | None, head_dim: int,
    state_size: int, norm_group_size: int, eps: float, dt_low: float, dt_high: float, silu: bool, keep_states: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(normed, y, the scan's chunk states and the conv output kept for the backward, or empty tensors)."""
    from .triton import mixer_forward

    return mixer_forward(zxbcdt, conv_weight, conv_bias, A, D, dt_bias, norm_weight, keep, head_dim, state_size,
                         norm_group_size, eps, (dt_low, dt_high), silu, keep_states)


@mamba2_mixer_fwd.register_fake
def _(zxbcdt, conv_weight, conv_bias, A, D, dt_bias, norm_weight, keep, head_dim, state_size, norm_group_size, eps,
      dt_low, dt_high, silu, keep_states):
    batch, seq, _ = zxbcdt.shape
    heads = A.shape[0]
    inner = heads * head_dim
    normed = torch.empty((batch, seq, inner), dtype=torch.result_type(norm_weight, zxbcdt), device=zxbcdt.device)
    y = zxbcdt.new_empty(batch, seq, inner)
    kept_conv = zxbcdt.new_empty(batch, seq, conv_weight.shape[0]) if keep_states else zxbcdt.new_empty(0)
    return normed, y, fake_kept_states(zxbcdt, keep_states, batch, seq, heads, head_dim, state_size), kept_conv


@kernel_op("mamba2_mixer_bwd")
def mamba2_mixer_bwd(
    zxbcdt: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None, A: torch.Tensor,
    D: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor, keep: torch.Tensor | None, y: torch.Tensor,
    kept: torch.Tensor, kept_conv: torch.Tensor, dnormed: torch.Tensor, head_dim: int, state_size: int,
    norm_group_size: int, eps: float, dt_low: float, dt_high: float, silu: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dzxbcdt, dconv_weight, dconv_bias or a placeholder, dA, dD, ddt_bias, dnorm_weight)."""
    from .triton import mixer_backward

    grads = mixer_backward(zxbcdt, conv_weight, conv_bias, A, D, dt_bias, norm_weight, keep, y, kept, kept_conv,
                           dnormed.contiguous(), head_dim, state_size, norm_group_size, eps, (dt_low, dt_high), silu)
    return tuple(placeholder(zxbcdt) if g is None else g for g in grads)


@mamba2_mixer_bwd.register_fake
def _(zxbcdt, conv_weight, conv_bias, A, D, dt_bias, norm_weight, keep, y, kept, kept_conv, dnormed, head_dim,
      state_size, norm_group_size, eps, dt_low, dt_high, silu):
    return fake_like(zxbcdt, conv_weight, conv_bias, A, D, dt_bias, norm_weight)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:8], *output[1:])
    ctx.arguments = inputs[8:15]  # head_dim, state_size, norm_group_size, eps, dt_low, dt_high, silu
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)


def _backward(ctx, dnormed, dy, dkept, dkept_conv):
    saved = ctx.saved_tensors
    if dnormed is None:  # normed took no part in the loss
        return (None,) * 16
    conv_bias = saved[2]
    grads = mamba2_mixer_bwd(*saved, dnormed, *ctx.arguments)
    dzxbcdt, dconv_weight, dconv_bias, dA, dD, ddt_bias, dnorm_weight = grads
    return (dzxbcdt, dconv_weight, optional(dconv_bias, conv_bias is not None), dA, dD, ddt_bias, dnorm_weight,
            *([None] * 9))


mamba2_mixer_fwd.register_autograd(_backward, setup_context=_setup)
