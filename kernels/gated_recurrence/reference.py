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
    pure-PyTorch path (CPU and GPU without Triton); the loop above stays the oracle.
    """
    seq = x.shape[1]
    a = g.to(torch.float32).clone()
    b = (1.0 - a) * x.to(torch.float32)
    if chunk_size > 0:
        positions = torch.arange(start_position, start_position + seq, device=x.device)
        restart = (positions % chunk_size == 0).view(1, seq, *([1] * (x.dim() - 2)))
        a = a.masked_fill(restart, 0.0)
    if initial_state is not None:
        # Fold the carried state into the first position: h_0 = a_0 h_{-1} + b_0.
        b[:, 0] = b[:, 0] + a[:, 0] * initial_state.to(torch.float32)
    offset = 1
    while offset < seq:
        a_prev = torch.ones_like(a[:, :offset])
        b_prev = torch.zeros_like(b[:, :offset])
        a_shift = torch.cat([a_prev, a[:, :-offset]], dim=1)
        b_shift = torch.cat([b_prev, b[:, :-offset]], dim=1)
        b = a * b_shift + b
        a = a * a_shift
        offset *= 2
    return b.to(x.dtype)
