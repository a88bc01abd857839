"""The PreTrainedModel features a transformers user reaches for, on every model type (tiny CPU
models): resize_token_embeddings, tied and untied embeddings through save/reload, device_map="auto"
offload (CPU + disk here, two GPUs where present), gradient checkpointing on PEFT's frozen-base path,
and padded training batches."""
from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F
from transformers import AutoModelForCausalLM

from tiny_models import MODEL_TYPES, PAD, VOCAB, left_pad, random_ids, three_prompts, tiny_model

pytestmark = pytest.mark.filterwarnings("ignore:.*falling back.*", "ignore:.*is deprecated.*:FutureWarning")

# rat_plus_sparse differs from rat_plus only in the pattern generate()/inference use by default;
# weights, embeddings and training are the same model, so these checks run it once.
ARCHITECTURES = tuple(name for name in MODEL_TYPES if name != "rat_plus_sparse")
# Offload changes where weights live during inference: the sparse default is run too.
OFFLOAD_TYPES = MODEL_TYPES


def byte_size(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


# ------------------------------------------------------------------------------------ embeddings


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_resize_token_embeddings_then_forward_generate_and_reload(name, tie, tmp_path):
    for new_size, multiple, expected in ((VOCAB + 9, None, VOCAB + 9), (VOCAB - 11, None, VOCAB - 11), (VOCAB, 16, 64)):
        model = tiny_model(name, tie_word_embeddings=tie)
        old_rows = model.get_input_embeddings().weight[: min(VOCAB, expected)].clone()
        model.resize_token_embeddings(new_size, pad_to_multiple_of=multiple, mean_resizing=False)
        embed, head = model.get_input_embeddings(), model.get_output_embeddings()
        assert embed.weight.shape[0] == head.weight.shape[0] == model.config.vocab_size == expected
        assert (head.weight is embed.weight) == tie, "resizing must keep the embeddings tied exactly when configured"
        torch.testing.assert_close(embed.weight[: min(VOCAB, expected)], old_rows, rtol=0, atol=0)

        ids = random_ids(2, 11) % expected
        ids[:, -1] = expected - 1  # the last row of the new table is usable
        with torch.no_grad():
            logits = model(ids).logits
            generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
        assert logits.shape == (2, 11, expected) and torch.isfinite(logits).all()
        assert torch.equal(generated[:, :11], ids) and generated.shape[1] > 11 and int(generated.max()) < expected

        folder = tmp_path / f"{name}-{tie}-{expected}"
        model.save_pretrained(folder)
        reloaded = AutoModelForCausalLM.from_pretrained(folder).eval()
        assert reloaded.config.vocab_size == expected
        assert (reloaded.get_output_embeddings().weight is reloaded.get_input_embeddings().weight) == tie
        with torch.no_grad():
            assert torch.equal(reloaded(ids).logits, logits), "save/reload after resizing is not bit-exact"


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_tied_and_untied_embeddings_save_and_reload_bit_exact(name, tie, tmp_path):
    model = tiny_model(name, tie_word_embeddings=tie)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert (head.weight is embed.weight) == tie
    if not tie:
        assert not torch.equal(head.weight, embed.weight), "untied weights are drawn independently"
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert (reloaded.get_output_embeddings().weight is reloaded.get_input_embeddings().weight) == tie
    for (key, original), (_, loaded) in zip(sorted(model.state_dict().items()), sorted(reloaded.state_dict().items())):
        assert torch.equal(original, loaded), key
    ids = random_ids(2, 13)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reloaded(ids).logits)
    if tie:  # training the shared table moves both ends
        with torch.no_grad():
            reloaded.get_input_embeddings().weight[5] += 1.0
        assert torch.equal(reloaded.get_output_embeddings().weight[5], reloaded.get_input_embeddings().weight[5])


# ------------------------------------------------------------------------------------ device_map / offload


