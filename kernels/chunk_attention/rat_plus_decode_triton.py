"""Triton kernels of :mod:`.rat_plus_decode` (the math, the store layout and the reference are there).

Two launches: ``_token_kernel`` (one program per row and kv head) does the element-wise part and
every write, ``_stored_attention_kernel`` (one program per row, query head and split) streams the
store's visible columns. The second must see the first's writes (the token's own column among
them), hence two launches rather than one.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._split_decode import combine, empty_state, online_update, plan_splits, store_partial
from .decode import LOG2E
from .rat_decode_triton import _rotate
from .rat_plus_decode import CosSin, StoreLayout

# The streaming tile of the store: 16 columns x 2 warps, as the chunk-end decode kernels (64 x 4 is
# no faster and needs 255 registers on sm_90 with Triton 3.6, where it spills).
BLOCK_N, WARPS = 16, 2


@triton.jit
def _new_state(GL, S, X, gl_off, s_off, x_off, dims, HAS_RECURRENCE: tl.constexpr):
    """k~ (or v~) at the dims given, float32: g * state + (1 - g) * x, or x without a recurrence."""
    x = tl.load(X + x_off + dims).to(tl.float32)
    if HAS_RECURRENCE:
        g = tl.sigmoid(tl.load(GL + gl_off + dims).to(tl.float32))
        x = g * tl.load(S + s_off + dims) + (1.0 - g) * x
    return x


@triton.jit
def _token_kernel(
    Q, K, V, GL, SK, SV, POS, COS, SIN, KB, VB, ST, SINK_VALID, QR,
    sqb, sqh, skb, skh, svb, svh, sgb, sgh, ssb, ssh, scb, sbb, sbc, sbh, stb, svlb, sqrb, sqrh,
    first_end, first_ring, ring, dilation, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, SINKS: tl.constexpr, BLOCK_S: tl.constexpr,
    HAS_RECURRENCE: tl.constexpr, HAS_ROPE: tl.constexpr, HAS_ENDS: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM)
    swapped = (dims + HEAD_DIM // 2) % HEAD_DIM
    position = tl.load(POS)
    cos, sin = COS + b * scb, SIN + b * scb

    # k~, v~: the new state (float32), then k~ rounded to the model dtype and rotated.
    gl_off, s_off = b * sgb + kvh * sgh, b * ssb + kvh * ssh
    k_tilde = _new_state(GL, SK, K, gl_off, s_off, b * skb + kvh * skh, dims, HAS_RECURRENCE)
    v_tilde = _new_state(GL, SV, V, gl_off, s_off, b * svb + kvh * svh, dims, HAS_RECURRENCE)
    k_round = k_tilde.to(KB.dtype.element_ty).to(tl.float32)
    k_rot = k_round
    if HAS_ROPE:  # rotate_half needs k~ at the swapped dims too: recompute it there (D numbers)
        k_swapped = _new_state(GL, SK, K, gl_off, s_off, b * skb + kvh * skh, swapped, HAS_RECURRENCE)
        k_rot = _rotate(k_round, k_swapped.to(KB.dtype.element_ty).to(tl.float32), cos, sin, dims, HEAD_DIM // 2, HAS_ROPE)
    if HAS_RECURRENCE:
        tl.store(SK + s_off + dims, k_tilde)
        tl.store(SV + s_off + dims, v_tilde)

    # The token's columns: its ring slot (visible now) and, with block ends, its block's slot.
    ring_col = first_ring + position % ring
    row = KB + b * sbb + kvh * sbh
    tl.store(row + ring_col * sbc + dims, k_rot.to(KB.dtype.element_ty))
    tl.store(VB + b * sbb + kvh * sbh + ring_col * sbc + dims, v_tilde.to(VB.dtype.element_ty))
    if HAS_ENDS:
        end_col = first_end + position // dilation
        tl.store(row + end_col * sbc + dims, k_rot.to(KB.dtype.element_ty))
        tl.store(VB + b * sbb + kvh * sbh + end_col * sbc + dims, v_tilde.to(VB.dtype.element_ty))

    # The queries of this kv head's group, rotated and rounded.
    for i in range(GROUP):
        h = kvh * GROUP + i
        q = tl.load(Q + b * sqb + h * sqh + dims).to(tl.float32)
        q = _rotate(q, tl.load(Q + b * sqb + h * sqh + swapped).to(tl.float32), cos, sin, dims, HEAD_DIM // 2, HAS_ROPE)
        tl.store(QR + b * sqrb + h * sqrh + dims, q.to(QR.dtype.element_ty))

    # The row's visible positions: once per row (kv head 0).
    if kvh == 0:
        tl.store(ST + b * stb + ring_col, position)
        if HAS_ENDS:
            leaving = position - window - 1
            closes = (leaving >= 0) & ((leaving + 1) % dilation == 0)
            leaving_col = first_end + tl.maximum(leaving, 0) // dilation
            tl.store(ST + b * stb + leaving_col, tl.where(closes, leaving, -1))
        if SINKS > 0:
            sinks = tl.arange(0, BLOCK_S)
            in_range = sinks < SINKS
            held = tl.load(SINK_VALID + b * svlb + sinks, mask=in_range, other=0) != 0
            shown = held & (sinks < position - window) & ((sinks + 1) % dilation != 0)
            tl.store(ST + b * stb + sinks, tl.where(shown, sinks, -1).to(tl.int64), mask=in_range)


@triton.jit
def _stored_attention_kernel(
    QR, KB, VB, ST, M_OUT, L_OUT, ACC_OUT, O, Z,
    sqrb, sqrh, sbb, sbc, sbh, stb, sob, soh, szb, szh,
    H, C, split_len, qk_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, DIRECT: tl.constexpr, HAS_GATE: tl.constexpr,
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = (pid // H).to(tl.int64)
    h = (pid % H).to(tl.int64)
    kvh = h // GROUP
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(QR + b * sqrb + h * sqrh + dims).to(tl.float32)
    k_base = KB + b * sbb + kvh * sbh
    v_base = VB + b * sbb + kvh * sbh
    lo = split * split_len
    hi = tl.minimum(lo + split_len, C)
    m_i, l_i, acc = empty_state(HEAD_DIM)
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ok = offs < hi
        ok = ok & (tl.load(ST + b * stb + offs, mask=ok, other=-1) >= 0)
        k = tl.load(k_base + offs.to(tl.int64)[:, None] * sbc + dims[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        v = tl.load(v_base + offs.to(tl.int64)[:, None] * sbc + dims[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        s = tl.where(ok, tl.sum(k * q[None, :], 1) * qk_scale, float("-inf"))
        m_i, l_i, acc = online_update(m_i, l_i, acc, s, v)
    store_partial(M_OUT, L_OUT, ACC_OUT, pid.to(tl.int64) * tl.num_programs(1) + split, m_i, l_i, acc, dims,
                  O, b * sob + h * soh, Z, b * szb + h * szh, HEAD_DIM, DIRECT, HAS_GATE)


def _row_stride(x: torch.Tensor) -> int:
    """Stride of dim 0, or 0 where one row is broadcast to all."""
    return x.stride(0) if x.shape[0] > 1 else 0


def rat_plus_decode_step_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gate_logits: torch.Tensor | None,
    state_key: torch.Tensor | None,
    state_value: torch.Tensor | None,
    position: torch.Tensor,
    cos_sin: CosSin | None,
    keys: torch.Tensor,
    values: torch.Tensor,
    stored: torch.Tensor,
    layout: StoreLayout,
    sink_valid: torch.Tensor | None = None,
    scale: float | None = None,
    output_gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """The step of :func:`.rat_plus_decode.rat_plus_decode_step_reference`, same arguments
    (inputs may be any views with a contiguous last dim; checks are the public op's). Returns
    y [B, 1, H, D] in q's dtype, times sigmoid(output_gate) when given (rounded once)."""
    batch, _, heads, dim = q.shape
    kv_heads, columns = keys.shape[2], keys.shape[1]
    recurrence = gate_logits is not None
    gl = gate_logits if recurrence else k  # unread without a recurrence
    sk, sv = (state_key, state_value) if recurrence else (k, v)
    cos, sin = cos_sin if cos_sin is not None else (q, q)  # unread without RoPE
    sinks = layout.sinks
    sink_flags = sink_valid.view(torch.uint8) if sinks else stored  # unread without sinks
    q_rot = torch.empty_like(q, memory_format=torch.contiguous_format)
    _token_kernel[(batch, kv_heads)](
        q, k, v, gl, sk, sv, position, cos, sin, keys, values, stored, sink_flags, q_rot,
        q.stride(0), q.stride(2), k.stride(0), k.stride(2), v.stride(0), v.stride(2), gl.stride(0), gl.stride(2),
        sk.stride(0), sk.stride(1), _row_stride(cos), keys.stride(0), keys.stride(1), keys.stride(2),
        stored.stride(0), sink_flags.stride(0), q_rot.stride(0), q_rot.stride(2),
        layout.first_end, layout.first_ring, layout.ring, max(layout.dilation, 1), layout.window,
        GROUP=heads // kv_heads, HEAD_DIM=dim, SINKS=sinks, BLOCK_S=max(triton.next_power_of_2(sinks), 2),
        HAS_RECURRENCE=recurrence, HAS_ROPE=cos_sin is not None, HAS_ENDS=layout.dilation > 0, num_warps=1,
    )
    scale = dim**-0.5 if scale is None else float(scale)
    splits, per_split, stats, partial = plan_splits(batch * heads, columns, BLOCK_N, dim, q.device)
    out = torch.empty_like(q_rot)
    z = output_gate if output_gate is not None else out  # unread without a gate
    _stored_attention_kernel[(batch * heads, splits)](
        q_rot, keys, values, stored, stats[0], stats[1], partial, out, z,
        q_rot.stride(0), q_rot.stride(2), keys.stride(0), keys.stride(1), keys.stride(2), stored.stride(0),
        out.stride(0), out.stride(2), z.stride(0), z.stride(2), heads, columns, per_split, scale * LOG2E,
        GROUP=heads // kv_heads, HEAD_DIM=dim, BLOCK=BLOCK_N, DIRECT=splits == 1, HAS_GATE=output_gate is not None,
        num_warps=WARPS,
    )
    return combine(stats, partial, out, heads, splits, WARPS, output_gate)
