"""Reference gated linear recurrence (RAT Eq. 3 intra-chunk RNN, RAT+ full-sequence recurrence).

Math, per batch row and per channel (every trailing dimension is an independent channel):

    h_t = g_t * h_{t-1} + (1 - g_t) * x_t

with ``h_{-1} = initial_state`` (zero when absent). With ``chunk_size = L > 0`` the state restarts
at zero at every chunk boundary, i.e. whenever ``(start_position + t) % L == 0``; ``initial_state``
then only feeds the positions before the first boundary (it is the state of the chunk that was
open when an earlier segment stopped). ``chunk_size = 0`` never restarts (RAT+).

Accumulates in float32 whatever the input dtype and returns the input dtype.
"""
from __future__ import annotations

import torch


def gated_recurrence_reference(
    x: torch.Tensor,
    g: torch.Tensor,
    chunk_size: int = 0,
    start_position: int = 0,
    initial_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """x, g: [batch, seq, ...]; initial_state: [batch, ...] or None. Returns h with x's shape and dtype."""
    batch, seq = x.shape[:2]
    state = (
        torch.zeros_like(x[:, 0], dtype=torch.float32)
        if initial_state is None
        else initial_state.to(torch.float32)
    )
    outputs = []
    for t in range(seq):
        if chunk_size > 0 and (start_position + t) % chunk_size == 0:
            state = torch.zeros_like(state)
        gate = g[:, t].to(torch.float32)
        state = gate * state + (1.0 - gate) * x[:, t].to(torch.float32)
        outputs.append(state)
    if not outputs:
        return x.clone()
    return torch.stack(outputs, dim=1).to(x.dtype)


def _restart_masked(t: torch.Tensor, x: torch.Tensor, chunk_size: int, start_position: int) -> torch.Tensor:
    """t with zeros at the positions of x [batch, seq, ...] that open a chunk."""
    seq = x.shape[1]
    positions = torch.arange(start_position, start_position + seq, device=x.device)
    restart = (positions % chunk_size == 0).view(1, seq, *([1] * (x.dim() - 2)))
    return t.masked_fill(restart, 0.0)


def _scan_coefficients(x, g, chunk_size: int, start_position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(a, b) = (g, (1 - g) x) in float32, with a = 0 where a chunk restarts (cutting the product)."""
    a = g.to(torch.float32)
    b = (1.0 - a) * x.to(torch.float32)
    if chunk_size > 0:
        a = _restart_masked(a, x, chunk_size, start_position)
    return a, b


def _linear_scan(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """h_t = a_t h_{t-1} + b_t from h_{-1} = 0 along dim 1, by a Hillis-Steele scan (b is not modified)."""
    seq = a.shape[1]
    offset = 1
    while offset < seq:
        a_shift = torch.cat([torch.ones_like(a[:, :offset]), a[:, :-offset]], dim=1)
        b_shift = torch.cat([torch.zeros_like(b[:, :offset]), b[:, :-offset]], dim=1)
        b = a * b_shift + b
        a = a * a_shift
        offset *= 2
    return b


def _scan_states(x, g, chunk_size, start_position, initial_state) -> tuple[torch.Tensor, torch.Tensor]:
    """(a, h): the coefficients and the float32 states."""
    a, b = _scan_coefficients(x, g, chunk_size, start_position)
    if initial_state is not None and x.shape[1]:
        # Fold the carried state into the first position: h_0 = a_0 h_{-1} + b_0.
        b = torch.cat([b[:, :1] + a[:, :1] * initial_state.to(torch.float32)[:, None], b[:, 1:]], dim=1)
    return a, _linear_scan(a, b)


class _GatedScan(torch.autograd.Function):
    """The scan with its backward as the reverse recurrence, keeping only x, g and the states: autograd
    through the Hillis-Steele steps would keep ~4 float32 copies per step, O(T log T) memory.

    With lambda_t = dL/dh_t through every later state, lambda_t = dh_t + a_{t+1} lambda_{t+1} (a
    reverse linear scan), and then db_t = lambda_t, da_t = lambda_t h_{t-1} (h_{-1} the initial state).
    """

    @staticmethod
    def forward(ctx, x, g, chunk_size, start_position, initial_state):
        _, h = _scan_states(x, g, chunk_size, start_position, initial_state)
        ctx.chunk_size, ctx.start_position = chunk_size, start_position
        ctx.save_for_backward(x, g, h, initial_state)
        return h.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, g, h, initial_state = ctx.saved_tensors
        a, _ = _scan_coefficients(x, g, ctx.chunk_size, ctx.start_position)
        a_next = torch.cat([a[:, 1:], torch.zeros_like(a[:, :1])], dim=1)
        lam = _linear_scan(a_next.flip(1), grad.to(torch.float32).flip(1)).flip(1)
        first = torch.zeros_like(h[:, :1]) if initial_state is None else initial_state.to(torch.float32)[:, None]
        h_prev = torch.cat([first, h[:, :-1]], dim=1)
        da = lam * h_prev
        if ctx.chunk_size > 0:  # a = 0 at a restart, whatever g: no gradient reaches g through it
            da = _restart_masked(da, x, ctx.chunk_size, ctx.start_position)
        dx = ((1.0 - g.to(torch.float32)) * lam).to(x.dtype)
        dg = (da - x.to(torch.float32) * lam).to(g.dtype)
        d_initial = None if initial_state is None else (a[:, 0] * lam[:, 0]).to(initial_state.dtype)
        return dx, dg, None, None, d_initial


def gated_recurrence_scan(
    x: torch.Tensor,
    g: torch.Tensor,
    chunk_size: int = 0,
    start_position: int = 0,
    initial_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same function as :func:`gated_recurrence_reference`, computed with a log-depth parallel scan.

    The pair (a, b) = (g, (1 - g) x) composes as (a1, b1) then (a2, b2) -> (a1 a2, a2 b1 + b2);
    a Hillis-Steele scan applies it in ceil(log2 T) vectorised steps. Chunk restarts zero the
    gate at the first position of every chunk, which cuts the product there. Used as the fast
    pure-PyTorch path (CPU and GPU without Triton); the loop above stays the oracle. Its backward
    is the reverse recurrence (:class:`_GatedScan`), so training keeps O(T) memory.
    """
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, g, initial_state)):
        return _GatedScan.apply(x, g, chunk_size, start_position, initial_state)
    return _scan_states(x, g, chunk_size, start_position, initial_state)[1].to(x.dtype)
