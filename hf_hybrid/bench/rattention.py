"""RATTENTION layer benchmark: the local layer (SWA w=512 + RLA) against a full-attention layer and an
SWA-only layer (w=4096), all in one process, plus the decode step at a long context.

    python -m hf_hybrid.bench.rattention                        # T = 4K, 8K; decode at 32K, batch 64
    python -m hf_hybrid.bench.rattention --json out.json
    python -m hf_hybrid.bench.rattention --kv-heads 16 --seq 8192 --tokens 8192   # the whole-model benches' heads, B = 1
    python -m benchmarks.sm90 --rla                             # from a checkout, no GPU: sm_90 registers / spills

Shapes follow the RATTENTION paper (Fig. 3, 3B model): hidden 2048, 16 query heads x 128,
4 key/value heads (``--kv-heads``), bf16. Layers (projections, QK-norm, RoPE and branch norms included):

* ``full``       RattentionGlobalAttention: causal SDPA (flash) over all tokens.
* ``swa4096``    RattentionLocalAttention(window_size=4096, RLA off): flex_attention band mask
                 (at T <= 4097 the window covers the sequence and SDPA's causal kernel runs).
* ``local512``   RattentionLocalAttention(window_size=512): flex_attention SWA + Triton RLA.

Training step = forward + backward with gradients for the input and every weight; prefill =
forward only. ``--tokens`` tokens per batch (batch = tokens // T). Before the layers, the RLA op
alone is timed for each kernel variant (chunk, value block, chunks per stored state); the local
layer then runs with the fastest one (reported). Decode step: one new token per row at position
``--decode-context`` with ``--decode-batch`` rows; the full layer writes into a preallocated K/V
buffer and attends over it (no concatenation: the strongest plain baseline), the local layer
uses RattentionLocalLayerCache (window of w + 1 tokens + RLA state). CUDA events, warm-up first
(compilation included), median of ``--repeat`` calls; inputs are random, never zeros.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
import traceback

import torch

from ..layers import residual_linear_attention as rla_layer_module
from ..layers.context import SequenceContext
from ..layers.residual_linear_attention import RattentionGlobalAttention, RattentionLocalAttention
from ..models.rattention.cache_rattention import RattentionLocalLayerCache
from .timing import free_memory, time_cuda_graph, time_fn

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 2048, 16, 4, 128
# RLA kernel options (residual_linear_attention's triton_options) to time; {} = the kernel's defaults
# (kernels/residual_linear_attention/triton.py, _Plan), which apply per pass where an option is not
# given. The second row runs one launch per feature half, the second launch adding the first's
# partials to its own (the defaults: one launch over both halves, float32 atomics); the third is
# the former default at 8K (both passes split over whole value rows, one query head per tile). Fused halves alone take 64 value
# columns and as many heads per tile as fit 128 rows (4 at 4 key / value heads, 1 at 16). The last
# row stores every chunk's state and computes outputs and gradients in parallel over chunks (its
# own defaults: 64-token chunks). The 16-token chunk with 32 chunks per segment keeps the default's
# 512 tokens per stored state: at 16 key / value heads its dk / dv kernel does not spill on sm_90
# (`python -m benchmarks.sm90 --rla`).
RLA_VARIANTS = [
    {},
    {"half_launches": True},
    {"fuse_halves": False, "block_v": 128, "heads_per_tile": 1},
    {"fuse_halves": False, "block_v": 128, "heads_per_tile": 2},
    {"fuse_halves": False, "block_v": 128, "heads_per_tile": 4},
    {"chunk_size": 16, "fuse_halves": False, "block_v": 128, "heads_per_tile": 4},
    {"fuse_halves": True},
    {"state_every": 8},
    {"chunk_size": 16},
    {"chunk_size": 16, "state_every": 32},
    {"chunk_size": 64},
    {"chunk_parallel": True},
]


def build_layers(device, dtype, kv_heads: int = KV_HEADS):
    torch.manual_seed(0)
    layers = {
        "full": RattentionGlobalAttention(HIDDEN, HEADS, kv_heads, HEAD_DIM),
        "swa4096": RattentionLocalAttention(HIDDEN, HEADS, kv_heads, HEAD_DIM, 4096, use_rla=False),
        "local512": RattentionLocalAttention(HIDDEN, HEADS, kv_heads, HEAD_DIM, 512),
    }
    return {name: layer.to(device=device, dtype=dtype) for name, layer in layers.items()}


@contextlib.contextmanager
def rla_options(options: dict):
    """Run the local layers' RLA op with the given Triton kernel options (bench only)."""
    original = rla_layer_module.residual_linear_attention

    def tuned(*args, **kwargs):
        return original(*args, **kwargs, **options)

    rla_layer_module.residual_linear_attention = tuned if options else original
    try:
        yield
    finally:
        rla_layer_module.residual_linear_attention = original


