"""Triton forward and backward of :func:`rat_keys_values` (math: rat_keys_values.py).

Forward: a program owns one chunk of L tokens of one batch row for a few heads and walks its
tokens: h_t = g_t h_{t-1} + (1 - g_t) x_t on [heads, D/2] float32 tiles (the two halves of
head_dim, which makes rotate-half RoPE elementwise), RoPE'd and stored per token. The state
starts at zero in every chunk, so chunks are independent programs; the small state keeps many
programs resident, which a memory-bound pass needs (the earlier one-program-per-group layout
scanned [L, D/2] tiles at 134 registers, one program per SM).

Backward: a program owns one chunk of one batch row and one key group, and loops over the heads
reading that group (head h = group + j * G), so the group's keys are loaded once. A chunk is held
as [L, D/2] tiles and the recurrence h_t = a_t h_{t-1} + b_t, (a, b) = (g, (1 - g) x), is an
associative scan down the tile: (a1, b1) then (a2, b2) composes to (a1 a2, a2 b1 + b2).

Backward, per head, with c_t = dL/dh_t in total (the adjoint):

    c_t = dh_t + g_{t+1} c_{t+1}      (a reverse scan; g_L = 0 at the chunk end)
    dx_t = (1 - g_t) c_t,   dg_t = c_k,t (hk_{t-1} - k_t) + c_v,t (hv_{t-1} - v_t)
    d logit_t = dg_t g_t (1 - g_t),   RoPE^T:  dh1 = dy1 cos1 + dy2 sin2,  dh2 = dy2 cos2 - dy1 sin1

h_{t-1} is recomputed by scanning the inputs shifted down one row (first row empty), in float32:
nothing but the inputs is saved. dk of a group sums its heads in registers; the gate bias gets
one partial sum per program (no atomics), added up by torch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _compose(a1, b1, a2, b2):
    return a1 * a2, a2 * b1 + b2


@triton.jit
def _scan(a, b):
    """h_t = a_t h_{t-1} + b_t down axis 0 from h = 0."""
    _, h = tl.associative_scan((a, b), 0, _compose)
    return h


@triton.jit
def _adjoint(a_next, d):
    """c_t = d_t + a_next_t c_{t+1} up axis 0 (a_next_t = g_{t+1}, zero past the chunk)."""
    _, c = tl.associative_scan((a_next, d), 0, _compose, reverse=True)
    return c


@triton.jit
def _halves(ptr, rows, cols, HALF: tl.constexpr, mask):
    """Float32 [L, D/2] tiles of the two halves of the rows at element offsets ``rows`` [L, 1]."""
    first = tl.load(ptr + rows + cols, mask=mask, other=0.0).to(tl.float32)
    second = tl.load(ptr + rows + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    return first, second


@triton.jit
def _gate(LOGIT, BIAS, rows, cols, h, D: tl.constexpr, HALF: tl.constexpr, mask):
    """sigmoid(logit + bias) as two [L, D/2] float32 tiles (rows: element offsets of head h's rows)."""
    l1, l2 = _halves(LOGIT, rows, cols, HALF, mask)
    b1 = tl.load(BIAS + h * D + cols).to(tl.float32)
    b2 = tl.load(BIAS + h * D + HALF + cols).to(tl.float32)
    return tl.sigmoid(l1 + b1), tl.sigmoid(l2 + b2)


@triton.jit
def _chunk(K, COS, SIN, T, n_chunks, sk_b, sk_t, sc_b, sc_t,
           D: tl.constexpr, HALF: tl.constexpr, L: tl.constexpr, HAS_ROPE: tl.constexpr):
    """This program's chunk: batch row b, chunk steps and token indices [L], the row mask, element
    offsets of the group's key rows, the keys' halves and the RoPE tables (cos 1, sin 0 for NoPE)."""
    group = tl.program_id(1)
    b = (tl.program_id(0) // n_chunks).to(tl.int64)
    step = tl.arange(0, L)
    t = (tl.program_id(0) % n_chunks) * L + step
    ok = (t < T)[:, None]
    cols = tl.arange(0, HALF)[None, :]
    k_rows = b * sk_b + t[:, None] * sk_t + group * D
    k1, k2 = _halves(K, k_rows, cols, HALF, ok)
    if HAS_ROPE:
        cos1, cos2 = _halves(COS, b * sc_b + t[:, None] * sc_t, cols, HALF, ok)
        sin1, sin2 = _halves(SIN, b * sc_b + t[:, None] * sc_t, cols, HALF, ok)
    else:
        cos1 = tl.full([L, HALF], 1.0, tl.float32)
        cos2 = cos1
        sin1 = tl.zeros([L, HALF], tl.float32)
        sin2 = sin1
    return group, b, step, t, ok, cols, k_rows, k1, k2, cos1, cos2, sin1, sin2


@triton.jit
def _fwd_kernel(
    K, V, LOGIT, BIAS, COS, SIN, KROT, VT,
    T, n_chunks, sk_b, sk_t, sc_b, sc_t,
    GROUPS: tl.constexpr, HEADS: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
    L: tl.constexpr, HAS_ROPE: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """One chunk of one batch row for BLOCK_H heads, token by token: the state is a few [BLOCK_H,
    D/2] float32 tiles, so many programs fit on an SM and the loads of later tokens do not wait
    for the recurrence (the forward needs no scan; the backward's reverse adjoint keeps one)."""
    b = (tl.program_id(0) // n_chunks).to(tl.int64)
    t0 = (tl.program_id(0) % n_chunks) * L
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, HALF)[None, :]
    head_ok = (heads < HEADS)[:, None] & (cols >= 0)
    first = heads[:, None] * D + cols  # first-half element offsets of these heads within a token row
    k_first = (heads % GROUPS)[:, None] * D + cols
    bias1 = tl.load(BIAS + first, mask=head_ok, other=0.0).to(tl.float32)
    bias2 = tl.load(BIAS + first + HALF, mask=head_ok, other=0.0).to(tl.float32)
    hk1 = tl.zeros([BLOCK_H, HALF], tl.float32)
    hk2 = hk1
    hv1 = hk1
    hv2 = hk1
    for step in tl.static_range(L):
        t = t0 + step
        in_seq = (cols * 0 + t) < T  # a [1, D/2] row mask: the interpreter rejects scalar masks
        ok = head_ok & in_seq
        row = (b * T + t) * (HEADS * D)
        k_row = b * sk_b + t * sk_t
        g1 = tl.sigmoid(tl.load(LOGIT + row + first, mask=ok, other=0.0).to(tl.float32) + bias1)
        g2 = tl.sigmoid(tl.load(LOGIT + row + first + HALF, mask=ok, other=0.0).to(tl.float32) + bias2)
        hk1 = g1 * hk1 + (1.0 - g1) * tl.load(K + k_row + k_first, mask=ok, other=0.0).to(tl.float32)
        hk2 = g2 * hk2 + (1.0 - g2) * tl.load(K + k_row + k_first + HALF, mask=ok, other=0.0).to(tl.float32)
        hv1 = g1 * hv1 + (1.0 - g1) * tl.load(V + row + first, mask=ok, other=0.0).to(tl.float32)
        hv2 = g2 * hv2 + (1.0 - g2) * tl.load(V + row + first + HALF, mask=ok, other=0.0).to(tl.float32)
        r1, r2 = hk1, hk2
        if HAS_ROPE:
            table = b * sc_b + t * sc_t + cols
            cos1 = tl.load(COS + table, mask=in_seq, other=1.0)
            cos2 = tl.load(COS + table + HALF, mask=in_seq, other=1.0)
            sin1 = tl.load(SIN + table, mask=in_seq, other=0.0)
            sin2 = tl.load(SIN + table + HALF, mask=in_seq, other=0.0)
            r1, r2 = hk1 * cos1 - hk2 * sin1, hk2 * cos2 + hk1 * sin2
        tl.store(KROT + row + first, r1.to(KROT.dtype.element_ty), mask=ok)
        tl.store(KROT + row + first + HALF, r2.to(KROT.dtype.element_ty), mask=ok)
        tl.store(VT + row + first, hv1.to(VT.dtype.element_ty), mask=ok)
        tl.store(VT + row + first + HALF, hv2.to(VT.dtype.element_ty), mask=ok)


@triton.jit
def _bwd_kernel(
    K, V, LOGIT, BIAS, COS, SIN, DKROT, DVT, DK, DV, DLOGIT, DBIAS,
    T, n_chunks, sk_b, sk_t, sc_b, sc_t,
    GROUPS: tl.constexpr, HEADS: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
    L: tl.constexpr, HAS_ROPE: tl.constexpr,
):
    group, b, step, t, ok, cols, k_rows, k1, k2, cos1, cos2, sin1, sin2 = _chunk(
        K, COS, SIN, T, n_chunks, sk_b, sk_t, sc_b, sc_t, D, HALF, L, HAS_ROPE)
    has_prev = ok & (step >= 1)[:, None]  # row t-1 is in this chunk
    has_next = ((t + 1 < T) & (step + 1 < L))[:, None]  # row t+1 is in this chunk
    tok = (b * T + t)[:, None]
    kp1, kp2 = _halves(K, k_rows - sk_t, cols, HALF, has_prev)  # k_{t-1}
    dk1 = tl.zeros([L, HALF], tl.float32)
    dk2 = tl.zeros([L, HALF], tl.float32)
    for j in range(HEADS // GROUPS):
        h = group + j * GROUPS
        rows = tok * (HEADS * D) + h * D
        g1, g2 = _gate(LOGIT, BIAS, rows, cols, h, D, HALF, ok)
        # previous states h_{t-1}: the scan of the inputs shifted down one row (row 0: nothing)
        gp1, gp2 = _gate(LOGIT, BIAS, rows - HEADS * D, cols, h, D, HALF, has_prev)
        gp1, gp2 = tl.where(has_prev, gp1, 0.0), tl.where(has_prev, gp2, 0.0)
        gn1, gn2 = _gate(LOGIT, BIAS, rows + HEADS * D, cols, h, D, HALF, has_next)
        gn1, gn2 = tl.where(has_next, gn1, 0.0), tl.where(has_next, gn2, 0.0)
        v1, v2 = _halves(V, rows, cols, HALF, ok)
        vp1, vp2 = _halves(V, rows - HEADS * D, cols, HALF, has_prev)
        hkp1, hkp2 = _scan(gp1, (1.0 - gp1) * kp1), _scan(gp2, (1.0 - gp2) * kp2)
        hvp1, hvp2 = _scan(gp1, (1.0 - gp1) * vp1), _scan(gp2, (1.0 - gp2) * vp2)
        dy1, dy2 = _halves(DKROT, rows, cols, HALF, ok)
        dy1, dy2 = dy1 * cos1 + dy2 * sin2, dy2 * cos2 - dy1 * sin1  # RoPE^T
        ck1, ck2 = _adjoint(gn1, dy1), _adjoint(gn2, dy2)
        dv1, dv2 = _halves(DVT, rows, cols, HALF, ok)
        cv1, cv2 = _adjoint(gn1, dv1), _adjoint(gn2, dv2)
        dk1 += (1.0 - g1) * ck1
        dk2 += (1.0 - g2) * ck2
        tl.store(DV + rows + cols, ((1.0 - g1) * cv1).to(DV.dtype.element_ty), mask=ok)
        tl.store(DV + rows + HALF + cols, ((1.0 - g2) * cv2).to(DV.dtype.element_ty), mask=ok)
        dl1 = (ck1 * (hkp1 - k1) + cv1 * (hvp1 - v1)) * g1 * (1.0 - g1)
        dl2 = (ck2 * (hkp2 - k2) + cv2 * (hvp2 - v2)) * g2 * (1.0 - g2)
        dl1, dl2 = tl.where(ok, dl1, 0.0), tl.where(ok, dl2, 0.0)
        tl.store(DLOGIT + rows + cols, dl1.to(DLOGIT.dtype.element_ty), mask=ok)
        tl.store(DLOGIT + rows + HALF + cols, dl2.to(DLOGIT.dtype.element_ty), mask=ok)
        bias_row = DBIAS + tl.program_id(0).to(tl.int64) * (HEADS * D) + h * D + tl.arange(0, HALF)
        tl.store(bias_row, tl.sum(dl1, 0))
        tl.store(bias_row + HALF, tl.sum(dl2, 0))
    tl.store(DK + k_rows + cols, dk1.to(DK.dtype.element_ty), mask=ok)
    tl.store(DK + k_rows + HALF + cols, dk2.to(DK.dtype.element_ty), mask=ok)


# Backward warps for a [16, 64] chunk tile (RAT L=16, head_dim 128), from an sm_90 compile
# (`python -m hf_hybrid.bench.sm90`: registers / spills per thread, not a timing): 16 warps = 128
# registers (8: 255). The forward walks tokens with [FWD_HEADS, D/2] tiles per program; H100 sweep
# at 32K x 4 rows (docs/device_runs/rat_sweeps_h100.log): 8 heads x 4 warps 0.90 ms, 16 x 8 0.90,
# 4 x 4 1.01, 2 x 2 1.48; the scan-per-group forward before it took 2.28 ms.
BIG_TILE = 1024
BWD_WARPS, SMALL_TILE_WARPS = 16, 4
FWD_HEADS, FWD_WARPS = 8, 4


def _launch(kernel, tensors, k_groups, v, chunk_size, cos_sin, num_warps, heads_per_program=None):
    """Grid (batch x chunk, key group) for the backward; (batch x chunk, head block) for the forward
    when ``heads_per_program`` is given."""
    batch, seq, heads, dim = v.shape
    n_chunks = triton.cdiv(seq, chunk_size)
    cos, sin = cos_sin if cos_sin is not None else (v, v)  # never read without RoPE
    sc_b = 0 if cos.shape[0] == 1 else cos.stride(0)
    if heads_per_program is None:
        grid, extra = (batch * n_chunks, k_groups.shape[2]), {}
        num_warps = num_warps if chunk_size * dim // 2 >= BIG_TILE else SMALL_TILE_WARPS
    else:
        block_h = min(heads_per_program, triton.next_power_of_2(heads))
        grid, extra = (batch * n_chunks, triton.cdiv(heads, block_h)), {"BLOCK_H": block_h}
    kernel[grid](
        *tensors[:4], cos, sin, *tensors[4:],
        seq, n_chunks, k_groups.stride(0), k_groups.stride(1), sc_b, cos.stride(1),
        GROUPS=k_groups.shape[2], HEADS=heads, D=dim, HALF=dim // 2, L=chunk_size, HAS_ROPE=cos_sin is not None,
        num_warps=num_warps, **extra,
    )
    return n_chunks


class _RatKeysValues(torch.autograd.Function):
    @staticmethod
    def forward(ctx, k_groups, v, gate_logits, gate_bias, cos, sin, chunk_size, has_rope):
        cos_sin = (cos, sin) if has_rope else None
        k_rot = torch.empty(v.shape, device=v.device, dtype=k_groups.dtype)
        v_tilde = torch.empty_like(v)
        _launch(_fwd_kernel, (k_groups, v, gate_logits, gate_bias, k_rot, v_tilde), k_groups, v, chunk_size, cos_sin,
                FWD_WARPS, heads_per_program=FWD_HEADS)
        ctx.save_for_backward(k_groups, v, gate_logits, gate_bias, cos, sin)
        ctx.meta = (chunk_size, has_rope)
        return k_rot, v_tilde

    @staticmethod
    def backward(ctx, d_k_rot, d_v_tilde):
        k_groups, v, gate_logits, gate_bias, cos, sin = ctx.saved_tensors
        chunk_size, has_rope = ctx.meta
        batch, seq, heads, dim = v.shape
        d_k_rot = torch.zeros_like(v, dtype=k_groups.dtype) if d_k_rot is None else d_k_rot.contiguous()
        d_v_tilde = torch.zeros_like(v) if d_v_tilde is None else d_v_tilde.contiguous()
        dk = torch.empty_like(k_groups)
        dv = torch.empty_like(v)
        dlogit = torch.empty_like(gate_logits)
        n_chunks = triton.cdiv(seq, chunk_size)
        dbias_parts = torch.empty(batch * n_chunks, heads * dim, device=v.device, dtype=torch.float32)
        _launch(
            _bwd_kernel, (k_groups, v, gate_logits, gate_bias, d_k_rot, d_v_tilde, dk, dv, dlogit, dbias_parts),
            k_groups, v, chunk_size, (cos, sin) if has_rope else None, BWD_WARPS,
        )
        dbias = dbias_parts.sum(0).to(gate_bias.dtype).view(gate_bias.shape)
        return dk, dv, dlogit, dbias, None, None, None, None


def rat_keys_values_triton(k_groups, v, gate_logits, gate_bias, chunk_size, cos_sin=None):
    """Inputs as :func:`rat_keys_values` (already checked); made contiguous once."""
    has_rope = cos_sin is not None
    cos, sin = (t.float().contiguous() for t in cos_sin) if has_rope else (v.new_empty(0), v.new_empty(0))
    return _RatKeysValues.apply(
        k_groups.contiguous(), v.contiguous(), gate_logits.contiguous(), gate_bias.contiguous(),
        cos, sin, chunk_size, has_rope,
    )
