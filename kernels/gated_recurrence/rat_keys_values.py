"""RAT's keys and values in one pass: forget gate, both chunk recurrences and inter-chunk RoPE.

The RAT layer computes, from the projections of x (RAT Eq. 3, hf_hybrid/layers/rat_attention.py):

    g     = sigmoid(gate_logits + gate_bias)           float32, [B, T, H, D]
    k~    = recurrence of k with g, restarting every L  k: one key per group of heads, head h
    v~    = recurrence of v with g, restarting every L      reading group h % G
    k_rot = RoPE(k~) with the chunk index as position   (NoPE: k_rot = k~)

    recurrence: h_t = g_t * h_{t-1} + (1 - g_t) * x_t, h = 0 before every multiple of L.

Unfused, that is a float32 gate tensor, a copy of k per head, two recurrence launches each reading
the gate, and a float32 RoPE pass: about ten passes over [B, T, H, D]. The fused kernel reads
k (per group), v and the logits once and writes k_rot and v~ once (``rat_keys_values_triton``).
Whole sequences only (no carried state): the layer uses it for training and cache-less prefill.
"""
from __future__ import annotations

import torch

from .._backend import resolve_backend
from .._common import expand_groups
from ..fused_norm.reference import rotary_reference
from .reference import gated_recurrence_reference

CosSin = tuple[torch.Tensor, torch.Tensor]


