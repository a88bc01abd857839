"""What the Triton kernels of a first training step and a first generate() cost to compile, for the
H100 (sm_90), on any machine (no GPU needed: Triton ships ptxas).

    python -m benchmarks.compile_cost                     every catalogued launch, per architecture and path
    python -m benchmarks.compile_cost --arch rat          one architecture (rat, rat_plus, fox, rattention, se_hybrid)
    python -m benchmarks.compile_cost --kernel output_gate  launches whose kernel name contains this
    python -m benchmarks.compile_cost --unroll            RAT's keys/values kernels at each token unroll
    python -m benchmarks.compile_cost --json F            also write the rows as JSON

Each launch is compiled by ``triton.compile`` for ``GPUTarget("cuda", 90, 32)`` into an empty Triton
cache (a fresh TRITON_CACHE_DIR for the process, every distinct launch compiled once, after one
untimed compile that loads the compiler). FoX's portable kernels launch one tile each
(``portable_tile``); under HF_HYBRID_AUTOTUNE=1 they are autotuned, and the rows compile every
configuration the autotuner keeps (on a GPU it also runs each of them several times, so that first
use costs more than the compile seconds shown). The totals count the builds per path. The seconds are this machine's: wall seconds, and the CPU
seconds of the build (ptxas included), which a busy machine stretches less. A GPU host's differ, but
the ranking holds (and Triton's version may differ from the GPU machine's).

The catalogue (:func:`catalogue`, built on call from the kernel modules' shipped constants) is the
launches as the host code makes them on an H100 at the first-use test's shape
(tests/gpu/test_first_use_gpu.py: 16 heads x 128, bf16, T = 2048, prompt 512): kernel, argument
types, constexprs, warps and stages. It is written by hand, since on a CPU the host code picks the
interpreter's tiles. It covers RAT's training step and generate(), RAT+'s training step, FoX's
portable attention, the sliding-window attention of RATTENTION's (and RAT-SWA's) training step and
the SE hybrid's Mamba-2 layers (training step and generate()); RATTENTION's RLA kernels and FoX's
Gluon kernels (the sm_90 default) come from benchmarks.sm90's reports (``REPORTS``). The backbone's
norm and SwiGLU kernels are added to every training path. The GPU test's JSON has every
architecture's actual compiles (``compiles``: kernel, seconds) from a compile hook, and
torch.compile's seconds. benchmarks/tests/test_compile_cost.py checks every catalogued launch
against its kernel's declared arguments and constexprs.
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import triton
import triton.language as tl

BF, F32, I32, I64 = "*bf16", "*fp32", "*i32", "*i64"
FLOATS = {"eps", "eps_a", "eps_b", "qk_scale", "scale", "scale2", "dt_min", "dt_max"}  # fp32 scalars; other plain arguments are i32

# The first-use test's layer shape.
HEADS, HEAD_DIM, QK_GROUPS, CHUNK = 16, 128, 2, 16
TOKENS, PROMPT = 2048, 512
RAT_PLUS_DILATION = 64  # RAT+'s sparse training pattern (dilation 1 takes the cuDNN chunk-end path at these lengths)
# The SE hybrid's Mamba-2 mixer at the 1.3B shape: 64 heads x 64, state 128, one group, conv width 4;
# inner width 2 x 2048 (the gated norm's group), conv channels inner + 2 x state.
MAMBA_HEADS, MAMBA_HEAD_DIM, MAMBA_STATE, MAMBA_CONV = 64, 64, 128, 4
MAMBA_INNER = MAMBA_HEADS * MAMBA_HEAD_DIM


@dataclass(frozen=True)
class Launch:
    """One compiled variant of a kernel: ``kernel`` is "<module under hf_hybrid.kernels>:<name>"."""

    kernel: str
    types: dict  # pointer / float arguments -> Triton type; the rest i32
    constexprs: dict
    num_warps: int = 4
    num_stages: int = 2
    note: str = ""
    tuned: bool = False  # autotuned: every configuration the autotuner keeps is compiled


@dataclass
class Path:
    arch: str
    path: str  # "train" or "generate" ("portable": FoX's training step where the Gluon kernels do not apply)
    launches: list = field(default_factory=list)


def _module(kernel: str):
    module, name = kernel.split(":")
    return getattr(importlib.import_module(f"hf_hybrid.kernels.{module}"), name)


def _jit(fn):
    """The JIT function under launch_cached / autotune wrappers."""
    fn = getattr(fn, "jit_function", fn)
    return getattr(fn, "fn", fn) if hasattr(fn, "configs") else fn


def autotune_configs(kernel: str) -> list:
    """The configurations an autotuned kernel keeps for bf16 at head_dim 128 (its early prune keeps
    them all there); [] for a kernel that is not autotuned."""
    fn = _module(kernel)
    fn = getattr(fn, "jit_function", fn)
    return list(getattr(fn, "configs", []) or [])


def _types(*names, dtype=BF):
    return {n: dtype for n in names}


# --- the catalogue ---------------------------------------------------------------------------------
def _rat_launches():
    from hf_hybrid.kernels.chunk_attention import decode, triton as ca
    from hf_hybrid.kernels.fused_norm import triton as fn
    from hf_hybrid.kernels.gated_recurrence import rat_keys_values_triton as kv
    from hf_hybrid.kernels.gated_recurrence import triton as gr

    kv_common = dict(GROUPS=QK_GROUPS, HEADS=HEADS, D=HEAD_DIM, HALF=HEAD_DIM // 2, L=CHUNK, HAS_ROPE=True)
    kv_in = dict(_types("K", "V", "LOGIT", "BIAS", "KROT", "VT"), COS=F32, SIN=F32)
    kv_fwd = Launch("gated_recurrence.rat_keys_values_triton:_fwd_kernel", kv_in,
                    dict(kv_common, BLOCK_H=kv.FWD_HEADS, UNROLL=kv.unroll_for(CHUNK, kv.FWD_UNROLL)), kv.FWD_WARPS)
    kv_bwd = Launch("gated_recurrence.rat_keys_values_triton:_bwd_kernel",
                    dict(kv_in, **_types("DKROT", "DVT", "DK", "DV", "DLOGIT"), DBIAS=F32),
                    dict(kv_common, BLOCK_H=HEADS, BLOCK_D=kv.BWD_BLOCK_D, UNROLL=kv.unroll_for(CHUNK, kv.BWD_UNROLL)),
                    kv.BWD_WARPS)
    rope = dict(D=HEAD_DIM, HALF=HEAD_DIM // 2, BLOCK_HALF=HEAD_DIM // 2, BLOCK_T=fn.TILE_ELEMENTS // HEAD_DIM, HAS_NORM=False)
    rope_fwd = Launch("fused_norm.triton:_norm_rope_fwd_kernel", dict(_types("X", "W", "Y"), COS=F32, SIN=F32),
                      rope, fn.NUM_WARPS, note="rotary q (no norm)")
    rope_bwd = Launch("fused_norm.triton:_norm_rope_bwd_kernel",
                      dict(_types("X", "W", "DY", "DX"), COS=F32, SIN=F32, DW_PART=F32), rope, fn.NUM_WARPS,
                      note="rotary q (no norm)")
    attention = dict(_types("Q", "K", "V", "KE", "VE", "O", "Z", "OU", "DO", "DQ", "DKE", "DVE", "DKF", "DVF",
                            "DKO", "DVO", "DY", "DZ"), QC=I32, LSE=F32, DELTA=F32, DSO=F32, DQA=F32)
    block_mode = dict(COMPACT=False, HAS_WINDOW=False, HAS_SINKS=False)
    (fm, fn_, fw, fs), (qm, qn, qw, qs), (km, kn, kw, ks) = ca.FWD_CONFIG, ca.DQ_CONFIG, ca.DKV_CONFIG
    prec = "tf32x3"  # _dot_precision on CUDA (16-bit operands ignore it)

    def attention_fwd(store_ungated):
        return Launch("chunk_attention.triton:_fwd_kernel", attention, dict(
            block_mode, HAS_GATE=True, STORE_UNGATED=store_ungated, BLOCK_M=fm, BLOCK_N=fn_, BLOCK_S=fn_,
            HEAD_DIM=HEAD_DIM, DOT_PREC=prec), fw, fs, note="block ends + own key, output gate")

    train = [
        kv_fwd, kv_bwd, rope_fwd, rope_bwd, attention_fwd(True),
        Launch("chunk_attention.triton:_own_rows_kernel", attention, dict(
            WRITE_OWN=True, HAS_GATE=True, ATOMIC_DQ=False, BLOCK_M=ca.ROWS_BLOCK, HEAD_DIM=HEAD_DIM), ca.ROWS_WARPS),
        Launch("chunk_attention.triton:_dq_kernel", attention, dict(
            block_mode, BLOCK_M=qm, BLOCK_N=qn, BLOCK_S=qn, HEAD_DIM=HEAD_DIM, DOT_PREC=prec), qw, qs),
        Launch("chunk_attention.triton:_dkdv_ends_kernel", attention, dict(
            COMPACT=False, OWN=True, ACCUMULATE=False, HAS_SINKS=False, BLOCK_M=km, BLOCK_N=kn, BLOCK_S=kn,
            HEAD_DIM=HEAD_DIM, DOT_PREC=prec, ATOMIC_DQ=False), kw, ks),
    ]
    # generate(): the prefill (no gradient: keys/values without the recompute path, the tail chunk's
    # recurrence for the cache's state, attention without the ungated copy), then the decode step.
    seg = gr._plan(CHUNK, CHUNK, PROMPT - CHUNK)[0]  # the tail chunk: one chunk-aligned segment
    partials = dict(M_OUT=F32, L_OUT=F32, ACC_OUT=F32)
    generate = [
        kv_fwd, rope_fwd, attention_fwd(False),
        Launch("gated_recurrence.triton:_recurrence_fwd_kernel", dict(X=BF, G=F32, H=BF, INIT=BF, SUM_STATE=BF,
                                                                       SUM_GATE=BF),
               dict(CHUNKED=True, INIT_MODE=0, SUMMARY=False, SEG=seg, BLOCK_N=gr.BLOCK_N,
                    UNROLL=math.gcd(seg, gr.STEP_UNROLL)), gr.NUM_WARPS, note="the prefill's last chunk, for the cache"),
        Launch("chunk_attention.rat_decode_triton:_rat_decode_kernel", dict(
            _types("Q", "K", "V", "GL", "SK", "SV", "KB", "VB", "O", "Z"), BIAS=F32, POS=I64, COS=F32, SIN=F32,
            **partials, sqb="i64", skb="i64", svb="i64", sgb="i64", ssb="i64", sbb="i64", sbc="i64", sob="i64"),
            dict(GROUPS=QK_GROUPS, HEAD_DIM=HEAD_DIM, BLOCK_N=decode.DECODE_BLOCK_N, HAS_ROPE=True, DIRECT=False,
                 HAS_GATE=True), decode.DECODE_WARPS, note="decode step"),
        Launch("_split_decode:_combine_kernel", dict(M_IN=F32, L_IN=F32, ACC_IN=F32, O=BF, Z=BF),
               dict(HEAD_DIM=HEAD_DIM, BLOCK_S=8, HAS_GATE=True), decode.DECODE_WARPS, note="decode step"),
    ]
    return [Path("rat", "train", train), Path("rat", "generate", generate)]


def _decode_backbone_launches():
    """The decode step's projections and fused residual norm, shared by every architecture."""
    from hf_hybrid.kernels.few_row_linear import triton as frl

    block_m, block_n, block_k, warps, stages = frl.tile_for(1)
    weights = _types(*(f"W{i}" for i in range(6)), *(f"O{i}" for i in range(6)), "X")
    return [
        Launch("few_row_linear.triton:_few_row_linear_kernel", weights,
               dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_PREC="tf32"), warps, stages,
               note="decode projections"),
        Launch("residual_norm.triton:_add_rms_norm_kernel", _types("X", "D", "W", "H", "Y"),
               dict(BLOCK=2048, HAS_DELTA=True), 8, note="decode residual + norm"),
    ]


