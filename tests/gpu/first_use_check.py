"""One architecture's first training step or first generate() in this process, timed, with every
Triton compile and autotuning it caused (tests/gpu/test_first_use_gpu.py runs it in a fresh process
with empty Triton and Inductor caches).

    python tests/gpu/first_use_check.py --arch rat --mode train --out first_use_rat_train.json
    python tests/gpu/first_use_check.py --arch rat --mode train --out F --tiny --device cpu   (a smoke run)
    python tests/gpu/first_use_check.py --arch fox --mode train --out F --fox-portable   (FoX off Hopper)

Shape: 2 layers of the 1.3B shape (hidden 2048 = 16 heads x 128, SwiGLU 5632, vocab 32000), bf16,
the model bench's row of the architecture (hf_hybrid/bench/models.py), one layer of each kind its
1.3B stack mixes; a training step at T = 2048
(``model(ids, labels=ids).loss.backward()``), generate() greedy with a 512-token prompt and 8 new
tokens. Compile cost does not grow with depth: every layer of a kind launches the same kernels.
The second call's time is recorded beside the first, so the difference is the first use's cost.
"""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch

FULL = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=2, num_attention_heads=16)
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2)
TRAIN_TOKENS, PROMPT, NEW_TOKENS = 2048, 512, 8
TINY_TRAIN_TOKENS, TINY_PROMPT = 64, 32
DEEP_LAYERS = 24  # the 1.3B depth: its default layer pattern says which layer kinds the architecture mixes


class CompileLog:
    """Seconds per kernel that Triton spent compiling (``JITFunction._do_compile``, Gluon kernels
    included) and autotuning (``Autotuner.run`` calls that tuned a new key: its compiles and timed
    runs), while installed. Reads Triton internals; where they are missing it records nothing and
    says so (``hooked``)."""

    def __init__(self):
        self.compiles = defaultdict(float)
        self.compile_counts = defaultdict(int)
        self.autotune = defaultdict(float)
        self.variants = defaultdict(list)  # kernel -> the constexprs of each compile
        self.hooked = []
        self._originals = []  # (class, attribute, original) to put back

    def install(self) -> "CompileLog":
        try:
            from triton.runtime import autotuner, jit
        except ImportError:
            return self
        log = self
        if hasattr(jit.JITFunction, "_do_compile"):
            original_compile = jit.JITFunction._do_compile

            def timed_compile(self, *args, **kwargs):
                start = time.perf_counter()
                try:
                    return original_compile(self, *args, **kwargs)
                finally:
                    name = f"{getattr(self.fn, '__module__', '?')}.{getattr(self.fn, '__name__', '?')}"
                    log.compiles[name] += time.perf_counter() - start
                    log.compile_counts[name] += 1
                    log.variants[name].append(_constexprs(self, args))

            self._originals.append((jit.JITFunction, "_do_compile", original_compile))
            jit.JITFunction._do_compile = timed_compile
            self.hooked.append("JITFunction._do_compile")
        if hasattr(autotuner, "Autotuner"):
            original_run = autotuner.Autotuner.run

            def timed_run(self, *args, **kwargs):
                before = len(getattr(self, "cache", {}) or {})
                start = time.perf_counter()
                try:
                    return original_run(self, *args, **kwargs)
                finally:
                    if len(getattr(self, "cache", {}) or {}) > before:  # a new key was tuned
                        fn = getattr(self, "fn", None)
                        name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__name__', '?')}"
                        log.autotune[name] += time.perf_counter() - start

            self._originals.append((autotuner.Autotuner, "run", original_run))
            autotuner.Autotuner.run = timed_run
            self.hooked.append("Autotuner.run")
        return self

    def uninstall(self) -> None:
        for owner, name, original in reversed(self._originals):
            setattr(owner, name, original)
        self._originals.clear()

    def report(self) -> dict:
        by_time = sorted(self.compiles.items(), key=lambda item: -item[1])
        return {
            "triton_compile_s": round(sum(self.compiles.values()), 3),
            "triton_compiles": sum(self.compile_counts.values()),
            "compiles": [{"kernel": k, "seconds": round(s, 3), "count": self.compile_counts[k], "variants": self.variants[k]}
                         for k, s in by_time],
            "autotune": [{"kernel": k, "seconds": round(s, 3)} for k, s in sorted(self.autotune.items(), key=lambda i: -i[1])],
            "hooked": self.hooked,
        }


