"""Tile-size sweep for the chunk-attention and recurrence kernels on the current GPU.

    python -m benchmarks.tune [--seq 32768] [--batch 2] [--only keys_values]

Times each candidate (BLOCK_M, BLOCK_N, num_warps, num_stages) of the forward, dQ and dK/dV
kernels (dK/dV also with ATOMIC_DQ), BLOCK_N / warps of the recurrence and (columns, warps) of the
fused keys/values backward and the tokens its two kernels unroll per loop step at the RAT(L=16)
training shape, prints a table and the best of each;
the winners are then written into FWD_CONFIG / DQ_CONFIG / DKV_CONFIG / ATOMIC_DQ of
kernels/chunk_attention/triton.py and BWD_BLOCK_D / BWD_WARPS / FWD_UNROLL / BWD_UNROLL of
kernels/gated_recurrence/rat_keys_values_triton.py by hand (plain constants, so that reading them
is easy). Run it at --seq 32768 --batch 2 and --seq 131072 --batch 1.
"""
from __future__ import annotations

import argparse
import json

import torch

FWD = [(128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3)]
DQ = [(128, 64, 8, 3), (128, 64, 8, 2), (128, 64, 8, 4), (128, 32, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2)]
DKV = [(64, 128, 8, 3), (64, 128, 8, 2), (64, 64, 4, 2), (64, 64, 4, 3), (32, 64, 4, 3), (128, 128, 8, 2)]
REC = [(512, 2), (256, 2), (1024, 4)]
KV_BWD = [(16, 4), (16, 2), (32, 4), (8, 2), (8, 1), (32, 2)]  # (columns per program, warps)
KV_UNROLL = [(4, 2), (4, 4), (2, 2), (1, 1), (8, 8), (16, 16)]  # (forward, backward) tokens unrolled per loop step


def _time(fn) -> float:
    from hf_hybrid.bench.timing import time_fn

    return time_fn(fn, torch.device("cuda"), warmup=2, repeat=10).median_ms