def _rat_plus_launches():
    """RAT+'s training step: the plain recurrence over the whole sequence (three passes: segments, their
    carry, the rerun; backward alike), RoPE, the chunk-end attention without a gate (dilation 64), the
    separate output gate."""
    from hf_hybrid.kernels.chunk_attention import triton as ca
    from hf_hybrid.kernels.fused_norm import triton as fn
    from hf_hybrid.kernels.gated_recurrence import triton as gr
    from hf_hybrid.kernels.output_gate import triton as og

    seg, _, _, _ = gr._plan(TOKENS, 0, 0)
    segments = dict(CHUNKED=False, SEG=seg, BLOCK_N=gr.BLOCK_N, UNROLL=math.gcd(seg, gr.STEP_UNROLL))
    rec = dict(X=BF, G=F32, H=F32, INIT=BF, SUM_STATE=F32, SUM_GATE=F32, DH=F32, DX=BF, DG=F32, DINIT=BF, CARRY=F32,
               SUM_ACC=F32)
    carry = dict(SUM_STATE=F32, SUM_GATE=F32, INIT=BF, CARRY=F32)
    rope = dict(D=HEAD_DIM, HALF=HEAD_DIM // 2, BLOCK_HALF=HEAD_DIM // 2, BLOCK_T=fn.TILE_ELEMENTS // HEAD_DIM, HAS_NORM=False)
    attention = dict(_types("Q", "K", "V", "KE", "VE", "O", "Z", "OU", "DO", "DQ", "DKE", "DVE", "DKF", "DVF",
                            "DKO", "DVO", "DY", "DZ"), QC=I32, LSE=F32, DELTA=F32, DSO=F32, DQA=F32)
    block_mode = dict(COMPACT=False, HAS_WINDOW=False, HAS_SINKS=False)
    (fm, fn_, fw, fs), (qm, qn, qw, qs), (km, kn, kw, ks) = ca.FWD_CONFIG, ca.DQ_CONFIG, ca.DKV_CONFIG
    return [Path("rat_plus", "train", [
        Launch("gated_recurrence.triton:_recurrence_fwd_kernel", rec, dict(segments, INIT_MODE=0, SUMMARY=True),
               gr.NUM_WARPS, note="segment summaries"),
        Launch("gated_recurrence.triton:_carry_kernel", carry,
               dict(HAS_INIT=False, REVERSE=False, BLOCK_N=gr.CARRY_BLOCK_N, UNROLL=gr.CARRY_UNROLL), 2),
        Launch("gated_recurrence.triton:_recurrence_fwd_kernel", rec, dict(segments, INIT_MODE=2, SUMMARY=False),
               gr.NUM_WARPS, note="rerun from the carries"),
        Launch("fused_norm.triton:_norm_rope_fwd_kernel", dict(_types("X", "W", "Y"), COS=F32, SIN=F32), rope,
               fn.NUM_WARPS, note="rotary q, k"),
        Launch("chunk_attention.triton:_fwd_kernel", attention, dict(
            block_mode, HAS_GATE=False, STORE_UNGATED=False, BLOCK_M=fm, BLOCK_N=fn_, BLOCK_S=fn_, HEAD_DIM=HEAD_DIM,
            DOT_PREC="tf32x3"), fw, fs, note=f"dilation {RAT_PLUS_DILATION}"),
        Launch("output_gate.triton:_fwd_kernel", _types("Z", "Y", "O"), dict(BLOCK=og.BLOCK, SILU=False), 8),
        Launch("output_gate.triton:_bwd_kernel", _types("Z", "Y", "DO", "DZ", "DY"), dict(BLOCK=og.BLOCK, SILU=False), 8),
        Launch("chunk_attention.triton:_own_rows_kernel", attention, dict(
            WRITE_OWN=True, HAS_GATE=False, ATOMIC_DQ=False, BLOCK_M=ca.ROWS_BLOCK, HEAD_DIM=HEAD_DIM), ca.ROWS_WARPS),
        Launch("chunk_attention.triton:_dq_kernel", attention, dict(
            block_mode, BLOCK_M=qm, BLOCK_N=qn, BLOCK_S=qn, HEAD_DIM=HEAD_DIM, DOT_PREC="tf32x3"), qw, qs),
        Launch("chunk_attention.triton:_dkdv_ends_kernel", attention, dict(
            COMPACT=False, OWN=True, ACCUMULATE=False, HAS_SINKS=False, BLOCK_M=km, BLOCK_N=kn, BLOCK_S=kn,
            HEAD_DIM=HEAD_DIM, DOT_PREC="tf32x3", ATOMIC_DQ=False), kw, ks),
        Launch("fused_norm.triton:_norm_rope_bwd_kernel",
               dict(_types("X", "W", "DY", "DX"), COS=F32, SIN=F32, DW_PART=F32), rope, fn.NUM_WARPS),
        Launch("gated_recurrence.triton:_recurrence_bwd_kernel", rec,
               dict(segments, HAS_INIT=False, HAS_CARRY=False, SUMMARY=True), gr.NUM_WARPS),
        Launch("gated_recurrence.triton:_carry_kernel", carry,
               dict(HAS_INIT=False, REVERSE=True, BLOCK_N=gr.CARRY_BLOCK_N, UNROLL=gr.CARRY_UNROLL), 2),
        Launch("gated_recurrence.triton:_recurrence_bwd_kernel", rec,
               dict(segments, HAS_INIT=False, HAS_CARRY=True, SUMMARY=False), gr.NUM_WARPS),
    ])]


def _portable_attention_launches(gated: bool, window: bool, note: str) -> list[Launch]:
    """Forgetting Attention's portable kernels (``GATED``: FoX; without the gate: the sliding-window
    layers' kernels/window_attention), each at the tile ``portable_tile`` picks for T, or every
    autotuning candidate under HF_HYBRID_AUTOTUNE=1."""
    import torch

    from hf_hybrid.kernels.forgetting_attention import triton as fa
    from hf_hybrid.options import get as option

    common = dict(GROUP=1, HEAD_DIM=HEAD_DIM, HAS_WINDOW=window, GATED=gated, DOT_PREC="tf32")
    types = dict(_types("Q", "K", "V", "O", "DO", "DK", "DV", "DQ"), C=F32, LSE=F32, DELTA=F32, DC=F32, DCQ=F32,
                 CU=I32)
    tuned = option("HF_HYBRID_AUTOTUNE")
    launches = []
    for kind, name in (("fwd", "_fwd_kernel"), ("dkdv", "_dkdv_kernel"), ("dq", "_dq_kernel")):
        kernel = f"forgetting_attention.triton:{name}"
        if tuned:
            launches.append(Launch(kernel, types, common, note="autotuned (HF_HYBRID_AUTOTUNE=1)", tuned=True))
        else:
            tile = fa.portable_tile(kind, TOKENS, HEAD_DIM, torch.bfloat16)
            launches.append(Launch(kernel, types, dict(common, **tile.kwargs), tile.num_warps, tile.num_stages,
                                   note=note))
    return launches


def _fox_launches():
    """FoX's portable attention (off Hopper or under deterministic algorithms: not the sm_90 default)."""
    return [Path("fox", "portable", _portable_attention_launches(True, False, "portable_tile"))]


def _window_launches():
    """The sliding-window layers' attention in a training step (RATTENTION's local branch, RAT-SWA's
    window layers): the portable kernels with a window and no gate."""
    return [Path("rattention", "train", _portable_attention_launches(False, True, "window_attention"))]


def _se_hybrid_launches():
    """The SE hybrid's Mamba-2 layers: causal conv1d, the SSD scan (states, kept in bf16 by the
    training forward; output; backward: the states' gradients, the chunk backward), the gated RMSNorm; generate():
    the forward kernels, then the decode step's conv step and SSM step. Its SE attention layer in
    the 1.3B stack's mode (``full``) is one causal SDPA call (cuDNN / FlashAttention: no Triton) and
    RoPE is PyTorch's."""
    from hf_hybrid.kernels.causal_conv1d import triton as conv
    from hf_hybrid.kernels.gated_rms_norm import triton as grn
    from hf_hybrid.kernels.ssd_scan import step_sizes as steps
    from hf_hybrid.kernels.ssd_scan import triton as ssd

    fwd_t, fwd_c, fwd_warps = conv.FORWARD_TILE
    bwd_t, bwd_c, bwd_warps = conv.BACKWARD_TILE
    conv_common = dict(K=MAMBA_CONV, HAS_BIAS=True, HAS_STATE=False, SILU=True)
    conv_fwd = Launch("causal_conv1d.triton:_conv_fwd", _types("X", "W", "BIAS", "STATE", "OUT"),
                      dict(conv_common, BT=fwd_t, BC=fwd_c), fwd_warps)
    block_n = max(16, triton.next_power_of_2(MAMBA_STATE))
    ssd_common = dict(L=ssd.CHUNK, BP=ssd.BLOCK_PN, BN=ssd.BLOCK_PN, PREC="tf32", NATIVE16=True)
    ssd_in = dict(_types("X", "Bm", "Cm", "Dv"), DT=F32, G=F32)

    def states(keep: bool, note):  # keep: the training forward also stores the states in bf16 for the backward
        return Launch("ssd_scan.triton:_states_fwd", dict(ssd_in, S=F32, S_COPY=BF if keep else F32, INIT=F32),
                      dict(ssd_common, HAS_INIT=False, HAS_COPY=keep), ssd.WARPS["states"], note=note)

    output = Launch("ssd_scan.triton:_output_fwd", dict(ssd_in, S=F32, Y=BF, CB=F32), dict(ssd_common, HAS_D=True),
                    ssd.WARPS["output"])
    scores = Launch("ssd_scan.triton:_chunk_scores", dict(_types("Bm", "Cm"), CB=F32),
                    dict(L=ssd.CHUNK, BN=ssd.BLOCK_PN, PREC="tf32", NATIVE16=True), 4)

    def step_sizes(discretize: bool, note: str = ""):  # discretize: from in_proj's raw dt (the mixer op), else dt given
        return Launch("ssd_scan.step_sizes:_forward_kernel",
                      dict(_types("BIAS"), DT_IN=BF if discretize else F32, A=F32, DT_OUT=F32, G=F32),
                      dict(L=ssd.CHUNK, BH=steps.BLOCK_HEADS, DISCRETIZE=discretize, HAS_BIAS=discretize, CLAMP=False), 4,
                      note=note)

    block_d, block_t = grn._tile(MAMBA_INNER)
    norm = dict(GROUP=MAMBA_INNER, D_TOTAL=MAMBA_INNER, BLOCK_D=block_d, BLOCK_T=block_t)
    norm_fwd = Launch("gated_rms_norm.triton:_fwd_kernel", _types("Y", "Z", "W", "OUT"), norm,
                      grn._forward_warps(block_d * block_t))
    train = [
        conv_fwd, step_sizes(True), states(True, "chunk states, kept in bf16 for the backward"), scores, output, norm_fwd,
        Launch("gated_rms_norm.triton:_bwd_kernel", dict(_types("Y", "Z", "W", "DOUT", "DY", "DZ"), DW_PART=F32), norm,
               grn._backward_warps(block_d * block_t)),
        Launch("ssd_scan.triton:_dstates_bwd", dict(ssd_in, DY=BF, DS=BF, DFINAL=F32, DINIT=F32),
               dict(ssd_common, HAS_DFINAL=False), ssd.WARPS["dstates"]),
        Launch("ssd_scan.triton:_chunk_bwd", dict(ssd_in, **_types("S", "DS", "DY", "DX", "DBH", "DCH"), DDT=F32, DAP=F32,
                                                  DDP=F32, A=F32),
               dict(ssd_common, BP=max(16, triton.next_power_of_2(MAMBA_HEAD_DIM)), BN=ssd.CHUNK_BWD_BLOCK_N, HAS_D=True),
               ssd.WARPS["chunk_bwd"]),
        Launch("ssd_scan.step_sizes:_backward_kernel", dict(_types("RAW", "BIAS", "DRAW"), DDT=F32, DBIAS_PARTS=F32),
               dict(BR=steps.BLOCK_ROWS_BWD, BH=steps.BLOCK_HEADS, HAS_BIAS=True, CLAMP=False), 4),
        Launch("causal_conv1d.triton:_conv_bwd_pre", dict(_types("X", "W", "BIAS", "STATE", "DOUT", "DPRE"),
                                                          DW_PART=F32, DB_PART=F32),
               dict(conv_common, BT=bwd_t, BC=bwd_c), bwd_warps),
        Launch("causal_conv1d.triton:_conv_bwd_dx", _types("DPRE", "W", "DX"), dict(K=MAMBA_CONV, BT=bwd_t, BC=bwd_c),
               bwd_warps),
    ]
    generate = [
        conv_fwd, step_sizes(False, "prefill: the chunks' log decay"), states(False, "prefill"), scores, output, norm_fwd,
        Launch("causal_conv1d.triton:_conv_step", _types("X", "STATE", "W", "BIAS", "OUT"),
               dict(K=MAMBA_CONV, HAS_BIAS=True, SILU=True, BC=256), note="decode step"),
        Launch("ssd_scan.triton:_step", dict(_types("X", "DT", "Bm", "Cm", "Dv", "DT_BIAS", "Y"), STATE=F32, A=F32),
               dict(BP=max(1, min(triton.next_power_of_2(MAMBA_HEAD_DIM), 4096 // block_n)), BN=block_n, HAS_D=True,
                    HAS_BIAS=True, SOFTPLUS=True), note="decode step"),
    ]
    return [Path("se_hybrid", "train", train), Path("se_hybrid", "generate", generate)]


def _train_backbone_launches():
    """The training step's RMSNorm and SwiGLU product (hidden 2048, SwiGLU 5632), shared by every
    architecture."""
    from hf_hybrid.kernels.output_gate import triton as og

    return [
        Launch("residual_norm.triton:_add_rms_norm_kernel", _types("X", "D", "W", "H", "Y"),
               dict(BLOCK=2048, HAS_DELTA=False), 8, note="RMSNorm"),
        Launch("residual_norm.triton:_rms_norm_bwd_kernel", dict(_types("X", "W", "DY", "DX"), DW_PARTS=F32),
               dict(BLOCK=2048), 8, note="RMSNorm"),
        Launch("output_gate.triton:_fwd_kernel", _types("Z", "Y", "O"), dict(BLOCK=og.BLOCK, SILU=True), 8, note="SwiGLU"),
        Launch("output_gate.triton:_bwd_kernel", _types("Z", "Y", "DO", "DZ", "DY"), dict(BLOCK=og.BLOCK, SILU=True), 8,
               note="SwiGLU"),
    ]


def catalogue() -> list[Path]:
    """Every catalogued (architecture, path) with its launches; the backbone's kernels are added to
    every training path (norm, SwiGLU) and every generate() path (the decode step's)."""
    paths = _rat_launches() + _rat_plus_launches() + _fox_launches() + _window_launches() + _se_hybrid_launches()
    for path in paths:
        if path.path == "generate":
            path.launches += _decode_backbone_launches()
        if path.path == "train":
            path.launches += _train_backbone_launches()
    return paths


# --- compiling -------------------------------------------------------------------------------------
@triton.jit
def _warm_up_kernel(X, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(X + offs, tl.load(X + offs, mask=offs < n) + 1, mask=offs < n)


def signature_of(fn, types: dict, constexprs: dict) -> dict:
    fn = _jit(fn)
    return {a: ("constexpr" if a in constexprs else types.get(a, "fp32" if a in FLOATS else "i32")) for a in fn.arg_names}


def compile_seconds(fn, types: dict, constexprs: dict, num_warps: int, num_stages: int) -> tuple[float, dict]:
    """Wall seconds to build ``fn`` for sm_90 (cache misses only: call with a fresh TRITON_CACHE_DIR) and
    its registers, spill bytes and the build's CPU seconds (``cpu_s``)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(fn=_jit(fn), signature=signature_of(fn, types, constexprs), constexprs=constexprs)
    start, cpu_start = time.perf_counter(), _cpu_seconds()
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    seconds, cpu = time.perf_counter() - start, _cpu_seconds() - cpu_start
    from .sm90 import _resources  # tests/kernels/sm90_resources.py, loaded by path: cuobjdump's register count

    resources = _resources()._resources(compiled)
    return seconds, {"regs": resources["regs"], "spill_bytes": resources["stack_bytes"],
                     "shared_bytes": resources["shared_bytes"], "cpu_s": round(cpu, 3)}


def _cpu_seconds() -> float:
    """CPU seconds of this process and its finished children (ptxas): steadier than wall time on a
    busy machine, where other processes stretch the wall clock."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _compile_row(launch: Launch, cache: dict) -> dict:
    """One launch, every autotune configuration of it (each distinct build compiled once per process:
    ``shared`` says that an earlier row already built all of them)."""
    configs = (autotune_configs(launch.kernel) if launch.tuned else []) or [None]
    row = {"kernel": launch.kernel, "configs": len(configs), "note": launch.note, "seconds": 0.0, "compiled": [],
           "shared": True}
    for config in configs:
        constexprs, warps, stages = dict(launch.constexprs), launch.num_warps, launch.num_stages
        if config is not None:
            constexprs.update(config.kwargs)
            warps, stages = config.num_warps, config.num_stages
        # The argument types are part of a build (a bf16 or fp32 store is another variant).
        key = (launch.kernel, json.dumps(signature_of(_module(launch.kernel), launch.types, constexprs), sort_keys=True),
               json.dumps(constexprs, sort_keys=True), warps, stages)
        if key not in cache:
            row["shared"] = False
            try:
                seconds, resources = compile_seconds(_module(launch.kernel), launch.types, constexprs, warps, stages)
                cache[key] = dict(resources, seconds=round(seconds, 3), warps=warps, stages=stages)
            except Exception as exc:  # reported, the others still run
                cache[key] = {"error": f"{type(exc).__name__}: {exc}"[:300], "seconds": 0.0}
        row["compiled"].append(dict(cache[key], constexprs=constexprs))
        row["seconds"] += cache[key]["seconds"]
    row["seconds"] = round(row["seconds"], 3)
    return row


def run(arch: str | None = None, kernel: str | None = None) -> list[dict]:
    """Rows {arch, path, kernel, configs, seconds, shared, compiled: [...]} for the catalogue's launches,
    then the kernels that benchmarks.sm90's reports describe (RATTENTION's RLA, FoX's Gluon kernels)."""
    _ensure_fresh_cache()
    compile_seconds(_warm_up_kernel, {"X": F32}, {"BLOCK": 16}, 1, 1)  # loads the compiler: not counted
    cache, rows = {}, []
    for path in catalogue():
        if arch and path.arch != arch:
            continue
        for launch in path.launches:
            if kernel is None or kernel in launch.kernel:
                rows.append(dict(_compile_row(launch, cache), arch=path.arch, path=path.path))
    for report_arch, path, note, make_rows in REPORTS:
        if (arch is None or arch == report_arch) and (kernel is None or kernel in note):
            rows += [dict(row, arch=report_arch, path=path) for row in _timed_report(make_rows, note)]
    return rows


def _rla_rows():
    """RATTENTION's RLA kernels with the default tiles on CUDA at 8K tokens (split halves, stacked heads)."""
    from .sm90 import rla_report

    return rla_report([{}])


def _fox_hopper_rows():
    from .sm90 import _resources

    return _resources().fox_hopper_report((HEAD_DIM,)) + _resources().fox_hopper_backward_report((HEAD_DIM,))


# (arch, path, note naming the module, rows) of kernels that benchmarks.sm90 already describes.
REPORTS = [
    ("rattention", "train", "residual_linear_attention.triton (RLA)", _rla_rows),
    ("fox", "train", "forgetting_attention.hopper* (Gluon, the sm_90 default)", _fox_hopper_rows),
]


def _timed_report(make_rows, note: str) -> list[dict]:
    """Rows of a benchmarks.sm90 report with each compile timed (its compile helpers wrapped for the
    call; the wgmma check's second ptxas run skipped, as a GPU build does not make it)."""
    from .sm90 import _resources

    module, timings = _resources(), []

    def timed(compile_fn):
        def wrapper(*args, **kwargs):
            start, cpu_start = time.perf_counter(), _cpu_seconds()
            out = compile_fn(*args, **kwargs)
            timings.append((time.perf_counter() - start, _cpu_seconds() - cpu_start))
            return out
        return wrapper

    saved = {name: getattr(module, name) for name in ("compile_for_sm90", "compile_gluon_for_sm90", "_wgmma_serialized")}
    module.compile_for_sm90 = timed(saved["compile_for_sm90"])
    module.compile_gluon_for_sm90 = timed(saved["compile_gluon_for_sm90"])
    module._wgmma_serialized = lambda ptx: False
    try:
        reported = make_rows()
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)
    rows = []
    for row, (seconds, cpu) in zip([r for r in reported if "error" not in r], timings):
        rows.append({"kernel": row["kernel"], "configs": 1, "note": note, "seconds": round(seconds, 3), "shared": False,
                     "compiled": [{"regs": row.get("regs"), "spill_bytes": row.get("stack_bytes"), "cpu_s": round(cpu, 3),
                                   "seconds": round(seconds, 3)}]})
    rows += [{"kernel": r["kernel"], "configs": 1, "note": note, "seconds": 0.0, "shared": False,
              "compiled": [{"error": r["error"], "seconds": 0.0}]} for r in reported if "error" in r]
    return rows


def unroll_rows(unrolls=(1, 2, 4, 8, 16)) -> list[dict]:
    """RAT's keys/values kernels (L = 16) at each token unroll: the compile seconds and registers that
    the runtime token loop trades against loads in flight (16 unrolls every token: the former kernel)."""
    _ensure_fresh_cache()
    compile_seconds(_warm_up_kernel, {"X": F32}, {"BLOCK": 16}, 1, 1)
    from hf_hybrid.kernels.gated_recurrence import rat_keys_values_triton as kv

    launches = {l.kernel: l for l in _rat_launches()[0].launches if "rat_keys_values" in l.kernel}
    rows = []
    for unroll in unrolls:
        for name, launch in launches.items():
            shipped = kv.FWD_UNROLL if name.endswith("_fwd_kernel") else kv.BWD_UNROLL
            seconds, resources = compile_seconds(_module(name), launch.types, dict(launch.constexprs, UNROLL=unroll),
                                                 launch.num_warps, launch.num_stages)
            rows.append(dict(resources, kernel=name.split(":")[1], unroll=unroll, shipped=unroll == shipped,
                             seconds=round(seconds, 3)))
    return rows


_FRESH_CACHE: list[str] = []  # this process's empty Triton cache, made on first use


def _ensure_fresh_cache() -> None:
    """Every compile of this process misses the cache: a new, empty TRITON_CACHE_DIR."""
    if not _FRESH_CACHE:
        _FRESH_CACHE.append(tempfile.mkdtemp(prefix="triton-cold-"))
        os.environ["TRITON_CACHE_DIR"] = _FRESH_CACHE[0]
        try:
            from triton import knobs

            knobs.cache.dir = _FRESH_CACHE[0]
        except (ImportError, AttributeError):  # older Triton reads the variable per compile
            pass


# --- report ----------------------------------------------------------------------------------------
def table(rows: list[dict]) -> str:
    lines = [f"{'arch':<9} {'path':<9} {'kernel':<58} {'configs':>7} {'compile s':>9} {'cpu s':>6} {'regs':>5}  note"]
    for r in rows:
        regs = ",".join(str(c.get("regs")) for c in r["compiled"])
        cpu = sum(c.get("cpu_s", 0.0) for c in r["compiled"])
        err = next((c["error"] for c in r["compiled"] if "error" in c), "")
        seconds = f"{r['seconds']:.2f}" + ("*" if r.get("shared") else "")
        lines.append(f"{r['arch']:<9} {r['path']:<9} {r['kernel']:<58} {r['configs']:>7} {seconds:>9} {cpu:>6.2f} {regs:>5}  "
                     f"{r['note']}{(' ERROR ' + err) if err else ''}")
    totals = {}
    for r in rows:
        wall, cpu, builds = totals.get((r["arch"], r["path"]), (0.0, 0.0, 0))
        totals[(r["arch"], r["path"])] = (wall + r["seconds"], cpu + sum(c.get("cpu_s", 0.0) for c in r["compiled"]),
                                          builds + r["configs"])
    lines.append("")
    lines += [f"{arch:<9} {path:<9} total compile s {wall:8.2f}, cpu s {cpu:7.2f}, {builds:3d} builds (its catalogued "
              f"launches in a fresh process; * built once here, by an earlier path)"
              for (arch, path), (wall, cpu, builds) in totals.items()]
    return "\n".join(lines)


def unroll_table(rows: list[dict]) -> str:
    lines = [f"{'kernel':<12} {'unroll':>6} {'compile s':>9} {'cpu s':>6} {'regs':>5} {'spill B':>7}"]
    for r in rows:
        lines.append(f"{r['kernel']:<12} {r['unroll']:>6} {r['seconds']:>9.2f} {r['cpu_s']:>6.2f} {r['regs']!s:>5} "
                     f"{r['spill_bytes']!s:>7}"
                     f"{'  shipped' if r['shipped'] else ''}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compile_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", choices=("rat", "rat_plus", "fox", "rattention", "se_hybrid"))
    parser.add_argument("--kernel", help="only launches whose kernel (module:name) contains this (reports: their note)")
    parser.add_argument("--unroll", action="store_true", help="RAT's keys/values kernels at each token unroll")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    if not _compilable():  # kernels defined under the CPU interpreter cannot be compiled: a clean process
        return subprocess.call([sys.executable, "-m", "benchmarks.compile_cost", *(argv if argv is not None else sys.argv[1:])],
                               env=dict(os.environ, TRITON_INTERPRET="0"))
    rows = unroll_rows() if args.unroll else run(args.arch, args.kernel)
    print(unroll_table(rows) if args.unroll else table(rows))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


def _compilable() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") != "1"


if __name__ == "__main__":
    raise SystemExit(main())