def rat_keys_values_reference(
    k_groups: torch.Tensor,
    v: torch.Tensor,
    gate_logits: torch.Tensor,
    gate_bias: torch.Tensor,
    chunk_size: int,
    cos_sin: CosSin | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition above, op by op (as the layer's unfused path computes it).

    k_groups [B, T, G, D]; v [B, T, H, D]; gate_logits [B, T, H, D] (before the sigmoid, without
    the bias); gate_bias [H * D]; cos_sin: chunk-index RoPE tables broadcastable to [B, T, 1, D],
    or None. Returns (k_rot, v~), [B, T, H, D] in k's and v's dtypes.
    """
    heads, dim = v.shape[2], v.shape[3]
    gate = torch.sigmoid(gate_logits.float() + gate_bias.float().view(heads, dim))
    k_tilde = gated_recurrence_reference(expand_groups(k_groups, heads), gate, chunk_size)
    v_tilde = gated_recurrence_reference(v, gate, chunk_size)
    return rotary_reference(k_tilde, cos_sin), v_tilde


def _check(op, k_groups, v, gate_logits, gate_bias, chunk_size, cos_sin) -> None:
    if v.dim() != 4 or k_groups.dim() != 4:
        raise ValueError(f"{op}: k_groups and v must be [batch, seq, groups|heads, head_dim]; got {tuple(k_groups.shape)}, {tuple(v.shape)}.")
    batch, seq, heads, dim = v.shape
    groups = k_groups.shape[2]
    if k_groups.shape[:2] != (batch, seq) or k_groups.shape[3] != dim or groups == 0 or heads % groups:
        raise ValueError(
            f"{op}: k_groups {tuple(k_groups.shape)} must be [batch, seq, groups, head_dim] with groups dividing "
            f"the {heads} heads of v {tuple(v.shape)}."
        )
    if gate_logits.shape != v.shape:
        raise ValueError(f"{op}: gate_logits must have v's shape {tuple(v.shape)}; got {tuple(gate_logits.shape)}.")
    if gate_bias.numel() != heads * dim:
        raise ValueError(f"{op}: gate_bias must hold heads * head_dim = {heads * dim} values; got {tuple(gate_bias.shape)}.")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"{op}: chunk_size must be an int >= 1; got {chunk_size!r}.")
    if cos_sin is not None:
        for name, t in zip(("cos", "sin"), cos_sin):
            if t.dim() != 4 or t.shape[1] != seq or t.shape[2] != 1 or t.shape[3] != dim or t.shape[0] not in (1, batch):
                raise ValueError(f"{op}: cos_sin's {name} must be [batch or 1, seq, 1, head_dim]; got {tuple(t.shape)}.")


# Both kernels unroll a chunk's L token steps in full. At L = 64 the backward's TritonGPU passes
# run for many minutes (`python -m benchmarks.sm90` shows it without a GPU), so chunks longer than
# 16 take the op-by-op Triton path instead.
MAX_FUSED_CHUNK = 16


def triton_supports(v: torch.Tensor, chunk_size: int) -> bool:
    """Shapes the kernels are built and tested for: D/2 a power of two in [8, 128] (column tiles of
    each half), L a power of two <= MAX_FUSED_CHUNK."""
    dim = v.shape[-1]
    half = dim // 2
    return (
        v.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and dim % 2 == 0 and half >= 8 and half & (half - 1) == 0 and half <= 128
        and chunk_size & (chunk_size - 1) == 0 and chunk_size <= MAX_FUSED_CHUNK
    )


def rat_keys_values_unfused(k_groups, v, gate_logits, gate_bias, chunk_size, cos_sin=None, backend="auto"):
    """The reference's composition with each op on ``backend``: the float32 gate, two
    ``gated_recurrence`` launches and one ``rotary`` (Triton on CUDA). Any chunk size; the layer's
    unfused path computes the same."""
    from ..fused_norm import rotary
    from . import gated_recurrence

    heads, dim = v.shape[2], v.shape[3]
    gate = torch.sigmoid(gate_logits.float() + gate_bias.float().view(heads, dim))
    k_tilde = gated_recurrence(expand_groups(k_groups, heads), gate, chunk_size, backend=backend)
    v_tilde = gated_recurrence(v, gate, chunk_size, backend=backend)
    k_rot = rotary(k_tilde, cos_sin, backend=backend)  # None: k~ itself
    return k_rot.to(k_groups.dtype), v_tilde.to(v.dtype)


def rat_keys_values(
    k_groups: torch.Tensor,
    v: torch.Tensor,
    gate_logits: torch.Tensor,
    gate_bias: torch.Tensor,
    chunk_size: int,
    cos_sin: CosSin | None = None,
    *,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RoPE(k~), v~) of a whole sequence, differentiable in k_groups, v, gate_logits and gate_bias
    (see the module docstring and :func:`rat_keys_values_reference` for shapes). backend: "auto"
    (the fused Triton kernel on CUDA where :func:`triton_supports`, op-by-op Triton for other shapes,
    the reference off CUDA), "triton", "reference"."""
    op = "rat_keys_values"
    _check(op, k_groups, v, gate_logits, gate_bias, chunk_size, cos_sin)
    impl = resolve_backend(backend, v.device, op)
    if impl == "triton" and not triton_supports(v, chunk_size):
        if backend == "triton":
            raise ValueError(
                f"{op}: the Triton kernel needs chunk_size and head_dim / 2 to be powers of two (chunk_size <= "
                f"{MAX_FUSED_CHUNK}, 8 <= head_dim / 2 <= 128) and a float dtype; got chunk_size={chunk_size}, "
                f"head_dim={v.shape[-1]}, {v.dtype}. Pass backend='auto' (op-by-op Triton for such shapes) or 'reference'."
            )
        # Not the slow reference on a GPU: the same math through the op-by-op Triton kernels.
        return rat_keys_values_unfused(k_groups, v, gate_logits, gate_bias, chunk_size, cos_sin, backend="auto")
    if impl == "reference":
        return rat_keys_values_reference(k_groups, v, gate_logits, gate_bias, chunk_size, cos_sin)
    from . import rat_keys_values_fwd  # the torch.library op around the kernels (one node under torch.compile)

    cos, sin = cos_sin if cos_sin is not None else (None, None)
    return rat_keys_values_fwd(k_groups, v, gate_logits, gate_bias, cos, sin, chunk_size)
