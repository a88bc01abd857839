"""The Mamba-2 mixer op's forward + backward at the SE hybrid's shape (64 heads x 64, state 128, one
group, conv width 4, bf16, B=1), timed whole and kernel by kernel, for one or more settings of the
SSD kernels' warps (ssd_scan.triton.WARPS) and of the chunk backward's N block, in one process:

    python -m benchmarks.mixer_kernels --seq 8192
    python -m benchmarks.mixer_kernels --seq 8192 --warps '{"chunk_bwd": 4}' '{"chunk_bwd": 8}'
    python -m benchmarks.mixer_kernels --seq 8192 --block-n 32 16

Per setting: the median and minimum of 30 timed calls (CUDA events), the sum of the kernels' own
times over 5 profiled calls (per call), the SSD kernels' times in us, and the largest difference of
any gradient from the first setting's, relative to its largest entry.
"""
from __future__ import annotations

import argparse
import json

import torch
from torch.profiler import ProfilerActivity, profile

HEADS, HEAD_DIM, STATE, CONV = 64, 64, 128, 4
SSD_KERNELS = ("_chunk_bwd", "_output_fwd", "_states_fwd", "_dstates_bwd", "_chunk_scores")


def mixer_step(seq: int, device: torch.device):
    """A closure running one forward + backward of the mixer op on fixed random inputs."""
    from hf_hybrid.kernels.mamba2_mixer import mamba2_mixer

    gen = torch.Generator(device=device).manual_seed(0)
    inner = HEADS * HEAD_DIM
    channels = inner + 2 * STATE

    def rand(*shape, scale=1.0, dtype=torch.bfloat16):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype).requires_grad_()

    zxbcdt = rand(1, seq, inner + channels + HEADS, scale=0.5)
    params = [rand(channels, CONV, scale=0.3), rand(channels, scale=0.1),
              (-torch.exp(torch.randn(HEADS, generator=gen, device=device) * 0.5)).requires_grad_(),
              rand(HEADS), rand(HEADS, scale=0.5), torch.ones(inner, device=device, dtype=torch.bfloat16).requires_grad_()]
    upstream = torch.randn(1, seq, inner, generator=gen, device=device).to(torch.bfloat16)

    def step():
        normed, _ = mamba2_mixer(zxbcdt, *params, head_dim=HEAD_DIM, state_size=STATE, norm_group_size=inner, eps=1e-6)
        return torch.autograd.grad((normed * upstream).sum(), [zxbcdt, *params])

    return step


def measure(step, repeat: int = 30, profiled: int = 5) -> dict:
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeat)]
    for start, end in events:
        start.record()
        step()
        end.record()
    torch.cuda.synchronize()
    times = sorted(start.elapsed_time(end) for start, end in events)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(profiled):
            step()
        torch.cuda.synchronize()
    kernels = {e.key: e.self_device_time_total / profiled for e in prof.key_averages() if e.self_device_time_total > 0}
    return {"median_ms": round(times[len(times) // 2], 3), "min_ms": round(times[0], 3),
            "kernels_ms": round(sum(kernels.values()) / 1e3, 3),
            "ssd_us": {k: round(kernels[k], 1) for k in SSD_KERNELS if k in kernels}}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.mixer_kernels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--warps", nargs="*", default=["{}"], help="JSON updates of ssd_scan.triton.WARPS, one per setting")
    parser.add_argument("--block-n", nargs="*", type=int, default=[], help="ssd_scan.triton.CHUNK_BWD_BLOCK_N values, each "
                        "timed with every --warps setting")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("mixer_kernels times CUDA kernels: run it on a GPU machine")
    from hf_hybrid.kernels.ssd_scan import triton as ssd

    device = torch.device("cuda")
    step = mixer_step(args.seq, device)
    rows, first = [], None
    defaults, default_block_n = dict(ssd.WARPS), ssd.CHUNK_BWD_BLOCK_N
    for block_n, setting in [(n, w) for n in args.block_n or [default_block_n] for w in args.warps]:
        ssd.WARPS.clear()
        ssd.WARPS.update(defaults, **json.loads(setting))
        ssd.CHUNK_BWD_BLOCK_N = block_n
        for _ in range(4):  # compilation, allocator
            grads = step()
        first = first or grads
        diff = max(((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-6)).item()
                   for a, b in zip(grads, first))
        row = {"seq": args.seq, "warps": dict(ssd.WARPS), "chunk_bwd_block_n": block_n, **measure(step),
               "grad_diff_vs_first": float(f"{diff:.1e}"), "device": torch.cuda.get_device_name()}
        print(json.dumps(row))
        rows.append(row)
    ssd.WARPS.clear()
    ssd.WARPS.update(defaults)
    ssd.CHUNK_BWD_BLOCK_N = default_block_n
    return rows


if __name__ == "__main__":
    main()
