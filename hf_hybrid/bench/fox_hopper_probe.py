"""Every config of the TMA Forgetting Attention forward (kernels/forgetting_attention/hopper.py),
warp-specialised ones included, each in its own process with a time limit: does it finish, is it
exact against the portable kernel, how fast is it.

    python -m hf_hybrid.bench.fox_hopper_probe [--timeout 40] [--json out.json]

A config whose kernel never finishes (Triton 3.6's warp-specialised configs deadlock) is reported
as a timeout instead of hanging the run. Shapes: bf16, 16 heads x 128; T = 1024 (B = 1), 16384
(B = 4) and packed sequences [1000, 1, 1499, 500]. Timing: triton.testing.do_bench medians of the
kernel alone, next to the portable kernel's shipped tile in the same process.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

SHAPES = [(1024, 1, False), (16384, 4, False), (3000, 1, True)]

_CHILD = r'''
import json, sys
import torch, torch.nn.functional as F, triton
from triton.testing import do_bench
from hf_hybrid.kernels.forgetting_attention import cumulative_log_forget_by_head, hopper
from hf_hybrid.kernels.forgetting_attention import triton as portable

(bm, bn, warps, stages, ws), t, b, packed = json.loads(sys.argv[1])
heads, dim = 16, 128
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v = (torch.randn(b * t, heads, dim, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
log_f = F.logsigmoid(torch.randn(b, t, heads, device="cuda", generator=g) + 4)
if packed:
    cu = torch.tensor([0, 1000, 1001, 2500, t], device="cuda", dtype=torch.int32)
    c_t = cumulative_log_forget_by_head(log_f, cu)
else:
    cu = torch.arange(0, (b + 1) * t, t, device="cuda", dtype=torch.int32)
    c_t = cumulative_log_forget_by_head(log_f)
max_len, scale, nseq = int((cu[1:] - cu[:-1]).max()), dim ** -0.5, cu.numel() - 1
o, lse = torch.empty_like(q), torch.empty(heads, b * t, device="cuda")
descs = [hopper._descriptor(x) for x in (q, k, v)] + [hopper._c_descriptor(c_t, cu, max_len, not packed)]
for desc, shape in zip(descs, ([bm, dim], [bn, dim], [bn, dim], [1, bn])):
    desc.block_shape = shape


def tma():
    hopper._fwd_kernel.fn[(triton.cdiv(max_len, bm), heads, nseq)](
        *descs, c_t, o, lse, cu, scale * 1.4426950408889634, 1, o.stride(0), o.stride(1), c_t.stride(0),
        GROUP=1, HEAD_DIM=dim, BLOCK_M=bm, BLOCK_N=bn, WARP_SPECIALIZE=ws, num_warps=warps, num_stages=stages)


shipped = triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=3)


def reference():
    return portable._forward(q, k, v, c_t, cu, max_len, scale, None, config=shipped)


tma()
o_ref, lse_ref = reference()
print(json.dumps({
    "rel_err_o": ((o.float() - o_ref.float()).norm() / o_ref.float().norm()).item(),
    "max_err_lse": (lse - lse_ref).abs().max().item(),
    "ms": do_bench(tma, warmup=5, rep=50, return_mode="median"),
    "ms_portable": do_bench(reference, warmup=5, rep=50, return_mode="median"),
}))
'''


def probe(config, shape, timeout: float) -> dict:
    """One config at one shape in a fresh process: its result, or why there is none."""
    try:
        run = subprocess.run([sys.executable, "-c", _CHILD, json.dumps([list(config), *shape])],
                             capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": "timeout"}
    if run.returncode != 0 or not run.stdout.strip():
        return {"status": "error", "stderr": run.stderr.strip()[-400:]}
    return {"status": "ok", **json.loads(run.stdout.strip().splitlines()[-1])}


def main(argv=None) -> int:
    from hf_hybrid.kernels.forgetting_attention import hopper

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=40.0, help="seconds per config and shape (compile included)")
    parser.add_argument("--ws", type=int, default=None, help="probe only the first N warp-specialised configs")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    rows = []
    for config in hopper.TUNED_CONFIGS + hopper.WARP_SPECIALIZED_CONFIGS[:args.ws]:
        for shape in SHAPES:
            row = {"config": config, "shape": shape, **probe(config, shape, args.timeout)}
            rows.append(row)
            print(json.dumps(row), flush=True)
            if row["status"] != "ok":
                break  # the next shapes would fail the same way
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
