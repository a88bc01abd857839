"""Compile a Triton kernel for the H100 (sm_90) without a GPU and read its resource use.

Triton ships ptxas and cuobjdump, so a kernel can be compiled ahead of time on any machine:
registers per thread, local-memory stack (register spills) and shared memory per block tell
whether a tile choice fits before any device time is spent on it. The kernel tests check the
shipped configurations with it (sm90_check.py); ``python -m benchmarks.sm90`` prints the reports
and scans a GPU run's Triton cache.
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile


def compile_for_sm90(fn, pointer_dtypes: dict, constexprs: dict, num_warps: int, num_stages: int = 2) -> dict:
    """fn: a @triton.jit kernel; pointer_dtypes: argument -> "*bf16" / "*fp32" / "fp32" ... (other
    non-constexpr arguments are int32). Returns {"regs", "stack_bytes", "shared_bytes", "wgmma"}."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(fn, "jit_function", fn)  # a launch_cached kernel (hf_hybrid/_compat/triton_launch.py): its JIT function
    signature = {a: ("constexpr" if a in constexprs else pointer_dtypes.get(a, "i32")) for a in fn.arg_names}
    compiled = triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=constexprs),
        target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages},
    )
    return _resources(compiled)


def compile_gluon_for_sm90(fn, types: dict, constexprs: dict, num_warps: int, maxnreg: int | None = None) -> dict:
    """fn: a @gluon.jit kernel; types: argument -> "*bf16" / "fp32" / an object to take the type of
    (a TensorDescriptor over a CPU tensor: its block shape and shared layout); other arguments
    int32. Returns compile_for_sm90's fields and "setmaxnreg" (whether the warp-specialised
    partitions rebalance their registers)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    signature = {}
    for a in fn.arg_names:
        given = types.get(a, "i32")
        signature[a] = "constexpr" if a in constexprs else (given if isinstance(given, str) else mangle_type(given))
    options = {"num_warps": num_warps} | ({"maxnreg": maxnreg} if maxnreg else {})
    positional = {(fn.arg_names.index(a),): v for a, v in constexprs.items()}
    compiled = triton.compile(GluonASTSource(fn, signature, positional), target=GPUTarget("cuda", 90, 32), options=options)
    return _resources(compiled) | {"setmaxnreg": "setmaxnreg" in compiled.asm["ptx"]}


def _resources(compiled) -> dict:
    import triton

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as fh:
        fh.write(compiled.asm["cubin"])
        fh.flush()
        usage = subprocess.run([cuobjdump, "-res-usage", fh.name], capture_output=True, text=True).stdout
    wgmma = "wgmma" in compiled.asm["ptx"]
    return {
        "regs": int(re.search(r"REG:(\d+)", usage).group(1)),
        "stack_bytes": int(re.search(r"STACK:(\d+)", usage).group(1)),
        "shared_bytes": compiled.metadata.shared,
        "wgmma": wgmma,
        "wgmma_serialized": wgmma and _wgmma_serialized(compiled.asm["ptx"]),
    }


def _wgmma_serialized(ptx: str) -> bool:
    """Whether ptxas makes each wgmma wait for the one before (its C7511 / C7512 note, "wgmma.mma_async
    instructions are serialized", given when a warpgroup's register budget cannot hold the
    asynchronous pipeline): the kernel then runs with no overlap between its matrix products (FoX's
    backward was 10% slower for it). ptxas prints the note only with -v, so the PTX is assembled
    again here."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(90).path  # the ptxas Triton itself runs for sm_90 (newer Triton ships two)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as fh:
            fh.write(ptx)
        notes = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", os.path.join(tmp, "kernel.cubin")],
                               capture_output=True, text=True)
    if notes.returncode != 0:  # no answer is not "not serialised"
        raise RuntimeError(f"ptxas could not assemble the kernel: {notes.stderr[-500:]}")
    return "instructions are serialized" in notes.stdout + notes.stderr


