"""Gated linear recurrence h_t = g_t * h_{t-1} + (1 - g_t) * x_t (RAT, RAT+); see reference.py."""
from __future__ import annotations

import torch

from .._backend import resolve_backend
from .rat_keys_values import rat_keys_values, rat_keys_values_reference
from .reference import gated_recurrence_reference, gated_recurrence_scan

__all__ = [
    "gated_recurrence",
    "gated_recurrence_reference",
    "gated_recurrence_scan",
    "rat_keys_values",
    "rat_keys_values_reference",
]


def gated_recurrence(
    x: torch.Tensor,
    g: torch.Tensor,
    chunk_size: int = 0,
    start_position: int = 0,
    initial_state: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """x, g: [batch, seq, heads, head_dim] (any trailing shape); g in (0, 1) after the sigmoid.

    chunk_size > 0 restarts the state at every multiple of chunk_size (RAT); 0 runs over the
    whole sequence (RAT+). start_position is the absolute position of x[:, 0] and initial_state
    [batch, ...] the state carried from earlier tokens (both for cached continuation).
    backend "scan" is the log-depth pure-PyTorch scan ("auto" off CUDA); "reference" the loop.
    """
    if x.shape != g.shape:
        raise ValueError(f"gated_recurrence: x {tuple(x.shape)} and g {tuple(g.shape)} must have the same shape.")
    if chunk_size < 0:
        raise ValueError(f"gated_recurrence: chunk_size must be >= 0 (0 = no restarts), got {chunk_size}.")
    if initial_state is not None and initial_state.shape != x[:, 0].shape:
        raise ValueError(
            f"gated_recurrence: initial_state must have shape {tuple(x[:, 0].shape)}, got {tuple(initial_state.shape)}."
        )
    impl = resolve_backend(backend, x.device, "gated_recurrence", extra=("scan",))
    if backend == "auto" and impl == "reference":
        impl = "scan"  # same function, vectorised: the loop is only the oracle
    if impl == "triton":
        from .triton import gated_recurrence_triton

        return gated_recurrence_triton(x, g, chunk_size, start_position, initial_state)
    if impl == "reference":
        return gated_recurrence_reference(x, g, chunk_size, start_position, initial_state)
    return gated_recurrence_scan(x, g, chunk_size, start_position, initial_state)
