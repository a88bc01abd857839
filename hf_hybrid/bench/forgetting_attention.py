"""Forgetting Attention op benchmark: our Triton kernels against SDPA (cuDNN and flash, causal) and FLA.

    python -m hf_hybrid.bench.forgetting_attention                 # T = 4K, 16K, 32K, 64K
    python -m hf_hybrid.bench.forgetting_attention --seq 4096 --json out.json
    python -m hf_hybrid.bench.forgetting_attention --sweep-forward --seq 4096 65536 --json sweep.json

Shapes: 16 heads x head dim 128, bf16, 65,536 tokens per batch (batch =
tokens // T). Compared in one process: ``torch.nn.functional.scaled_dot_product_attention``
restricted to its cuDNN backend and to its flash backend with ``is_causal=True`` (plain softmax
attention: cuDNN is the speed floor on Hopper), flash-linear-attention's
``parallel_forgetting_attn`` when ``fla`` imports, ours as shipped ("ours": on Hopper its forward is
the warp-specialised Gluon kernels, kernels/forgetting_attention/hopper.py and hopper_backward.py),
on Hopper ours with the portable kernels ("ours_portable": the Hopper dispatch predicates held
off) and ours with the Hopper forward but the portable backward ("ours_portable_bwd"),
and ours on cuDNN with the forget bias as extra head dimensions ("ours_sdpa", what "auto" runs
without gradients in bf16 on GPUs other than Hopper). Ratios are time / cuDNN's.
Forward = one call; forward+backward = one call plus ``autograd.grad`` of q, k, v (and log f for
the forget-gate ops). Timing: CUDA events, warm-up first (includes autotuning), then each op runs
for ``--warm-ms`` (250 ms) untimed so that the clocks settle at its own level (a kernel timed
right after a different one can run up to 10% off its steady speed), then the median of ``--repeat``
calls; inputs are random (never zeros); log f = logsigmoid(N(4, 1)) per head.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
from unittest import mock

import torch
import torch.nn.functional as F

from hf_hybrid.bench.timing import time_fn
from hf_hybrid.kernels.forgetting_attention import forgetting_attention


def _inputs(batch, seq, heads, head_dim, dtype, device):
    g = torch.Generator(device=device).manual_seed(seq)
    shape = (batch, seq, heads, head_dim)
    q, k, v, do = (torch.randn(shape, device=device, dtype=dtype, generator=g) for _ in range(4))
    log_f = F.logsigmoid(torch.randn((batch, seq, heads), device=device, generator=g) + 4.0)
    return q, k, v, log_f, do


def _ops():
    """name -> fn(q, k, v, log_f) with [B, T, H, D] tensors; SDPA ignores log f."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa(backend):
        def fn(q, k, v, log_f):
            with sdpa_kernel(backend):
                o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
            return o.transpose(1, 2)
        return fn

    ops = {"sdpa_cudnn": sdpa(SDPBackend.CUDNN_ATTENTION), "sdpa_flash": sdpa(SDPBackend.FLASH_ATTENTION)}
    try:
        from fla.ops.forgetting_attn import parallel_forgetting_attn

        ops["fla"] = lambda q, k, v, log_f: parallel_forgetting_attn(q, k, v, log_f)
    except Exception as exc:  # not installed, or no GPU build
        print(f"[bench] FLA not available ({type(exc).__name__}: {exc}); comparing to SDPA only", file=sys.stderr)

    ops["ours"] = lambda q, k, v, log_f: forgetting_attention(q, k, v, log_f, backend="triton")
    # cuDNN with the forget bias as extra head dimensions (kernels/forgetting_attention/sdpa.py):
    # what "auto" runs in bf16 on CUDA for whole sequences
    ops["ours_sdpa"] = lambda q, k, v, log_f: forgetting_attention(q, k, v, log_f, backend="sdpa")
    if torch.cuda.get_device_capability()[0] == 9:
        ops["ours_portable"] = ops["ours"]  # under CONTEXTS' switches
        ops["ours_portable_bwd"] = ops["ours"]
    return ops