def _compile_rows(kernels: dict) -> list[dict]:
    """{name: (kernel, pointer dtypes, constexprs, warps)} -> one row per kernel (resources or the error)."""
    rows = []
    for name, (fn, types, constexprs, warps) in kernels.items():
        row = {"kernel": name, "num_warps": warps}
        try:
            row.update(compile_for_sm90(fn, types, constexprs, warps))
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        rows.append(row)
    return rows


def rat_keys_values_report(warps=(2, 4, 8, 16)) -> list[dict]:
    """The fused RAT keys/values kernels at the RAT(L=16) layer shape (bf16, 16 heads x 128, 2 key
    groups; the forward with FWD_HEADS heads per program, the backward with all 16) for each warp count."""
    from hf_hybrid.kernels.gated_recurrence import rat_keys_values_triton as kv

    bf, f32 = "*bf16", "*fp32"
    inputs = dict(K=bf, V=bf, LOGIT=bf, BIAS=bf, COS=f32, SIN=f32)
    constexprs = dict(GROUPS=2, HEADS=16, D=128, HALF=64, L=16, HAS_ROPE=True)
    kernels = {
        "_fwd_kernel": (dict(inputs, KROT=bf, VT=bf),
                        dict(constexprs, BLOCK_H=kv.FWD_HEADS, UNROLL=kv.unroll_for(16, kv.FWD_UNROLL))),
        "_bwd_kernel": (dict(inputs, KROT=bf, VT=bf, DKROT=bf, DVT=bf, DK=bf, DV=bf, DLOGIT=bf, DBIAS=f32),
                        dict(constexprs, BLOCK_H=16, BLOCK_D=kv.BWD_BLOCK_D, UNROLL=kv.unroll_for(16, kv.BWD_UNROLL))),
    }
    rows = []
    for name, (pointers, kernel_constexprs) in kernels.items():
        for num_warps in warps:
            row = {"kernel": name, "num_warps": num_warps}
            try:
                row.update(compile_for_sm90(getattr(kv, name), pointers, kernel_constexprs, num_warps))
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(row)
    return rows


def fused_norm_report() -> list[dict]:
    """The fused norm kernels at RATTENTION's shape (bf16, head_dim 128) with the shipped tiles."""
    from hf_hybrid.kernels.fused_norm import triton as fn

    bf, f32 = "*bf16", "*fp32"
    block_t = fn.TILE_ELEMENTS // 128
    norm = dict(D=128, HALF=64, BLOCK_HALF=64, BLOCK_T=block_t, HAS_NORM=True)
    branch = dict(HAS_B=True, D=128, BLOCK_D=128, BLOCK_T=block_t)
    rope_only = dict(norm, HAS_NORM=False)
    kernels = {
        "_norm_rope_fwd_kernel": (dict(X=bf, W=bf, COS=f32, SIN=f32, Y=bf, eps="fp32"), norm),
        "_norm_rope_bwd_kernel": (dict(X=bf, W=bf, COS=f32, SIN=f32, DY=bf, DX=bf, DW_PART=f32, eps="fp32"), norm),
        "_norm_rope_fwd_kernel (rotary)": (dict(X=bf, W=bf, COS=f32, SIN=f32, Y=bf, eps="fp32"), rope_only),
        "_norm_rope_bwd_kernel (rotary)": (dict(X=bf, W=bf, COS=f32, SIN=f32, DY=bf, DX=bf, DW_PART=f32, eps="fp32"), rope_only),
        "_branch_fwd_kernel": (dict(A=bf, WA=bf, B=bf, WB=bf, Y=bf, eps_a="fp32", eps_b="fp32"), branch),
        "_branch_bwd_kernel": (dict(A=bf, WA=bf, B=bf, WB=bf, DY=bf, DA=bf, DB=bf, DWA_PART=f32, DWB_PART=f32,
                                    eps_a="fp32", eps_b="fp32"), branch),
    }
    rows = []
    for name, (types, constexprs) in kernels.items():
        row = {"kernel": name, "num_warps": fn.NUM_WARPS}
        try:
            row.update(compile_for_sm90(getattr(fn, name.split()[0]), types, constexprs, fn.NUM_WARPS))
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        rows.append(row)
    return rows


