"""Forgetting Attention forward for Hopper (sm_90), written in Gluon with explicit warp specialisation.

The same function and outputs (o, and the log2-sum-exp the backward reads) as
``triton._fwd_kernel``, whose design notes apply (log2 units, the per-block reference c_ref so
that the bias stays small). What the portable kernel leaves to Triton's compiler is written out
here, because Triton 3.6's automatic warp specialisation of the same loop deadlocked on the H100:

* three partitions per program of 128 query rows: a one-warp **loader** that moves Q once and the
  K and V tiles of every key block through TMA into a ring of shared-memory stages, and two
  **softmax warpgroups** of four warps, each owning 64 of the query rows;
* K and V have their own ready / empty mbarriers per stage, so the score product of a key block
  starts as soon as its K lands and its stage is refilled as soon as both warpgroups' products
  with it are done (each arrives once on the empty barrier, initialised with count 2);
* in each warpgroup the next block's Q K^T and the current block's P V are issued together as
  asynchronous wgmma and the softmax of the scores runs while P V is still on the tensor cores
  (FlashAttention-3's intra-warpgroup overlap); P goes to the second product from registers;
* the loader also stages each key block's forget bias, (c_j - c_ref) in log2 units, in shared
  memory: when every softmax thread loaded its 32 columns from global memory, the 64-bit address
  arithmetic was ~40% of the loop's instructions; only key blocks that reach the diagonal or the
  sequence's end apply the causal mask.

Measured on an H100 (docs/benchmarks_fox.md): forward 1.2-1.4x cuDNN's causal attention at 4K
and 1.0-1.1x from 32K (16 heads x 128), where the portable kernel is 1.4-1.8x. A persistent grid
striding over the work items, FlashAttention-3's ping-pong between the warpgroups and other tiles
were slower (same page).
Causal attention without a window only; 16-bit inputs, head_dim 64 or 128. Everything else
takes the portable kernel.
"""
from __future__ import annotations

import os

import torch
import triton

try:  # Gluon ships with Triton >= 3.5
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: the portable kernel only
    gluon = None

HEAD_DIMS = (64, 128)
BLOCK_M = 128  # query rows per program: two warpgroups of 64
BLOCK_N = 128  # keys per block
STAGES = {64: 3, 128: 2}  # K/V ring depth per head_dim (shared memory: 112 / 160 KB)
MAX_REGISTERS = 168  # per thread at launch; the partitions rebalance to 240 (softmax) and LOADER_REGISTERS
LOADER_REGISTERS = 32  # per loader thread (read inside the kernel: a Triton constexpr below)