def rla_sweep(seq, batch, device, dtype, repeat, kv_heads: int = KV_HEADS):
    """Forward+backward of the RLA op alone for each kernel variant; returns rows and the fastest."""
    from ..kernels.residual_linear_attention import residual_linear_attention

    g = torch.Generator(device=device).manual_seed(seq)
    q = torch.randn(batch, seq, HEADS, HEAD_DIM, device=device, dtype=dtype, generator=g).requires_grad_()
    k = torch.randn(batch, seq, kv_heads, HEAD_DIM, device=device, dtype=dtype, generator=g).requires_grad_()
    v = torch.randn(batch, seq, kv_heads, HEAD_DIM, device=device, dtype=dtype, generator=g).requires_grad_()
    do = torch.randn(batch, seq, HEADS, HEAD_DIM, device=device, dtype=dtype, generator=g)
    rows, best = [], None
    for opts in RLA_VARIANTS:
        try:
            def fwd():
                with torch.no_grad():
                    residual_linear_attention(q, k, v, 512, backend="triton", **opts)

            def fwd_bwd():
                o, _ = residual_linear_attention(q, k, v, 512, backend="triton", **opts)
                torch.autograd.grad(o, (q, k, v), do)

            t_f = time_fn(fwd, device, warmup=2, repeat=repeat)
            t_fb = time_fn(fwd_bwd, device, warmup=2, repeat=repeat)
            row = {"options": opts, "fwd_ms": t_f.median_ms, "fwd_bwd_ms": t_fb.median_ms, "peak_gb": t_fb.peak_mem_gb}
        except Exception as exc:  # a variant that does not compile on this GPU is reported, not fatal
            row = {"options": opts, "error": f"{type(exc).__name__}: {exc}"[:300]}
        rows.append(row)
        print(f"[rla op] T={seq} B={batch} {opts}: {row}", flush=True)
        if "fwd_bwd_ms" in row and (best is None or row["fwd_bwd_ms"] < best["fwd_bwd_ms"]):
            best = row
        free_memory(device)
    swa = _swa_op_time(q, k, v, do, device, repeat)
    return rows, best, swa


def _swa_op_time(q, k, v, do, device, repeat):
    """The local layers' window (w = 512) alone, forward and backward, per backend: both ways of
    kernels/window_attention (FlashAttention-2, which the layers run in half precision, and the
    Triton kernels) and flex_attention."""
    from ..kernels.residual_linear_attention import sliding_window_attention

    rows = {}
    for backend in ("flash", "triton", "flex"):
        try:
            def fwd():
                with torch.no_grad():
                    sliding_window_attention(q, k, v, 512, backend=backend)

            def fwd_bwd():
                o = sliding_window_attention(q, k, v, 512, backend=backend)
                torch.autograd.grad(o, (q, k, v), do)

            rows[backend] = {"fwd_ms": time_fn(fwd, device, warmup=3, repeat=repeat).median_ms,
                             "fwd_bwd_ms": time_fn(fwd_bwd, device, warmup=3, repeat=repeat).median_ms}
        except Exception as exc:
            rows[backend] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    return rows