def assert_dispatched_model_matches(model, dispatched, ids):
    with torch.no_grad():
        expected = model(ids).logits
        got = dispatched(ids.to(dispatched.device)).logits.to(expected.device)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        mask = torch.ones_like(ids)
        settings = dict(max_new_tokens=5, do_sample=False, pad_token_id=PAD)
        plain = model.generate(ids, attention_mask=mask, **settings)
        spread = dispatched.generate(
            ids.to(dispatched.device), attention_mask=mask.to(dispatched.device), return_dict_in_generate=True, **settings
        )
    assert isinstance(spread.past_key_values, type(model).base_model_class.cache_class), "decoded without the model's cache"
    assert torch.equal(spread.sequences.cpu(), plain.cpu()), "the dispatched model generates differently"


def assert_no_layer_split(placement: dict) -> None:
    """_no_split_modules: a decoder layer (mixer, its cache layer, MLP) stays on one device."""
    deeper = [key for key in placement if key.startswith("model.layers.") and key.count(".") > 2]
    assert not deeper, f"decoder layers were split across devices: {deeper}"


def first_two_layers_budget(model) -> int:
    """Bytes for the embeddings and layers 0-1, plus the largest layer that accelerate keeps in
    reserve on the main device when it offloads, plus half of the smallest layer: layer 2 is left out."""
    sizes = [byte_size(block) for block in model.model.layers]
    return byte_size(model.model.embed_tokens) + sizes[0] + sizes[1] + max(sizes) + min(sizes) // 2


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("name", OFFLOAD_TYPES)
def test_device_map_auto_spreads_layers_over_cpu_and_disk(name, tie, tmp_path):
    """max_memory fits the embeddings and two of four layers on the CPU; the rest is offloaded to
    disk and streamed in by accelerate's hooks, while our caches stay where the layers compute."""
    model = tiny_model(name, num_hidden_layers=4, tie_word_embeddings=tie)
    model.save_pretrained(tmp_path / "ckpt")
    budget = first_two_layers_budget(model)
    offloaded = AutoModelForCausalLM.from_pretrained(
        tmp_path / "ckpt", device_map="auto", max_memory={"cpu": budget}, offload_folder=tmp_path / "offload"
    ).eval()
    placement = offloaded.hf_device_map
    assert placement.get("model.layers.0") == "cpu" and placement.get("model.layers.3") == "disk", placement
    assert_no_layer_split(placement)
    assert any(p.device.type == "meta" for p in offloaded.model.layers[3].parameters()), "layer 3 is not offloaded"
    assert_dispatched_model_matches(model, offloaded, random_ids(2, 13))


