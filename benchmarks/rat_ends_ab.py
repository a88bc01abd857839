"""RAT's chunk-end attention op, forward and forward + backward, on the automatic choice (cuDNN from
sdpa_ends.MIN_ENDS chunk ends on) against the Triton kernels, through the public op
(bf16, 2 q groups, 16 heads of 128, with the output gate; L = 1 is RAT+'s dense training):

    python -m benchmarks.rat_ends_ab --out rat_ends_ab.json
"""
from __future__ import annotations

import argparse
import json

import torch

CASES = ((16384, 16), (32768, 16), (65536, 16), (16384, 1))


def measure(seq: int, chunk: int) -> dict:
    from triton.testing import do_bench

    from hf_hybrid.kernels.chunk_attention import block_end_attention

    torch.manual_seed(0)
    groups = 2 if chunk > 1 else 16
    q = torch.randn(1, seq, groups, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v, z = (torch.randn(1, seq, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dy = torch.randn(1, seq, 16, 128, device="cuda", dtype=torch.bfloat16)
    row = {"T": seq, "L": chunk}
    for backend in ("auto", "triton"):
        def forward(backend=backend):
            return block_end_attention(q, k, v, chunk, backend=backend, output_gate=z)

        def forward_backward():
            torch.autograd.grad(forward(), (q, k, v, z), dy)

        row[backend + "_fwd"] = do_bench(forward, warmup=5, rep=40)
        row[backend + "_fwdbwd"] = do_bench(forward_backward, warmup=5, rep=40)
    return row


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    rows = []
    for seq, chunk in CASES:
        rows.append(measure(seq, chunk))
        print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