def layer_times(layers, seq, batch, device, dtype, repeat, options):
    x = torch.randn(batch, seq, HIDDEN, device=device, dtype=dtype)
    dy = torch.randn_like(x)
    context = SequenceContext.build(batch, seq, 0, None, None, device)
    row = {}
    for name, layer in layers.items():
        params = list(layer.parameters())
        leaf = x.detach().requires_grad_()
        try:
            with rla_options(options if name == "local512" else {}), _flash_only(name == "full"):
                def fwd():
                    with torch.no_grad():
                        layer(leaf, context)

                def fwd_bwd():
                    torch.autograd.grad(layer(leaf, context), [leaf] + params, dy)

                t_f = time_fn(fwd, device, warmup=3, repeat=repeat)
                t_fb = time_fn(fwd_bwd, device, warmup=3, repeat=repeat)
            row[name] = {"fwd_ms": t_f.median_ms, "fwd_bwd_ms": t_fb.median_ms, "peak_gb": t_fb.peak_mem_gb}
        except Exception as exc:
            traceback.print_exc()
            row[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        print(f"[layer] T={seq} B={batch} {name}: {row[name]}", flush=True)
        free_memory(device)
    return row


def _flash_only(enabled: bool):
    """The full-attention baseline must run SDPA's flash kernel (an error otherwise, not a slow fallback)."""
    if not enabled:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION])


class StaticKV:
    """Preallocated [batch, kv_heads, length + 1, head_dim] K/V, filled up to ``length``; each call
    writes slot ``length`` and returns the whole buffer (the decode position stays fixed)."""

    def __init__(self, batch, length, device, dtype, kv_heads: int):
        shape = (batch, kv_heads, length + 1, HEAD_DIM)
        self.keys = torch.randn(shape, device=device, dtype=dtype)
        self.values = torch.randn(shape, device=device, dtype=dtype)
        self.length = length

    def update(self, key_states, value_states):
        self.keys[:, :, self.length : self.length + 1] = key_states
        self.values[:, :, self.length : self.length + 1] = value_states
        return self.keys, self.values


def local_cache(layer, batch, length, device, dtype):
    """A RattentionLocalLayerCache as it stands after ``length`` tokens: a full window + a state."""
    cache = RattentionLocalLayerCache()
    held = min(layer.cache_capacity, length)
    shape = (batch, held, layer.num_kv_heads, HEAD_DIM)
    keys = torch.randn(shape, device=device, dtype=dtype)
    values = torch.randn(shape, device=device, dtype=dtype)
    raw = torch.randn(shape, device=device, dtype=dtype) if layer.use_rla else None
    state = torch.randn(layer.state_shape(batch), device=device) * 0.01 if layer.use_rla else None
    cache.update(keys, values, raw, state, capacity=layer.cache_capacity, new_tokens=length)
    return cache