def rat_decode_report() -> list[dict]:
    """The split-K decode kernels at the RAT(L=16) layer shape (bf16, 16 heads x 128, 2 q/k groups) with
    the shipped warp count: the one-kernel RAT step, the chunk-end decode and the pass that merges splits."""
    from hf_hybrid.kernels import _split_decode
    from hf_hybrid.kernels.chunk_attention import decode, rat_decode_triton as rd

    bf, f32 = "*bf16", "*fp32"
    partials = dict(M_OUT=f32, L_OUT=f32, ACC_OUT=f32)
    kernels = {
        "_rat_decode_kernel": (rd._rat_decode_kernel, dict(
            Q=bf, K=bf, V=bf, GL=bf, BIAS=f32, SK=bf, SV=bf, POS="*i64", COS=f32, SIN=f32, KB=bf, VB=bf, **partials,
            O=bf, Z=bf, sqb="i64", skb="i64", svb="i64", sgb="i64", ssb="i64", sbb="i64", sbc="i64", sob="i64", qk_scale="fp32",
        ), dict(GROUPS=2, HEAD_DIM=128, BLOCK_N=decode.DECODE_BLOCK_N, HAS_ROPE=True, DIRECT=False, HAS_GATE=True),
            decode.DECODE_WARPS),
        "_decode_kernel": (decode._decode_kernel, dict(
            Q=bf, KO=bf, VO=bf, KE=bf, VE=bf, QC="*i64", **partials, O=bf, qk_scale="fp32",
        ), dict(HEAD_DIM=128, BLOCK_N=decode.DECODE_BLOCK_N, DIRECT=False), decode.DECODE_WARPS),
        "_combine_kernel": (_split_decode._combine_kernel, dict(M_IN=f32, L_IN=f32, ACC_IN=f32, O=bf, Z=bf),
                            dict(HEAD_DIM=128, BLOCK_S=8, HAS_GATE=True), decode.DECODE_WARPS),
    }
    return _compile_rows(kernels)


def rat_plus_decode_report() -> list[dict]:
    """RAT+'s two decode-step kernels at the 1.3B shape (bf16, 16 query heads x 128, 16 kv heads,
    a dilated store with sinks) with the shipped warp counts."""
    from hf_hybrid.kernels.chunk_attention import rat_plus_decode_triton as rp

    bf, f32, i64 = "*bf16", "*fp32", "*i64"
    kernels = {
        "_token_kernel": (rp._token_kernel, dict(
            Q=bf, K=bf, V=bf, GL=bf, SK=f32, SV=f32, POS=i64, COS=f32, SIN=f32, KB=bf, VB=bf, ST=i64,
            SINK_VALID="*u8", QR=bf,
        ), dict(GROUP=1, HEAD_DIM=128, SINKS=4, BLOCK_S=4, HAS_RECURRENCE=True, HAS_ROPE=True, HAS_ENDS=True), 1),
        "_stored_attention_kernel": (rp._stored_attention_kernel, dict(
            QR=bf, KB=bf, VB=bf, ST=i64, M_OUT=f32, L_OUT=f32, ACC_OUT=f32, O=bf, Z=bf, qk_scale="fp32",
        ), dict(GROUP=1, HEAD_DIM=128, BLOCK=rp.BLOCK_N, DIRECT=False, HAS_GATE=True), rp.WARPS),
    }
    return _compile_rows(kernels)


