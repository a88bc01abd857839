"""ms per new token of model.generate(): our architectures (CUDA-graph decode step and eager) vs
transformers' LlamaForCausalLM with a static cache (which generate() compiles automatically).

    python -m benchmarks.generation --batch 32 --prompt 2048
    python -m benchmarks.generation --batch 8 --prompt 16384 --models llama,llama_projections,rat

The Llama baseline gets every backbone optimisation our models get: ``llama_projections`` is the
same Llama with its decode step's projections through our few-row projection kernel, as our models'
are (benchmarks/llama_projections.py); the ratio column is against the faster of the two.

Every model has the same shape: 8 layers of the 1.3B configuration (hidden 2048, 16 heads x 128,
intermediate 5632, vocab 32000), random weights, bf16, greedy decoding without EOS. A model's ms
per token is the time from the first new token to the last (CUDA events recorded by a logits
processor, so generate()'s own per-step work is in it and the prefill is not) over ``--new`` - 1;
the best of ``--repeats`` runs after a warm-up generate() (compilation, autotuning, capture).
Llama decodes into one user-made StaticCache of fixed length (reset before each run), so every
run reuses one compiled graph. Our models decode with default arguments: generate()'s stop check
one step late (generation/deferred_stop.py; ``--llama-deferred-stop`` times Llama with that loop
too), and from the second timed run on, a capture at the first decode step (the same shape ran
before: StaticDecodeStep.prewarmed). (The difference of two whole generate() calls would carry the
prefill's run-to-run noise.)
"""
from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch

from hf_hybrid.layers.backbone_fusion import backbone_fusion_settings
from hf_hybrid.compat import CACHE_NAME, cache_of
from hf_hybrid.generation.deferred_stop import deferred_for_every_generation

SHAPE = dict(
    hidden_size=2048, num_attention_heads=16, head_dim=128, intermediate_size=5632, vocab_size=32000,
    num_hidden_layers=8,
)
MODELS = ("llama", "llama_projections", "rat", "rat_swa", "rat_plus_d16", "rattention", "fox", "se_hybrid", "se_hybrid_se")
# transformers' Llama, timed with a static cache that generate() compiles (not our decode step).
LLAMA_MODELS = ("llama", "llama_projections")


