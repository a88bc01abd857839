"""The sliding-window op (w = 512, RATTENTION's local branch) through each of its GPU ways, forward
and forward + backward, at the whole models' heads: kernels/window_attention's two ways
(``flash``: PyTorch's FlashAttention-2 with its native window, the default for bf16; ``triton``)
and ``flex`` (compiled flex_attention).

    python -m benchmarks.window_ways --json F

Per shape and way: the relative error of o, dq, dk, dv against the float32 reference (lengths up
to 8K), the latency of one call (synchronised after each, so the host's launch time counts) and
the GPU time of back-to-back forward + backward calls (``hf_hybrid.bench.timing.time_fn``).
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

WAYS = ("triton", "flex", "flash")
SHAPES = ((1, 8192, 16, 16), (1, 8192, 16, 4), (1, 32768, 16, 16))  # batch, tokens, query heads, key / value heads
WINDOW, HEAD_DIM, REFERENCE_MAX_TOKENS = 512, 128, 8192


def _errors(op, q, k, v, do) -> list[float]:
    from hf_hybrid.kernels.residual_linear_attention import sliding_window_attention_reference

    leaves = [x.detach().float().requires_grad_() for x in (q, k, v)]
    want_o = sliding_window_attention_reference(*leaves, WINDOW)
    want = (want_o.detach(), *torch.autograd.grad(want_o, leaves, do.float()))
    got_o = op(q, k, v)
    got = (got_o.detach(), *torch.autograd.grad(got_o, (q, k, v), do))
    return [float((g.float() - w).norm() / w.norm()) for g, w in zip(got, want)]


def run(shapes=SHAPES) -> list[dict]:
    from hf_hybrid.bench.timing import latency_ms, time_fn
    from hf_hybrid.kernels.residual_linear_attention import sliding_window_attention

    device, rows = torch.device("cuda"), []
    for batch, seq, heads, kv_heads in shapes:
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(batch, seq, heads, HEAD_DIM, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
        k, v = (torch.randn(batch, seq, kv_heads, HEAD_DIM, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
                for _ in range(2))
        do = torch.randn_like(q)
        for way in WAYS:
            def op(q, k, v, way=way):
                return sliding_window_attention(q, k, v, WINDOW, backend=way)

            def forward():
                with torch.no_grad():
                    op(q, k, v)

            def step():
                torch.autograd.grad(op(q, k, v), (q, k, v), do)

            row = {"batch": batch, "seq": seq, "heads": heads, "kv_heads": kv_heads, "window": WINDOW, "way": way}
            try:
                if seq <= REFERENCE_MAX_TOKENS:
                    row["rel_err_o_dq_dk_dv"] = _errors(op, q, k, v, do)
                row["fwd_latency_ms"] = latency_ms(forward)
                row["fwd_bwd_latency_ms"] = latency_ms(step)
                row["fwd_bwd_gpu_ms"] = time_fn(step, device, warmup=3, repeat=30, warm_ms=200).median_ms
            except Exception as exc:  # a way this torch / GPU lacks is reported, not fatal
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            row["device"] = torch.cuda.get_device_name()
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.window_ways", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None, help="write the rows here (JSON lines)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("window_ways times CUDA kernels: run it on a GPU machine", file=sys.stderr)
        return 1
    rows = run()
    if args.json:
        with open(args.json, "w") as fh:
            fh.writelines(json.dumps(row) + "\n" for row in rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