def decode_times(layers, batch, length, device, dtype, repeat):
    x = torch.randn(batch, 1, HIDDEN, device=device, dtype=dtype)
    positions = torch.full((batch, 1), length, device=device, dtype=torch.long)
    context = SequenceContext(positions=positions, key_valid=None, past_length=length)
    row = {}
    for name, layer in layers.items():
        try:
            if name == "full":
                cache = StaticKV(batch, length, device, dtype, layer.num_kv_heads)
            else:
                cache = local_cache(layer, batch, length, device, dtype)
            nbytes = (cache.keys.numel() * 2 * cache.keys.element_size()) if name == "full" else cache.nbytes()

            def step():
                with torch.no_grad():
                    layer(x, context, cache)

            with _flash_only(name == "full"):
                t = time_fn(step, device, warmup=5, repeat=max(repeat, 50))
                graphed = time_cuda_graph(step, device, warmup=3, repeat=max(repeat, 50))
            row[name] = {"step_ms": t.median_ms, "graph_step_ms": graphed.median_ms, "cache_gb": nbytes / 2**30}
            cache = step = None  # free the K/V before the next layer
        except Exception as exc:
            traceback.print_exc()
            row[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        print(f"[decode] ctx={length} B={batch} {name}: {row[name]}", flush=True)
        free_memory(device)
    return row


def kernel_report():
    """Registers / spills / warps of every compiled RLA kernel variant (from Triton's caches)."""
    from ..kernels.residual_linear_attention import triton as rla_triton

    report = []
    for name in ("_state_pass_kernel", "_fwd_kernel", "_fwd_fused_kernel", "_dq_kernel", "_dq_fused_kernel",
                 "_adjoint_pass_kernel", "_dkv_kernel", "_decode_kernel"):
        fn = getattr(rla_triton, name)
        caches = getattr(fn, "device_caches", None)
        try:
            kernels = [k for cache in caches.values() for k in cache[0].values()] if caches else list(fn.cache.get(0, {}).values())
        except Exception:
            kernels = []
        for kernel in kernels:
            with contextlib.suppress(Exception):
                kernel._init_handles()
            consts = {k: v for k, v in getattr(kernel, "constants", {}).items() if isinstance(k, str)} if hasattr(kernel, "constants") else {}
            report.append({
                "kernel": name, "n_regs": getattr(kernel, "n_regs", None), "n_spills": getattr(kernel, "n_spills", None),
                "num_warps": getattr(getattr(kernel, "metadata", None), "num_warps", None),
                "shared": getattr(getattr(kernel, "metadata", None), "shared", None), "constants": str(consts)[:200],
            })
    return report


def _ms(cell, key):
    return cell.get(key) if isinstance(cell, dict) else None


def markdown(train_rows, decode_row, decode_batch, decode_context):
    lines = [
        "| T | batch | full fwd+bwd | SWA w=4096 fwd+bwd (x full) | local w=512 fwd+bwd (x full) | full fwd | SWA w=4096 fwd (x full) | local w=512 fwd (x full) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in train_rows:
        cells = [str(r["seq"]), str(r["batch"])]
        for key in ("fwd_bwd_ms", "fwd_ms"):
            base = _ms(r["layers"].get("full", {}), key)
            cells.append(f"{base:.2f}" if base else "error")
            for name in ("swa4096", "local512"):
                t = _ms(r["layers"].get(name, {}), key)
                cells.append(f"{t:.2f} ({t / base:.2f}x)" if t and base else "error")
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Decode step, batch {decode_batch}, context {decode_context} (ms per step; speed-up vs full):",
        "",
        "| layer | step ms, eager | speed-up vs full | step ms, CUDA graph | speed-up vs full | cache GiB |",
        "|---|---|---|---|---|---|",
    ]
    full = decode_row.get("full", {})
    for name in ("full", "swa4096", "local512"):
        cell = decode_row.get(name, {})
        cells = []
        for key in ("step_ms", "graph_step_ms"):
            t, base = _ms(cell, key), _ms(full, key)
            cells += [f"{t:.3f}" if t else "error", f"{base / t:.2f}x" if t and base else "-"]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {cell.get('cache_gb', 0):.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--tokens", type=int, default=32768, help="tokens per training batch (batch = tokens // T)")
    parser.add_argument("--decode-batch", type=int, default=64)
    parser.add_argument("--decode-context", type=int, default=32768)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--kv-heads", type=int, default=KV_HEADS,
                        help="key/value heads of the layers and the RLA sweep (16: the whole-model benches' MHA shape)")
    parser.add_argument("--no-sweep", action="store_true", help="skip the RLA kernel-variant sweep (use defaults)")
    parser.add_argument("--json", type=str, default=None, help="write the raw numbers here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("the rattention bench needs a CUDA device", file=sys.stderr)
        return 1
    device, dtype = torch.device("cuda"), torch.bfloat16
    layers = build_layers(device, dtype, args.kv_heads)
    train_rows = []
    for seq in args.seq:
        batch = max(args.tokens // seq, 1)
        sweep, best, swa = ([], None, None) if args.no_sweep else rla_sweep(seq, batch, device, dtype, args.repeat, args.kv_heads)
        options = best["options"] if best else {}
        row = {"seq": seq, "batch": batch, "rla_sweep": sweep, "swa512_op": swa, "local_rla_options": options}
        row["layers"] = layer_times(layers, seq, batch, device, dtype, args.repeat, options)
        train_rows.append(row)
    decode_row = decode_times(layers, args.decode_batch, args.decode_context, device, dtype, args.repeat)
    table = markdown(train_rows, decode_row, args.decode_batch, args.decode_context)
    kernels = kernel_report()
    for row in kernels:
        print(f"[kernel] {row}")
    print(table)
    if args.json:
        import triton

        meta = {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "python": platform.python_version(),
            "args": vars(args),
        }
        with open(args.json, "w") as fh:
            json.dump({"meta": meta, "train": train_rows, "decode": decode_row, "kernels": kernels, "table": table}, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
