"""Depthwise causal conv1d of Mamba layers (optionally + SiLU), with carried state; see reference.py.

    causal_conv1d(x, weight, bias, initial_state, activation)   prefill / training, differentiable
    causal_conv1d_step(x, conv_state, weight, bias, activation) one decode token, state updated in place

x is channels last ([batch, seq, channels], a slice of the in_proj output is fine); the state is
[batch, channels, K] (the last K inputs: transformers' ``LinearAttentionLayer`` conv-state layout).
The Triton path reads x once and writes the output once, forward and backward (weight/bias
gradients reduced per channel block without atomics).
"""
from __future__ import annotations

import torch

from .._backend import resolve_backend
from .._custom_ops import KernelContext, fake_like, kernel_op, optional, placeholder
from .reference import ACTIVATIONS, causal_conv1d_reference, causal_conv1d_step_reference

__all__ = ["causal_conv1d", "causal_conv1d_reference", "causal_conv1d_step", "causal_conv1d_step_reference"]

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TRITON_MAX_WIDTH = 8  # the kernels unroll the K taps


def _check(op: str, x, weight, bias, state, activation, state_name: str, x_rank: int) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != x_rank or not x.is_floating_point():
        layout = "[batch, seq, channels]" if x_rank == 3 else "[batch, channels]"
        raise ValueError(f"{op}: x must be a floating {layout} tensor; got {getattr(x, 'shape', type(x).__name__)}.")
    channels = x.shape[-1]
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[0] != channels:
        raise ValueError(
            f"{op}: weight must be [channels, K] = [{channels}, K] (nn.Conv1d's weight[:, 0, :]); "
            f"got {tuple(getattr(weight, 'shape', ()))}."
        )
    if bias is not None and tuple(bias.shape) != (channels,):
        raise ValueError(f"{op}: bias must be [channels] = [{channels}] or None; got {tuple(bias.shape)}.")
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op}: activation must be one of {ACTIVATIONS}; got {activation!r}.")
    width = weight.shape[1]
    if state is not None and tuple(state.shape) != (x.shape[0], channels, width):
        raise ValueError(
            f"{op}: {state_name} must be [batch, channels, K] = {(x.shape[0], channels, width)} (the last K inputs); "
            f"got {tuple(state.shape)}."
        )
    for name, t in (("weight", weight), ("bias", bias), (state_name, state)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{op}: {name} is on {t.device} but x is on {x.device}; put them on one device.")


def triton_problem(dtype: torch.dtype, width: int) -> str | None:
    """What the Triton kernels cannot take of these inputs, or None."""
    if dtype not in TRITON_DTYPES:
        return f"dtype {dtype} (supported: {TRITON_DTYPES})"
    if width > TRITON_MAX_WIDTH:
        return f"kernel width {width} > {TRITON_MAX_WIDTH}"
    return None


def _pick(op: str, backend: str, x: torch.Tensor, weight: torch.Tensor) -> str:
    impl = resolve_backend(backend, x.device, op)
    if impl != "triton":
        return impl
    problem = triton_problem(x.dtype, weight.shape[1])
    if problem is not None:
        # Never a silent slow path on the GPU: name the limit and the way out.
        raise ValueError(f"{op}: the Triton kernel does not support {problem}; pass backend='reference'.")
    return "triton"


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    activation: str | None = None,
    return_final_state: bool = False,
    *,
    backend: str = "auto",
):
    """Depthwise causal conv1d over x [batch, seq, channels] with weight [channels, K], bias
    [channels] or None, activation None or "silu". initial_state [batch, channels, K] (the inputs
    before x; zeros when None). Returns out [batch, seq, channels] in x's dtype, and with
    return_final_state also the state after x [batch, channels, K]. Differentiable in x, weight,
    bias and initial_state. backend: "auto" (Triton on CUDA), "triton", "reference"."""
    op = "causal_conv1d"
    _check(op, x, weight, bias, initial_state, activation, "initial_state", 3)
    if _pick(op, backend, x, weight) == "reference" or x.shape[1] == 0:
        return causal_conv1d_reference(x, weight, bias, initial_state, activation, return_final_state)
    out = causal_conv1d_fwd(x, weight, bias, initial_state, activation in ("silu", "swish"))
    if not return_final_state:
        return out
    width = weight.shape[1]
    history = x.new_zeros(x.shape[0], x.shape[2], width) if initial_state is None else initial_state.to(x.dtype)
    return out, torch.cat([history, x.transpose(1, 2)], dim=-1)[..., -width:]


