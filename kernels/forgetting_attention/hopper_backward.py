"""Forgetting Attention backward for Hopper (sm_90) in Gluon: five products, dQ by TMA reduce-add.

The same gradients as ``triton._dkdv_kernel`` + ``triton._dq_kernel`` (whose design notes apply:
log2 units, the per-block reference c_ref), in one kernel instead of two. The portable backward
recomputes P and dP in a second kernel for dQ (seven matrix products per key-query tile); here each
program of 128 keys adds its share of dQ = dS K into a float32 buffer with TMA reduce-add, as
FlashAttention-3 does, so each tile costs the five products of the dense backward.

Schedule: a program takes a block of 128 keys of one KV head and then the mirror block from its
sequence's end (block n - 1 - p after block p), so programs carry about equal work and half as many
start and end (a program's start and end cost more than the step between its two blocks); the
last (KV head, sequence) pairs of the grid run one block per program, heaviest first, so the last
wave of equal programs does not leave most multiprocessors idle (``SINGLE_WAVES``).

Per key block (128 keys of one KV head), warp-specialised:

* a one-warp **loader** moves K and V (once a program's first block is done with them, the second
  block's) and, per query block of 64, Q and dO through TMA into a
  two-stage ring, and stages the block's row terms (c_i - c_ref) log2(e) - lse_i and delta_i in
  shared memory (loaded by every compute thread from global memory they cost registers that spilled);
* two **compute warpgroups**, 64 keys each: S^T = K Q^T and dP^T = V dO^T, P^T and dS^T in
  registers, dV += P^T dO with P from registers, dS^T to shared memory, dK += dS^T Q from there, then
  (both warpgroups' dS in place) dQ = dS K, each warpgroup taking half of dQ's columns, staged in
  shared memory and added to global memory by TMA reduce-add (double-buffered);
* dK and dV leave through the dQ staging buffers (free once the last reduce-add has read them) and TMA
  stores, not 4-byte stores from the accumulators' registers, which matters at short sequences, where a
  program's end is a larger share (blocks that run past their sequence's end keep masked stores);
* a one-warp **row-sum** partition adds up each query's dS over the program's keys (the queries'
  share of the forget gate's gradient, which cancels the rounding of the bf16 output in delta) and
  adds it into a float32 buffer with atomics, off the compute warpgroups' path: in the compute
  warpgroups that sum runs across warps (keys are rows) and slows the whole kernel.

dQ's summation order depends on the run (float atomics); ``torch.use_deterministic_algorithms(True)``
keeps the portable two-kernel backward. Causal attention without a window only; 16-bit inputs,
head_dim 64 or 128 (shared memory: 226 KB at 128).

The default on sm_90 (deterministic algorithms keep the portable pair), being clearly faster than
the portable pair (`python -m hf_hybrid.bench.forgetting_attention`; docs/benchmarks/fox.md).
Registers decide its speed: with fewer than 240 per compute thread ptxas serialises the wgmma
(``PARTITION_REGISTERS``), and with more live accumulators (the next block's S^T and dP^T issued
early) it spills. Both sides of d log f add up the same bf16-rounded dS (the queries' row sums read
it from shared memory), so their rounding cancels in the reverse cumulative sum as in the portable
kernels; the GPU tests hold every gradient to 1e-2 of float64.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._common import multiprocessors
from ..._compat.gluon_tma import tma_reduce_add
from ..._compat.triton_launch import launch_cached
from .hopper import HEAD_DIMS, _descriptor, gluon

# The one-warp partitions' registers. setmaxnreg works per warpgroup, so the loader, the row-sum warp
# and two idle warps hold 4 x 32 x this; the default partition (compute warpgroup 0) gets what is
# left of 168 x 384. At 32 that was 232, and ptxas then serialised every wgmma of the kernel
# ("insufficient register resources": no product overlapped another, 10% slower); at 24 both
# compute warpgroups get 240.
PARTITION_REGISTERS = 24

if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from .hopper import _mbarriers

    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    # Triton 3.6 (the GPU image) names the shared-memory type pun _reinterpret; newer Triton reinterpret.
    _PUBLIC_REINTERPRET: gl.constexpr = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))
    LOG2E: gl.constexpr = gl.constexpr(1.4426950408889634)
    _PARTITION_REGS: gl.constexpr = gl.constexpr(PARTITION_REGISTERS)

    _tma_reduce_add = tma_reduce_add()  # None on a Triton without it: the portable backward runs

    @gluon.jit
    def _opaque_zero(x):
        """0, computed from x by an instruction the compiler cannot see through.

        Shared-memory descriptors indexed with it are rebuilt in every step (a few integer
        instructions): hoisted out of the step loop they live in registers across the whole program,
        and at 240 registers ptxas spilled them and reloaded them from local memory right before
        each product (19% slower)."""
        return gl.inline_asm_elementwise("mov.u32 $0, 0;", "=r,r", [x], dtype=gl.int32, is_pure=True, pack=1)

    @gluon.jit
    def _load_item(desc_q, desc_do, desc_k, desc_v, k_smem, v_smem, q_smem, do_smem, row_smem, delta_smem, bars, rows,
                   start_n, step0, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_Q: gl.constexpr,
                   STAGES: gl.constexpr):
        """One key block: its K and V, then Q, dO and the row terms of every query block of every head
        of the group into the stage ring (ring position step0 onwards)."""
        kv_bar, kv_empty, q_ready, q_empty, do_ready, do_empty, ds_ready, ds_free = bars
        C, LSE, DELTA, tok0, seq_start, stride_ch, seq_len, kvh = rows
        r_layout: gl.constexpr = gl.BlockedLayout([BLOCK_Q // 32], [32], [1], [0])
        offs = gl.arange(0, BLOCK_Q, layout=r_layout)
        half: gl.constexpr = desc_k.block_type.shape[0]
        n_q = gl.cdiv(seq_len - start_n, BLOCK_Q)
        mbarrier.expect(kv_bar, 4 * desc_k.block_type.nbytes)
        _tma_load(desc_k, [seq_start + start_n, kvh * HEAD_DIM], kv_bar, k_smem.index(0))
        _tma_load(desc_k, [seq_start + start_n + half, kvh * HEAD_DIM], kv_bar, k_smem.index(1))
        _tma_load(desc_v, [seq_start + start_n, kvh * HEAD_DIM], kv_bar, v_smem.index(0))
        _tma_load(desc_v, [seq_start + start_n + half, kvh * HEAD_DIM], kv_bar, v_smem.index(1))
        for t in range(GROUP * n_q):
            g = t // n_q
            qm = start_n + (t - g * n_q) * BLOCK_Q
            h = kvh * GROUP + g
            i = step0 + t
            stage = i % STAGES
            free_phase = ((i // STAGES) & 1) ^ 1  # a fresh mbarrier passes the wait of the phase before
            mbarrier.wait(q_empty.index(stage), free_phase)
            mbarrier.expect(q_ready.index(stage), desc_q.block_type.nbytes)
            _tma_load(desc_q, [seq_start + qm, h * HEAD_DIM], q_ready.index(stage), q_smem.index(stage))
            rows_q = qm + offs
            ok = rows_q < seq_len
            base = h * stride_ch + tok0
            c_ref = gl.load(C + base + start_n) * LOG2E
            # Past the sequence's end lse = +inf, so P = 0 there.
            row_smem.index(stage).store((gl.load(C + base + rows_q, mask=ok, other=0.0) * LOG2E - c_ref)
                                        - gl.load(LSE + base + rows_q, mask=ok, other=float("inf")))
            delta_smem.index(stage).store(gl.load(DELTA + base + rows_q, mask=ok, other=0.0))
            mbarrier.arrive(q_ready.index(stage), count=1)  # the second of q_ready's two arrivals
            mbarrier.wait(do_empty.index(stage), free_phase)
            mbarrier.expect(do_ready.index(stage), desc_do.block_type.nbytes)
            _tma_load(desc_do, [seq_start + qm, h * HEAD_DIM], do_ready.index(stage), do_smem.index(stage))

    @gluon.jit
    def _load_partition(desc_q, desc_do, desc_k, desc_v, k_smem, v_smem, q_smem, do_smem, row_smem, delta_smem, bars,
                        rows, pair, mirror, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_Q: gl.constexpr,
                        STAGES: gl.constexpr):
        """One warp: the program's key block, then (once both warpgroups' last products have read K and
        V) its mirror block if it has one (mirror > pair), each as ``_load_item``."""
        kv_empty = bars[1]
        seq_len = rows[6]
        keys: gl.constexpr = 2 * desc_k.block_type.shape[0]
        _load_item(desc_q, desc_do, desc_k, desc_v, k_smem, v_smem, q_smem, do_smem, row_smem, delta_smem, bars, rows,
                   pair * keys, 0, GROUP, HEAD_DIM, BLOCK_Q, STAGES)
        if mirror > pair:
            mbarrier.wait(kv_empty, 0)
            _load_item(desc_q, desc_do, desc_k, desc_v, k_smem, v_smem, q_smem, do_smem, row_smem, delta_smem, bars,
                       rows, mirror * keys, GROUP * gl.cdiv(seq_len - pair * keys, BLOCK_Q), GROUP, HEAD_DIM, BLOCK_Q,
                       STAGES)

    @gluon.jit
    def _compute_item(k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, row_smem, delta_smem, desc_dq, desc_dk,
                      desc_dv, bars, ptrs, scalars, start_n, step0, kv_phase, wg: gl.constexpr, GROUP: gl.constexpr,
                      HALF: gl.constexpr, BLOCK_Q: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
        """One warpgroup, one key block: keys [start_n + wg * HALF, + HALF); dK, dV, the keys' dc, half
        of dQ's columns."""
        kv_bar, kv_empty, q_ready, q_empty, do_ready, do_empty, ds_ready, ds_free = bars
        C, DK, DV, DC = ptrs
        seq_len, tok0, seq_start, kvh, stride_ch, stride_kt, scale, scale2 = scalars
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_Q, 16])
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, HEAD_DIM, 16])
        DQ_COLS: gl.constexpr = HEAD_DIM // 2
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, DQ_COLS, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        keys_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        queries_s: gl.constexpr = gl.SliceLayout(0, s_layout)
        rows_acc: gl.constexpr = gl.SliceLayout(1, acc_layout)
        cols_acc: gl.constexpr = gl.SliceLayout(0, acc_layout)

        key0 = start_n + wg * HALF
        kn = key0 + gl.arange(0, HALF, layout=keys_s)
        k_ok = kn < seq_len
        offs_q = gl.arange(0, BLOCK_Q, layout=queries_s)
        dk = gl.zeros([HALF, HEAD_DIM], gl.float32, layout=acc_layout)
        dv = gl.zeros([HALF, HEAD_DIM], gl.float32, layout=acc_layout)
        n_q = gl.cdiv(seq_len - start_n, BLOCK_Q)  # start_n is a multiple of BLOCK_Q
        mbarrier.wait(kv_bar, kv_phase)
        tma.store_wait(0)  # the block before's dK / dV copies have read the dQ staging buffers
        for g in range(GROUP):
            h = kvh * GROUP + g
            c_row = C + h * stride_ch + tok0
            c_ref = gl.load(c_row + start_n) * LOG2E
            kb = gl.load(c_row + kn, mask=k_ok, other=0.0) * LOG2E - c_ref
            dc = gl.zeros([HALF], gl.float32, layout=keys_s)
            dq_row0 = seq_start + start_n
            for j in range(n_q):
                i = step0 + g * n_q + j
                stage = i % STAGES
                phase = (i // STAGES) & 1
                buf = i % 2
                zero = _opaque_zero(i)
                k_w = k_smem.index(wg + zero)
                v_w = v_smem.index(wg + zero)
                k_cols0 = k_smem.index(zero).slice(wg * DQ_COLS, DQ_COLS, dim=1)
                k_cols1 = k_smem.index(1 + zero).slice(wg * DQ_COLS, DQ_COLS, dim=1)
                mbarrier.wait(q_ready.index(stage), phase)
                s_tok = warpgroup_mma(k_w, q_smem.index(stage).permute((1, 0)),
                                      gl.zeros([HALF, BLOCK_Q], gl.float32, layout=s_layout), use_acc=False,
                                      is_async=True)
                mbarrier.wait(do_ready.index(stage), phase)
                dp_tok = warpgroup_mma(v_w, do_smem.index(stage).permute((1, 0)),
                                       gl.zeros([HALF, BLOCK_Q], gl.float32, layout=s_layout), use_acc=False,
                                       is_async=True)
                row = row_smem.index(stage).load(queries_s)
                s = warpgroup_mma_wait(1, deps=(s_tok, ))
                p = gl.exp2(s * scale2 - kb[:, None] + row[None, :])
                if j * BLOCK_Q < 2 * HALF:  # blocks that reach the diagonal
                    p = gl.where((start_n + j * BLOCK_Q + offs_q)[None, :] >= kn[:, None], p, 0.0)
                p_op = gl.convert_layout(p.to(q_smem.dtype), a_layout)
                dv_tok = warpgroup_mma(p_op, do_smem.index(stage), dv, is_async=True)
                delta = delta_smem.index(stage).load(queries_s)
                dp = warpgroup_mma_wait(1, deps=(dp_tok, ))
                # dc's key and query sums must add the same (rounded) values: the query sums read
                # the bf16 dS from shared memory, and a key sum of the float32 dS left 2.3e-2
                # relative error in d log f against float64 (the two sides no longer cancel).
                ds = (p * (dp - delta[None, :])).to(q_smem.dtype)
                dc += gl.sum(ds.to(gl.float32), 1)
                # dS^T through shared memory: the A operand of dK += dS^T Q and, transposed and with
                # the other warpgroup's keys, of dQ = dS K; the row-sum warp reads it too.
                mbarrier.wait(ds_free.index(buf), ((i // 2) & 1) ^ 1)
                ds_smem.index(2 * buf + wg).store(ds)
                fence_async_shared()
                mbarrier.arrive(ds_ready.index(buf), count=1)
                dk_tok = warpgroup_mma(ds_smem.index(2 * buf + wg), q_smem.index(stage), dk, is_async=True)
                mbarrier.wait(ds_ready.index(buf), (i // 2) & 1)
                dq_tok = warpgroup_mma(ds_smem.index(2 * buf).permute((1, 0)), k_cols0,
                                       gl.zeros([BLOCK_Q, DQ_COLS], gl.float32, layout=dq_layout), use_acc=False,
                                       is_async=True)
                dq_tok = warpgroup_mma(ds_smem.index(2 * buf + 1).permute((1, 0)), k_cols1, dq_tok, is_async=True)
                dv, dk, dq = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, dq_tok))
                mbarrier.arrive(ds_free.index(buf), count=1)
                mbarrier.arrive(q_empty.index(stage), count=1)
                mbarrier.arrive(do_empty.index(stage), count=1)
                tma.store_wait(1)  # the reduce-add that read this staging buffer two steps ago is done
                dq_smem.index(2 * buf + wg).store(dq)
                fence_async_shared()
                # Rows past the sequence's end carry dS = 0: adding them changes nothing.
                _tma_reduce_add(desc_dq, [dq_row0 + j * BLOCK_Q, h * HEAD_DIM + wg * DQ_COLS],
                                dq_smem.index(2 * buf + wg))
            gl.store(DC + h * stride_ch + tok0 + kn, -dc, mask=k_ok)
        mbarrier.arrive(kv_empty, count=1)  # the loader may bring the next block's K and V
        tma.store_wait(0)  # the last reduce-adds have read the dQ staging buffers
        if key0 + HALF <= seq_len:
            # dK / dV staged in this warpgroup's dQ buffers (slots wg and 2 + wg) and copied by TMA. A
            # block that runs past its sequence would overwrite the next sequence's rows: pointer stores.
            if _PUBLIC_REINTERPRET:
                kv_stage = dq_smem.reinterpret(desc_dk.dtype, [4] + desc_dk.block_type.shape, desc_dk.layout)
            else:
                kv_stage = dq_smem._reinterpret(desc_dk.dtype, [4] + desc_dk.block_type.shape, desc_dk.layout)
            kv_stage.index(wg).store((dk * scale).to(desc_dk.dtype))
            kv_stage.index(2 + wg).store(dv.to(desc_dv.dtype))
            fence_async_shared()
            _tma_store(desc_dk, [seq_start + key0, kvh * HEAD_DIM], kv_stage.index(wg))
            _tma_store(desc_dv, [seq_start + key0, kvh * HEAD_DIM], kv_stage.index(2 + wg))
        else:
            offs_k = key0 + gl.arange(0, HALF, layout=rows_acc)
            offs_d = gl.arange(0, HEAD_DIM, layout=cols_acc)
            out = (tok0 + offs_k.to(gl.int64))[:, None] * stride_kt + kvh * HEAD_DIM + offs_d[None, :]
            ok = (offs_k < seq_len)[:, None]
            gl.store(DK + out, (dk * scale).to(DK.dtype.element_ty), mask=ok)
            gl.store(DV + out, dv.to(DV.dtype.element_ty), mask=ok)

    @gluon.jit
    def _compute_partition(k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, row_smem, delta_smem, desc_dq, desc_dk,
                           desc_dv, bars, ptrs, scalars, pair, mirror, wg: gl.constexpr, GROUP: gl.constexpr,
                           HALF: gl.constexpr, BLOCK_Q: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
        """One warpgroup: the program's key block, then its mirror, each as ``_compute_item``."""
        seq_len = scalars[0]
        _compute_item(k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, row_smem, delta_smem, desc_dq, desc_dk,
                      desc_dv, bars, ptrs, scalars, pair * (2 * HALF), 0, 0, wg, GROUP, HALF, BLOCK_Q, HEAD_DIM, STAGES)
        if mirror > pair:
            _compute_item(k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, row_smem, delta_smem, desc_dq, desc_dk,
                          desc_dv, bars, ptrs, scalars, mirror * (2 * HALF),
                          GROUP * gl.cdiv(seq_len - pair * (2 * HALF), BLOCK_Q), 1, wg, GROUP, HALF, BLOCK_Q, HEAD_DIM,
                          STAGES)
        tma.store_wait(0)  # the dK / dV copies have read shared memory before the program ends

    @gluon.jit
    def _row_sum_item(ds_smem, bars, DCQ, tok0, stride_ch, seq_len, start_n, step0, kvh, GROUP: gl.constexpr,
                      HALF: gl.constexpr, BLOCK_Q: gl.constexpr):
        """Per query block of one key block: dcq_i += sum over its 128 keys of dS_ij, read from the
        compute warpgroups' shared dS^T tiles in slices of 16 keys."""
        kv_bar, kv_empty, q_ready, q_empty, do_ready, do_empty, ds_ready, ds_free = bars
        SLICE: gl.constexpr = 16
        layout: gl.constexpr = gl.BlockedLayout([SLICE, BLOCK_Q // 32], [1, 32], [1, 1], [1, 0])
        cols: gl.constexpr = gl.SliceLayout(0, layout)
        offs = gl.arange(0, BLOCK_Q, layout=cols)
        n_q = gl.cdiv(seq_len - start_n, BLOCK_Q)
        for t in range(GROUP * n_q):
            g = t // n_q
            i = step0 + t
            buf = i % 2
            total = gl.zeros([BLOCK_Q], gl.float32, layout=cols)
            mbarrier.wait(ds_ready.index(buf), (i // 2) & 1)
            for part in gl.static_range(2):
                for k0 in gl.static_range(0, HALF, SLICE):
                    tile = ds_smem.index(2 * buf + part).slice(k0, SLICE, dim=0).load(layout)
                    total += gl.sum(tile.to(gl.float32), 0)
            mbarrier.arrive(ds_free.index(buf), count=1)
            rows_q = start_n + (t - g * n_q) * BLOCK_Q + offs
            gl.atomic_add(DCQ + (kvh * GROUP + g) * stride_ch + tok0 + rows_q, total, mask=rows_q < seq_len,
                          sem="relaxed")

    @gluon.jit
    def _row_sum_partition(ds_smem, bars, DCQ, tok0, stride_ch, seq_len, pair, mirror, kvh, GROUP: gl.constexpr,
                           HALF: gl.constexpr, BLOCK_Q: gl.constexpr):
        """One warp: the queries' dS sums of the program's key block, then of its mirror."""
        _row_sum_item(ds_smem, bars, DCQ, tok0, stride_ch, seq_len, pair * (2 * HALF), 0, kvh, GROUP, HALF, BLOCK_Q)
        if mirror > pair:
            _row_sum_item(ds_smem, bars, DCQ, tok0, stride_ch, seq_len, mirror * (2 * HALF),
                          GROUP * gl.cdiv(seq_len - pair * (2 * HALF), BLOCK_Q), kvh, GROUP, HALF, BLOCK_Q)

    @gluon.jit
    def _bwd_kernel(desc_q, desc_do, desc_k, desc_v, desc_dq, desc_dk, desc_dv, C, LSE, DELTA, DK, DV, DC, DCQ, CU,
                    scale, scale2, stride_kt, stride_ch, n_n, hkv, n_heads, single_heads, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr,
                    BLOCK_Q: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
        HALF: gl.constexpr = desc_k.block_type.shape[0]
        # Most programs take a key block and then its mirror from the sequence's end: about the same work
        # each (a heavy block and a light one), and half as many program starts and ends. Equal
        # programs leave a ragged last wave, so the last `single_heads` (KV head,
        # sequence) pairs come after them as one block per program, heaviest first.
        pid = gl.program_id(0)
        n_pairs = gl.cdiv(n_n, 2)
        paired_programs = (n_heads - single_heads) * n_pairs
        if pid < paired_programs:
            hs = pid // n_pairs
            pair = pid - hs * n_pairs
        else:
            rest = pid - paired_programs
            pair = rest // single_heads
            hs = n_heads - single_heads + (rest - pair * single_heads)
        kvh = hs % hkv
        seq = hs // hkv
        seq_start = gl.load(CU + seq)
        seq_len = gl.load(CU + seq + 1) - seq_start
        n_blocks = gl.cdiv(seq_len, 2 * HALF)
        paired = pid < paired_programs
        mirror = gl.where(paired, n_blocks - 1 - pair, -1)  # -1: no second block
        if pair < gl.where(paired, mirror + 1, n_blocks):  # a pair's middle block (pair == mirror) runs once
            k_smem = gl.allocate_shared_memory(desc_k.dtype, [2] + desc_k.block_type.shape, desc_k.layout)
            v_smem = gl.allocate_shared_memory(desc_v.dtype, [2] + desc_v.block_type.shape, desc_v.layout)
            q_smem = gl.allocate_shared_memory(desc_q.dtype, [STAGES] + desc_q.block_type.shape, desc_q.layout)
            do_smem = gl.allocate_shared_memory(desc_do.dtype, [STAGES] + desc_do.block_type.shape, desc_do.layout)
            ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF, BLOCK_Q], desc_q.dtype)
            ds_smem = gl.allocate_shared_memory(desc_q.dtype, [4, HALF, BLOCK_Q], ds_layout)  # 2 steps x 2 halves
            dq_smem = gl.allocate_shared_memory(gl.float32, [4] + desc_dq.block_type.shape, desc_dq.layout)
            r_shared: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
            row_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_Q], r_shared)
            delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_Q], r_shared)
            kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            kv_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            q_ready = _mbarriers(STAGES)
            q_empty = _mbarriers(STAGES)
            do_ready = _mbarriers(STAGES)
            do_empty = _mbarriers(STAGES)
            ds_ready = _mbarriers(2)
            ds_free = _mbarriers(2)
            mbarrier.init(kv_bar, count=1)
            mbarrier.init(kv_empty, count=2)  # both warpgroups' last products of a block
            for i in gl.static_range(STAGES):
                mbarrier.init(q_ready.index(i), count=2)  # the TMA's expect + the loader's row terms
                mbarrier.init(q_empty.index(i), count=2)  # one arrival per compute warpgroup
                mbarrier.init(do_ready.index(i), count=1)
                mbarrier.init(do_empty.index(i), count=2)
            for i in gl.static_range(2):
                mbarrier.init(ds_ready.index(i), count=2)  # both warpgroups' dS stored
                mbarrier.init(ds_free.index(i), count=3)  # both warpgroups' dQ and the row-sum warp done
            bars = (kv_bar, kv_empty, q_ready, q_empty, do_ready, do_empty, ds_ready, ds_free)
            tok0 = seq_start.to(gl.int64)
            ptrs = (C, DK, DV, DC)
            scalars = (seq_len, tok0, seq_start, kvh, stride_ch, stride_kt, scale, scale2)
            rows = (C, LSE, DELTA, tok0, seq_start, stride_ch, seq_len, kvh)
            gl.warp_specialize([
                (_compute_partition, (k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, row_smem, delta_smem, desc_dq,
                                      desc_dk, desc_dv, bars, ptrs, scalars, pair, mirror, 0, GROUP, HALF, BLOCK_Q,
                                      HEAD_DIM, STAGES)),
                (_compute_partition, (k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, row_smem, delta_smem, desc_dq,
                                      desc_dk, desc_dv, bars, ptrs, scalars, pair, mirror, 1, GROUP, HALF, BLOCK_Q,
                                      HEAD_DIM, STAGES)),
                (_load_partition, (desc_q, desc_do, desc_k, desc_v, k_smem, v_smem, q_smem, do_smem, row_smem,
                                   delta_smem, bars, rows, pair, mirror, GROUP, HEAD_DIM, BLOCK_Q, STAGES)),
                (_row_sum_partition, (ds_smem, bars, DCQ, tok0, stride_ch, seq_len, pair, mirror, kvh,
                                      GROUP, HALF, BLOCK_Q)),
            ], [4, 1, 1], [240, _PARTITION_REGS, _PARTITION_REGS])
else:  # pragma: no cover
    _bwd_kernel = _tma_reduce_add = None

BLOCK_Q = 64  # queries per step
KEYS = 128  # keys per program: two warpgroups of 64
STAGES = 2  # Q / dO ring depth (shared memory at head_dim 128: 226 KB of 227)
SINGLE_WAVES = 2  # waves of work (one pair per multiprocessor) left to single-block programs at the end
MAX_REGISTERS = 168  # per thread at launch (384 threads: 3 warpgroups, the one-warp partitions share one)


@launch_cached
@triton.jit
def _scale_to_output_kernel(ACC, OUT, n, scale, BLOCK: tl.constexpr):
    """OUT = (ACC * scale) in OUT's dtype over n flat elements: dQ's float32 sum to the model's dtype
    in one vectorised pass (torch.mul(acc, scale, out=bf16) runs an unvectorised mixed-dtype loop)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    tl.store(OUT + offs, (tl.load(ACC + offs, mask=ok) * scale).to(OUT.dtype.element_ty), mask=ok)


def _scale_to_output(acc: torch.Tensor, scale: float, like: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(like)
    block = 4096
    _scale_to_output_kernel[(triton.cdiv(acc.numel(), block),)](acc, out, acc.numel(), scale, BLOCK=block, num_warps=8)
    return out


def hopper_backward_applies(q: torch.Tensor, window_size) -> bool:
    """Whether the backward takes this kernel: a Hopper GPU, 16-bit inputs, head_dim 64 or
    128, causal without a window, Gluon available and deterministic algorithms off; everything else
    takes the portable kernels."""
    if gluon is None or _tma_reduce_add is None or window_size is not None or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    if q.shape[-1] not in HEAD_DIMS:
        return False
    if torch.are_deterministic_algorithms_enabled():
        return False
    return q.is_cuda and torch.cuda.get_device_capability(q.device)[0] == 9


def _dq_descriptor(dq_acc: torch.Tensor) -> "TensorDescriptor":
    """Float32 dQ [tokens, heads, head_dim] as [tokens, heads * head_dim]; one warpgroup adds
    [BLOCK_Q, head_dim / 2] at a time."""
    tokens, heads, d = dq_acc.shape
    layout = gl.NVMMASharedLayout.get_default_for([BLOCK_Q, d // 2], gl.float32)
    return TensorDescriptor(dq_acc.view(tokens, heads * d), [tokens, heads * d], [heads * d, 1], [BLOCK_Q, d // 2], layout)


def backward(do, q, k, v, c_t, o, lse, delta, cu, max_len, scale):
    """As ``triton._backward`` for causal attention: (dq, dk, dv, dc) with dc [HQ, N_tok] the
    gradient of the cumulative log forget; ``delta`` = rowsum(dO o O) [HQ, N_tok] float32."""
    total, hq, d = q.shape
    hkv = k.shape[1]
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    dc = torch.empty_like(c_t)
    dcq = torch.zeros_like(c_t)
    # Float32 dQ in q's layout: each program adds its keys' share; scaled and rounded in one pass.
    dq_acc = torch.zeros((total, hq, d), device=q.device, dtype=torch.float32)
    n_n = triton.cdiv(max_len, KEYS)
    n_heads = hkv * (cu.numel() - 1)
    # About one wave's work in single-block programs at the end (see _bwd_kernel).
    single = min(n_heads, triton.cdiv(SINGLE_WAVES * 2 * multiprocessors(q.device), max(n_n, 1)))
    grid = ((n_heads - single) * triton.cdiv(n_n, 2) + single * n_n,)
    _bwd_kernel[grid](
        _descriptor(q, BLOCK_Q), _descriptor(do, BLOCK_Q), _descriptor(k, KEYS // 2), _descriptor(v, KEYS // 2),
        _dq_descriptor(dq_acc), _descriptor(dk, KEYS // 2), _descriptor(dv, KEYS // 2), c_t, lse, delta, dk, dv, dc, dcq, cu, scale, scale * 1.4426950408889634, dk.stride(0), c_t.stride(0),
        n_n, hkv, n_heads, single,
        GROUP=hq // hkv, HEAD_DIM=d, BLOCK_Q=BLOCK_Q, STAGES=STAGES, num_warps=4, maxnreg=MAX_REGISTERS,
    )
    return _scale_to_output(dq_acc, scale, q), dk, dv, dc.add_(dcq)
