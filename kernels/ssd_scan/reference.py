"""Mamba-2's selective state space scan (SSD) in readable PyTorch: the oracle of the Triton kernels
and the CPU path.

Per head h (x_t: P channels, state S: [P, N], heads share B_t, C_t within a group):

    dt_t = clamp(softplus(dt_raw_t + dt_bias_h), *dt_limit)         (see :func:`discretize_dt`)
    a_t  = dt_t * A_h                                                (A_h = -exp(A_log_h) < 0)
    S_t  = exp(a_t) S_{t-1} + dt_t x_t B_t^T
    y_t  = S_t C_t + D_h x_t

Chunked form (what both the reference and the kernels compute). Inside a chunk of L tokens with
entry state S_0 and g_l = a_1 + ... + a_l (cumulative log decay from the chunk start):

    y_l   = exp(g_l) S_0 C_l  +  sum_{s <= l} exp(g_l - g_s) (C_l . B_s) dt_s x_s  +  D x_l
    S_out = exp(g_L) S_0      +  sum_s exp(g_L - g_s) dt_s x_s B_s^T

The reference walks the chunks in order carrying S, so it holds one chunk's [L, L] tile at a time
(transformers' Bamba ``torch_forward`` builds [batch, chunks, L, L, heads, ...] tensors for the whole
sequence at once). Each chunk runs under activation checkpointing when gradients are needed: the
backward keeps only the chunk entry states and recomputes one chunk's tile at a time, so a
training step's memory is O(T x heads x head_dim) plus one tile, at any T. Math in float32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

DEFAULT_CHUNK_SIZE = 256


def discretize_dt(
    dt: torch.Tensor,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> torch.Tensor:
    """The step sizes in float32 (float64 stays): clamp(softplus(dt + dt_bias), *dt_limit) (Bamba's order)."""
    dt = dt.to(compute_dtype(dt))
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    if dt_limit != (0.0, float("inf")):
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    return dt


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """float32 math for 16/32-bit inputs; float64 inputs (gradcheck) stay float64."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def expand_groups(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[..., groups, N] -> [..., heads, N]: head h reads group h // (heads / groups) (Mamba-2's order)."""
    groups = t.shape[-2]
    return t if groups == heads else t.repeat_interleave(heads // groups, dim=-2)


def ssd_chunk(x, dt, A, B, C, state):
    """One chunk: x [b, L, h, P], dt [b, L, h], A [h], B/C [b, L, g, N], state [b, h, P, N] (the
    entry state, in the compute dtype). Returns (y [b, L, h, P] without the D term, exit state).

    Heads are laid out as [groups, heads per group] so a group's C B^T is computed once and
    broadcast over its heads (no per-head copies of B and C)."""
    batch, length, heads, head_dim = x.shape
    groups, cd = B.shape[2], state.dtype
    per_group = heads // groups
    x = x.to(cd).permute(0, 2, 1, 3).reshape(batch, groups, per_group, length, head_dim)
    dt = dt.to(cd).transpose(1, 2).reshape(batch, groups, per_group, length)
    B, C = B.to(cd).transpose(1, 2)[:, :, None], C.to(cd).transpose(1, 2)[:, :, None]  # [b, g, 1, L, N]
    state = state.view(batch, groups, per_group, head_dim, -1)
    g = torch.cumsum(dt * A.to(cd).view(groups, per_group, 1), dim=-1)  # [b, g, r, L] cumulative log decay
    v = x * dt[..., None]  # dt_s x_s
    # exp(g_l - g_s) for s <= l, 0 above the diagonal (masked before exp, so no inf * 0).
    causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
    decay = torch.exp((g[..., :, None] - g[..., None, :]).masked_fill(~causal, float("-inf")))
    y = ((C @ B.transpose(-1, -2)) * decay) @ v  # within the chunk: sum_s exp(g_l - g_s) (C_l . B_s) v_s
    y = y + (C @ state.transpose(-1, -2)) * torch.exp(g)[..., None]  # from the entry state
    to_end = torch.exp(g[..., -1:] - g)[..., None]  # exp(g_L - g_s)
    state = state * torch.exp(g[..., -1])[..., None, None] + (v * to_end).transpose(-1, -2) @ B
    y = y.reshape(batch, heads, length, head_dim).transpose(1, 2)
    return y, state.reshape(batch, heads, head_dim, -1)


def ssd_scan_reference(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    return_final_state: bool = False,
):
    """SSD scan with already discretised dt (float [batch, seq, heads]); see the module docstring.

    x [batch, seq, heads, P]; A, D [heads]; B, C [batch, seq, groups, N]; initial_state
    [batch, heads, P, N] or None (zeros). Returns y [batch, seq, heads, P] in x's dtype, and the
    final state [batch, heads, P, N] float32 when return_final_state.
    """
    batch, seq, heads, head_dim = x.shape
    cd = compute_dtype(x)
    state = (
        x.new_zeros(batch, heads, head_dim, B.shape[-1], dtype=cd)
        if initial_state is None
        else initial_state.to(cd)
    )
    grads = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, dt, A, B, C, initial_state)
    )
    outputs = []
    for start in range(0, seq, chunk_size):
        piece = slice(start, start + chunk_size)
        args = (x[:, piece], dt[:, piece], A, B[:, piece], C[:, piece], state)
        # Checkpointed: the backward recomputes this chunk's tile instead of keeping every chunk's.
        y, state = checkpoint(ssd_chunk, *args, use_reentrant=False) if grads else ssd_chunk(*args)
        outputs.append(y)
    y = torch.cat(outputs, dim=1) if outputs else x.new_zeros(x.shape, dtype=cd)
    if D is not None:
        y = y + D.to(cd)[:, None] * x.to(cd)
    y = y.to(x.dtype)
    return (y, state) if return_final_state else y


def ssd_step_reference(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
) -> torch.Tensor:
    """One recurrent step, updating ``state`` [batch, heads, P, N] in place.

    x [batch, heads, P]; dt [batch, heads] discretised (float); B, C [batch, groups, N].
    Returns y [batch, heads, P] in x's dtype.
    """
    heads = x.shape[1]
    dt = dt.float()
    Bh, Ch = expand_groups(B.float(), heads), expand_groups(C.float(), heads)
    decay = torch.exp(dt * A.float())[..., None, None]
    new_state = state.float() * decay + (dt[..., None] * x.float())[..., None] * Bh[:, :, None, :]
    state.copy_(new_state)
    y = torch.einsum("bhpn,bhn->bhp", new_state, Ch)
    if D is not None:
        y = y + D.float()[:, None] * x.float()
    return y.to(x.dtype)