def _constexprs(jit_function, args) -> str:
    """The constexpr values of one compile (``_do_compile``'s fourth argument: {(index,): value}), by name."""
    try:
        names = [p.name for p in jit_function.params]
        return ", ".join(f"{names[k[0]] if isinstance(k, tuple) else k}={v}" for k, v in args[3].items())
    except Exception:  # another Triton's argument order: the kernel's time is still recorded
        return "?"


def build(model_type: str, tiny: bool, device: torch.device, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    import hf_hybrid  # noqa: F401  (registers the architectures)
    from hf_hybrid.bench.models import architectures

    row = next(arch for arch in architectures(quick=tiny) if arch.model_type == model_type and arch.trains)
    shape = dict(TINY if tiny else FULL, max_position_embeddings=4096, pad_token_id=0)
    # One layer of each kind that the architecture's deeper default stack mixes (RATTENTION: local and
    # global), at least two layers.
    deep = AutoConfig.for_model(model_type, **dict(shape, num_hidden_layers=DEEP_LAYERS), **row.overrides)
    kinds = list(dict.fromkeys(getattr(deep, "layer_types", None) or []))
    layers = max(shape["num_hidden_layers"], len(kinds))
    if kinds and "layer_types" not in row.overrides:
        shape["layer_types"] = (kinds * layers)[:layers]
    config = AutoConfig.for_model(model_type, **dict(shape, num_hidden_layers=layers), **row.overrides)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config)
    return model.to(dtype), row.name


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(call, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    call()
    _sync(device)
    return time.perf_counter() - start


def _torch_compile_seconds() -> dict:
    """Seconds torch.compile spent so far, per phase (Dynamo's own counters: flex_attention's
    compiled kernels, for instance); {} where this torch keeps none."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:
        return {}
    return {name: round(sum(times), 3) for name, times in compilation_time_metrics.items() if times}


def _first_and_second_call(args, log: CompileLog) -> dict:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    start = time.perf_counter()
    model, row = build(args.arch, args.tiny, device, dtype)
    build_s = time.perf_counter() - start
    vocab = model.config.vocab_size
    halves = []  # forward seconds of each training call
    if args.mode == "train":
        model.train()
        ids = torch.randint(3, vocab, (1, TINY_TRAIN_TOKENS if args.tiny else TRAIN_TOKENS), device=device)

        def call():  # forward and backward timed apart: which half's kernels cost the first step
            start = time.perf_counter()
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            _sync(device)
            halves.append(round(time.perf_counter() - start, 3))
            loss.backward()
            model.zero_grad(set_to_none=True)
    else:
        model.eval()
        ids = torch.randint(3, vocab, (1, TINY_PROMPT if args.tiny else PROMPT), device=device)

        def call():
            with torch.no_grad():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                     min_new_tokens=NEW_TOKENS, do_sample=False)
            if out.shape[1] != ids.shape[1] + NEW_TOKENS:
                raise RuntimeError(f"generate() returned {out.shape[1] - ids.shape[1]} new tokens, expected {NEW_TOKENS}")

    first_s = timed(call, device)
    compiled = dict(log.report(), torch_compile=_torch_compile_seconds())
    second_s = timed(call, device)
    result = {
        "arch": args.arch, "row": row, "mode": args.mode, "first_s": round(first_s, 3), "second_s": round(second_s, 3),
        "build_s": round(build_s, 3), "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "tokens": ids.shape[1], "new_tokens": NEW_TOKENS if args.mode == "generate" else 0,
        **compiled,
    }
    if halves:
        result["first_forward_s"] = halves[0]
        result["first_backward_s"] = round(first_s - halves[0], 3)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", required=True, help="a model_type of hf_hybrid/architectures.py")
    parser.add_argument("--mode", choices=("train", "generate"), required=True)
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the model bench's quick shape (a smoke run)")
    parser.add_argument("--fox-portable", action="store_true",
                        help="FoX's portable Triton kernels where the Hopper (Gluon) ones would run (GPUs before Hopper)")
    args = parser.parse_args(argv)

    log = CompileLog().install()
    try:
        if args.fox_portable:
            from hf_hybrid.bench.forgetting_attention import portable_kernels

            with portable_kernels(forward=True):
                result = _first_and_second_call(args, log)
            result["fox_portable"] = True
        else:
            result = _first_and_second_call(args, log)
    finally:
        log.uninstall()
    try:
        import triton

        result["triton"] = triton.__version__
    except ImportError:
        result["triton"] = None
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(json.dumps({k: result[k] for k in ("arch", "mode", "first_s", "second_s", "triton_compile_s")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
