"""Forgetting Attention forward for Hopper (sm_90), written in Gluon with explicit warp specialisation.

The same function and outputs (o, and the log2-sum-exp the backward reads) as
``triton._fwd_kernel``, whose design notes apply (log2 units, the per-block reference c_ref so
that the bias stays small). What the portable kernel leaves to Triton's compiler is written out
here, because Triton 3.6's automatic warp specialisation of the same loop deadlocks on sm_90:

* **persistent**: one program per multiprocessor. A work item is 128 query rows of one head; the
  loader takes items from a global counter in the order the hardware's block scheduler used
  (each head's heaviest query blocks first, heads in turn, so that programs running together share
  K and V in L2) and hands each to the softmax warpgroups through a small record in shared memory;
* three partitions per program: a one-warp **loader** that moves each item's Q into one of two Q
  slots (the next item's Q lands while this one runs) and the K and V tiles of every key block
  through TMA into a ring of shared-memory stages that runs on across items, and two **softmax
  warpgroups** of four warps, each owning 64 of the query rows;
* K and V have their own ready / empty mbarriers per stage, so the score product of a key block
  starts as soon as its K lands and its stage is refilled as soon as both warpgroups' products
  with it are done (each arrives once on the empty barrier, initialised with count 2);
* in each warpgroup the next block's Q K^T and the current block's P V are issued together as
  asynchronous wgmma and the softmax of the scores runs while P V is still on the tensor cores
  (FlashAttention-3's intra-warpgroup overlap); P goes to the second product from registers;
* the loader also stages each key block's forget bias, (c_j - c_ref) in log2 units, in shared
  memory: when every softmax thread loaded its 32 columns from global memory, the 64-bit address
  arithmetic was ~40% of the loop's instructions; only key blocks that reach the diagonal or the
  sequence's end apply the causal mask;
* the output leaves through the item's own Q slot and a TMA store, so the warpgroups start the
  next item while it drains (the slot is handed back to the loader one score product later);
  blocks that run past their sequence's end use masked pointer stores instead.

Persistence and the TMA epilogue cut the fixed cost between two items (a block's end, the next
block's launch, its first Q and K loads), which matters most at short sequences; a static
(non-counter) persistent grid and FlashAttention-3's ping-pong between the warpgroups were slower
(`python -m hf_hybrid.bench.forgetting_attention`; docs/benchmarks/fox.md).
Causal attention without a window only; 16-bit inputs, head_dim 64 or 128. Everything else
takes the portable kernel.
"""
from __future__ import annotations

import torch
import triton

from .._common import multiprocessors

try:  # Gluon ships with Triton >= 3.5
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: the portable kernel only
    gluon = None

HEAD_DIMS = (64, 128)
BLOCK_M = 128  # query rows per program: two warpgroups of 64
BLOCK_N = 128  # keys per block
STAGES = {64: 3, 128: 2}  # K/V ring depth per head_dim (shared memory with two Q slots: 130 / 194 KB)
MAX_REGISTERS = 168  # per thread at launch; the partitions rebalance to 240 (softmax) and LOADER_REGISTERS
LOADER_REGISTERS = 32  # per loader thread (read inside the kernel: a Triton constexpr below)

