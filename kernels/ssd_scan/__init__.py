"""Mamba-2's selective state space scan (SSD): chunked scan for prefill / training, a recurrent step
for decoding, and the fused Mamba-2 decode step (conv shift + SSM update); see reference.py.

    ssd_scan(x, dt, A, B, C, D=..., dt_bias=..., dt_softplus=..., initial_state=...)   differentiable
    ssd_step(state, x, dt, A, B, C, ...)                      one token, state updated in place
    mamba2_decode_step(xBC, dt, conv_state, ssm_state, ...)   conv1d step + SSM step, in place

Shapes (Mamba-2 / Bamba names): x [batch, seq, heads, P]; dt [batch, seq, heads] (raw, before
dt_bias / softplus / clamp when those are asked for); A, D, dt_bias [heads]; B, C
[batch, seq, groups, N] (heads share a group's B/C: head h reads group h // (heads / groups));
states [batch, heads, P, N] float32.

Memory: the reference holds one chunk's [L, L] tile at a time (checkpointed per chunk in training);
the Triton path keeps O(T x heads x (P + N)) plus per-chunk states recomputed in the backward.
"""
from __future__ import annotations

import torch

from .._backend import resolve_backend
from .._common import last_dim_contiguous
from .._custom_ops import fake_like, kernel_op, needs_grad, optional, placeholder
from ..causal_conv1d import causal_conv1d_step
from .reference import DEFAULT_CHUNK_SIZE, discretize_dt, ssd_scan_reference, ssd_step_reference

__all__ = [
    "discretize_dt",
    "mamba2_decode_step",
    "ssd_scan",
    "ssd_scan_reference",
    "ssd_step",
    "ssd_step_reference",
]

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TRITON_MAX_DIM = 256  # head_dim and state size: one [chunk, dim] tile per operand


def _shape(t) -> object:
    return tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__


def check_ssd_inputs(op: str, x, dt, A, B, C, D, dt_bias, dt_limit, state, state_name: str, token_dims: int) -> None:
    """Shape/dtype/device checks shared by the scan (token_dims=2: [batch, seq]) and the step (1)."""
    lead = "[batch, seq" if token_dims == 2 else "[batch"
    if not isinstance(x, torch.Tensor) or x.dim() != token_dims + 2 or not x.is_floating_point():
        raise ValueError(f"{op}: x must be a floating {lead}, heads, head_dim] tensor; got {_shape(x)}.")
    tokens, (heads, head_dim) = tuple(x.shape[:token_dims]), tuple(x.shape[token_dims:])
    if not isinstance(dt, torch.Tensor) or tuple(dt.shape) != tokens + (heads,):
        raise ValueError(f"{op}: dt must be {lead}, heads] = {tokens + (heads,)}; got {_shape(dt)}.")
    for name, t in (("A", A), ("D", D), ("dt_bias", dt_bias)):
        if t is not None and (not isinstance(t, torch.Tensor) or tuple(t.shape) != (heads,)):
            raise ValueError(f"{op}: {name} must be [heads] = [{heads}]; got {_shape(t)}.")
    if A is None:
        raise ValueError(f"{op}: A is required ([heads], negative: A = -exp(A_log)).")
    for name, t in (("B", B), ("C", C)):
        if not isinstance(t, torch.Tensor) or t.dim() != token_dims + 2 or tuple(t.shape[:token_dims]) != tokens:
            raise ValueError(f"{op}: {name} must be {lead}, groups, state_size] with {lead}] = {tokens}; got {_shape(t)}.")
    if B.shape != C.shape:
        raise ValueError(f"{op}: B {tuple(B.shape)} and C {tuple(C.shape)} must have the same shape.")
    groups, state_size = B.shape[-2:]
    if heads % groups:
        raise ValueError(f"{op}: the number of groups ({groups}) in B/C must divide heads ({heads}).")
    if state is not None and tuple(state.shape) != (x.shape[0], heads, head_dim, state_size):
        raise ValueError(
            f"{op}: {state_name} must be [batch, heads, head_dim, state_size] = {(x.shape[0], heads, head_dim, state_size)}; "
            f"got {_shape(state)}."
        )
    if not (isinstance(dt_limit, (tuple, list)) and len(dt_limit) == 2 and dt_limit[0] <= dt_limit[1]):
        raise ValueError(f"{op}: dt_limit must be a (min, max) pair with min <= max; got {dt_limit!r}.")
    for name, t in (("dt", dt), ("A", A), ("B", B), ("C", C), ("D", D), ("dt_bias", dt_bias), (state_name, state)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{op}: {name} is on {t.device} but x is on {x.device}; put them on one device.")


def triton_problem(x_dtype: torch.dtype, B_dtype: torch.dtype, head_dim: int, state_size: int) -> str | None:
    """What the Triton kernels cannot take of these inputs, or None."""
    if x_dtype not in TRITON_DTYPES or B_dtype not in TRITON_DTYPES:
        return f"dtypes x {x_dtype} / B {B_dtype} (supported: {TRITON_DTYPES})"
    if max(head_dim, state_size) > TRITON_MAX_DIM:
        return f"head_dim {head_dim} / state size {state_size} above {TRITON_MAX_DIM}"
    return None


def _pick(op: str, backend: str, x: torch.Tensor, B: torch.Tensor) -> str:
    impl = resolve_backend(backend, x.device, op)
    if impl != "triton":
        return impl
    problem = triton_problem(x.dtype, B.dtype, x.shape[-1], B.shape[-1])
    if problem is not None:
        raise ValueError(f"{op}: the Triton kernels do not support {problem}; pass backend='reference'.")
    return "triton"


def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    initial_state: torch.Tensor | None = None,
    return_final_state: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    backend: str = "auto",
):
    """Mamba-2 SSD over a sequence: y [batch, seq, heads, P] in x's dtype (+ the final state
    [batch, heads, P, N] float32 with return_final_state). dt is discretised as
    clamp(softplus(dt + dt_bias), *dt_limit) (softplus only with dt_softplus=True). initial_state:
    the state before x (zeros when None). chunk_size: the reference's chunk (the result does not
    depend on it beyond round-off; the Triton kernels pick their own). Differentiable in every
    tensor input. backend: "auto" (Triton on CUDA, the chunked reference elsewhere), "triton",
    "reference"."""
    op = "ssd_scan"
    check_ssd_inputs(op, x, dt, A, B, C, D, dt_bias, dt_limit, initial_state, "initial_state", 2)
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"{op}: chunk_size must be a positive int; got {chunk_size!r}.")
    dt = discretize_dt(dt, dt_bias, dt_softplus, tuple(dt_limit))
    if _pick(op, backend, x, B) == "reference" or x.shape[1] == 0:
        return ssd_scan_reference(x, dt, A, B, C, D, initial_state, chunk_size, return_final_state)
    keep = _keeps_states(x, dt, A, B, C, D, initial_state)
    y, final_state, _ = ssd_scan_fwd(x, dt, A, B, C, D, initial_state, keep)
    return (y, final_state) if return_final_state else y