def fox_decode_report(gated: bool = True) -> list[dict]:
    """FoX's split-K decode kernel at the benchmark's shape (bf16, 16 heads x 128) with the shipped
    tile; ``gated=False``: the same kernel with the gate compiled out (kernels/window_attention)."""
    from hf_hybrid.kernels.forgetting_attention import decode_triton as fd

    bf, f32 = "*bf16", "*fp32"
    types = dict(Q=bf, K=bf, V=bf, CQ=f32, CK=f32, LEN="*i64", MASK="*u8", M_OUT=f32, L_OUT=f32, ACC_OUT=f32, O=bf,
                 qk_scale="fp32")
    name = "_partial_kernel (FoX decode)" if gated else "decode GATED=False"
    row = {"kernel": name, "num_warps": fd.WARPS, "block_n": fd.BLOCK_N}
    try:
        row.update(compile_for_sm90(fd._partial_kernel, types, dict(
            HEAD_DIM=128, BLOCK=fd.BLOCK_N, HAS_MASK=False, HAS_WINDOW=False, DIRECT=False, STAGES=fd.STAGES,
            GATED=gated), fd.WARPS))
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"[:300]
    return [row]


def window_attention_report() -> list[dict]:
    """Forgetting Attention's portable kernels with a window, with and without the gate (FoX; the
    window layers' kernels/window_attention), at the tiles portable_tile picks for 8K (bf16, head_dim
    128), and the decode kernel without the gate."""
    import torch

    from hf_hybrid.kernels.forgetting_attention import triton as fa

    bf, f32 = "*bf16", "*fp32"
    types = dict(Q=bf, K=bf, V=bf, O=bf, DO=bf, DK=bf, DV=bf, DQ=bf, C=f32, LSE=f32, DELTA=f32, DC=f32, DCQ=f32,
                 CU="*i32", scale="fp32", scale2="fp32")
    rows = []
    for gated in (True, False):
        for kind, kernel in (("fwd", fa._fwd_kernel), ("dkdv", fa._dkdv_kernel), ("dq", fa._dq_kernel)):
            tile = fa.portable_tile(kind, 8192, 128, torch.bfloat16)
            row = {"kernel": f"{kind} GATED={gated}", "num_warps": tile.num_warps}
            try:
                row.update(compile_for_sm90(kernel.fn, types, dict(
                    GROUP=1, HEAD_DIM=128, HAS_WINDOW=True, GATED=gated, DOT_PREC="tf32", **tile.kwargs),
                    tile.num_warps, tile.num_stages))
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(row)
    return rows + fox_decode_report(gated=False)


def output_gate_report() -> list[dict]:
    """The output gates' forward and backward (bf16), sigmoid and SiLU."""
    from hf_hybrid.kernels.output_gate import triton as og

    bf = "*bf16"
    kernels = {"_fwd_kernel": dict(Z=bf, Y=bf, O=bf), "_bwd_kernel": dict(Z=bf, Y=bf, DO=bf, DZ=bf, DY=bf)}
    rows = []
    for silu in (False, True):
        for name, types in kernels.items():
            row = {"kernel": name, "silu": silu, "num_warps": 8}
            try:
                row.update(compile_for_sm90(getattr(og, name), types, dict(BLOCK=og.BLOCK, SILU=silu), 8))
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(row)
    return rows


def linear_cross_entropy_report() -> list[dict]:
    """The loss-and-gradient pass over a chunk of bf16 logits (int64 targets)."""
    from hf_hybrid.kernels.linear_cross_entropy import triton as lce

    types = dict(LOGITS="*bf16", TARGETS="*i64", LOSS="*fp32", SCALE="*fp32")
    return _compile_rows({
        "_loss_and_grad_kernel": (lce._loss_and_grad_kernel, types, dict(BLOCK=lce.BLOCK_V, HAS_GRAD=True), lce.WARPS),
    })


def kv_shift_report() -> list[dict]:
    """FoX's KV-shift, forward and backward (bf16, head_dim 128, previous token given)."""
    from hf_hybrid.kernels.kv_shift import triton as ks

    bf = "*bf16"
    constexprs = dict(BLOCK_T=ks.BLOCK_T, BLOCK_D=128, HAS_PREV=True)
    return _compile_rows({
        "_fwd_kernel": (ks._fwd_kernel, dict(X=bf, L=bf, P=bf, O=bf), constexprs, ks.NUM_WARPS),
        "_bwd_kernel": (ks._bwd_kernel, dict(X=bf, L=bf, P=bf, DO=bf, DX=bf, DL=bf, DP=bf), constexprs, ks.NUM_WARPS),
    })