def portable_kernels(forward: bool = True):
    """The portable kernels in place of the Hopper ones: the backward always, the forward too when
    asked (the Triton wrapper and the SDPA route both ask the forward's predicate)."""
    from hf_hybrid.kernels.forgetting_attention import sdpa as fa_sdpa
    from hf_hybrid.kernels.forgetting_attention import triton as fa_triton

    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(fa_triton, "hopper_backward_applies", lambda *args: False))
    if forward:
        for module in (fa_triton, fa_sdpa):
            stack.enter_context(mock.patch.object(module, "hopper_forward_applies", lambda *args: False))
    return stack


# Rows timed with the Hopper kernels held off over the whole call, backward included.
CONTEXTS = {
    "ours_portable": lambda: portable_kernels(forward=True),
    "ours_portable_bwd": lambda: portable_kernels(forward=False),
}


BASELINES = ("sdpa_cudnn", "sdpa_flash")
FORWARD_ONLY = ("ours_sdpa",)  # no backward (kernels/forgetting_attention/sdpa.py says why)


def run(seqs, tokens, heads, head_dim, repeat, dtype=torch.bfloat16, warm_ms=250.0):
    device = torch.device("cuda")
    rows = []
    for seq in seqs:
        batch = max(tokens // seq, 1)
        q, k, v, log_f, do = _inputs(batch, seq, heads, head_dim, dtype, device)
        flops_fwd = 4 * batch * heads * seq * seq * head_dim / 2  # causal: half the score matrix
        row = {"seq": seq, "batch": batch}
        for name, op in _ops().items():
            leaves = [x.detach().requires_grad_() for x in (q, k, v, log_f)]
            wrt = leaves[:3] if name in BASELINES else leaves

            context = CONTEXTS.get(name, contextlib.nullcontext)

            def fwd():
                with torch.no_grad(), context():
                    op(*leaves)

            def fwd_bwd():
                with context():
                    torch.autograd.grad(op(*leaves), wrt, do)

            t_f = time_fn(fwd, device, warmup=3, repeat=repeat, warm_ms=warm_ms)
            t_fb = None if name in FORWARD_ONLY else time_fn(fwd_bwd, device, warmup=3, repeat=repeat, warm_ms=warm_ms)
            row[name] = {
                "fwd_ms": t_f.median_ms,
                "fwd_bwd_ms": None if t_fb is None else t_fb.median_ms,
                "fwd_tflops": flops_fwd / t_f.median_ms / 1e9,
                "fwd_bwd_tflops": None if t_fb is None else 3.5 * flops_fwd / t_fb.median_ms / 1e9,
                "peak_gb": (t_f if t_fb is None else t_fb).peak_mem_gb,
            }
            del leaves
            torch.cuda.empty_cache()
        rows.append(row)
        print(_line(row), flush=True)
    return rows


def _line(row):
    base = row["sdpa_cudnn"]
    parts = [f"T={row['seq']:>6} B={row['batch']:>3}"]
    for name, r in row.items():
        if isinstance(r, dict):
            both = "" if r["fwd_bwd_ms"] is None else (
                f" fwd+bwd {r['fwd_bwd_ms']:.2f} ms ({r['fwd_bwd_ms'] / base['fwd_bwd_ms']:.2f}x)")
            parts.append(f"{name}: fwd {r['fwd_ms']:.2f} ms ({r['fwd_ms'] / base['fwd_ms']:.2f}x)" + both)
    return " | ".join(parts)


def markdown(rows):
    """The table for docs/benchmarks/fox.md: times in ms, ratios to SDPA's cuDNN backend (time / cuDNN's)."""
    names = [n for n in rows[0] if isinstance(rows[0][n], dict)]
    head = "| T | batch | " + " | ".join(f"{n} fwd" for n in names) + " | " + " | ".join(f"{n} fwd+bwd" for n in names) + " |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        base = r["sdpa_cudnn"]
        cells = [f"{r['seq']}", f"{r['batch']}"]
        for key in ("fwd_ms", "fwd_bwd_ms"):
            for n in names:
                cells.append(f"{r[n][key]:.2f} ({r[n][key] / base[key]:.2f}x)" if n in r and r[n][key] is not None else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# Forward tiles the sweep times: (BLOCK_M, BLOCK_N, warps, stages), BLOCK_M a multiple of BLOCK_N.
SWEEP_TILES = [
    (m, n, w, st) for m in (64, 128) for n in (32, 64, 128) for w in (4, 8) for st in (2, 3, 4) if m % n == 0
]


def sweep_forward(seqs, tokens, heads, head_dim, repeat):
    """The forward kernel alone (no set-up) at every tile of SWEEP_TILES, next to SDPA flash:
    {seq: {"sdpa_flash": ms, "BMxBNxWxS": ms or error}}. How the autotuning table was chosen."""
    import triton

    from hf_hybrid.kernels.forgetting_attention import cumulative_log_forget_by_head
    from hf_hybrid.kernels.forgetting_attention import triton as fa_triton

    device = torch.device("cuda")
    results = {}
    for seq in seqs:
        batch = max(tokens // seq, 1)
        q, k, v, log_f, _ = _inputs(batch, seq, heads, head_dim, torch.bfloat16, device)
        c_by_head = cumulative_log_forget_by_head(log_f)
        cu = torch.arange(0, (batch + 1) * seq, seq, device=device, dtype=torch.int32)
        packed = [x.reshape(batch * seq, heads, head_dim) for x in (q, k, v)]
        row = {"sdpa_flash": time_fn(lambda: _ops()["sdpa_flash"](q, k, v, log_f), device, warmup=2, repeat=repeat).median_ms}
        for m, n, w, st in SWEEP_TILES:
            config = triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st)
            try:
                row[f"{m}x{n}x{w}x{st}"] = time_fn(
                    lambda: fa_triton._forward(*packed, c_by_head, cu, seq, head_dim**-0.5, None, config=config),
                    device, warmup=2, repeat=repeat,
                ).median_ms
            except Exception as exc:  # a tile that does not fit this GPU is reported, not fatal
                row[f"{m}x{n}x{w}x{st}"] = f"{type(exc).__name__}: {exc}"[:120]
        timed = sorted((ms, tile) for tile, ms in row.items() if tile != "sdpa_flash" and isinstance(ms, float))
        print(f"T={seq}: SDPA {row['sdpa_flash']:.2f} ms; fastest tiles " +
              ", ".join(f"{tile} {ms:.2f} ms ({ms / row['sdpa_flash']:.2f}x)" for ms, tile in timed[:4]), flush=True)
        results[seq] = row
    return results


def _tuned_configs():
    """The block sizes the autotuner picked, per kernel and tuning key (only under
    HF_HYBRID_AUTOTUNE=1; by default the portable kernels launch ``portable_tile``'s tile, shown
    per kernel for T = 4K and 64K at head_dim 128 in bf16): run the bench with and without the
    switch to compare the fixed tiles' ``ours_portable`` rows with the autotuner's."""
    from hf_hybrid.kernels.forgetting_attention import triton as fa_triton

    kernels = {name: getattr(fa_triton, name) for name in ("_fwd_kernel", "_dkdv_kernel", "_dq_kernel")}
    tuned = {name: {str(key): str(cfg) for key, cfg in kernel.cache.items()} for name, kernel in kernels.items()}
    fixed = {kind: {seq: str(fa_triton.portable_tile(kind, seq, 128, torch.bfloat16)) for seq in (4096, 65536)}
             for kind in ("fwd", "dkdv", "dq")}
    return {"autotuned": tuned, "portable_tile": fixed}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[4096, 16384, 32768, 65536])
    parser.add_argument("--tokens", type=int, default=65536, help="tokens per batch (batch = tokens // T)")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--json", type=str, default=None, help="write the raw numbers here")
    parser.add_argument("--warm-ms", type=float, default=250.0,
                        help="untimed running time of each op before it is timed (0: the warm-up calls only)")
    parser.add_argument("--sweep-forward", action="store_true",
                        help="time the forward kernel alone at every tile of SWEEP_TILES instead (how the autotuning table was chosen)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("forgetting_attention bench needs a CUDA device", file=sys.stderr)
        return 1
    if args.sweep_forward:
        results = sweep_forward(args.seq, args.tokens, args.heads, args.head_dim, args.repeat)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"device": torch.cuda.get_device_name(), "sweep_forward": results}, fh, indent=2)
        return 0
    rows = run(args.seq, args.tokens, args.heads, args.head_dim, args.repeat, warm_ms=args.warm_ms)
    table = markdown(rows)
    print(json.dumps(_tuned_configs(), indent=1))
    print(table)
    if args.json:
        meta = {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "args": vars(args),
            "tuned_configs": _tuned_configs(),
        }
        with open(args.json, "w") as fh:
            json.dump({"meta": meta, "rows": rows, "table": table}, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