@pytest.mark.gpu
@pytest.mark.parametrize("name", OFFLOAD_TYPES)
def test_device_map_auto_spreads_layers_over_two_gpus(name, tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    # head_dim 16: the smallest the Triton kernels take (on CUDA the models run them).
    model = tiny_model(name, num_hidden_layers=4, num_attention_heads=2).to("cuda:0")
    model.save_pretrained(tmp_path / "ckpt")
    budget = first_two_layers_budget(model)
    spread = AutoModelForCausalLM.from_pretrained(
        tmp_path / "ckpt", device_map="auto", max_memory={0: budget, 1: 10 * byte_size(model), "cpu": 0}
    ).eval()
    placement = spread.hf_device_map
    assert placement.get("model.layers.0") == 0 and placement.get("model.layers.3") == 1, placement
    assert_no_layer_split(placement)
    assert_dispatched_model_matches(model, spread, random_ids(2, 13).to("cuda:0"))


# ------------------------------------------------------------------------------------ training


def lora_model(name: str, checkpointing: bool, use_reentrant: bool):
    """PEFT's LoRA path: a frozen base with adapters; with checkpointing, PEFT (and the Trainer)
    also call enable_input_require_grads so reentrant checkpointing sees an input needing grad."""
    from peft import LoraConfig, get_peft_model

    model = tiny_model(name)
    torch.manual_seed(3)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"], init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
        model.enable_input_require_grads()
    return peft_model.train()


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_gradient_checkpointing_on_frozen_base_gives_the_same_lora_gradients(name, use_reentrant):
    ids = random_ids(2, 13)
    results = []
    for checkpointing in (False, True):
        model = lora_model(name, checkpointing, use_reentrant)
        assert not model.get_input_embeddings().weight.requires_grad
        calls = []  # entries into the first mixer: checkpointing recomputes it in backward
        mixer = model.base_model.model.model.layers[0].self_attn
        hook = mixer.register_forward_pre_hook(lambda *args: calls.append(1))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        hook.remove()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        assert grads and all("lora_" in n for n in grads)
        results.append((loss.detach(), grads, len(calls)))
    (loss_plain, grads_plain, calls_plain), (loss_ckpt, grads_ckpt, calls_ckpt) = results
    # RAT+'s joint objective runs one forward per training pattern; with checkpointing each is
    # recomputed once (without it, on CPU, the earlier patterns are rebuilt once in the backward).
    # Under reentrant checkpointing its patterns are row groups of one forward (stacked_patterns.py).
    config = model.base_model.model.config
    forwards = len(config.training_patterns(None)[0]) if hasattr(config, "training_patterns") else 1
    assert calls_plain in (forwards, 2 * forwards - 1), f"{calls_plain} mixer calls without checkpointing"
    forwards_ckpt = 1 if use_reentrant else forwards
    assert calls_ckpt == 2 * forwards_ckpt, f"{calls_ckpt} mixer calls with checkpointing, {forwards_ckpt} forwards"
    torch.testing.assert_close(loss_ckpt, loss_plain, rtol=0, atol=1e-6)
    for key, grad in grads_plain.items():
        assert grad is not None and grads_ckpt[key] is not None, f"{key}: no gradient"
        assert grad.abs().sum() > 0, f"{key}: zero gradient"
        torch.testing.assert_close(grads_ckpt[key], grad, rtol=1e-5, atol=1e-6, msg=key)


def next_token_loss_sum(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Summed next-token loss over the positions where the token and its target are both real."""
    keep = (mask[:, :-1] * mask[:, 1:]).reshape(-1).bool()
    flat_logits = logits[:, :-1].reshape(-1, logits.shape[-1])
    return F.cross_entropy(flat_logits[keep], ids[:, 1:].reshape(-1)[keep], reduction="sum")


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_left_padded_training_batch_gives_the_gradients_of_its_rows_alone(name):
    model = tiny_model(name).train()
    rows = three_prompts()
    ids, mask = left_pad(rows)
    next_token_loss_sum(model(ids, attention_mask=mask).logits, ids, mask).backward()
    padded = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    for row in rows:
        alone = torch.tensor([row])
        next_token_loss_sum(model(alone).logits, alone, torch.ones_like(alone)).backward()
    for n, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(padded[n], p.grad, rtol=1e-4, atol=1e-5, msg=n)
    assert padded.keys() == {n for n, p in model.named_parameters() if p.grad is not None}


def test_fused_norm_entry_points_call_hooked_norm_modules():
    """accelerate's offload hook loads a norm's weight in the norm's pre-forward: the fused entry
    points must call such a module (its weight is on the meta device until then), not read it."""
    from hf_hybrid.layers.fused_norms import qk_norm_rotary, sum_branch_norms
    from hf_hybrid.layers.norm import RMSNorm
    from hf_hybrid.layers.rotary import build_rotary

    torch.manual_seed(0)
    q, k = torch.randn(2, 5, 4, 8), torch.randn(2, 5, 2, 8)
    q_norm, k_norm = RMSNorm((4, 8)), RMSNorm((2, 8))
    with torch.no_grad():
        q_norm.weight.uniform_(0.5, 1.5)
        k_norm.weight.uniform_(0.5, 1.5)
    cos_sin = build_rotary(8, 10000.0)(torch.arange(5)[None].expand(2, 5))
    expected_qk = qk_norm_rotary(q, k, q_norm, k_norm, cos_sin, backend="reference")
    expected_sum = sum_branch_norms(q, q_norm, q * 2, q_norm, backend="reference")

    stored = {id(norm): norm.weight.detach().clone() for norm in (q_norm, k_norm)}
    calls = []

    def load_weight(module, args):  # what accelerate's AlignDevicesHook does for an offloaded module
        calls.append(module)
        module.weight = torch.nn.Parameter(stored[id(module)])

    for norm in (q_norm, k_norm):
        norm.weight = torch.nn.Parameter(norm.weight.to("meta"))
        norm.register_forward_pre_hook(load_weight)
    got_qk = qk_norm_rotary(q, k, q_norm, k_norm, cos_sin, backend="reference")
    assert len(calls) == 2
    for norm in (q_norm, k_norm):
        norm.weight = torch.nn.Parameter(norm.weight.to("meta"))
    got_sum = sum_branch_norms(q, q_norm, q * 2, q_norm, backend="reference")
    assert len(calls) == 4
    for got, expected in zip(got_qk, expected_qk):
        assert torch.equal(got, expected)
    assert torch.equal(got_sum, expected_sum)


def test_sequence_context_follows_a_layer_to_another_device():
    """Layers over several GPUs: accelerate's hook sends a layer's arguments to its device through
    their ``.to``; the per-forward context must follow (its positions and padding mask feed RoPE
    and the masks there), once per device, with recorded attention weights reaching the model."""
    from accelerate.utils import send_to_device

    from hf_hybrid.layers.context import SequenceContext

    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    context = SequenceContext.build(2, 5, 0, mask, None, torch.device("cpu"), output_attentions=True)
    assert send_to_device(context, "cpu") is context
    moved = send_to_device(context, "meta")  # a device other than the one the context was built on
    assert moved is not context and moved.positions.device.type == "meta" and moved.key_valid.device.type == "meta"
    assert moved.positions.shape == context.positions.shape and moved.past_length == context.past_length
    assert send_to_device(context, "meta") is moved and moved.to("meta") is moved  # one copy per device
    assert moved.to("cpu") is context
    weights = torch.rand(2, 4, 5, 5)
    moved.record_attention_weights(weights)
    assert context.take_attention_weights() is weights


@pytest.mark.parametrize("name, overrides", [
    ("rat", {}), ("rat_plus_sparse", {}), ("fox_llama", {"use_rope": True}), ("rattention", {}), ("se_hybrid", {}),
])
def test_rope_tables_are_built_once_per_forward(name, overrides, monkeypatch):
    """Every layer of a stack rotates by the same positions: the first one builds the cos/sin
    tables and the others reuse them from the forward's context (SequenceContext.shared_table),
    in a prefill and in a decode step, with the same logits as tables built per layer."""
    from hf_hybrid.layers import context as context_module
    from hf_hybrid.layers.rotary import RotaryEmbedding

    model = tiny_model(name, num_hidden_layers=4, **overrides)
    ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    builds = []
    build = RotaryEmbedding.forward
    monkeypatch.setattr(RotaryEmbedding, "forward", lambda self, positions: builds.append(1) or build(self, positions))
    with torch.no_grad():
        shared = model(ids, use_cache=True)
        prefill_builds = len(builds)
        step = model(ids[:, :1], past_key_values=shared.past_key_values, use_cache=True).logits
        monkeypatch.setattr(context_module.SequenceContext, "shared_table", lambda self, key, make: make())
        per_layer = model(ids, use_cache=True)
        per_layer_step = model(ids[:, :1], past_key_values=per_layer.past_key_values, use_cache=True).logits
    rotating = sum(isinstance(m, RotaryEmbedding) for m in model.modules())
    assert rotating >= 2 and prefill_builds < rotating, (prefill_builds, rotating)
    assert torch.equal(shared.logits, per_layer.logits) and torch.equal(step, per_layer_step)


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_training_forward_builds_a_cache_only_when_asked(name):
    """A training step (Trainer's call: training mode, gradients on, no use_cache) builds no cache;
    use_cache=True still returns one, and an eval forward keeps the config's default."""
    model = tiny_model(name).train()
    ids = random_ids(1, 9)
    assert model(ids).past_key_values is None
    assert model(ids, use_cache=True).past_key_values is not None
    with torch.no_grad():
        assert model(ids).past_key_values is not None  # no gradients: may continue (config.use_cache)
    assert model.eval()(ids).past_key_values is not None
