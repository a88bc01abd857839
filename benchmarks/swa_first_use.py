"""RATTENTION's sliding-window branch at a first use: what each way of computing the band costs in
a fresh process with empty Triton and Inductor caches (the first forward + backward: compiles
included), and afterwards (the median of later calls). The default on CUDA is kernels/window_attention
(Triton, one build per kernel); flex_attention is built by torch.compile at the first call of every
shape.

    python -m benchmarks.swa_first_use                       T = 2048, window 512, 16 heads x 128, bf16
    python -m benchmarks.swa_first_use --seq 4096 --json F

Ways, each in its own fresh process:

* ``flex``: ``sliding_window_attention_flex`` (compiled flex_attention, the eager block mask);
* ``sdpa``: ``sliding_window_attention_sdpa`` (one SDPA call with the [T, T] band mask: no compile,
  every score of the square computed);
* ``window``: ``kernels/window_attention``'s Triton kernels (Forgetting Attention's portable kernels
  with the forget gate compiled out; one build per kernel);
* ``flash``: ``kernels/window_attention``'s FlashAttention-2 way (PyTorch's kernels with their
  window; nothing to build), the default in half precision.

Every way's output is checked against ``sdpa`` (bf16 tolerance) before it is timed.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WAYS = ("flex", "sdpa", "window", "flash")
ROOT = Path(__file__).resolve().parent.parent  # ``python -m benchmarks.<name>`` runs from here


def band_attention(way: str, q, k, v, window: int, scale: float):
    """Causal attention of each query over itself and the ``window`` keys before it (the sliding-
    window op's convention: 0 <= i - j <= window), q, k, v [B, T, H, D] -> [B, T, H, D]."""
    import torch

    from hf_hybrid.kernels.residual_linear_attention import sliding_window as sw

    if way == "flex":
        return sw.sliding_window_attention_flex(q, k, v, window, scale)
    if way == "sdpa":
        return sw.sliding_window_attention_sdpa(q, k, v, window, scale)
    if way == "window":
        from hf_hybrid.kernels.window_attention import window_attention

        return window_attention(q, k, v, window_size=window + 1, scale=scale, backend="triton")  # counts itself
    if way == "flash":
        from hf_hybrid.kernels.window_attention import window_attention

        return window_attention(q, k, v, window_size=window + 1, scale=scale, backend="flash")
    raise ValueError(f"way must be one of {', '.join(WAYS)}; got {way!r}.")


def _one_way(way: str, seq: int, window: int, heads: int, head_dim: int, repeat: int) -> dict:
    """In this process (its caches empty): the first forward + backward, then the median of ``repeat``."""
    import torch

    device = torch.device("cuda")
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(1, seq, heads, head_dim, generator=g).to(device, torch.bfloat16).requires_grad_()
               for _ in range(3))
    do = torch.randn(1, seq, heads, head_dim, generator=g).to(device, torch.bfloat16)
    scale = head_dim ** -0.5

    def step():
        out = band_attention(way, q, k, v, window, scale)
        out.backward(do)
        return out

    torch.cuda.synchronize()
    start = time.perf_counter()
    out = step()
    torch.cuda.synchronize()
    first = time.perf_counter() - start
    with torch.no_grad():
        expected = band_attention("sdpa", q, k, v, window, scale)
    error = ((out.float() - expected.float()).norm() / expected.float().norm()).item()
    times = []
    for _ in range(repeat):
        q.grad = k.grad = v.grad = None
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    times.sort()
    return {"way": way, "first_s": round(first, 3), "later_ms": round(1e3 * times[len(times) // 2], 3),
            "rel_error_vs_sdpa": error}


def run(seq: int, window: int, heads: int, head_dim: int, repeat: int) -> list[dict]:
    """Each way in a fresh process with its own empty Triton and Inductor caches."""
    rows = []
    for way in WAYS:
        with tempfile.TemporaryDirectory(prefix="swa-first-use-") as caches, tempfile.NamedTemporaryFile("r") as out:
            env = dict(os.environ, TRITON_CACHE_DIR=os.path.join(caches, "triton"),
                       TORCHINDUCTOR_CACHE_DIR=os.path.join(caches, "inductor"), TRITON_INTERPRET="0")
            args = [sys.executable, "-m", "benchmarks.swa_first_use", "--child", way, "--out", out.name,
                    "--seq", str(seq), "--window", str(window), "--heads", str(heads), "--head-dim", str(head_dim),
                    "--repeat", str(repeat)]
            done = subprocess.run(args, env=env, capture_output=True, text=True, cwd=ROOT)
            if done.returncode != 0:
                rows.append({"way": way, "error": done.stderr[-1500:]})
                continue
            rows.append(json.loads(open(out.name).read()))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.swa_first_use", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--window", type=int, default=512, help="keys before each query (RATTENTION's window_size)")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--child", choices=WAYS, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("swa_first_use needs a CUDA device", file=sys.stderr)
        return 1
    if args.child:
        row = _one_way(args.child, args.seq, args.window, args.heads, args.head_dim, args.repeat)
        with open(args.out, "w") as fh:
            json.dump(row, fh)
        return 0
    rows = run(args.seq, args.window, args.heads, args.head_dim, args.repeat)
    print(f"T={args.seq} window={args.window} {args.heads}x{args.head_dim} bf16, {torch.cuda.get_device_name()}")
    for r in rows:
        if "error" in r:
            print(f"{r['way']:<11} ERROR {r['error']}")
        else:
            print(f"{r['way']:<11} first fwd+bwd {r['first_s']:7.2f} s   later {r['later_ms']:8.3f} ms   "
                  f"rel. error vs sdpa {r['rel_error_vs_sdpa']:.1e}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "args": vars(args), "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