def fox_hopper_report(head_dims=(64, 128)) -> list[dict]:
    """The Gluon FoX forward (kernels/forgetting_attention/hopper.py) per head_dim at its shipped
    tiles, stages and register budget (bf16, 16 heads, GQA off)."""
    import torch

    from hf_hybrid.kernels.forgetting_attention import hopper

    rows = []
    for d in head_dims:
        x = torch.empty(1024, 16 * d, dtype=torch.bfloat16)
        row = {"kernel": f"hopper._fwd_kernel d={d}", "num_warps": 4}
        try:
            desc_q = hopper._descriptor(x.view(1024, 16, d), hopper.BLOCK_M // 2)
            desc_kv = hopper._descriptor(x.view(1024, 16, d), hopper.BLOCK_N)
            types = dict(desc_q=desc_q, desc_k=desc_kv, desc_v=desc_kv, desc_o=desc_q, C="*fp32", O="*bf16",
                         LSE="*fp32", CU="*i32", COUNTER="*i32", scale2="fp32")
            constexprs = dict(GROUP=1, HEAD_DIM=d, BLOCK_N=hopper.BLOCK_N, STAGES=hopper.STAGES[d], num_warps=4)
            row.update(compile_gluon_for_sm90(hopper._fwd_kernel, types, constexprs, 4, hopper.MAX_REGISTERS))
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        rows.append(row)
    return rows


def fox_hopper_backward_report(head_dims=(64, 128)) -> list[dict]:
    """The Gluon FoX backward (kernels/forgetting_attention/hopper_backward.py) per head_dim at its
    shipped tiles, stages and register budget (bf16, 16 heads, GQA off)."""
    import torch

    from hf_hybrid.kernels.forgetting_attention import hopper, hopper_backward

    rows = []
    for d in head_dims:
        x = torch.empty(1024, 16, d, dtype=torch.bfloat16)
        row = {"kernel": f"hopper_backward._bwd_kernel d={d}", "num_warps": 4}
        try:
            desc_q = hopper._descriptor(x, hopper_backward.BLOCK_Q)
            desc_kv = hopper._descriptor(x, hopper_backward.KEYS // 2)
            desc_dq = hopper_backward._dq_descriptor(torch.empty(1024, 16, d))
            types = dict(desc_q=desc_q, desc_do=desc_q, desc_k=desc_kv, desc_v=desc_kv, desc_dq=desc_dq,
                         desc_dk=desc_kv, desc_dv=desc_kv, C="*fp32",
                         LSE="*fp32", DELTA="*fp32", DK="*bf16", DV="*bf16", DC="*fp32", DCQ="*fp32", CU="*i32",
                         scale="fp32", scale2="fp32")
            constexprs = dict(GROUP=1, HEAD_DIM=d, BLOCK_Q=hopper_backward.BLOCK_Q, STAGES=hopper_backward.STAGES,
                              num_warps=4)
            row.update(compile_gluon_for_sm90(hopper_backward._bwd_kernel, types, constexprs, 4,
                                              hopper_backward.MAX_REGISTERS))
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        rows.append(row)
    return rows


def serialised_wgmma_in_cache(cache_dir: str) -> dict[str, bool]:
    """Every kernel with wgmma that a run compiled into ``cache_dir`` (``TRITON_CACHE_DIR``), by its
    PTX file -> whether ptxas serialised its wgmma: a whole workload checked at once, on the GPU
    machine after a benchmark or a training step."""
    import glob

    found = {}
    for path in sorted(glob.glob(os.path.join(cache_dir, "**", "*.ptx"), recursive=True)):
        with open(path) as fh:
            ptx = fh.read()
        if "wgmma" in ptx:
            found[os.path.relpath(path, cache_dir)] = _wgmma_serialized(ptx)
    return found

