"""Layer-level entry points to the fused per-head norms (hf_hybrid.kernels.fused_norm).

They take the layers' existing RMSNorm modules (weights, eps, parameter names and checkpoints
unchanged) and compute what the layers compute today with RMSNorm + apply_rotary:

    qk_norm_rotary:    q~, k~ = RoPE(q_norm(q)), RoPE(k_norm(k))     (QK-norm + RoPE of the SWA branch,
                                                                    or QK-norm alone with cos_sin None)
    sum_branch_norms:  swa_norm(o_swa) + rla_norm(o_rla)             (either branch may be None)

backend="reference" is bit-identical to the current layer code; "triton" rounds once per output
instead of after each step (see kernels/fused_norm/reference.py); "auto" = Triton on CUDA.
"""
from __future__ import annotations

import torch

from ..kernels._backend import BACKENDS
from ..kernels.fused_norm import branch_norm_sum, rms_norm_rotary
from .backbone_fusion import fused_decode_active
from .norm import RMSNorm
from .rotary import apply_rotary

CosSin = tuple[torch.Tensor, torch.Tensor]


# Below this many tokens (decode steps) launching the fused kernels costs more host time than
# the PyTorch ops take in all (an eager RATTENTION decode step is slower with them,
# `python -m hf_hybrid.bench.rattention`). Training and prefill shapes are far above it.
FUSED_MIN_TOKENS = 1024


def norm_backend(layer_backend: str, tokens: int | None = None) -> str:
    """The norms' backend for a layer's kernel backend: "auto" / "reference" / "triton" carry
    over; op-specific names such as RLA's "chunked" (a PyTorch path for the RLA op) leave the
    norms on "auto", and "auto" keeps PyTorch for fewer than FUSED_MIN_TOKENS tokens."""
    backend = layer_backend if layer_backend in BACKENDS else "auto"
    # Inside generate()'s graphed decode step there is no launch cost to amortise (on by default, see
    # backbone_fusion.fused_decode_active): one fused kernel there instead of a dozen small ones.
    if backend == "auto" and tokens is not None and tokens < FUSED_MIN_TOKENS and not fused_decode_active():
        return "reference"
    return backend


def has_forward_hooks(norm: torch.nn.Module) -> bool:
    """A norm with forward hooks (accelerate's offload hook loads its weight from disk or CPU in
    its pre-forward; user hooks) must be called as a module: its ``weight`` may be on the meta
    device until then."""
    return bool(norm._forward_hooks or norm._forward_pre_hooks or hasattr(norm, "_hf_hook"))


def norm_rotary(x: torch.Tensor, norm: RMSNorm | None, cos_sin: CosSin | None, backend: str = "auto") -> torch.Tensor:
    """RoPE(norm(x)) for x [B, T, H, D]; no norm module = RoPE alone, no cos_sin = norm alone."""
    if norm is None:
        return apply_rotary(x, cos_sin)
    if has_forward_hooks(norm):
        return apply_rotary(norm(x), cos_sin)
    return rms_norm_rotary(x, norm.weight, norm.eps, cos_sin, backend=backend)


def qk_norm_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    q_norm: RMSNorm | None,
    k_norm: RMSNorm | None,
    cos_sin: CosSin | None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RoPE(q_norm(q)), RoPE(k_norm(k))) for q [B, T, H, D], k [B, T, H_kv, D]."""
    return norm_rotary(q, q_norm, cos_sin, backend), norm_rotary(k, k_norm, cos_sin, backend)


def sum_branch_norms(
    o_swa: torch.Tensor | None,
    swa_norm: RMSNorm | None,
    o_rla: torch.Tensor | None,
    rla_norm: RMSNorm | None,
    backend: str = "auto",
) -> torch.Tensor:
    """swa_norm(o_swa) + rla_norm(o_rla) for [B, T, H, D] branch outputs; pass None (output and
    norm) for a branch the layer does not have."""
    for name, out, norm in (("o_swa", o_swa, swa_norm), ("o_rla", o_rla, rla_norm)):
        if out is not None and norm is None:
            raise ValueError(f"sum_branch_norms: {name} is given without its norm module.")
    if any(out is not None and has_forward_hooks(norm) for out, norm in ((o_swa, swa_norm), (o_rla, rla_norm))):
        return sum(norm(out) for out, norm in ((o_swa, swa_norm), (o_rla, rla_norm)) if out is not None)
    eps_swa = swa_norm.eps if o_swa is not None else 0.0
    eps_rla = rla_norm.eps if o_rla is not None else 0.0
    return branch_norm_sum(
        o_swa, swa_norm.weight if o_swa is not None else None,
        o_rla, rla_norm.weight if o_rla is not None else None,
        (eps_swa, eps_rla), backend=backend,
    )