def causal_conv1d_step(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    *,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """One decode token x [batch, channels]: shifts ``conv_state`` [batch, channels, K] in place
    (x becomes its newest column) and returns act(conv) [batch, channels] (into ``out`` when given:
    no allocation, fixed addresses, so it can be captured in a CUDA graph). Not differentiable."""
    op = "causal_conv1d_step"
    _check(op, x, weight, bias, conv_state, activation, "conv_state", 2)
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype):
        raise ValueError(f"{op}: out must be a {tuple(x.shape)} {x.dtype} tensor like x; got {tuple(out.shape)} {out.dtype}.")
    if _pick(op, backend, x, weight) == "reference":
        result = causal_conv1d_step_reference(x, conv_state, weight, bias, activation)
        return result if out is None else out.copy_(result)
    out = torch.empty_like(x) if out is None else out
    causal_conv1d_step_op(x, conv_state, weight, bias, activation, out)
    return out


# ---------------------------------------------------------------- custom ops (see .._custom_ops)


@kernel_op("causal_conv1d_fwd")
def causal_conv1d_fwd(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, initial_state: torch.Tensor | None, silu: bool
) -> torch.Tensor:
    from .triton import _CausalConv1d

    return _CausalConv1d.forward(KernelContext(), x, weight, bias, initial_state, silu)


@causal_conv1d_fwd.register_fake
def _(x, weight, bias, initial_state, silu):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@kernel_op("causal_conv1d_bwd")
def causal_conv1d_bwd(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, initial_state: torch.Tensor | None,
    dout: torch.Tensor, silu: bool, need_dstate: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dweight, dbias or a placeholder, d initial_state or a placeholder)."""
    from .triton import _rows_contiguous, causal_conv1d_backward

    dx, dweight, dbias, dstate = causal_conv1d_backward(
        _rows_contiguous(x), weight.contiguous(), bias, initial_state, dout, silu, need_dstate=need_dstate,
    )
    return dx, dweight, placeholder(x) if dbias is None else dbias, placeholder(x) if dstate is None else dstate


@causal_conv1d_bwd.register_fake
def _(x, weight, bias, initial_state, dout, silu, need_dstate):
    dx, dweight, dbias, dstate = fake_like(x, weight, bias, initial_state)
    return dx, dweight, dbias, dstate if need_dstate else placeholder(x)


def _conv_setup(ctx, inputs, output):
    x, weight, bias, initial_state, silu = inputs
    ctx.save_for_backward(x, weight, bias, initial_state)
    ctx.silu = silu


def _conv_backward(ctx, dout):
    x, weight, bias, initial_state = ctx.saved_tensors
    need_dstate = initial_state is not None and ctx.needs_input_grad[3]
    dx, dweight, dbias, dstate = causal_conv1d_bwd(x, weight, bias, initial_state, dout, ctx.silu, need_dstate)
    return dx, dweight, optional(dbias, bias is not None), optional(dstate, need_dstate), None


causal_conv1d_fwd.register_autograd(_conv_backward, setup_context=_conv_setup)



@kernel_op("causal_conv1d_step", mutates_args=("conv_state", "out"))
def causal_conv1d_step_op(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    activation: str | None, out: torch.Tensor,
) -> None:
    """One decode token of :func:`causal_conv1d_step`: conv_state and out written in place."""
    from .triton import causal_conv1d_step_triton

    y = causal_conv1d_step_triton(x, conv_state, weight, bias, activation, out)
    if y is not out:
        out.copy_(y)


@causal_conv1d_step_op.register_fake
def _(x, conv_state, weight, bias, activation, out):
    return None