def build_model(name: str, device: torch.device, dtype: torch.dtype, max_positions: int, **shape):
    """``shape``: overrides of SHAPE (e.g. num_hidden_layers=24 for the largest-batch bench)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    import hf_hybrid  # noqa: F401  (registers the architectures)
    from hf_hybrid.models.fox import FoxConfig
    from hf_hybrid.models.rat import RatConfig
    from hf_hybrid.models.rat_plus import RatPlusConfig
    from hf_hybrid.models.rattention import RattentionConfig
    from hf_hybrid.sparse import SparseInferenceConfig

    shape = SHAPE | shape
    kv_heads = shape["num_attention_heads"]
    if name in LLAMA_MODELS:
        config = LlamaConfig(**shape, num_key_value_heads=kv_heads, max_position_embeddings=max_positions)
    elif name == "rat":
        config = RatConfig(**shape, chunk_size=16)
    elif name == "rat_swa":
        # The paper's RAT-SWA interleaving: RAT and sliding-window attention (window 1024) layers alternate.
        config = RatConfig(**shape, chunk_size=16, num_key_value_heads=kv_heads,
                           layer_types=RatConfig.hybrid_layer_types(shape["num_hidden_layers"], "rat"))
    elif name == "rat_plus_d16":
        # The pattern hf_hybrid/bench/layers.py times (block ends only, besides the token itself).
        sparse = SparseInferenceConfig(dilation=16, local_window=0, num_sink_tokens=0)
        config = RatPlusConfig(**shape, num_key_value_heads=kv_heads, max_position_embeddings=max_positions, sparse_config=sparse)
    elif name == "rattention":
        config = RattentionConfig(**shape, num_key_value_heads=kv_heads)
    elif name in ("fox", "fox_llama"):  # FoX's default Pro block, or its LLaMA block
        config = FoxConfig(**shape, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                           block_type="llama" if name == "fox_llama" else "pro")
    elif name in ("se_hybrid", "se_hybrid_se"):
        from hf_hybrid.models.se_hybrid import SEHybridConfig

        # The default layer types (Mamba-2 with attention every few layers), in `full` attention mode
        # or in `se` mode (SE-Attn retrieval of memory blocks).
        mode = "se" if name == "se_hybrid_se" else "full"
        config = SEHybridConfig(**shape, num_key_value_heads=kv_heads, max_position_embeddings=max_positions, attention_mode=mode)
    else:
        raise ValueError(f"--models: unknown model {name!r}; choose from {MODELS + ('fox_llama',)}.")
    config.pad_token_id, config.eos_token_id = 0, None
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    if name == "llama_projections":
        from .llama_projections import apply_few_row_projections_to_llama

        apply_few_row_projections_to_llama(model)
    return model


def _timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def ms_per_token(model, ids: torch.Tensor, warmup: int, new: int, repeats: int, **generate_kwargs) -> tuple[float, dict | None]:
    """ms per new token of generate(..., max_new_tokens=new): the first token's stamp to the last
    (CUDA events from a logits processor), divided by new - 1, so the prefill is not in it; the
    best of ``repeats`` runs after a warm-up generate() of ``warmup`` tokens."""
    from transformers import LogitsProcessorList

    from hf_hybrid.bench.models import TokenClock

    mask = torch.ones_like(ids)
    cache = generate_kwargs.pop("static_cache", None)
    clock = TokenClock(ids.device)

    def run(tokens):
        if cache is not None:
            cache.reset()
            generate_kwargs[CACHE_NAME] = cache  # also Llama's generate(), which takes only the installed name
        begin = clock.start()
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                           logits_processor=LogitsProcessorList([clock]), **generate_kwargs)
        if len(clock.stamps) != tokens:
            raise RuntimeError(f"generate() stamped {len(clock.stamps)} tokens, expected {tokens}")
        return clock.elapsed_ms(begin)[1] / (tokens - 1)

    run(warmup)  # compilation, autotuning, graph capture
    return min(run(new) for _ in range(repeats)), getattr(model, "last_decode_report", None)


def decode_loop_ms(model, ids: torch.Tensor, steps: int, mode: str = "graph", measure=None) -> float:
    """ms per token of the graphed decode step in a bare greedy loop: no generate(), no host sync
    per step. What the device needs per token; generate()'s own per-step host work (input
    preparation, logits processing, a stop check that syncs) comes on top of it. ``measure(fn)``
    (default: the host clock around fn with synchronisation) returns seconds; the profiler passes
    its own to see the steps' kernels."""
    from hf_hybrid.generation.graph_decode import DecodeGraphSession

    session = DecodeGraphSession(model, mode)
    session.max_length = ids.shape[1] + steps + 8
    previous, model._decode_graph_session = model._decode_graph_session, session
    try:
        with torch.no_grad():
            out = model(ids, attention_mask=torch.ones_like(ids), use_cache=True)
            cache, token = cache_of(out), out.logits[:, -1:].argmax(-1)

            def loop(n):
                nonlocal token
                for _ in range(n):
                    token = model(token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)

            loop(3)  # eager warm-up step, capture, first replay
            elapsed = (measure or _timed)(lambda: loop(steps))
        if session.static_steps != steps + 3:
            raise RuntimeError(f"decode loop: only {session.static_steps} of {steps + 3} steps were static: {session.report()}")
    finally:
        model._decode_graph_session = previous
        session.release()
    return 1000 * elapsed / steps


