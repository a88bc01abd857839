"""A/B of RAT's chunk-end attention op: dense (cuDNN) path vs Triton kernels, public API."""
import json, os, sys
import torch
from triton.testing import do_bench
from hf_hybrid.kernels.chunk_attention import block_end_attention
rows = []
for T, L in ((16384, 16), (32768, 16), (65536, 16), (16384, 1)):
    torch.manual_seed(0)
    G = 2 if L > 1 else 16
    q = torch.randn(1, T, G, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v, z = (torch.randn(1, T, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dy = torch.randn(1, T, 16, 128, device="cuda", dtype=torch.bfloat16)
    row = {"T": T, "L": L}
    for be in ("auto", "triton"):
        f = lambda: block_end_attention(q, k, v, L, backend=be, output_gate=z)
        def fb():
            torch.autograd.grad(f(), (q, k, v, z), dy)
        row[be + "_fwd"] = do_bench(f, warmup=5, rep=40)
        row[be + "_fwdbwd"] = do_bench(fb, warmup=5, rep=40)
    print(row, flush=True)
    rows.append(row)
    del q, k, v, z, dy
    torch.cuda.empty_cache()
json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "rat_ends_ab.json"), "w"), indent=1)
