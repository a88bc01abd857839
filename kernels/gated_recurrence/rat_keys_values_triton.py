"""Triton forward and backward of :func:`rat_keys_values` (math: rat_keys_values.py).

Forward: a program owns one chunk of L tokens of one batch row for a few heads and walks its
tokens: h_t = g_t h_{t-1} + (1 - g_t) x_t on [heads, D/2] float32 tiles (the two halves of
head_dim, which makes rotate-half RoPE elementwise), RoPE'd and stored per token. The state
starts at zero in every chunk, so chunks are independent programs; the small state keeps many
programs resident, which a memory-bound pass needs (the earlier one-program-per-group layout
scanned [L, D/2] tiles at 134 registers, one program per SM).

Backward: a program owns one chunk of one batch row for every head and walks its tokens from the
chunk's end with the adjoint c_t = dL/dh_t in total:

    c_t = dh_t + g_{t+1} c_{t+1}      (g_{t+1} = 0 past the chunk's end: the state restarts there)
    dx_t = (1 - g_t) c_t,   dg_t = c_k,t (hk_{t-1} - k_t) + c_v,t (hv_{t-1} - v_t)
    d logit_t = dg_t g_t (1 - g_t),   RoPE^T:  dh1 = dy1 cos1 + dy2 sin2,  dh2 = dy2 cos2 - dy1 sin1

The previous states h_{t-1} are the forward's outputs (v~, and k_rot rotated back), which the
attention keeps alive anyway; in 16-bit they carry the outputs' rounding (within the tests'
bf16 tolerance), in float32 they are exact. dk of a group sums its heads in registers; the gate
bias gets one partial sum per program (no atomics), added up by torch. (A scan-based backward
would recompute h_{t-1} with associative scans and read the gates three times, ~10x the forward.)
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..._compat.triton_launch import launch_cached


@triton.jit
def _rope_row(COS, SIN, table, in_seq, HALF: tl.constexpr, HAS_ROPE: tl.constexpr):
    """cos / sin halves of one token's RoPE row at the column offsets ``table`` ([1, width] tiles;
    cos 1, sin 0 without RoPE: every rotation below is then the identity)."""
    if HAS_ROPE:
        ok = (table * 0 + in_seq) != 0  # a [1, D/2] mask: the interpreter rejects scalar masks
        cos1 = tl.load(COS + table, mask=ok, other=1.0)
        cos2 = tl.load(COS + table + HALF, mask=ok, other=1.0)
        sin1 = tl.load(SIN + table, mask=ok, other=0.0)
        sin2 = tl.load(SIN + table + HALF, mask=ok, other=0.0)
    else:
        cos1 = (table * 0 + 1).to(tl.float32)
        cos2 = cos1
        sin1 = (table * 0).to(tl.float32)
        sin2 = sin1
    return cos1, cos2, sin1, sin2


@triton.jit
def _store_group_sums(DK_ROW, x1, x2, heads, cols, in_seq, GROUPS: tl.constexpr, HEADS: tl.constexpr,
                      D: tl.constexpr, HALF: tl.constexpr):
    """dk of one token: the [BLOCK_H, len(cols)] tiles of both halves summed over the heads of each
    key group (head h reads group h % GROUPS), stored at DK_ROW + group * D (+ HALF) + cols."""
    ok = (cols * 0 + in_seq) != 0
    if GROUPS == HEADS:
        tile_ok = ok[None, :] & (heads < HEADS)[:, None]
        tl.store(DK_ROW + heads[:, None] * D + cols[None, :], x1.to(DK_ROW.dtype.element_ty), mask=tile_ok)
        tl.store(DK_ROW + heads[:, None] * D + HALF + cols[None, :], x2.to(DK_ROW.dtype.element_ty), mask=tile_ok)
    else:
        for group in tl.static_range(GROUPS):
            mine = ((heads % GROUPS == group) & (heads < HEADS))[:, None]
            tl.store(DK_ROW + group * D + cols, tl.sum(tl.where(mine, x1, 0.0), 0).to(DK_ROW.dtype.element_ty), mask=ok)
            tl.store(DK_ROW + group * D + HALF + cols, tl.sum(tl.where(mine, x2, 0.0), 0).to(DK_ROW.dtype.element_ty),
                     mask=ok)


@triton.jit
def _head_tile(BIAS, heads, cols, GROUPS: tl.constexpr, HEADS: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr):
    """For a [heads, cols] tile: the mask of real heads, the first-half element offsets within a
    token row of v / the logits (first) and of k's groups (k_first, head h reads group h % GROUPS),
    and the gate bias of both halves in float32."""
    head_ok = (heads < HEADS)[:, None] & (cols >= 0)
    first = heads[:, None] * D + cols
    k_first = (heads % GROUPS)[:, None] * D + cols
    bias1 = tl.load(BIAS + first, mask=head_ok, other=0.0).to(tl.float32)
    bias2 = tl.load(BIAS + first + HALF, mask=head_ok, other=0.0).to(tl.float32)
    return head_ok, first, k_first, bias1, bias2


@launch_cached
@triton.jit
def _fwd_kernel(
    K, V, LOGIT, BIAS, COS, SIN, KROT, VT,
    T, n_chunks, sk_b, sk_t, sc_b, sc_t,
    GROUPS: tl.constexpr, HEADS: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
    L: tl.constexpr, HAS_ROPE: tl.constexpr, BLOCK_H: tl.constexpr, UNROLL: tl.constexpr,
):
    """One chunk of one batch row for BLOCK_H heads, token by token: the state is a few [BLOCK_H,
    D/2] float32 tiles, so many programs fit on an SM and the loads of later tokens do not wait
    for the recurrence. The token loop is a runtime loop over groups of UNROLL unrolled steps
    (UNROLL divides L): the loads of a group are in flight together, and the compiled code does
    not grow with L."""
    b = (tl.program_id(0) // n_chunks).to(tl.int64)
    t0 = ((tl.program_id(0) % n_chunks) * L).to(tl.int64)  # t * token stride passes 2**31 in long rows
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, HALF)[None, :]
    head_ok, first, k_first, bias1, bias2 = _head_tile(BIAS, heads, cols, GROUPS, HEADS, D, HALF)
    hk1 = tl.zeros([BLOCK_H, HALF], tl.float32)
    hk2 = hk1
    hv1 = hk1
    hv2 = hk1
    for s0 in range(0, L, UNROLL):
        for u in tl.static_range(UNROLL):
            step = s0 + u
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
            cos1, cos2, sin1, sin2 = _rope_row(COS, SIN, b * sc_b + t * sc_t + cols, t < T, HALF, HAS_ROPE)
            r1, r2 = hk1 * cos1 - hk2 * sin1, hk2 * cos2 + hk1 * sin2
            tl.store(KROT + row + first, r1.to(KROT.dtype.element_ty), mask=ok)
            tl.store(KROT + row + first + HALF, r2.to(KROT.dtype.element_ty), mask=ok)
            tl.store(VT + row + first, hv1.to(VT.dtype.element_ty), mask=ok)
            tl.store(VT + row + first + HALF, hv2.to(VT.dtype.element_ty), mask=ok)


@launch_cached
@triton.jit
def _bwd_kernel(
    K, V, LOGIT, BIAS, COS, SIN, KROT, VT, DKROT, DVT, DK, DV, DLOGIT, DBIAS,
    T, n_chunks, sk_b, sk_t, sc_b, sc_t,
    GROUPS: tl.constexpr, HEADS: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
    L: tl.constexpr, HAS_ROPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    UNROLL: tl.constexpr,
):
    """One chunk of one batch row for all heads (BLOCK_H >= HEADS, so a group's dk sums in
    registers) and BLOCK_D columns of each half, token by token from the chunk's end: the
    adjoints are [BLOCK_H, BLOCK_D] float32 tiles and the previous states come from the forward's
    outputs (KROT un-rotated, VT). Narrow column slices keep registers low and programs many.
    The token loop runs as the forward's: groups of UNROLL unrolled steps in a runtime loop."""
    # One flat grid, column slices fastest: the slices of one chunk run side by side, so the 128-byte
    # lines they split (BLOCK_D columns each) are fetched from memory once, not once per slice.
    slices = tl.cdiv(HALF, BLOCK_D)
    chunk_row = tl.program_id(0) // slices
    b = (chunk_row // n_chunks).to(tl.int64)
    t0 = ((chunk_row % n_chunks) * L).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    offs_d = (tl.program_id(0) % slices) * BLOCK_D + tl.arange(0, BLOCK_D)
    cols = offs_d[None, :]
    head_ok, first, k_first, bias1, bias2 = _head_tile(BIAS, heads, cols, GROUPS, HEADS, D, HALF)
    ck1 = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    ck2 = ck1
    cv1 = ck1
    cv2 = ck1
    g_next1 = ck1  # g_{t+1}; zero past the chunk's end (the recurrence restarts there)
    g_next2 = ck1
    dbias1 = ck1
    dbias2 = ck1
    cos1, cos2, sin1, sin2 = _rope_row(COS, SIN, b * sc_b + (t0 + L - 1) * sc_t + cols, t0 + L - 1 < T,
                                       HALF, HAS_ROPE)
    for b0 in range(0, L, UNROLL):
        for u in tl.static_range(UNROLL):
            step = L - 1 - (b0 + u)
            t = t0 + step
            ok = head_ok & ((cols * 0 + t) < T)
            row = (b * T + t) * (HEADS * D)
            g1 = tl.sigmoid(tl.load(LOGIT + row + first, mask=ok, other=0.0).to(tl.float32) + bias1)
            g2 = tl.sigmoid(tl.load(LOGIT + row + first + HALF, mask=ok, other=0.0).to(tl.float32) + bias2)
            dy1 = tl.load(DKROT + row + first, mask=ok, other=0.0).to(tl.float32)
            dy2 = tl.load(DKROT + row + first + HALF, mask=ok, other=0.0).to(tl.float32)
            # c_t = dh_t + g_{t+1} c_{t+1}, with dh of k~ = RoPE^T(d k_rot)
            ck1 = dy1 * cos1 + dy2 * sin2 + g_next1 * ck1
            ck2 = dy2 * cos2 - dy1 * sin1 + g_next2 * ck2
            cv1 = tl.load(DVT + row + first, mask=ok, other=0.0).to(tl.float32) + g_next1 * cv1
            cv2 = tl.load(DVT + row + first + HALF, mask=ok, other=0.0).to(tl.float32) + g_next2 * cv2
            tl.store(DV + row + first, ((1.0 - g1) * cv1).to(DV.dtype.element_ty), mask=ok)
            tl.store(DV + row + first + HALF, ((1.0 - g2) * cv2).to(DV.dtype.element_ty), mask=ok)
            k_row = b * sk_b + t * sk_t
            _store_group_sums(DK + k_row, (1.0 - g1) * ck1, (1.0 - g2) * ck2, heads, offs_d, t < T,
                              GROUPS, HEADS, D, HALF)
            # dg_t = c_k (hk_{t-1} - k_t) + c_v (hv_{t-1} - v_t); h_{t-1} = 0 at the chunk's start
            d1 = -(ck1 * tl.load(K + k_row + k_first, mask=ok, other=0.0).to(tl.float32)
                   + cv1 * tl.load(V + row + first, mask=ok, other=0.0).to(tl.float32))
            d2 = -(ck2 * tl.load(K + k_row + k_first + HALF, mask=ok, other=0.0).to(tl.float32)
                   + cv2 * tl.load(V + row + first + HALF, mask=ok, other=0.0).to(tl.float32))
            if step > 0:
                prev = row - HEADS * D
                cos1, cos2, sin1, sin2 = _rope_row(COS, SIN, b * sc_b + (t - 1) * sc_t + cols, t - 1 < T,
                                                   HALF, HAS_ROPE)
                r1 = tl.load(KROT + prev + first, mask=ok, other=0.0).to(tl.float32)
                r2 = tl.load(KROT + prev + first + HALF, mask=ok, other=0.0).to(tl.float32)
                d1 += ck1 * (r1 * cos1 + r2 * sin2) + cv1 * tl.load(VT + prev + first, mask=ok, other=0.0).to(tl.float32)
                d2 += ck2 * (r2 * cos2 - r1 * sin1) + cv2 * tl.load(VT + prev + first + HALF, mask=ok, other=0.0).to(tl.float32)
            dl1 = tl.where(ok, d1 * g1 * (1.0 - g1), 0.0)
            dl2 = tl.where(ok, d2 * g2 * (1.0 - g2), 0.0)
            tl.store(DLOGIT + row + first, dl1.to(DLOGIT.dtype.element_ty), mask=ok)
            tl.store(DLOGIT + row + first + HALF, dl2.to(DLOGIT.dtype.element_ty), mask=ok)
            dbias1 += dl1
            dbias2 += dl2
            g_next1 = g1
            g_next2 = g2
    bias_row = DBIAS + chunk_row.to(tl.int64) * (HEADS * D)
    tl.store(bias_row + first, dbias1, mask=head_ok)
    tl.store(bias_row + first + HALF, dbias2, mask=head_ok)


# Both kernels walk the L tokens of a chunk. The forward takes FWD_HEADS heads x D/2 columns per
# program: 8 heads x 4 warps is as fast as 16 x 8 and faster than smaller tiles
# (`python -m benchmarks.tune`).
# The backward takes every head (a group's dk sums in registers) x BWD_BLOCK_D columns.
FWD_HEADS, FWD_WARPS = 8, 4
BWD_BLOCK_D, BWD_WARPS = 16, 4
# Tokens unrolled per iteration of the runtime token loop (at most; a divisor of L). Unrolling all
# L tokens kept more loads in flight but made the sm_90 build grow much faster than L, the largest
# part of a first RAT training step's compiles (docs/benchmarks/rat.md, "First use"); the backward's
# registers grow with its unroll too. `python -m benchmarks.compile_cost --unroll` prints both,
# `python -m benchmarks.tune --only keys_values` times the choices on a GPU.
FWD_UNROLL, BWD_UNROLL = 4, 2


def unroll_for(chunk_size: int, most: int) -> int:
    """The largest power of two that divides ``chunk_size`` and is at most ``most``."""
    return math.gcd(chunk_size, 1 << (most.bit_length() - 1))


def _launch(kernel, tensors, k_groups, v, chunk_size, cos_sin, num_warps, grid_y, **blocks):
    """Grid (batch x chunk, grid_y) with head blocks in the forward; the backward's column slices
    ride in the first axis (batch x chunk x slice, slices fastest; grid_y = 1)."""
    batch, seq, heads, dim = v.shape
    n_chunks = triton.cdiv(seq, chunk_size)
    cos, sin = cos_sin if cos_sin is not None else (v, v)  # never read without RoPE
    sc_b = 0 if cos.shape[0] == 1 else cos.stride(0)
    slices = triton.cdiv(dim // 2, blocks["BLOCK_D"]) if "BLOCK_D" in blocks else 1
    kernel[(batch * n_chunks * slices, grid_y)](
        *tensors[:4], cos, sin, *tensors[4:],
        seq, n_chunks, k_groups.stride(0), k_groups.stride(1), sc_b, cos.stride(1),
        GROUPS=k_groups.shape[2], HEADS=heads, D=dim, HALF=dim // 2, L=chunk_size, HAS_ROPE=cos_sin is not None,
        num_warps=num_warps, **blocks,
    )


class _RatKeysValues(torch.autograd.Function):
    @staticmethod
    def forward(ctx, k_groups, v, gate_logits, gate_bias, cos, sin, chunk_size, has_rope):
        cos_sin = (cos, sin) if has_rope else None
        k_rot = torch.empty(v.shape, device=v.device, dtype=k_groups.dtype)
        v_tilde = torch.empty_like(v)
        block_h = min(FWD_HEADS, triton.next_power_of_2(v.shape[2]))
        _launch(_fwd_kernel, (k_groups, v, gate_logits, gate_bias, k_rot, v_tilde), k_groups, v, chunk_size, cos_sin,
                FWD_WARPS, triton.cdiv(v.shape[2], block_h), BLOCK_H=block_h, UNROLL=unroll_for(chunk_size, FWD_UNROLL))
        ctx.save_for_backward(k_groups, v, gate_logits, gate_bias, cos, sin, k_rot, v_tilde)
        ctx.meta = (chunk_size, has_rope)
        return k_rot, v_tilde

    @staticmethod
    def backward(ctx, d_k_rot, d_v_tilde):
        k_groups, v, gate_logits, gate_bias, cos, sin, k_rot, v_tilde = ctx.saved_tensors
        chunk_size, has_rope = ctx.meta
        batch, seq, heads, dim = v.shape
        d_k_rot = torch.zeros_like(v, dtype=k_groups.dtype) if d_k_rot is None else d_k_rot.contiguous()
        d_v_tilde = torch.zeros_like(v) if d_v_tilde is None else d_v_tilde.contiguous()
        dk = torch.empty_like(k_groups)
        dv = torch.empty_like(v)
        dlogit = torch.empty_like(gate_logits)
        block_d = min(BWD_BLOCK_D, dim // 2)
        dbias_parts = torch.empty(batch * triton.cdiv(seq, chunk_size), heads * dim, device=v.device, dtype=torch.float32)
        _launch(
            _bwd_kernel,
            (k_groups, v, gate_logits, gate_bias, k_rot, v_tilde, d_k_rot, d_v_tilde, dk, dv, dlogit, dbias_parts),
            k_groups, v, chunk_size, (cos, sin) if has_rope else None, BWD_WARPS, 1,
            BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=block_d, UNROLL=unroll_for(chunk_size, BWD_UNROLL),
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