def _keeps_states(x, dt, A, B, C, D, initial_state) -> bool:
    """Whether the forward keeps its chunk states: a backward will follow and they fit (triton.keeps_states)."""
    from .triton import keeps_states

    return needs_grad(x, dt, A, B, C, D, initial_state) and keeps_states(x, B)


def ssd_step(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """One recurrent token: state [batch, heads, P, N] (float32) updated in place; x [batch, heads, P];
    dt [batch, heads]; B, C [batch, groups, N]. Returns y [batch, heads, P] (into ``out`` when given).
    Not differentiable."""
    op = "ssd_step"
    check_ssd_inputs(op, x, dt, A, B, C, D, dt_bias, dt_limit, state, "state", 1)
    if state.dtype != torch.float32:
        raise ValueError(f"{op}: state must be float32 (it accumulates over the whole sequence); got {state.dtype}.")
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype):
        raise ValueError(f"{op}: out must be a {tuple(x.shape)} {x.dtype} tensor like x; got {_shape(out)} {out.dtype}.")
    if _pick(op, backend, x, B) == "reference":
        y = ssd_step_reference(state, x, discretize_dt(dt, dt_bias, dt_softplus, tuple(dt_limit)), A, B, C, D)
        return y if out is None else out.copy_(y)
    out = torch.empty_like(x) if out is None else out
    low, high = dt_limit
    ssd_step_op(state, x, dt, A, B, C, D, dt_bias, dt_softplus, float(low), float(high), out)
    return out


def mamba2_decode_step(
    xBC: torch.Tensor,
    dt: torch.Tensor,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    A: torch.Tensor,
    *,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    head_dim: int,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    activation: str | None = "silu",
    backend: str = "auto",
) -> torch.Tensor:
    """The Mamba-2 mixer's decode step for one token: conv state shift + conv1d + activation, then the
    SSM state update and its output. Both states are updated in place and nothing reads host values,
    so a CUDA graph can capture it (transformers' cache keeps static state addresses).

    xBC [batch, heads * head_dim + 2 * groups * N] (in_proj's x, B, C part, before the conv);
    dt [batch, heads] raw; conv_state [batch, channels, K]; ssm_state [batch, heads, head_dim, N]
    float32. Returns y [batch, heads, head_dim] (D skip included, before the gated norm)."""
    batch, channels = xBC.shape
    heads = dt.shape[-1]
    state_size = ssm_state.shape[-1]
    inner = heads * head_dim
    groups2 = channels - inner
    if groups2 <= 0 or groups2 % (2 * state_size):
        raise ValueError(
            f"mamba2_decode_step: xBC has {channels} channels; expected heads * head_dim ({inner}) + 2 * groups * "
            f"state_size ({state_size}) - check head_dim and the ssm_state shape."
        )
    groups = groups2 // (2 * state_size)
    conv_out = causal_conv1d_step(xBC, conv_state, conv_weight, conv_bias, activation, backend=backend)
    x, B, C = conv_out.split([inner, groups * state_size, groups * state_size], dim=-1)
    return ssd_step(
        ssm_state,
        x.reshape(batch, heads, head_dim),
        dt,
        A,
        B.reshape(batch, groups, state_size),
        C.reshape(batch, groups, state_size),
        D=D,
        dt_bias=dt_bias,
        dt_softplus=dt_softplus,
        dt_limit=dt_limit,
        backend=backend,
    )


