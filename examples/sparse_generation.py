"""One dense-trained RAT+ model, many sparse inference patterns chosen per generate() call.

Trains a tiny RAT+ briefly with the joint objective (dense + dilated) on a generated language, then
generates with dense, dilated, dilated + local window, layer and head hybrids, Quest / MoBA top-k and
dilation || top-k. For every pattern it asserts that cached generation equals uncached generation
and that the cache holds what the pattern needs (about T/D + W + sinks entries for dilated layers,
all T plus block summaries for top-k), and prints held-out loss and cache bytes. Finally it stores a
default pattern in the config, saves, reloads and checks the default is used.

    python examples/sparse_generation.py [--train-steps 100 --prompt-length 96 --new-tokens 32]
"""
from __future__ import annotations

import argparse
import tempfile

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import hf_hybrid  # noqa: F401  (registers rat_plus)
from hf_hybrid.adapt import adapt, evaluate_patterns, lm_dataset, synthetic_language
from hf_hybrid.compat import cache_of
from hf_hybrid.sparse import SparseInferenceConfig

PATTERNS = {
    "dense": SparseInferenceConfig(),
    "D=4": SparseInferenceConfig(dilation=4),
    "D=16": SparseInferenceConfig(dilation=16),
    "D=8, W=16": SparseInferenceConfig(dilation=8, local_window=16),
    "dense layer 0 | D=16": SparseInferenceConfig(dilation=16, layer_overrides={0: "dense"}),
    "dense heads 0,1 | D=16": SparseInferenceConfig(dilation=16, head_overrides={0: "dense", 1: "dense"}),
    "Quest top-4 (B=8)": SparseInferenceConfig(top_k=4, block_size=8, block_scoring="quest"),
    "MoBA top-4 (B=8)": SparseInferenceConfig(top_k=4, block_size=8, block_scoring="moba"),
    "D=16 || top-2 (B=16)": SparseInferenceConfig(dilation=16, top_k=2, block_size=16),
}


def expected_entries(pattern: SparseInferenceConfig, layer: int, num_heads: int, tokens: int) -> int:
    """Entries one layer's cache needs per kv head: one store per head group (see RatPlusCache)."""
    return sum(p.cache_entries(tokens) for p, _ in pattern.layer_groups(layer, num_heads))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train-steps", type=int, default=100)
    parser.add_argument("--prompt-length", type=int, default=96)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)

    config = AutoConfig.for_model(
        "rat_plus", vocab_size=35, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, training_dilations=[1, 16],
    )
    model = AutoModelForCausalLM.from_config(config)
    train = lm_dataset(synthetic_language(args.train_steps * 16, 128, 32, seed=args.seed))
    with tempfile.TemporaryDirectory() as tmp:
        adapt(model, train, tmp, max_steps=args.train_steps, learning_rate=3e-3, batch_size=16, logging_steps=1000, seed=args.seed)
    held_out = synthetic_language(16, 128, 32, seed=args.seed + 1)
    losses = evaluate_patterns(model, held_out, PATTERNS)

    prompt = synthetic_language(2, args.prompt_length, 32, seed=args.seed + 2)
    total = args.prompt_length + args.new_tokens
    greedy = dict(max_new_tokens=args.new_tokens, do_sample=False, attention_mask=torch.ones_like(prompt), pad_token_id=0)
    print(f"{'pattern':<24}{'loss':>7}{'entries/layer':>15}{'cache bytes/layer':>19}   first tokens")
    summary = {"losses": losses, "entries": {}, "cache_bytes": {}}
    for name, pattern in PATTERNS.items():
        with torch.no_grad():
            out = model.generate(prompt, sparse_config=pattern, return_dict_in_generate=True, **greedy)
            uncached = model.generate(prompt, sparse_config=pattern, use_cache=False, **greedy)
        assert torch.equal(out.sequences, uncached), f"{name}: cached generation differs from uncached"
        cache = cache_of(out)  # out.past_key_values before transformers 5.24, out.cache since
        # The last generated token is never fed back, so the cache holds total - 1 tokens.
        entries = cache.num_entries_per_layer()
        for layer, held in enumerate(entries):
            assert held == expected_entries(pattern, layer, config.num_attention_heads, total - 1), (name, layer, held)
        summary["entries"][name], summary["cache_bytes"][name] = entries, cache.nbytes_per_layer()
        print(f"{name:<24}{losses[name]:7.3f}{str(entries):>15}{str(cache.nbytes_per_layer()):>19}   {out.sequences[0, args.prompt_length:][:8].tolist()}")
    assert losses["D=16"] < losses["dense"] + 0.5, "joint training keeps dilation D=16 close to dense"

    default = PATTERNS["D=8, W=16"]
    model.config.sparse_config = default.to_dict()
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        reloaded = AutoModelForCausalLM.from_pretrained(tmp).eval()
    with torch.no_grad():
        implicit = reloaded.generate(prompt, **greedy)
        explicit = model.generate(prompt, sparse_config=default, **greedy)
    assert torch.equal(implicit, explicit), "the config's stored sparse_config is the default pattern"
    print(f"reloaded model uses its stored default pattern {default.to_json_string()}")
    return summary


if __name__ == "__main__":
    main()
