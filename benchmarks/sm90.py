"""sm_90 compiles without a GPU: registers, spills and shared memory of the shipped kernels.

It also scans a GPU run's Triton cache for wgmma that ptxas serialised.

    python -m benchmarks.sm90                      every kernel report of tests/kernels/sm90_resources.py
    python -m benchmarks.sm90 --rla [--kv-heads N] [--json F]
                                                   the RATTENTION RLA kernels at the bench's variants
    python -m benchmarks.sm90 --scan-cache DIR     after a benchmark or a training step on the GPU machine
                                                   (DIR: its TRITON_CACHE_DIR)

The compile helper itself lives beside the kernel tests that use it in CI
(tests/kernels/sm90_resources.py); it is loaded here by path.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

RESOURCES = Path(__file__).resolve().parent.parent / "tests" / "kernels" / "sm90_resources.py"


def _resources():
    """tests/kernels/sm90_resources.py as a module (loaded once, by path)."""
    module = sys.modules.get("sm90_resources")
    if module is None:
        spec = importlib.util.spec_from_file_location("sm90_resources", RESOURCES)
        module = importlib.util.module_from_spec(spec)
        sys.modules["sm90_resources"] = module
        spec.loader.exec_module(module)
    return module


def rla_report(variants=None, kv_heads: int | None = None) -> list[dict]:
    """Compile every RLA kernel for sm_90 ahead of time (no GPU needed) and report registers,
    local-memory stack (spills) and shared memory per thread block. bf16, head_dim 128, 16 query /
    ``kv_heads`` key-value heads (default 4), T = 8192, each pass's kernels with the tiling the
    kernel's plan gives for the bench's option variants ({}: the CUDA defaults)."""
    from types import SimpleNamespace

    import torch

    from hf_hybrid.bench.rattention import HEAD_DIM, HEADS, KV_HEADS, RLA_VARIANTS
    from hf_hybrid.kernels.residual_linear_attention import triton as rla_triton

    kv_heads = kv_heads or KV_HEADS

    compile_for_sm90 = _resources().compile_for_sm90

    bf, f32 = "*bf16", "*fp32"
    # kernel -> (pointer dtypes, extra constexprs, the pass whose tiling it runs, fused kernel or None for both)
    specs = {
        "_state_pass_kernel": (dict(K=bf, V=bf, S0=f32, STATES=f32), dict(HAS_S0=False), "backward", None),
        "_fwd_kernel": (dict(Q=bf, K=bf, V=bf, S_IN=f32, O=f32, O_RES=bf, S_OUT=f32), dict(S_IN_MODE=2, STORE_FINAL=False), "forward", False),
        "_fwd_fused_kernel": (dict(Q=bf, K=bf, V=bf, S_IN=f32, O=bf, S_OUT=f32), dict(S_IN_MODE=2, STORE_FINAL=False), "forward", True),
        "_dq_kernel": (dict(Q=bf, K=bf, V=bf, DO=bf, S_IN=f32, DQ=f32, DQ_RES=bf), dict(S_IN_MODE=2), "backward", False),
        "_dq_fused_kernel": (dict(Q=bf, K=bf, V=bf, DO=bf, S_IN=f32, DQ=f32), dict(S_IN_MODE=2), "backward", True),
        "_adjoint_pass_kernel": (dict(Q=bf, DO=bf, DSF=f32, GSTATES=f32), dict(HAS_DSF=False), "backward", None),
        "_dkv_kernel": (dict(Q=bf, K=bf, V=bf, DO=bf, G_IN=f32, DK=f32, DV=f32, DK_RES=bf, DV_RES=bf, DS0=f32),
                        dict(G_IN_MODE=2, STORE_DS0=False), "backward", None),
    }
    q = SimpleNamespace(shape=(1, 8192, HEADS, HEAD_DIM), is_cuda=True, dtype=torch.bfloat16, device=torch.device("cuda"))
    k = SimpleNamespace(shape=(1, 8192, kv_heads, HEAD_DIM))
    interpreting = rla_triton.triton_interpreting
    rla_triton.triton_interpreting = lambda: False  # the plan a GPU run makes
    try:
        plans = [(opts, rla_triton._Plan(q, k, "softmax", 512, opts.get("chunk_size"), opts.get("block_v"),
                                         opts.get("state_every"), opts.get("num_warps"), opts.get("fuse_halves"),
                                         opts.get("heads_per_tile"), half_launches=opts.get("half_launches")))
                 for opts in (variants if variants is not None else RLA_VARIANTS)]
    finally:
        rla_triton.triton_interpreting = interpreting
    rows = []
    for opts, plan in plans:
        for name, (ptrs, extra, pass_name, fused) in specs.items():
            tiling = getattr(plan, pass_name)
            if fused is not None and fused != tiling.fuse:
                continue
            consts = dict(extra, **plan.common(tiling, halves=fused is not True, queries=name != "_state_pass_kernel"))
            warps = consts.pop("num_warps")
            consts.pop("num_stages")
            fn = getattr(rla_triton, name)
            if "H" in fn.arg_names:
                consts["H"] = HEADS
            if "HALF" in fn.arg_names:  # the second of the launches per half: it reads, adds and stores
                consts["HALF"] = 1 if plan.half_launches else -1
            consts["HKV"] = kv_heads
            variant = f"C={plan.chunk} BV={tiling.block_v} fuse={tiling.fuse} HG={tiling.heads_per_tile} warps={warps}"
            row = {"options": opts, "variant": variant, "kernel": name}
            try:
                row.update(compile_for_sm90(fn, ptrs, consts, warps))
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            print(f"[compile] {row}", flush=True)
            rows.append(row)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sm90", description=__doc__.splitlines()[0])
    parser.add_argument("--scan-cache", metavar="DIR", help="report whether ptxas serialised the wgmma of every kernel cached in DIR")
    parser.add_argument("--rla", action="store_true", help="only the RATTENTION RLA kernels at the bench's variants")
    parser.add_argument("--kv-heads", type=int, default=None,
                        help="--rla: key / value heads (default: the RATTENTION bench's 4; the whole-model benches use 16)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    resources = _resources()
    if args.scan_cache:
        for name, serialised in resources.serialised_wgmma_in_cache(args.scan_cache).items():
            print(f"{'SERIALISED' if serialised else 'ok':10} {name}")
        return 0
    if args.rla:
        rows = rla_report(kv_heads=args.kv_heads)
    else:
        rows = (resources.rat_keys_values_report() + resources.fused_norm_report() + resources.rat_decode_report()
                + resources.fox_decode_report() + resources.output_gate_report() + resources.kv_shift_report()
                + resources.fox_hopper_report() + resources.fox_hopper_backward_report())
        for row in rows:
            print(row)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)
    return 0 if all("error" not in row for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
