"""Mamba-2 mixer benchmark: the SE hybrid's mixer on this package's ops (Triton conv1d + SSD scan,
fused decode step) against transformers' Bamba ``torch_forward`` (the fallback without mamba_ssm /
causal_conv1d) on the same parameters, same process.

    python -m hf_hybrid.bench.mamba                         # T = 2048, Mamba-2-Hybrid 2.7B mixer shape
    python -m hf_hybrid.bench.mamba --seq 2048 8192 --json out.json

Rows: the mixer forward, forward+backward, one decode token (cache), and the SSD op alone
(ssd_scan vs Bamba's mamba2_chunk_scan), each with the allocator's peak. Timing: CUDA events after
warm-up, median of ``--repeat`` calls; random inputs. A variant that runs out of memory says OOM.
Current figures: docs/benchmarks/se_hybrid.md.
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch
from transformers.models.bamba import modeling_bamba
from transformers.models.bamba.modeling_bamba import BambaMixer

from hf_hybrid.kernels.ssd_scan import ssd_scan
from hf_hybrid.layers.context import SequenceContext
from hf_hybrid.models.se_hybrid import SEHybridCache, SEHybridConfig
from hf_hybrid.models.se_hybrid.modeling_se_hybrid import SEMambaMixer


def _time(fn, repeat: int, warmup: int = 2) -> tuple[float, float]:
    """(median ms, peak GiB above what was allocated before) of fn() on CUDA, or raises OOM."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeat)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events), (torch.cuda.max_memory_allocated() - base) / 2**30


def _config(args) -> SEHybridConfig:
    return SEHybridConfig(
        vocab_size=128, hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=2,
        num_attention_heads=args.hidden // 128, layer_types=["mamba", "attention"], mamba_d_head=args.d_head,
        mamba_d_state=args.d_state, mamba_n_groups=args.groups, mamba_chunk_size=256,
    )


def _rows(args, seq: int) -> list[dict]:
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    mixer_config = _config(args)
    mixer = SEMambaMixer(mixer_config, 0).cuda().to(dtype).train()
    x = torch.randn(args.batch, seq, args.hidden, device="cuda", dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)
    context = SequenceContext.build(args.batch, seq, 0, None, None, x.device)
    ours = lambda: mixer(x, context)  # noqa: E731
    bamba = lambda: BambaMixer.forward(mixer, x)  # noqa: E731

    def fwd(f):
        def run():
            with torch.no_grad():
                f()
        return run

    def fwd_bwd(f):
        def run():
            x.grad = None
            mixer.zero_grad(set_to_none=True)
            f().backward(grad)
        return run

    def decode(use_ours):
        cache = SEHybridCache(mixer_config)
        layer = cache.layers[0]
        with torch.no_grad():
            mixer(x[:, :64].detach(), SequenceContext.build(args.batch, 64, 0, None, None, x.device), layer)
        token = x[:, 64:65].detach()
        token_context = SequenceContext.build(args.batch, 1, 64, None, None, x.device)

        def run():
            with torch.no_grad():
                if use_ours:
                    mixer(token, token_context, layer)
                else:
                    BambaMixer.forward(mixer, token, cache_params=cache)
        return run

    heads, P, N, G = mixer.num_heads, mixer.head_dim, mixer.ssm_state_size, mixer.n_groups
    op_in = dict(
        x=torch.randn(args.batch, seq, heads, P, device="cuda", dtype=dtype),
        dt=torch.randn(args.batch, seq, heads, device="cuda", dtype=dtype),
        B=torch.randn(args.batch, seq, G, N, device="cuda", dtype=dtype),
        C=torch.randn(args.batch, seq, G, N, device="cuda", dtype=dtype),
    )
    for t in op_in.values():
        t.requires_grad_(True)
    def op(use_ours):
        def run():
            A = -torch.exp(mixer.A_log.float())
            if use_ours:
                y = ssd_scan(op_in["x"], op_in["dt"], A, op_in["B"], op_in["C"], D=mixer.D, dt_bias=mixer.dt_bias, dt_softplus=True)
            else:
                y = modeling_bamba.mamba2_chunk_scan(op_in["x"], op_in["dt"], A, op_in["B"], op_in["C"], 256, D=mixer.D,
                                                     dt_bias=mixer.dt_bias, dt_softplus=True)
            y.float().square().mean().backward()
        return run

    cases = [
        ("mixer fwd", fwd(ours), fwd(bamba)),
        ("mixer fwd+bwd", fwd_bwd(ours), fwd_bwd(bamba)),
        ("mixer decode token", decode(True), decode(False)),
        ("ssd op fwd+bwd", op(True), op(False)),
    ]
    rows = []
    for name, mine, theirs in cases:
        row = dict(seq=seq, case=name)
        for label, fn in (("ours", mine), ("bamba", theirs)):
            try:
                row[f"{label}_ms"], row[f"{label}_gib"] = _time(fn, args.repeat)
            except torch.cuda.OutOfMemoryError:
                row[f"{label}_ms"] = row[f"{label}_gib"] = "OOM"
            except Exception as exc:  # one failing variant still leaves a row
                row[f"{label}_ms"] = row[f"{label}_gib"] = f"error: {type(exc).__name__}: {str(exc)[:80]}"
            torch.cuda.empty_cache()
        rows.append(row)
    return rows



def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[2048])
    parser.add_argument("--hidden", type=int, default=2560)  # Mamba-2-Hybrid 2.7B: 80 heads x 64, d_state 128
    parser.add_argument("--d-head", type=int, default=64)
    parser.add_argument("--d-state", type=int, default=128)
    parser.add_argument("--groups", type=int, default=1)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("hf_hybrid.bench.mamba times CUDA kernels; run it on a GPU machine.")
    rows = [row for seq in args.seq for row in _rows(args, seq)]
    fmt = lambda v: v if isinstance(v, str) else f"{v:.3f}"  # noqa: E731
    print(f"Mamba-2 mixer, hidden {args.hidden}, d_head {args.d_head}, d_state {args.d_state}, groups {args.groups}, "
          f"batch {args.batch}, {args.dtype}, {torch.cuda.get_device_name()}")
    print("| T | case | ours ms | Bamba torch_forward ms | speed-up | ours peak GiB | Bamba peak GiB |\n|---|---|---|---|---|---|---|")
    for r in rows:
        speed = f"{r['bamba_ms'] / r['ours_ms']:.1f}x" if not isinstance(r["bamba_ms"], str) and not isinstance(r["ours_ms"], str) else "-"
        print(f"| {r['seq']} | {r['case']} | {fmt(r['ours_ms'])} | {fmt(r['bamba_ms'])} | {speed} | {fmt(r['ours_gib'])} | {fmt(r['bamba_gib'])} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
