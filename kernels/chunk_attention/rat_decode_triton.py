"""Triton kernel of :mod:`.rat_decode` (the math and the reference are stated there)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._split_decode import combine, empty_state, plan_splits, store_partial
from .decode import DECODE_BLOCK_N, DECODE_WARPS, LOG2E, _attend_ends
from .rat_decode import CosSin, rat_decode_supported

# The streaming tile, warps and programs per SM of the chunk-end loop (benchmarks/rat_decode_sweep.py
# times the alternatives at generate()'s shapes).
BLOCK_N, WARPS, PROGRAMS_PER_SM = DECODE_BLOCK_N, DECODE_WARPS, None


@triton.jit
def _recurrence_step(GL, BIAS, SK, K, keep, gl_off, bias_off, sk_off, k_off, dims):
    """k~ (or v~) at the dims given, float32 math rounded to K's dtype, returned as float32."""
    g = tl.sigmoid(tl.load(GL + gl_off + dims).to(tl.float32) + tl.load(BIAS + bias_off + dims).to(tl.float32))
    prev = tl.load(SK + sk_off + dims).to(tl.float32) * keep
    x = tl.load(K + k_off + dims).to(tl.float32)
    return (g * prev + (1.0 - g) * x).to(K.dtype.element_ty).to(tl.float32)


@triton.jit
def _rotate(x, x_swapped, COS, SIN, dims, HALF: tl.constexpr, HAS_ROPE: tl.constexpr):
    """RoPE with rotate_half: x * cos + [-x2, x1] * sin; x_swapped = x at dims (d + D/2) % D."""
    if HAS_ROPE:
        sign = tl.where(dims < HALF, -1.0, 1.0)
        x = x * tl.load(COS + dims) + sign * x_swapped * tl.load(SIN + dims)
    return x


