"""SE-Attn op benchmark: forward+backward time against SDPA full causal attention, same process.

    python -m hf_hybrid.bench.se_attention                       # T = 16K, 32K; M = 2048, 4096
    python -m hf_hybrid.bench.se_attention --seq 8192 --json out.json

Shapes follow the paper (hidden 2048 = 16 heads x 128, bf16, batch 1; S = 32, k = 8). "se M=a|b"
is the paper's training recipe, a chunk size drawn per forward from {a, b}: its time is the mean of
the two. Timing: CUDA events around each call after warm-up, median of ``--repeat`` calls; inputs
are random (never zeros). Peak memory is the allocator's peak during the timed calls.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys

import torch
from torch.nn import functional as F

from hf_hybrid.kernels.span_expanded_attention import span_expanded_attention


def _time(fn, repeat: int, warmup: int = 3) -> tuple[float, float]:
    """(median ms, peak GiB) of fn() on CUDA."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeat)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events), torch.cuda.max_memory_allocated() / 2**30


def _step(attn, q, k, v, grad, backward: bool):
    def run():
        for x in (q, k, v):
            x.grad = None
        out = attn(q, k, v)
        if backward:
            out.backward(grad)

    return run


def variants(args) -> dict:
    """name -> attention callable on [b, t, h, d] tensors."""
    def sdpa_full(q, k, v):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2)

    def sdpa_flash(q, k, v):
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            return sdpa_full(q, k, v)

    out = {"sdpa full (default)": sdpa_full, "sdpa full (flash)": sdpa_flash}
    common = dict(block_size=args.block_size, top_k=args.top_k, backend="sdpa")
    for m in args.chunk_sizes:
        for g in args.select_every:
            out[f"se M={m} G={g}"] = lambda q, k, v, m=m, g=g: span_expanded_attention(
                q, k, v, mode="se", chunk_size=m, select_every=g, **common)
        out[f"se_nomem M={m}"] = lambda q, k, v, m=m: span_expanded_attention(q, k, v, mode="se_nomem", chunk_size=m, backend="sdpa")
    out[f"swa W={args.window}"] = lambda q, k, v: span_expanded_attention(q, k, v, mode="swa", window=args.window, backend="sdpa")
    return out


def _device_us(event) -> float:
    """Total device time of a profiler row (named cuda_time_total in older torch versions)."""
    for name in ("device_time_total", "cuda_time_total"):
        if hasattr(event, name):
            return float(getattr(event, name))
    return 0.0


def _profile(name, attn, seq, args, steps: int = 3) -> None:
    """Per-step time of the op's stages (the se::* ranges in chunked.py) and of its top CUDA kernels."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    shape = (args.batch, seq, args.heads, args.head_dim)
    q, k, v, grad = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    for x in (q, k, v):
        x.requires_grad_(True)
    step = _step(attn, q, k, v, grad, backward=True)
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    rows = prof.key_averages()
    kernels = [e for e in rows if e.device_type == DeviceType.CUDA and not e.key.startswith("se::")]
    total = sum(_device_us(e) for e in kernels) / steps / 1e3
    print(f"\n== profile: {name}, T={seq}, fwd+bwd, per step: {sum(e.count for e in kernels) / steps:.0f} GPU kernels, {total:.2f} ms kernel time")
    stages = {}
    for e in rows:  # a stage shows up as a CPU range (its kernels' time) and, with newer torch, as a GPU annotation
        if e.key.startswith("se::"):
            stages[e.key] = max(stages.get(e.key, 0.0), _device_us(e))
    print("| stage | ms per step |\n|---|---|")
    for key, us in sorted(stages.items(), key=lambda kv: -kv[1]):
        print(f"| {key} | {us / steps / 1e3:.3f} |")
    print("| kernel | ms per step | calls per step |\n|---|---|---|")
    for e in sorted(kernels, key=_device_us, reverse=True)[:25]:
        print(f"| {e.key[:90]} | {_device_us(e) / steps / 1e3:.3f} | {e.count / steps:.0f} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[16384, 32768])
    parser.add_argument("--chunk-sizes", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--select-every", type=int, nargs="+", default=[128])
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--window", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--json", type=str, default=None)
    parser.add_argument(
        "--profile", type=str, nargs="+", default=[],
        help="variant name(s), e.g. 'se M=2048 G=128': also print a torch.profiler breakdown (stages, top CUDA kernels) at the largest T",
    )
    args = parser.parse_args(argv)
    unknown = [name for name in args.profile if name not in variants(args)]
    if unknown:
        parser.error(f"--profile: unknown variant(s) {unknown}; choose from {list(variants(args))}")
    if not torch.cuda.is_available():
        print("se_attention bench needs a CUDA device (it times fused GPU kernels).", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    rows = []
    for seq in args.seq:
        gen = torch.Generator(device=device).manual_seed(seq)
        shape = (args.batch, seq, args.heads, args.head_dim)
        q, k, v, grad = (torch.randn(shape, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(4))
        for x in (q, k, v):
            x.requires_grad_(True)
        for name, attn in variants(args).items():
            fwd_ms, _ = _time(_step(attn, q, k, v, grad, backward=False), args.repeat)
            step_ms, peak = _time(_step(attn, q, k, v, grad, backward=True), args.repeat)
            rows.append(dict(seq=seq, variant=name, fwd_ms=fwd_ms, fwd_bwd_ms=step_ms, peak_gib=peak))
            torch.cuda.empty_cache()
        for g in args.select_every:  # the paper's recipe: M drawn per forward from the list
            picks = [r for r in rows if r["seq"] == seq and r["variant"] in {f"se M={m} G={g}" for m in args.chunk_sizes}]
            rows.append(dict(
                seq=seq, variant="se M=" + "|".join(map(str, args.chunk_sizes)) + f" G={g}",
                fwd_ms=statistics.mean(r["fwd_ms"] for r in picks), fwd_bwd_ms=statistics.mean(r["fwd_bwd_ms"] for r in picks),
                peak_gib=max(r["peak_gib"] for r in picks),
            ))
    for row in rows:
        base = next(r for r in rows if r["seq"] == row["seq"] and r["variant"] == "sdpa full (default)")
        row["speedup_fwd_bwd"] = base["fwd_bwd_ms"] / row["fwd_bwd_ms"]
        row["speedup_fwd"] = base["fwd_ms"] / row["fwd_ms"]
    env = dict(
        device=torch.cuda.get_device_name(), torch=torch.__version__, python=platform.python_version(),
        command="python -m hf_hybrid.bench.se_attention " + " ".join(sys.argv[1:] if argv is None else argv),
        shape=f"batch {args.batch}, heads {args.heads}, head_dim {args.head_dim}, bf16; S={args.block_size}, k={args.top_k}",
    )
    from hf_hybrid.kernels._lse_attention import _kind

    env["se_fused_kernel"] = _kind(torch.empty(1, 1, 1, args.head_dim, device=device, dtype=torch.bfloat16))
    print(f"device: {env['device']}  torch {env['torch']}  {env['shape']}  SE fused kernel: {env['se_fused_kernel']}")
    print("| T | variant | fwd ms | fwd+bwd ms | speedup fwd+bwd vs SDPA | speedup fwd | peak GiB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['seq']} | {r['variant']} | {r['fwd_ms']:.2f} | {r['fwd_bwd_ms']:.2f} | "
              f"{r['speedup_fwd_bwd']:.2f}x | {r['speedup_fwd']:.2f}x | {r['peak_gib']:.2f} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(environment=env, results=rows), fh, indent=2)
    for name in args.profile:
        _profile(name, variants(args)[name], max(args.seq), args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