if gluon is not None:
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    LOG2E: gl.constexpr = gl.constexpr(1.4426950408889634)
    _LOADER_REGS: gl.constexpr = gl.constexpr(LOADER_REGISTERS)
    RECORD: gl.constexpr = gl.constexpr(8)  # a work item in shared memory: more (0: stop), start row, head,
    # sequence start, sequence length, three unused

    @gluon.jit
    def _mbarriers(count: gl.constexpr):
        """``count`` mbarriers in shared memory, one per index."""
        return gl.allocate_shared_memory(gl.int64, [count, 1], mbarrier.MBarrierLayout())

    @gluon.jit
    def _take_item(counter):
        """Lane 0 of the calling warp takes the next work item; every lane gets it."""
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        lane = gl.arange(0, 32, layout=layout)
        got = gl.atomic_add(counter + lane * 0, gl.full([32], 1, gl.int32, layout), mask=lane == 0, sem="relaxed")
        return gl.sum(gl.where(lane == 0, got, 0), 0)

    @gluon.jit
    def _publish(item_smem, item_ready, item_free, t, more, start, head, seq_start, seq_len):
        """The loader hands one work item (or, with more = 0, the end) to the other partitions."""
        layout: gl.constexpr = gl.BlockedLayout([RECORD], [32], [1], [0])
        slot = t % 2
        mbarrier.wait(item_free.index(slot), ((t // 2) & 1) ^ 1)
        f = gl.arange(0, RECORD, layout=layout)
        rec = gl.where(f == 0, more, gl.where(f == 1, start, gl.where(f == 2, head, gl.where(f == 3, seq_start,
                                                                                            seq_len))))
        item_smem.index(slot).store(rec)
        mbarrier.arrive(item_ready.index(slot), count=1)

    @gluon.jit
    def _read_item(item_smem, item_ready, item_free, t, WARPS: gl.constexpr):
        """A partition of WARPS warps takes the t-th published work item."""
        layout: gl.constexpr = gl.BlockedLayout([RECORD], [32], [WARPS], [0])
        slot = t % 2
        mbarrier.wait(item_ready.index(slot), (t // 2) & 1)
        rec = item_smem.index(slot).load(layout)
        mbarrier.arrive(item_free.index(slot), count=1)
        f = gl.arange(0, RECORD, layout=layout)
        more = gl.sum(gl.where(f == 0, rec, 0), 0)
        start = gl.sum(gl.where(f == 1, rec, 0), 0)
        head = gl.sum(gl.where(f == 2, rec, 0), 0)
        seq_start = gl.sum(gl.where(f == 3, rec, 0), 0)
        seq_len = gl.sum(gl.where(f == 4, rec, 0), 0)
        return more, start, head, seq_start, seq_len

    @gluon.jit
    def _load_partition(desc_q, desc_k, desc_v, q_smem, k_smem, v_smem, c_smem, item_smem, bars, C, CU, counter,
                        n_items, n_m, hq, stride_ch, BLOCK_N: gl.constexpr, GROUP: gl.constexpr,
                        HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
        """One warp: per work item, its Q into a Q slot, then K, V and the keys' forget bias of every key
        block into the stage ring. The bias, (c_j - c_ref) in log2 units, goes through shared memory so
        that the softmax warpgroups read it ready to use, without per-element address arithmetic."""
        q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, item_ready, item_free = bars
        c_layout: gl.constexpr = gl.BlockedLayout([BLOCK_N // 32], [32], [1], [0])
        offs_c = gl.arange(0, BLOCK_N, layout=c_layout)
        half: gl.constexpr = desc_q.block_type.shape[0]
        u = 0
        kv_count = 0
        item = _take_item(counter)
        while item < n_items:
            nxt = _take_item(counter)  # its latency hides behind this item's loads
            pid_m = n_m - 1 - item % n_m
            h = (item // n_m) % hq
            seq = item // (n_m * hq)
            seq_start = gl.load(CU + seq)
            seq_len = gl.load(CU + seq + 1) - seq_start
            start_m = pid_m * (2 * half)
            if start_m < seq_len:  # past a shorter sequence's end: nothing to do, not published
                _publish(item_smem, item_ready, item_free, u, 1, start_m, h, seq_start, seq_len)
                n_blocks = gl.cdiv(gl.minimum(start_m + 2 * half, seq_len), BLOCK_N)
                c_row = C + h * stride_ch + seq_start.to(gl.int64)
                c_ref = gl.load(c_row + start_m)
                kv_row = seq_start
                kv_col = (h // GROUP) * HEAD_DIM
                qs = u % 2
                mbarrier.wait(q_empty.index(qs), ((u // 2) & 1) ^ 1)
                mbarrier.expect(q_ready.index(qs), 2 * desc_q.block_type.nbytes)
                _tma_load(desc_q, [seq_start + start_m, h * HEAD_DIM], q_ready.index(qs), q_smem.index(2 * qs))
                _tma_load(desc_q, [seq_start + start_m + half, h * HEAD_DIM], q_ready.index(qs),
                          q_smem.index(2 * qs + 1))
                for i in range(n_blocks):
                    idx = kv_count + i
                    stage = idx % STAGES
                    free_phase = ((idx // STAGES) & 1) ^ 1
                    mbarrier.wait(k_empty.index(stage), free_phase)
                    mbarrier.expect(k_ready.index(stage), desc_k.block_type.nbytes)
                    _tma_load(desc_k, [kv_row + i * BLOCK_N, kv_col], k_ready.index(stage), k_smem.index(stage))
                    cols = i * BLOCK_N + offs_c
                    c_smem.index(stage).store((gl.load(c_row + cols, mask=cols < seq_len, other=0.0) - c_ref) * LOG2E)
                    mbarrier.arrive(k_ready.index(stage), count=1)
                    mbarrier.wait(v_empty.index(stage), free_phase)
                    mbarrier.expect(v_ready.index(stage), desc_v.block_type.nbytes)
                    _tma_load(desc_v, [kv_row + i * BLOCK_N, kv_col], v_ready.index(stage), v_smem.index(stage))
                kv_count += n_blocks
                u += 1
            item = nxt
        _publish(item_smem, item_ready, item_free, u, 0, 0, 0, 0, 0)

    @gluon.jit
    def _softmax_partition(q_smem, k_smem, v_smem, c_smem, item_smem, bars, C, O, LSE, desc_o, scalars,
                           wg: gl.constexpr, HALF: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                           STAGES: gl.constexpr):
        """One warpgroup: per work item, online softmax over the key blocks for its 64 query rows."""
        q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, item_ready, item_free = bars
        stride_ot, stride_ch, scale2 = scalars
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        cols_s: gl.constexpr = gl.SliceLayout(0, s_layout)
        rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        cols_o: gl.constexpr = gl.SliceLayout(0, o_layout)
        no_scores = gl.zeros([HALF, BLOCK_N], gl.float32, layout=s_layout)
        offs_n = gl.arange(0, BLOCK_N, layout=cols_s)
        u = 0
        kv_count = 0
        more, start_m, h, seq_start, seq_len = _read_item(item_smem, item_ready, item_free, u, 4)
        while more != 0:
            n_blocks = gl.cdiv(gl.minimum(start_m + 2 * HALF, seq_len), BLOCK_N)
            n_unmasked = start_m // BLOCK_N
            tok0 = seq_start.to(gl.int64)
            c_row = C + h * stride_ch + tok0
            row0 = start_m + wg * HALF
            offs_m = row0 + gl.arange(0, HALF, layout=rows_s)
            last_key = gl.minimum(offs_m, seq_len - 1)
            acc = gl.zeros([HALF, HEAD_DIM], gl.float32, layout=o_layout)
            qs = u % 2
            q = q_smem.index(2 * qs + wg)

            stage0 = kv_count % STAGES
            mbarrier.wait(q_ready.index(qs), (u // 2) & 1)
            mbarrier.wait(k_ready.index(stage0), (kv_count // STAGES) & 1)
            s_tok = warpgroup_mma(q, k_smem.index(stage0).permute((1, 0)), no_scores, use_acc=False,
                                  is_async=True)
            bias = c_smem.index(stage0).load(cols_s)
            s = warpgroup_mma_wait(0, deps=(s_tok, ))
            mbarrier.arrive(k_empty.index(stage0), count=1)
            if u > 0:
                # The last item's output went out by TMA from its Q slot: free the slot for the loader
                # once that copy has read it (issued a whole Q K^T ago, so this rarely waits).
                tma.store_wait(0)
                mbarrier.arrive(q_empty.index(1 - qs), count=1)
            s = s * scale2 - bias[None, :]
            if n_unmasked == 0:
                s = gl.where(last_key[:, None] >= offs_n[None, :], s, float("-inf"))
            m_i = gl.max(s, 1)
            p = gl.exp2(s - m_i[:, None])
            l_i = gl.sum(p, 1)
            p_op = gl.convert_layout(p.to(v_smem.dtype), p_layout)

            for i in range(1, n_blocks):
                idx = kv_count + i
                stage = idx % STAGES
                prev = (idx - 1) % STAGES
                mbarrier.wait(k_ready.index(stage), (idx // STAGES) & 1)
                mbarrier.wait(v_ready.index(prev), ((idx - 1) // STAGES) & 1)
                s_tok = warpgroup_mma(q, k_smem.index(stage).permute((1, 0)), no_scores, use_acc=False,
                                      is_async=True)
                o_tok = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
                bias = c_smem.index(stage).load(cols_s)
                s = warpgroup_mma_wait(1, deps=(s_tok, ))
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

            idx = kv_count + n_blocks - 1
            last = idx % STAGES
            mbarrier.wait(v_ready.index(last), (idx // STAGES) & 1)
            o_tok = warpgroup_mma(p_op, v_smem.index(last), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(o_tok, ))
            mbarrier.arrive(v_empty.index(last), count=1)

            m_ok = offs_m < seq_len
            c_ref2 = gl.load(c_row + start_m) * LOG2E
            c_rows2 = gl.load(c_row + offs_m, mask=m_ok, other=0.0) * LOG2E
            gl.store(LSE + h * stride_ch + tok0 + offs_m, m_i + gl.log2(l_i) + (c_rows2 - c_ref2), mask=m_ok)
            out = acc / gl.convert_layout(l_i, rows_o)[:, None]
            offs_mo = row0 + gl.arange(0, HALF, layout=rows_o)
            offs_d = gl.arange(0, HEAD_DIM, layout=cols_o)
            if row0 + HALF <= seq_len:
                # Staged in this item's Q slot (every Q K^T with it is done) and copied by TMA; a block
                # past its sequence's end would overwrite the next sequence's rows: pointer store below.
                q.store(out.to(desc_o.dtype))
                fence_async_shared()
                _tma_store(desc_o, [seq_start + row0, h * HEAD_DIM], q)
            else:
                tok = tok0 + offs_mo.to(gl.int64)
                gl.store(O + tok[:, None] * stride_ot + h * HEAD_DIM + offs_d[None, :], out.to(O.dtype.element_ty),
                         mask=(offs_mo < seq_len)[:, None])
            kv_count += n_blocks
            u += 1
            more, start_m, h, seq_start, seq_len = _read_item(item_smem, item_ready, item_free, u, 4)
        tma.store_wait(0)

    @gluon.jit
    def _fwd_kernel(desc_q, desc_k, desc_v, desc_o, C, O, LSE, CU, COUNTER, n_items, n_m, hq, scale2, stride_ot,
                    stride_ch, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                    STAGES: gl.constexpr, num_warps: gl.constexpr):
        HALF: gl.constexpr = desc_q.block_type.shape[0]
        q_smem = gl.allocate_shared_memory(desc_q.dtype, [4] + desc_q.block_type.shape, desc_q.layout)
        k_smem = gl.allocate_shared_memory(desc_k.dtype, [STAGES] + desc_k.block_type.shape, desc_k.layout)
        v_smem = gl.allocate_shared_memory(desc_v.dtype, [STAGES] + desc_v.block_type.shape, desc_v.layout)
        flat: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        c_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N], flat)
        item_smem = gl.allocate_shared_memory(gl.int32, [2, RECORD], flat)
        q_ready = _mbarriers(2)
        q_empty = _mbarriers(2)
        k_ready = _mbarriers(STAGES)
        k_empty = _mbarriers(STAGES)
        v_ready = _mbarriers(STAGES)
        v_empty = _mbarriers(STAGES)
        item_ready = _mbarriers(2)
        item_free = _mbarriers(2)
        for i in gl.static_range(2):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=2)
            mbarrier.init(item_ready.index(i), count=1)
            mbarrier.init(item_free.index(i), count=2)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=2)
            mbarrier.init(k_empty.index(i), count=2)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(v_empty.index(i), count=2)
        bars = (q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, item_ready, item_free)
        scalars = (stride_ot, stride_ch, scale2)
        gl.warp_specialize([
            (_softmax_partition, (q_smem, k_smem, v_smem, c_smem, item_smem, bars, C, O, LSE, desc_o, scalars, 0,
                                  HALF, BLOCK_N, HEAD_DIM, STAGES)),
            (_softmax_partition, (q_smem, k_smem, v_smem, c_smem, item_smem, bars, C, O, LSE, desc_o, scalars, 1,
                                  HALF, BLOCK_N, HEAD_DIM, STAGES)),
            (_load_partition, (desc_q, desc_k, desc_v, q_smem, k_smem, v_smem, c_smem, item_smem, bars, C, CU, COUNTER,
                               n_items, n_m, hq, stride_ch, BLOCK_N, GROUP, HEAD_DIM, STAGES)),
        ], [4, 1], [240, _LOADER_REGS])
else:  # pragma: no cover
    _fwd_kernel = None


def hopper_forward_applies(q: torch.Tensor, window_size) -> bool:
    """Whether the forward takes this path: a Hopper GPU, 16-bit inputs, head_dim 64 or 128,
    causal without a window, Gluon available; everything else takes the portable kernel."""
    if gluon is None or window_size is not None or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    if q.shape[-1] not in HEAD_DIMS:
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
    n_m = triton.cdiv(max_len, BLOCK_M)
    n_items = n_m * hq * (cu.numel() - 1)
    next_item = torch.zeros(1, device=q.device, dtype=torch.int32)  # the work counter the loaders share
    _fwd_kernel[(min(n_items, multiprocessors(q.device)),)](
        _descriptor(q, BLOCK_M // 2), _descriptor(k, BLOCK_N), _descriptor(v, BLOCK_N), _descriptor(o, BLOCK_M // 2),
        c_t, o, lse, cu, next_item, n_items, n_m, hq, scale * 1.4426950408889634, o.stride(0), c_t.stride(0),
        GROUP=hq // k.shape[1], HEAD_DIM=d, BLOCK_N=BLOCK_N, STAGES=STAGES[d], num_warps=4, maxnreg=MAX_REGISTERS,
    )
    return o, lse