@triton.jit
def _rat_decode_kernel(
    Q, K, V, GL, BIAS, SK, SV, POS, COS, SIN, KB, VB, M_OUT, L_OUT, ACC_OUT, O, Z,
    sqb, skb, svb, sgb, ssb, sbb, sbc, sob, szb, szh,
    H, C, L, split_len, qk_scale,
    GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, HAS_ROPE: tl.constexpr, DIRECT: tl.constexpr,
    HAS_GATE: tl.constexpr,
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = (pid // H).to(tl.int64)
    h = (pid % H).to(tl.int64)
    grp = h % GROUPS
    dims = tl.arange(0, HEAD_DIM)
    swapped = (dims + HEAD_DIM // 2) % HEAD_DIM
    position = tl.load(POS)
    chunk = (position // L).to(tl.int32)
    head_off = h * HEAD_DIM
    q_off = b * sqb + grp * HEAD_DIM
    q = _rotate(tl.load(Q + q_off + dims).to(tl.float32), tl.load(Q + q_off + swapped).to(tl.float32),
                COS, SIN, dims, HEAD_DIM // 2, HAS_ROPE)
    q = q.to(Q.dtype.element_ty).to(tl.float32)

    m_i, l_i, acc = empty_state(HEAD_DIM)
    if split == 0:
        # The recurrence step, the state and slot writes and the own pair: split 0 alone (the other
        # splits read slots < chunk only, never the state or this step's slot).
        keep = (position % L != 0).to(tl.float32)
        gl_off, sk_off = b * sgb + head_off, b * ssb + head_off
        k_off, v_off = b * skb + grp * HEAD_DIM, b * svb + head_off
        k_tilde = _recurrence_step(GL, BIAS, SK, K, keep, gl_off, head_off, sk_off, k_off, dims)
        v_tilde = _recurrence_step(GL, BIAS, SV, V, keep, gl_off, head_off, sk_off, v_off, dims)
        k_rot = k_tilde
        if HAS_ROPE:  # rotate_half needs k~ at the swapped dims too: recompute it there (D numbers)
            k_tilde_swapped = _recurrence_step(GL, BIAS, SK, K, keep, gl_off, head_off, sk_off, k_off, swapped)
            k_rot = _rotate(k_tilde, k_tilde_swapped, COS, SIN, dims, HEAD_DIM // 2, HAS_ROPE)
        k_rot = k_rot.to(KB.dtype.element_ty)
        tl.store(SK + sk_off + dims, k_tilde.to(SK.dtype.element_ty))
        tl.store(SV + sk_off + dims, v_tilde.to(SV.dtype.element_ty))
        slot = b * sbb + chunk.to(tl.int64) * sbc + head_off
        tl.store(KB + slot + dims, k_rot)
        tl.store(VB + slot + dims, v_tilde.to(VB.dtype.element_ty))
        m_i = tl.sum(q * k_rot.to(tl.float32), 0) * qk_scale
        l_i = l_i + 1.0
        acc = v_tilde

    n = tl.minimum(chunk, C)
    lo = split * split_len
    m_i, l_i, acc = _attend_ends(q, KB + b * sbb + head_off, VB + b * sbb + head_off, sbc, sbc, lo,
                                 tl.minimum(lo + split_len, n), dims, qk_scale, m_i, l_i, acc, BLOCK_N)
    store_partial(M_OUT, L_OUT, ACC_OUT, pid.to(tl.int64) * tl.num_programs(1) + split, m_i, l_i, acc, dims,
                  O, b * sob + head_off, Z, b * szb + h * szh, HEAD_DIM, DIRECT, HAS_GATE)


def rat_decode_step_triton(
    q_groups: torch.Tensor,
    k_groups: torch.Tensor,
    v: torch.Tensor,
    gate_logits: torch.Tensor,
    gate_bias: torch.Tensor,
    state_key: torch.Tensor,
    state_value: torch.Tensor,
    position: torch.Tensor,
    chunk_size: int,
    cos_sin: CosSin | None,
    key_buffer: torch.Tensor,
    value_buffer: torch.Tensor,
    scale: float | None = None,
    output_gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """The whole step above (shapes as :func:`rat_decode_inputs_reference`; key_buffer / value_buffer
    [B, slots, H, D] with slot position // L present). Writes the new state and the token's slot in
    place; returns y [B, 1, H, D], times sigmoid(output_gate) ([B, 1, H, D] logits) when given
    (the layer's output gate, rounded once with y). Not differentiable (decoding)."""
    batch, _, heads, dim = v.shape
    groups = q_groups.shape[2]
    if not rat_decode_supported(v):
        raise ValueError(f"rat_decode_step_triton: head_dim must be a power of two in [16, 256], got {dim}.")
    if heads % groups or k_groups.shape[2] != groups:
        raise ValueError(f"rat_decode_step_triton: q/k groups ({groups}, {k_groups.shape[2]}) must be equal and divide the {heads} heads.")
    for name, t in (("state_key", state_key), ("state_value", state_value)):
        if t.shape != (batch, heads, dim) or not t.is_contiguous():
            raise ValueError(f"rat_decode_step_triton: {name} must be a contiguous [{batch}, {heads}, {dim}] tensor, got {tuple(t.shape)}.")
    for name, t in (("key_buffer", key_buffer), ("value_buffer", value_buffer)):
        if t.shape[0] != batch or t.shape[2:] != (heads, dim) or t.stride()[1:] != key_buffer.stride()[1:] or t.stride(-1) != 1:
            raise ValueError(f"rat_decode_step_triton: {name} must be [{batch}, slots, {heads}, {dim}] with key_buffer's strides.")
    q_groups, k_groups, v, gate_logits = (x.contiguous() for x in (q_groups, k_groups, v, gate_logits))
    cos, sin = cos_sin if cos_sin is not None else (q_groups, q_groups)  # unread without RoPE
    cos, sin = cos.reshape(-1).contiguous(), sin.reshape(-1).contiguous()
    scale = dim**-0.5 if scale is None else float(scale)
    splits, per_split, stats, partial = plan_splits(batch * heads, key_buffer.shape[1], BLOCK_N, dim, v.device, PROGRAMS_PER_SM)
    out = torch.empty_like(v)
    z = output_gate if output_gate is not None else out  # unread without a gate
    _rat_decode_kernel[(batch * heads, splits)](
        q_groups, k_groups, v, gate_logits, gate_bias, state_key, state_value, position, cos, sin,
        key_buffer, value_buffer, stats[0], stats[1], partial, out, z,
        q_groups.stride(0), k_groups.stride(0), v.stride(0), gate_logits.stride(0), state_key.stride(0),
        key_buffer.stride(0), key_buffer.stride(1), out.stride(0), z.stride(0), z.stride(2),
        heads, key_buffer.shape[1], chunk_size, per_split, scale * LOG2E,
        GROUPS=groups, HEAD_DIM=dim, BLOCK_N=BLOCK_N, HAS_ROPE=cos_sin is not None,
        DIRECT=splits == 1, HAS_GATE=output_gate is not None, num_warps=WARPS,
    )
    return combine(stats, partial, out, heads, splits, WARPS, output_gate)
