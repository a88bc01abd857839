"""Reusable model checks: every architecture's test file calls these with its own tiny configs.

Each check states the property it proves:
* prefill + decode with the model's cache == one full forward (the cache is exact),
* save_pretrained -> AutoModelForCausalLM.from_pretrained in another process == bit-identical logits,
* left-padded batched greedy generation == generating each row alone,
* gradient checkpointing changes no gradient,
* invalid configs raise ValueError naming the field.
"""
from __future__ import annotations

import json
import textwrap
import uuid
from pathlib import Path

import pytest
import torch

from helper_process import hf_hybrid_helper, remote_code_helper


def full_vs_cached_logits(model, input_ids: torch.Tensor, segments: list[int], **forward_kwargs):
    """Logits of one full forward and of the same tokens fed as consecutive segments through the cache.

    ``segments`` are segment lengths after the first (prefill) one, e.g. [1, 1, 1] decodes three
    tokens one by one, [5, 1] continues a prefill with 5 more tokens then decodes one.
    """
    total = input_ids.shape[1]
    prefill = total - sum(segments)
    assert prefill >= 1, "segments longer than the input"
    with torch.no_grad():
        full = model(input_ids, use_cache=False, **forward_kwargs).logits
        out = model(input_ids[:, :prefill], use_cache=True, **forward_kwargs)
        pieces, cache, start = [out.logits], out.past_key_values, prefill
        for length in segments:
            out = model(input_ids[:, start : start + length], past_key_values=cache, use_cache=True, **forward_kwargs)
            pieces.append(out.logits)
            start += length
    return full, torch.cat(pieces, dim=1)


def assert_prefill_decode_matches(model, input_ids, prefill_length: int, atol: float = 1e-4, **forward_kwargs):
    """Prefill ``prefill_length`` tokens, then decode the rest one token at a time."""
    segments = [1] * (input_ids.shape[1] - prefill_length)
    full, cached = full_vs_cached_logits(model, input_ids, segments, **forward_kwargs)
    diff = (full - cached).abs().max().item()
    assert diff < atol, f"prefill({prefill_length}) + decode differs from the full forward by {diff:.3g}"


def assert_chunked_prefill_matches(model, input_ids, segments: list[int], atol: float = 1e-4, **forward_kwargs):
    full, cached = full_vs_cached_logits(model, input_ids, segments, **forward_kwargs)
    diff = (full - cached).abs().max().item()
    assert diff < atol, f"segmented prefill {segments} differs from the full forward by {diff:.3g}"


_RELOAD_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    import hf_hybrid  # registers the architectures
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
    ids = torch.load(sys.argv[2])
    with torch.no_grad():
        torch.save({"logits": model(ids).logits, "class": type(model).__name__, "module": type(model).__module__}, sys.argv[3])
    """
)

# The same, in a process where `import hf_hybrid` fails (remote_code_helper): only the code saved
# with the checkpoint runs.
_REMOTE_CODE_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
    ids = torch.load(sys.argv[2])
    with torch.no_grad():
        logits = model(ids).logits
        generated = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert not any(name.split(".")[0] == "hf_hybrid" for name in sys.modules)
    torch.save({"logits": logits, "generated": generated, "module": type(model).__module__}, sys.argv[3])
    """
)


def _load_elsewhere(helper, script: str, tmp_path: Path, input_ids: torch.Tensor, output: str) -> dict:
    """Run ``script`` on tmp_path/ckpt in a helper process (tests/helper_process.py), not the test
    process that built the model; one helper of each kind serves every architecture's check."""
    torch.save(input_ids, tmp_path / "ids.pt")
    # A folder name no other checkpoint loaded by the helper has: its remote code gets a module
    # namespace of its own, so a file missing from it cannot be found among another checkpoint's.
    alias = tmp_path / f"ckpt_{uuid.uuid4().hex}"
    alias.symlink_to("ckpt", target_is_directory=True)
    helper.run(script, alias, tmp_path / "ids.pt", tmp_path / output)
    return torch.load(tmp_path / output)


def assert_save_load_roundtrip(model, tmp_path: Path, input_ids: torch.Tensor, expected_class: str):
    """save_pretrained, then in *other processes*: AutoModelForCausalLM.from_pretrained with hf-hybrid
    installed (its own classes, no trust_remote_code) and with hf-hybrid blocked (trust_remote_code=True,
    the code saved with the checkpoint). Both give bit-identical logits; the folder holds a filled card."""
    model = model.eval()
    model.save_pretrained(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "model.safetensors").exists(), "weights must be saved as safetensors"
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config["model_type"] == model.config.model_type
    assert "AutoModelForCausalLM" in config["auto_map"]
    card = (tmp_path / "ckpt" / "README.md").read_text()
    assert card.startswith("---\n") and "library_name: transformers" in card and "$" not in card
    with torch.no_grad():
        original = model(input_ids).logits
        original_generated = model.generate(input_ids, max_new_tokens=3, do_sample=False)

    local = _load_elsewhere(hf_hybrid_helper(), _RELOAD_SCRIPT, tmp_path, input_ids, "local.pt")
    assert local["class"] == expected_class and local["module"].startswith("hf_hybrid.")
    assert torch.equal(original, local["logits"]), "reloaded model's logits are not bit-identical"

    remote = _load_elsewhere(remote_code_helper(), _REMOTE_CODE_SCRIPT, tmp_path, input_ids, "remote.pt")
    assert remote["module"].startswith("transformers_modules.")
    assert torch.equal(original, remote["logits"]), "remote-code model's logits are not bit-identical"
    assert torch.equal(original_generated, remote["generated"])


def assert_left_padding_matches(model, prompts: list[list[int]], pad_token_id: int, max_new_tokens: int = 6, **generate_kwargs):
    """Greedy generation of a left-padded batch == generating each prompt alone, and the padded
    forward's logits at real tokens == the unpadded forward's."""
    model = model.eval()
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, longest - len(prompt) :] = torch.tensor(prompt)
        mask[row, longest - len(prompt) :] = 1
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_token_id, **generate_kwargs)
    with torch.no_grad():
        padded_logits = model(ids, attention_mask=mask).logits
        batched = model.generate(ids, attention_mask=mask, **kwargs)
        for row, prompt in enumerate(prompts):
            alone_ids = torch.tensor([prompt])
            alone_logits = model(alone_ids).logits[0]
            diff = (padded_logits[row, longest - len(prompt) :] - alone_logits).abs().max().item()
            assert diff < 1e-4, f"row {row}: padded forward differs from the unpadded one by {diff:.3g}"
            alone = model.generate(alone_ids, attention_mask=torch.ones_like(alone_ids), **kwargs)
            assert batched[row, longest:].tolist() == alone[0, len(prompt) :].tolist(), f"row {row} generated differently"


def assert_gradient_checkpointing_matches(model, input_ids):
    """Enabling gradient checkpointing changes neither the loss nor any gradient."""
    model = model.train()
    results = []
    for enable in (False, True):
        model.zero_grad()
        if enable:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_disable()
        loss = model(input_ids, labels=input_ids).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    model.gradient_checkpointing_disable()
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.allclose(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_a:
        assert torch.allclose(grads_a[name], grads_b[name], atol=1e-6), name


def assert_config_error(config_class, field: str, **kwargs):
    """Constructing the config with ``kwargs`` raises a ValueError whose message names ``field``."""
    with pytest.raises(ValueError, match=field):
        config_class(**kwargs)
