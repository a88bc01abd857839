"""Decode throughput at each model's largest batch: how many rows of a long prompt generate() can
take on one GPU, and the decode tokens/s there, against transformers' Llama with a static cache at
its own largest batch.

    python -m benchmarks.largest_batch                       # rat, rattention, fox, llama; 24 layers, 4K prompt
    python -m benchmarks.largest_batch --models rat,llama --max-batch 1024 --json rows.jsonl

Every model has 24 layers of the 1.3B shape (benchmarks/generation.py's SHAPE), random weights,
bf16, a prompt of ``--prompt`` random tokens and ``--new`` greedy new tokens. The largest batch is
searched by doubling from ``--start`` and then bisecting between the last batch that generated and
the first that failed (out of memory; any other error is kept in the row's ``errors``), to
``--resolution`` rows, at most ``--max-tries`` generate() calls
per model, none started after ``--search-seconds`` of the model's search, and never past
``--max-batch`` (a model that reaches it is reported as ">= max-batch"; ``tries`` lists every try,
so a search cut short by its budget shows its open bracket). ``--fixed-batch NAME=B`` skips a
model's search and times it at B after one warm-up generate() (a batch an earlier search found).
Each try runs in this process after the previous one's memory was handed back (gc and
``torch.cuda.empty_cache()``). Our models generate with default arguments: the prefill in slices
where the batch's activations would not fit beside the decode cache
(hf_hybrid/generation/sliced_prefill.py; ``prefill_plan`` in each row), the decode step in a CUDA
graph. Llama generates with ``cache_implementation="static"``: the search runs it eagerly (a
compile per batch would take minutes), its timed run compiled as generate() does by default
(``--llama-eager`` keeps it eager); ``--llama-prefill-chunk N`` gives it transformers' own prefill
slices of N tokens, as ours take them (off by default: Llama as transformers runs it).

Decode tokens/s = batch / (ms per new token), the first new token's stamp to the last (CUDA events
from a logits processor, hf_hybrid/bench/models.py's ``TokenClock``): the prefill is not in it. It
is timed by one more generate() at the largest batch after the search (kernels tuned, the decode
step's shape seen; Llama's compiled step gets a warm-up generate() first); if that runs out of
memory (Llama's compiled step holds more), the batch steps down by ``--resolution``. ``ratio_vs_llama`` is tokens/s over Llama's at Llama's largest batch.

The memory-bound ceiling (``memory_bound`` in each row): a decode step at batch B reads at least
every weight and every byte of the decode cache once, so tokens/s <= B x bandwidth / (weight bytes
+ cache bytes at B), with the device's copy bandwidth measured in the same process
(``copy_bandwidth``) and the cache measured as generate() builds it (``decode_cache_bytes``).
``ceiling_vs_llama`` is a model's ceiling at its largest batch over Llama's measured tokens/s: the
most any decode kernel could give that model at that batch against this run's Llama.
"""
from __future__ import annotations

import argparse
import gc
import json
import time

import torch

from .generation import LLAMA_MODELS, _append, build_model

MODELS = ("rat", "rattention", "fox", "llama")
LAYERS = 24
# A CPU-sized shape for the benchmark's own test (--shape tiny).
TINY_SHAPE = dict(hidden_size=64, num_attention_heads=4, head_dim=16, intermediate_size=128, vocab_size=128)


def is_out_of_memory(error: BaseException) -> bool:
    message = str(error)
    return (isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in message.lower()
            or "ALLOC_FAILED" in message)  # cuBLAS / cuDNN handles that found no memory


def release_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def copy_bandwidth(device: torch.device, nbytes: int = 2**30, repeat: int = 10) -> float:
    """Bytes per second a device-to-device copy moves (read + written), timed here: the rate every
    decode step's reads are bounded by."""
    from hf_hybrid.bench.timing import time_fn

    source = torch.empty(nbytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    timing = time_fn(lambda: target.copy_(source), device, warmup=1, repeat=repeat)
    return 2 * nbytes / (timing.median_ms / 1000)


def decode_cache_bytes(model, name: str, batch: int, tokens: int) -> float:
    """Bytes of the decode cache of ``batch`` rows holding ``tokens`` tokens: for Llama the static
    cache generate() allocates (keys and values of every layer), for ours the cache their class
    builds, measured by hf_hybrid's prefill planner (probe_cache_footprint)."""
    config = model.config
    if name in LLAMA_MODELS:
        heads = config.num_key_value_heads or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return 2.0 * config.num_hidden_layers * heads * head_dim * tokens * batch * model.dtype.itemsize
    from hf_hybrid.generation.sliced_prefill import probe_cache_footprint

    return probe_cache_footprint(model).bytes(batch, tokens)


def memory_bound(model, name: str, batch: int, tokens: int, bandwidth: float, tokens_per_s: float) -> dict:
    """The decode ceiling at ``batch`` (module docstring) and how much of it the timed run reached."""
    weights = float(sum(p.numel() * p.element_size() for p in model.parameters()))
    cache = decode_cache_bytes(model, name, batch, tokens)
    ceiling = batch * bandwidth / (weights + cache)
    return dict(bandwidth_bytes_per_s=bandwidth, weight_bytes=weights, cache_bytes=cache,
                ceiling_tokens_per_s=round(ceiling, 1), fraction_of_ceiling=round(tokens_per_s / ceiling, 3))


def generate_once(model, batch: int, prompt: int, new: int, **generate_kwargs) -> dict:
    """One generate() of ``batch`` random prompts: its prefill and decode ms (TokenClock stamps) and
    what the prefill planner chose (our models)."""
    from transformers import LogitsProcessorList

    from hf_hybrid.bench.models import TokenClock

    ids = torch.randint(3, model.config.vocab_size, (batch, prompt), device=model.device)
    clock = TokenClock(model.device)
    begin = clock.start()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, logits_processor=LogitsProcessorList([clock]), **generate_kwargs)
    if out.shape != (batch, prompt + new) or len(clock.stamps) != new:
        raise RuntimeError(f"generate() returned {tuple(out.shape)} with {len(clock.stamps)} stamps, expected "
                           f"{(batch, prompt + new)} with {new}")
    prefill_ms, decode_ms = clock.elapsed_ms(begin)
    return {"prefill_ms": round(prefill_ms, 1), "ms_per_token": round(decode_ms / (new - 1), 3),
            "prefill_plan": getattr(model, "last_prefill_plan", None)}