if gluon is not None:
    # Triton >= 3.7 calls the TMA load async_load; 3.6 (the GPU image) has only the old name.
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    LOG2E: gl.constexpr = gl.constexpr(1.4426950408889634)
    _LOADER_REGS: gl.constexpr = gl.constexpr(LOADER_REGISTERS)

    @gluon.jit
    def _load_partition(desc_q, desc_k, desc_v, q_smem, k_smem, v_smem, c_smem, bars, coords, c_row, start_m, seq_len,
                        n_blocks, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        """One warp: Q's two halves once, then K, V and the keys' forget bias of every key block
        into the stage ring. The bias, (c_j - c_ref) in log2 units, goes through shared memory so
        that the softmax warpgroups read it ready to use, without per-element address arithmetic
        (which took ~40% of their instructions when each thread loaded its columns itself)."""
        q_bar, k_ready, k_empty, v_ready, v_empty = bars
        q_row, q_col, kv_row, kv_col = coords
        c_layout: gl.constexpr = gl.BlockedLayout([BLOCK_N // 32], [32], [1], [0])
        offs_c = gl.arange(0, BLOCK_N, layout=c_layout)
        c_ref = gl.load(c_row + start_m)
        half: gl.constexpr = desc_q.block_type.shape[0]
        mbarrier.expect(q_bar, 2 * desc_q.block_type.nbytes)
        _tma_load(desc_q, [q_row, q_col], q_bar, q_smem.index(0))
        _tma_load(desc_q, [q_row + half, q_col], q_bar, q_smem.index(1))
        for i in range(n_blocks):
            stage = i % STAGES
            # A fresh mbarrier counts as having completed the phase before its first, so the
            # first lap through the ring does not wait.
            free_phase = ((i // STAGES) & 1) ^ 1
            mbarrier.wait(k_empty.index(stage), free_phase)
            mbarrier.expect(k_ready.index(stage), desc_k.block_type.nbytes)
            _tma_load(desc_k, [kv_row + i * BLOCK_N, kv_col], k_ready.index(stage), k_smem.index(stage))
            cols = i * BLOCK_N + offs_c
            c_smem.index(stage).store((gl.load(c_row + cols, mask=cols < seq_len, other=0.0) - c_ref) * LOG2E)
            mbarrier.arrive(k_ready.index(stage), count=1)  # the second of k_ready's two arrivals
            mbarrier.wait(v_empty.index(stage), free_phase)
            mbarrier.expect(v_ready.index(stage), desc_v.block_type.nbytes)
            _tma_load(desc_v, [kv_row + i * BLOCK_N, kv_col], v_ready.index(stage), v_smem.index(stage))

    @gluon.jit
    def _softmax_partition(q_smem, k_smem, v_smem, c_smem, bars, c_row, O, lse_row, scalars, wg: gl.constexpr,
                           HALF: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                           STAGES: gl.constexpr):
        """One warpgroup: online softmax over the key blocks for query rows [row0, row0 + HALF)."""
        q_bar, k_ready, k_empty, v_ready, v_empty = bars
        start_m, seq_len, n_blocks, n_unmasked, tok0, o_col, stride_ot, scale2 = scalars
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        cols_s: gl.constexpr = gl.SliceLayout(0, s_layout)
        rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        cols_o: gl.constexpr = gl.SliceLayout(0, o_layout)

        row0 = start_m + wg * HALF
        offs_m = row0 + gl.arange(0, HALF, layout=rows_s)
        offs_n = gl.arange(0, BLOCK_N, layout=cols_s)
        # Key j is visible to row i iff j <= min(i, seq_len - 1): one compare per score.
        last_key = gl.minimum(offs_m, seq_len - 1)
        c_ref2 = gl.load(c_row + start_m) * LOG2E
        no_scores = gl.zeros([HALF, BLOCK_N], gl.float32, layout=s_layout)
        acc = gl.zeros([HALF, HEAD_DIM], gl.float32, layout=o_layout)
        q = q_smem.index(wg)

        # Key block 0: scores only (no P V yet).
        mbarrier.wait(q_bar, 0)
        mbarrier.wait(k_ready.index(0), 0)
        s_tok = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), no_scores, use_acc=False, is_async=True)
        bias = c_smem.index(0).load(cols_s)
        s = warpgroup_mma_wait(0, deps=(s_tok, ))
        mbarrier.arrive(k_empty.index(0), count=1)
        # log2-unit score minus the row constant (c_i - c_ref), which the LSE adds back.
        s = s * scale2 - bias[None, :]
        if n_unmasked == 0:
            s = gl.where(last_key[:, None] >= offs_n[None, :], s, float("-inf"))
        m_i = gl.max(s, 1)
        p = gl.exp2(s - m_i[:, None])
        l_i = gl.sum(p, 1)
        p_op = gl.convert_layout(p.to(v_smem.dtype), p_layout)

        for i in range(1, n_blocks):
            stage = i % STAGES
            prev = (i - 1) % STAGES
            mbarrier.wait(k_ready.index(stage), (i // STAGES) & 1)
            mbarrier.wait(v_ready.index(prev), ((i - 1) // STAGES) & 1)
            s_tok = warpgroup_mma(q, k_smem.index(stage).permute((1, 0)), no_scores, use_acc=False, is_async=True)
            o_tok = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
            bias = c_smem.index(stage).load(cols_s)
            s = warpgroup_mma_wait(1, deps=(s_tok, ))  # this block's scores; P V may still run
            mbarrier.arrive(k_empty.index(stage), count=1)
            s = s * scale2 - bias[None, :]
            if i >= n_unmasked:
                s = gl.where(last_key[:, None] >= (i * BLOCK_N + offs_n)[None, :], s, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, 1))
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + gl.sum(p, 1)
            acc = warpgroup_mma_wait(0, deps=(o_tok, ))
            mbarrier.arrive(v_empty.index(prev), count=1)
            acc = acc * gl.convert_layout(alpha, rows_o)[:, None]
            p_op = gl.convert_layout(p.to(v_smem.dtype), p_layout)
            m_i = m_new

        last = (n_blocks - 1) % STAGES
        mbarrier.wait(v_ready.index(last), ((n_blocks - 1) // STAGES) & 1)
        o_tok = warpgroup_mma(p_op, v_smem.index(last), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(o_tok, ))
        mbarrier.arrive(v_empty.index(last), count=1)

        m_ok = offs_m < seq_len
        c_rows2 = gl.load(c_row + offs_m, mask=m_ok, other=0.0) * LOG2E
        gl.store(lse_row + tok0 + offs_m, m_i + gl.log2(l_i) + (c_rows2 - c_ref2), mask=m_ok)
        out = acc / gl.convert_layout(l_i, rows_o)[:, None]
        offs_mo = row0 + gl.arange(0, HALF, layout=rows_o)
        offs_d = gl.arange(0, HEAD_DIM, layout=cols_o)
        tok = tok0 + offs_mo.to(gl.int64)
        # A pointer store: a TMA store of a block that runs past its sequence would overwrite the
        # next sequence's rows.
        gl.store(O + tok[:, None] * stride_ot + o_col + offs_d[None, :], out.to(O.dtype.element_ty),
                 mask=(offs_mo < seq_len)[:, None])

    @gluon.jit
    def _fwd_kernel(desc_q, desc_k, desc_v, C, O, LSE, CU, scale2, stride_ot, stride_ch,
                    GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                    num_warps: gl.constexpr):
        HALF: gl.constexpr = desc_q.block_type.shape[0]
        # Heaviest (last) query blocks first: better tail balance under the causal mask.
        pid_m = gl.num_programs(0) - 1 - gl.program_id(0)
        h = gl.program_id(1)
        seq = gl.program_id(2)
        seq_start = gl.load(CU + seq)
        seq_len = gl.load(CU + seq + 1) - seq_start
        start_m = pid_m * (2 * HALF)
        if start_m < seq_len:
            n_blocks = gl.cdiv(gl.minimum(start_m + 2 * HALF, seq_len), BLOCK_N)
            n_unmasked = start_m // BLOCK_N  # key blocks wholly before the first row: no mask
            q_smem = gl.allocate_shared_memory(desc_q.dtype, [2] + desc_q.block_type.shape, desc_q.layout)
            k_smem = gl.allocate_shared_memory(desc_k.dtype, [STAGES] + desc_k.block_type.shape, desc_k.layout)
            v_smem = gl.allocate_shared_memory(desc_v.dtype, [STAGES] + desc_v.block_type.shape, desc_v.layout)
            c_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N],
                                               gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))
            q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            mbarrier.init(q_bar, count=1)
            for i in gl.static_range(STAGES):
                mbarrier.init(k_ready.index(i), count=2)  # the TMA's expect + the loader's bias store
                mbarrier.init(k_empty.index(i), count=2)  # one arrival per softmax warpgroup
                mbarrier.init(v_ready.index(i), count=1)
                mbarrier.init(v_empty.index(i), count=2)
            bars = (q_bar, k_ready, k_empty, v_ready, v_empty)
            tok0 = seq_start.to(gl.int64)
            c_row = C + h * stride_ch + tok0
            lse_row = LSE + h * stride_ch
            coords = (seq_start + start_m, h * HEAD_DIM, seq_start, (h // GROUP) * HEAD_DIM)
            scalars = (start_m, seq_len, n_blocks, n_unmasked, tok0, h * HEAD_DIM, stride_ot, scale2)
            gl.warp_specialize([
                (_softmax_partition, (q_smem, k_smem, v_smem, c_smem, bars, c_row, O, lse_row, scalars, 0,
                                      HALF, BLOCK_N, HEAD_DIM, STAGES)),
                (_softmax_partition, (q_smem, k_smem, v_smem, c_smem, bars, c_row, O, lse_row, scalars, 1,
                                      HALF, BLOCK_N, HEAD_DIM, STAGES)),
                (_load_partition, (desc_q, desc_k, desc_v, q_smem, k_smem, v_smem, c_smem, bars, coords, c_row, start_m,
                                   seq_len, n_blocks, BLOCK_N, STAGES)),
            ], [4, 1], [240, _LOADER_REGS])
else:  # pragma: no cover
    _fwd_kernel = None


def hopper_forward_applies(q: torch.Tensor, window_size) -> bool:
    """Whether the forward takes this path: a Hopper GPU, 16-bit inputs, head_dim 64 or 128,
    causal without a window, Gluon available. ``HF_HYBRID_FOX_HOPPER=0`` keeps the portable kernel
    (A/B runs); everything else takes it anyway."""
    if gluon is None or window_size is not None or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    if q.shape[-1] not in HEAD_DIMS or os.environ.get("HF_HYBRID_FOX_HOPPER", "1") == "0":
        return False
    return q.is_cuda and torch.cuda.get_device_capability(q.device)[0] == 9


def _descriptor(x: torch.Tensor, rows: int) -> "TensorDescriptor":
    """A 2-D descriptor over [tokens, heads * head_dim]; one tile is [rows, head_dim] of one head.
    Rows past a sequence's end are the next sequence's tokens (hidden by the mask), rows past the
    tensor are zeros."""
    total, heads, d = x.shape
    flat = x.view(total, heads * d)
    dtype = gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16
    layout = gl.NVMMASharedLayout.get_default_for([rows, d], dtype)
    return TensorDescriptor(flat, [total, heads * d], [heads * d, 1], [rows, d], layout)


def forward(q, k, v, c_t, cu, max_len, scale):
    """q [N_tok, HQ, D], k/v [N_tok, HKV, D] contiguous 16-bit, c_t [HQ, N_tok] float32
    -> (o [N_tok, HQ, D], lse [HQ, N_tok] float32), as ``triton._forward`` without a window."""
    total, hq, d = q.shape
    o = torch.empty_like(q)
    lse = torch.empty((hq, total), device=q.device, dtype=torch.float32)
    grid = (triton.cdiv(max_len, BLOCK_M), hq, cu.numel() - 1)
    _fwd_kernel[grid](
        _descriptor(q, BLOCK_M // 2), _descriptor(k, BLOCK_N), _descriptor(v, BLOCK_N), c_t, o, lse, cu,
        scale * 1.4426950408889634, o.stride(0), c_t.stride(0),
        GROUP=hq // k.shape[1], HEAD_DIM=d, BLOCK_N=BLOCK_N, STAGES=STAGES[d], num_warps=4, maxnreg=MAX_REGISTERS,
    )
    return o, lse