def _append(path: str | None, row: dict) -> None:
    """One JSON line per row as soon as it is timed: a later failure keeps the rows before it."""
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=8, help="new tokens of the warm-up generate()")
    parser.add_argument("--new", type=int, default=40, help="new tokens of each timed generate()")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--eager", action="store_true", help="also time our models with decode_cuda_graph=False")
    parser.add_argument("--eager-models", default="", help="comma list: time these with decode_cuda_graph=False too")
    parser.add_argument("--llama-deferred-stop", action="store_true",
                        help="also time Llama (static cache, compiled) with the stop check one step late, as our models decode")
    parser.add_argument("--floor", action="store_true", help="also time the graphed step in a bare loop (decode_loop_ms)")
    parser.add_argument("--unfused-decode", action="store_true",
                        help="also time our models without the fused norm / SwiGLU kernels in the graphed step (fused_decode off)")
    parser.add_argument("--json", help="append the rows to this JSON-lines file")
    args = parser.parse_args(argv)
    device, dtype = torch.device("cuda"), torch.bfloat16
    rows = []
    ids = torch.randint(3, 32000, (args.batch, args.prompt), device=device)
    for name in args.models.split(","):
        model = build_model(name, device, dtype, args.prompt + args.new + 16)
        variants = {}
        if name in LLAMA_MODELS:
            from transformers import StaticCache

            cache = StaticCache(config=model.config, max_cache_len=args.prompt + args.new)
            variants["static_compiled"] = dict(static_cache=cache)
            if args.llama_deferred_stop:
                # The same generate() loop our models get (deferred_stop.py), for transparency: a
                # cache generate() builds (a user's cache keeps the synchronous check), and a warm-up
                # of the timed length, so the timed runs reuse its compiled step.
                variants["static_compiled_deferred_stop"] = dict(cache_implementation="static", deferred_stop=True)
        else:
            variants["graph"] = dict(decode_cuda_graph=None)  # default arguments
            if args.unfused_decode:
                variants["graph_unfused_decode"] = dict(decode_cuda_graph=None, fused_decode=False)
            if args.eager or name in args.eager_models.split(","):
                variants["eager"] = dict(decode_cuda_graph=False)
        for variant, kwargs in variants.items():
            deferred = kwargs.pop("deferred_stop", False)
            loop = deferred_for_every_generation() if deferred else contextlib.nullcontext()
            with backbone_fusion_settings(fused_decode=kwargs.pop("fused_decode", None)), loop:
                ms, report = ms_per_token(model, ids, args.new if deferred else args.warmup, args.new, args.repeats, **kwargs)
            row = dict(model=name, variant=variant, batch=args.batch, prompt=args.prompt, ms_per_token=round(ms, 3),
                       tokens_per_s=round(1000 * args.batch / ms, 1), device=torch.cuda.get_device_name(), report=report)
            print(json.dumps(row), flush=True)
            rows.append(row)
            _append(args.json, row)
        if args.floor and name not in LLAMA_MODELS:
            ms = decode_loop_ms(model, ids, args.new)
            row = dict(model=name, variant="bare_graph_loop", batch=args.batch, prompt=args.prompt, ms_per_token=round(ms, 3),
                       tokens_per_s=round(1000 * args.batch / ms, 1), device=torch.cuda.get_device_name(), report=None)
            print(json.dumps(row), flush=True)
            rows.append(row)
            _append(args.json, row)
        del model
        torch.cuda.empty_cache()
    # The baseline is the faster Llama row (plain, or with our projection kernels).
    base = min((r["ms_per_token"] for r in rows if r["model"] in LLAMA_MODELS), default=None)
    if base:
        for r in rows:
            setup = (r["report"] or {}).get("setup_ms")  # the per-generate() one-off host work
            print(f"{r['model']:>17} {r['variant']:>16}: {r['ms_per_token']:8.3f} ms/token  {base / r['ms_per_token']:6.2f}x fastest llama-static"
                  + (f"  setup ms {setup}" if setup else ""))
    return rows


if __name__ == "__main__":
    main()