def try_batch(model, batch: int, prompt: int, new: int, **generate_kwargs) -> tuple[bool, dict]:
    """(True, info) when generate() ran at ``batch``; (False, info) when it failed: out of memory,
    or another error (say, an out-of-memory inside a CUDA graph capture that surfaces as a capture
    error), recorded in ``info`` with its message so that the row shows it."""
    start = time.perf_counter()
    try:
        info = generate_once(model, batch, prompt, new, **generate_kwargs)
        ok = True
    except Exception as error:  # noqa: BLE001 (a failed try brackets the search; the row says why)
        info, ok = {"out_of_memory": is_out_of_memory(error)}, False
        if not info["out_of_memory"]:
            info["error"] = f"{type(error).__name__}: {str(error)[:300]}"
        del error  # its traceback holds the failed try's tensors
    release_memory(model.device)
    info["seconds"] = round(time.perf_counter() - start, 2)
    return ok, info


def search_largest(fits, start: int, max_batch: int, resolution: int, max_tries: int,
                   deadline: float | None = None, clock=time.monotonic) -> tuple[int | None, bool, list]:
    """The largest batch for which ``fits(batch)`` is True: doubling from ``start``, then bisection
    to ``resolution`` rows. Returns (largest batch or None, whether ``max_batch`` capped the search,
    the tries as (batch, fitted)). At most ``max_tries`` calls, and none started after ``deadline``
    (on ``clock``)."""
    tries = []

    def budget_left() -> bool:
        return len(tries) < max_tries and (deadline is None or clock() < deadline)

    def attempt(batch):
        fitted = fits(batch)
        tries.append((batch, fitted))
        return fitted

    good, bad, batch = None, None, min(start, max_batch)
    while budget_left():
        if attempt(batch):
            good = batch
            if batch >= max_batch:
                return good, True, tries
            batch = min(2 * batch, max_batch)
        else:
            bad = batch
            break
    if good is None:  # even the first batch failed: halve down
        while bad is not None and bad > 1 and budget_left():
            batch = bad // 2
            if attempt(batch):
                good = batch
                break
            bad = batch
    while good is not None and bad is not None and bad - good > resolution and budget_left():
        middle = (good + bad) // 2
        if attempt(middle):
            good = middle
        else:
            bad = middle
    return good, False, tries


def parse_fixed_batches(text: str) -> dict[str, int]:
    """``"rattention=256,llama=96"`` -> {"rattention": 256, "llama": 96}."""
    batches = {}
    for item in filter(None, text.split(",")):
        name, sep, batch = item.partition("=")
        if not sep or not batch.strip().isdigit() or int(batch) < 1:
            raise argparse.ArgumentTypeError(f"--fixed-batch: {item!r} is not NAME=ROWS (e.g. rattention=256)")
        batches[name.strip()] = int(batch)
    return batches