def sweep_attention(batch, seq, heads, dim, block, window, sinks, log):
    from hf_hybrid.kernels.chunk_attention import triton as attn

    q, k, v, dout = (torch.randn(batch, seq, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    geo = attn._Geometry(False, seq // block, block, window, sinks, sinks // block)
    qc = attn._dummy_query_chunk(q.device)
    ke, ve = k[:, block - 1 :: block], v[:, block - 1 :: block]
    scale = dim**-0.5
    results = {"fwd": {}, "dq": {}, "dkv": {}}
    base = (attn.FWD_CONFIG, attn.DQ_CONFIG, attn.DKV_CONFIG)
    for cfg in FWD:
        attn.FWD_CONFIG = cfg
        try:
            results["fwd"][str(cfg)] = _time(lambda: attn._forward(q, k, v, ke, ve, qc, geo, scale))
        except Exception as exc:  # out of shared memory / registers for this tile
            results["fwd"][str(cfg)] = f"error {type(exc).__name__}"
        log(f"fwd {cfg}: {results['fwd'][str(cfg)]}")
    attn.FWD_CONFIG = base[0]
    out, lse = attn._forward(q, k, v, ke, ve, qc, geo, scale)
    dk, dv = torch.empty_like(k), torch.empty_like(v)

    def bwd():
        attn._backward(q, k, v, ke, ve, qc, out, lse, dout, geo, scale, dk, dv, dk[:, block - 1 :: block], dv[:, block - 1 :: block])

    for key, cands in (("dq", DQ), ("dkv", DKV)):
        for cfg in cands:
            setattr(attn, "DQ_CONFIG" if key == "dq" else "DKV_CONFIG", cfg)
            try:
                results[key][str(cfg)] = _time(bwd)
            except Exception as exc:
                results[key][str(cfg)] = f"error {type(exc).__name__}"
            log(f"bwd with {key} {cfg}: {results[key][str(cfg)]}")
        setattr(attn, "DQ_CONFIG" if key == "dq" else "DKV_CONFIG", base[1] if key == "dq" else base[2])
    if window == 0 and sinks == 0:  # dQ from the dK/dV kernel's atomics instead of the dQ kernel
        results["dkv_atomic_dq"] = {}
        attn.ATOMIC_DQ = True
        for cfg in DKV:
            attn.DKV_CONFIG = cfg
            try:
                results["dkv_atomic_dq"][str(cfg)] = _time(bwd)
            except Exception as exc:
                results["dkv_atomic_dq"][str(cfg)] = f"error {type(exc).__name__}"
            log(f"bwd with ATOMIC_DQ, dkv {cfg}: {results['dkv_atomic_dq'][str(cfg)]}")
        attn.ATOMIC_DQ, attn.DKV_CONFIG = False, base[2]
    return results


def sweep_recurrence(batch, seq, heads, dim, log):
    from hf_hybrid.kernels.gated_recurrence import triton as rec

    x = torch.randn(batch, seq, heads * dim, device="cuda", dtype=torch.bfloat16)
    g = torch.rand(batch, seq, heads * dim, device="cuda")
    results = {}
    base = (rec.BLOCK_N, rec.NUM_WARPS)
    for block_n, warps in REC:
        rec.BLOCK_N, rec.NUM_WARPS = block_n, warps
        for chunk in (16, 0):
            key = f"BLOCK_N={block_n},warps={warps},L={chunk}"
            results[key] = _time(lambda: rec._launch_forward(x, g, chunk, 0, None))
            log(f"recurrence fwd {key}: {results[key]:.3f} ms")
    rec.BLOCK_N, rec.NUM_WARPS = base
    return results


def sweep_keys_values(batch, seq, log):
    """fwd+bwd of the fused keys/values (rat_keys_values) per backward (columns, warps)."""
    from hf_hybrid.kernels.gated_recurrence import rat_keys_values
    from hf_hybrid.kernels.gated_recurrence import rat_keys_values_triton as kv
    from hf_hybrid.layers.rotary import RotaryEmbedding

    def leaf(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    k, v, logits, bias = leaf(batch, seq, 2, 128), leaf(batch, seq, 16, 128), leaf(batch, seq, 16, 128), leaf(2048)
    cos_sin = RotaryEmbedding(128, 10000.0)(torch.arange(seq, device="cuda")[None] // 16)

    def step():
        k_rot, v_tilde = rat_keys_values(k, v, logits, bias, 16, cos_sin, backend="triton")
        torch.autograd.grad((k_rot, v_tilde), (k, v, logits, bias), (torch.ones_like(k_rot), torch.ones_like(v_tilde)))

    results = {}
    base = (kv.BWD_BLOCK_D, kv.BWD_WARPS)
    for block_d, warps in KV_BWD:
        kv.BWD_BLOCK_D, kv.BWD_WARPS = block_d, warps
        key = f"BLOCK_D={block_d},warps={warps}"
        results[key] = _time(step)
        log(f"keys/values fwd+bwd {key}: {results[key]:.3f} ms")
    kv.BWD_BLOCK_D, kv.BWD_WARPS = base
    base = (kv.FWD_UNROLL, kv.BWD_UNROLL)
    for fwd, bwd in KV_UNROLL:  # (16, 16): every token of an L=16 chunk unrolled, the slowest to compile
        kv.FWD_UNROLL, kv.BWD_UNROLL = fwd, bwd
        key = f"UNROLL={fwd},{bwd}"
        results[key] = _time(step)
        log(f"keys/values fwd+bwd {key}: {results[key]:.3f} ms")
    kv.FWD_UNROLL, kv.BWD_UNROLL = base
    return results


SWEEPS = ("rat_L16", "recurrence", "keys_values")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tune")
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--out", default=None, help="write the timings as JSON here")
    p.add_argument("--only", choices=SWEEPS, action="append", help="run only these sweeps (repeatable)")
    args = p.parse_args(argv)
    sweeps = {
        "rat_L16": lambda: sweep_attention(args.batch, args.seq, 16, 128, 16, 0, 0, print),
        "recurrence": lambda: sweep_recurrence(args.batch, args.seq, 16, 128, print),
        "keys_values": lambda: sweep_keys_values(args.batch, args.seq, print),
    }
    report = {name: sweeps[name]() for name in SWEEPS if not args.only or name in args.only}
    for name, part in report.items():
        for kernel, timings in part.items() if name == "rat_L16" else [("fwd" if name == "recurrence" else "fwd+bwd", part)]:
            ok = {k: v for k, v in timings.items() if isinstance(v, float)}
            if ok:
                best = min(ok, key=ok.get)
                print(f"best {name} {kernel}: {best} {ok[best]:.3f} ms")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