# ---------------------------------------------------------------- custom ops (see .._custom_ops)


@kernel_op("ssd_scan_fwd")
def ssd_scan_fwd(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None,
    initial_state: torch.Tensor | None, keep_states: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, final state, the chunk states kept for the backward or an empty tensor) of the Triton
    SSD scan; dt already discretised."""
    from .triton import ssd_scan_forward

    return ssd_scan_forward(x, dt, A, B, C, D, initial_state, keep_states)


def fake_kept_states(like: torch.Tensor, keep_states: bool, batch: int, seq: int, heads: int, head_dim: int,
                     state_size: int) -> torch.Tensor:
    """The fake of the chunk states a forward keeps (in ``like``'s dtype), or of its empty tensor."""
    if not keep_states:
        return like.new_empty(0)
    from .triton import _sizes

    return like.new_empty(batch, -(-seq // _sizes()[0]) + 1, heads, head_dim, state_size)


@ssd_scan_fwd.register_fake
def _(x, dt, A, B, C, D, initial_state, keep_states):
    batch, seq, heads, head_dim = x.shape
    final = torch.empty(batch, heads, head_dim, B.shape[-1], dtype=torch.float32, device=x.device)
    kept = fake_kept_states(x, keep_states, batch, seq, heads, head_dim, B.shape[-1])
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), final, kept


@kernel_op("ssd_scan_bwd")
def ssd_scan_bwd(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None,
    initial_state: torch.Tensor | None, kept: torch.Tensor, dy: torch.Tensor, dfinal: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, ddt float32, dA, dB, dC, dD or a placeholder, d initial_state or a placeholder); ``kept``:
    the forward's chunk states, or an empty tensor (recomputed here)."""
    from .triton import ssd_scan_backward

    x, B, C = (last_dim_contiguous(t) for t in (x, B, C))
    dx, ddt, dA, dB, dC, dD, dinit = ssd_scan_backward(x, dt.float().contiguous(), A, B, C, D, initial_state, kept, dy, dfinal)
    return dx, ddt, dA, dB, dC, placeholder(x) if dD is None else dD, placeholder(x) if dinit is None else dinit


@ssd_scan_bwd.register_fake
def _(x, dt, A, B, C, D, initial_state, kept, dy, dfinal):
    dx, ddt, dA, dB, dC, dD, dinit = fake_like(x, dt, A, B, C, D, initial_state)
    return dx, ddt.float(), dA, dB, dC, dD, dinit


def _ssd_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:7], output[2])
    ctx.mark_non_differentiable(output[2])
    ctx.set_materialize_grads(False)  # no zero-filled gradients for the kept states and an unused final state


def _ssd_backward(ctx, dy, dfinal, dkept):
    x, dt, A, B, C, D, initial_state, kept = ctx.saved_tensors
    if dy is None:  # only the final state took part in the loss
        dy = torch.zeros_like(x)
    dx, ddt, dA, dB, dC, dD, dinit = ssd_scan_bwd(x, dt, A, B, C, D, initial_state, kept, dy, dfinal)
    return (dx, ddt.to(dt.dtype), dA, dB, dC, optional(dD, D is not None), optional(dinit, initial_state is not None),
            None)


ssd_scan_fwd.register_autograd(_ssd_backward, setup_context=_ssd_setup)



@kernel_op("ssd_step", mutates_args=("state", "out"))
def ssd_step_op(
    state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    D: torch.Tensor | None, dt_bias: torch.Tensor | None, dt_softplus: bool, dt_low: float, dt_high: float,
    out: torch.Tensor,
) -> None:
    """One recurrent token of :func:`ssd_step`: state and out written in place (no gradient)."""
    from .triton import ssd_step_triton

    y = ssd_step_triton(state, x, dt, A, B, C, D, dt_bias, dt_softplus, (dt_low, dt_high), out)
    if y is not out:
        out.copy_(y)


@ssd_step_op.register_fake
def _(state, x, dt, A, B, C, D, dt_bias, dt_softplus, dt_low, dt_high, out):
    return None