def measure_model(name: str, args, device: torch.device, dtype: torch.dtype, shape: dict, bandwidth: float) -> dict:
    max_positions = args.prompt + args.new + 16
    model = build_model(name, device, dtype, max_positions, **shape)
    search_kwargs, timed_kwargs = {}, {}
    if name in LLAMA_MODELS:
        search_kwargs = dict(cache_implementation="static", disable_compile=True)
        timed_kwargs = dict(cache_implementation="static", disable_compile=args.llama_eager)
        if args.llama_prefill_chunk:
            search_kwargs["prefill_chunk_size"] = timed_kwargs["prefill_chunk_size"] = args.llama_prefill_chunk
    infos = {}

    def fits(batch):
        ok, info = try_batch(model, batch, args.prompt, args.new, **search_kwargs)
        infos[batch] = info
        plan = info.pop("prefill_plan", None) or {}
        print(json.dumps(dict(model=name, batch=batch, generated=ok, prefill_slice=plan.get("slice_tokens"), **info)),
              flush=True)
        return ok

    fixed = args.fixed_batch.get(name)
    if fixed is None:
        deadline = time.monotonic() + args.search_seconds if args.search_seconds else None
        largest, capped, tries = search_largest(fits, args.start, args.max_batch, args.resolution, args.max_tries, deadline)
    else:  # a batch found by an earlier search: one warm-up generate() stands in for the search
        fitted = fits(fixed)
        largest, capped, tries = (fixed if fitted else None), False, [(fixed, fitted)]
    errors = {batch: info["error"] for batch, info in infos.items() if "error" in info}
    row = dict(model=name, layers=shape.get("num_hidden_layers"), prompt=args.prompt, new=args.new,
               largest_batch=largest, capped=capped, tries=tries, errors=errors,
               device=torch.cuda.get_device_name(device) if device.type == "cuda" else str(device))
    batch = largest
    while batch is not None and batch > 0:
        ok, info = True, {}
        if timed_kwargs.get("disable_compile") is False:
            ok, info = try_batch(model, batch, args.prompt, args.new, **timed_kwargs)  # compiles Llama's step
        # (otherwise the search ran this shape: kernels tuned, the decode step's shape seen)
        if ok:
            ok, info = try_batch(model, batch, args.prompt, args.new, **timed_kwargs)
        if not ok:  # the timed configuration holds more (Llama's compiled step): a smaller batch
            if "error" in info:
                errors[f"timed at {batch}"] = info["error"]
            batch -= args.resolution
            continue
        row.update(timed_batch=batch, ms_per_token=info["ms_per_token"],
                   tokens_per_s=round(1000 * batch / info["ms_per_token"], 1), prefill_ms=info["prefill_ms"],
                   prefill_plan=info["prefill_plan"], decode_report=getattr(model, "last_decode_report", None))
        row["memory_bound"] = memory_bound(model, name, batch, args.prompt + args.new, bandwidth, row["tokens_per_s"])
        break
    del model
    release_memory(device)
    return row


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--new", type=int, default=32, help="new tokens of every generate()")
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--start", type=int, default=32, help="first batch of the doubling")
    parser.add_argument("--max-batch", type=int, default=512, help="the search stops here (reported as capped)")
    parser.add_argument("--resolution", type=int, default=16, help="bisection stops when the bracket is this narrow")
    parser.add_argument("--max-tries", type=int, default=8, help="generate() calls of the search, per model")
    parser.add_argument("--search-seconds", type=float, default=50.0,
                        help="no new try of a model's search starts after this many seconds (0: no limit)")
    parser.add_argument("--llama-eager", action="store_true", help="time Llama's static cache without compiling its step")
    parser.add_argument("--llama-prefill-chunk", type=int, default=None,
                        help="give Llama transformers' prefill_chunk_size (its own sliced prefill)")
    parser.add_argument("--fixed-batch", type=parse_fixed_batches, default={},
                        help="NAME=B,...: time these models at batch B without searching (one warm-up generate())")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", choices=("1.3b", "tiny"), default="1.3b", help="tiny: the CPU-sized test shape")
    parser.add_argument("--json", help="append the rows to this JSON-lines file")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = dict(num_hidden_layers=args.layers) | (TINY_SHAPE if args.shape == "tiny" else {})
    bandwidth = copy_bandwidth(device)
    print(f"copy bandwidth: {bandwidth / 1e9:.1f} GB/s", flush=True)
    rows = []
    for name in args.models.split(","):
        row = measure_model(name, args, device, dtype, shape, bandwidth)
        print(json.dumps(row), flush=True)
        rows.append(row)
        _append(args.json, row)
    llama = next((r for r in rows if r["model"] in LLAMA_MODELS and r.get("tokens_per_s")), None)
    for r in rows:
        if llama is not None and r.get("tokens_per_s"):
            r["ratio_vs_llama"] = round(r["tokens_per_s"] / llama["tokens_per_s"], 2)
            r["ceiling_vs_llama"] = round(r["memory_bound"]["ceiling_tokens_per_s"] / llama["tokens_per_s"], 2)
        largest = "none" if r["largest_batch"] is None else (">= " if r["capped"] else "") + str(r["largest_batch"])
        bound = r.get("memory_bound", {})
        print(f"{r['model']:>11}: largest batch {largest:>7}  decode {r.get('tokens_per_s', 'n/a'):>10} tok/s at B="
              f"{r.get('timed_batch')}  {r.get('ratio_vs_llama', ''):>6}x llama-static;  memory-bound ceiling "
              f"{bound.get('ceiling_tokens_per_s', 'n/a')} tok/s ({r.get('ceiling_vs_llama', '')}x llama-static, "
              f"{bound.get('fraction_of_ceiling', 'n/a')} of it reached)")
    return rows


if __name__ == "__main__":
    main()
