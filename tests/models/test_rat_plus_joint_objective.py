"""RAT+'s joint objective run one pattern's graph at a time (hf_hybrid/models/rat_plus/joint_objective.py)
equals the plain sum of every pattern's loss backpropagated together: loss, pattern_losses, logits
and every gradient, under loss scaling, gradient accumulation, PEFT LoRA, frozen parameters,
inputs_embeds that require grad, gradient checkpointing, shift_labels, packed rows and DDP; and the
graph it leaves for the caller's backward is one pass's."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_hybrid  # noqa: F401
from hf_hybrid.models.rat_plus import RatPlusConfig
from hf_hybrid.models.rat_plus import joint_objective

VOCAB = 61
EXACT = dict(atol=1e-6, rtol=1e-5)


def tiny_model(**overrides):
    settings = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, training_dilations=[1, 8],
        training_loss_weights=[1.0, 0.5],
    )
    settings.update(overrides)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(RatPlusConfig(**settings)).train()


def batch(seed=2, rows=2, seq=33):
    return torch.randint(1, VOCAB, (rows, seq), generator=torch.Generator().manual_seed(seed))


def summed_reference(model, **inputs):
    """The plain sum w_i L_i of each pattern's loss, every graph kept, as one loss tensor."""
    patterns, weights = model.config.training_patterns(inputs.pop("training_dilations", None))
    outputs = [model(sparse_config=p, **inputs) for p in patterns]
    return outputs, sum(w * out.loss for w, out in zip(weights, outputs))


def grads(model):
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def assert_same_grads(got, expected, tolerance=EXACT):
    assert got.keys() == expected.keys()
    for name, g in expected.items():
        if g is None:
            assert got[name] is None, f"{name}: a gradient where the reference has none"
        else:
            assert got[name] is not None, f"{name}: no gradient"
            torch.testing.assert_close(got[name], g, **tolerance, msg=lambda m: f"{name}: {m}")


def count_graph_calls(monkeypatch):
    calls = []
    grad = torch.autograd.grad
    monkeypatch.setattr(torch.autograd, "grad", lambda *a, **k: calls.append(1) or grad(*a, **k))
    return calls


@pytest.mark.parametrize("dilations", [None, [1, 4, {"dilation": 8, "local_window": 2}]])
def test_joint_step_equals_the_summed_graphs(dilations, monkeypatch):
    ids = batch()
    model = tiny_model()
    ref_outputs, ref_loss = summed_reference(model, input_ids=ids, labels=ids, training_dilations=dilations)
    model.zero_grad()
    (ref_loss * 0.37).backward()  # an outer scale (GradScaler, 1/N) reaches every pattern
    expected = grads(model)

    model.zero_grad(set_to_none=True)
    calls = count_graph_calls(monkeypatch)
    out = model(input_ids=ids, labels=ids, training_dilations=dilations)
    assert len(calls) == len(ref_outputs) - 1, "each pattern but the returned one runs its backward in the forward"
    torch.testing.assert_close(out.loss, ref_loss, **EXACT)
    torch.testing.assert_close(out.pattern_losses, torch.stack([o.loss.detach() for o in ref_outputs]), **EXACT)
    torch.testing.assert_close(out.logits, ref_outputs[0].logits, **EXACT)  # the first pattern's
    (out.loss * 0.37).backward(retain_graph=True)
    assert_same_grads(grads(model), expected)
    with pytest.raises(RuntimeError, match="backpropagated twice"):  # the kept gradients were handed over
        out.loss.backward()


def _graph_nodes(tensor) -> int:
    seen, stack = set(), [tensor.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return len(seen)


def test_the_callers_graph_is_one_pass():
    """What stays for the caller's backward is the returned pattern's graph (plus the node that
    hands over the other patterns' gradients), not one graph per pattern."""
    ids = batch()
    model = tiny_model()
    one = _graph_nodes(model(input_ids=ids, labels=ids, training_dilations=[1]).loss)
    joint = _graph_nodes(model(input_ids=ids, labels=ids, training_dilations=[1, 8]).loss)
    assert joint <= one + 3 < 2 * one


def test_gradient_accumulation_over_two_micro_batches():
    micro = [batch(seed=s) for s in (3, 4)]
    model = tiny_model()
    for ids in micro:
        (summed_reference(model, input_ids=ids, labels=ids)[1] / 2).backward()
    expected = grads(model)
    model.zero_grad(set_to_none=True)
    for ids in micro:
        (model(input_ids=ids, labels=ids).loss / 2).backward()
    assert_same_grads(grads(model), expected)


def test_trainer_step_equals_the_summed_graphs(tmp_path):
    """transformers.Trainer with gradient accumulation over 2 micro-batches: the gradients of its
    first optimizer step equal the summed graphs' (captured before the optimizer runs)."""
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    rows = [batch(seed=s, rows=1)[0].tolist() for s in (5, 6)]
    data = Dataset.from_dict({"input_ids": rows, "labels": rows})
    model = tiny_model()
    for row in rows:
        ids = torch.tensor([row])
        (summed_reference(model, input_ids=ids, labels=ids)[1] / 2).backward()
    expected = grads(model)
    model.zero_grad(set_to_none=True)

    captured = {}

    class Capture(torch.optim.SGD):
        def step(self, closure=None):
            captured.update(grads(model))
            return super().step(closure)

    args = TrainingArguments(str(tmp_path), per_device_train_batch_size=1, gradient_accumulation_steps=2, max_steps=1,
                             max_grad_norm=0.0, report_to=[], save_strategy="no", use_cpu=True, logging_strategy="no")
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      optimizers=(Capture(model.parameters(), lr=0.0), None))
    trainer.train()
    assert captured, "the optimizer never stepped"
    assert_same_grads(captured, expected)


@pytest.mark.parametrize("kind", ["lora", "hylora"])
def test_peft_trains_only_what_it_marks_trainable(kind):
    """PEFT LoRA (adapters only) and HyLoRA (adapters plus trainable copies of the embeddings and norms)."""
    from peft import LoraConfig, get_peft_model

    from hf_hybrid.peft import HyLoraConfig

    ids = batch()

    def peft_model():
        config = (LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"], init_lora_weights=False)
                  if kind == "lora" else HyLoraConfig(r=4, lora_alpha=8, init_lora_weights=False))
        return get_peft_model(tiny_model(), config)

    reference = peft_model()
    summed_reference(reference, input_ids=ids, labels=ids)[1].backward()
    model = peft_model()
    model(input_ids=ids, labels=ids).loss.backward()
    got, expected = grads(model), grads(reference)
    trained = {n for n, g in got.items() if g is not None}
    assert trained == {n for n, p in model.named_parameters() if p.requires_grad}
    assert any("lora_" in n for n in trained)
    if kind == "lora":
        assert all("lora_" in n for n in trained), "a frozen base weight got a gradient"
    else:
        assert any("modules_to_save" in n and "embed_tokens" in n for n in trained)
    assert_same_grads(got, expected)


def test_frozen_parameters_get_no_gradient():
    ids = batch()

    def partly_frozen():
        model = tiny_model()
        model.model.embed_tokens.weight.requires_grad_(False)
        for p in model.model.layers[0].parameters():
            p.requires_grad_(False)
        return model

    reference = partly_frozen()
    summed_reference(reference, input_ids=ids, labels=ids)[1].backward()
    model = partly_frozen()
    model(input_ids=ids, labels=ids).loss.backward()
    assert model.model.layers[0].self_attn.q_proj.weight.grad is None
    assert_same_grads(grads(model), grads(reference))


def check_inputs_embeds_that_require_grad(prepare_joint=lambda model: model, tolerance=EXACT):
    """inputs_embeds computed by a trainable module outside the model: its gradient (and through it
    the module's) equals the summed graphs', counted once. ``prepare_joint`` picks the joint path."""
    ids = batch()
    results = []
    for joint in (False, True):
        model = prepare_joint(tiny_model()) if joint else tiny_model()
        torch.manual_seed(1)
        upstream = torch.nn.Linear(32, 32)
        embeds = upstream(model.model.embed_tokens(ids))  # also through the model's own trainable embedding
        embeds.retain_grad()
        if joint:
            loss = model(inputs_embeds=embeds, labels=ids).loss
        else:
            loss = summed_reference(model, inputs_embeds=embeds, labels=ids)[1]
        loss.backward()
        results.append((loss.detach(), embeds.grad, upstream.weight.grad, grads(model)))
    (ref_loss, ref_embeds, ref_upstream, ref_grads), (loss, embeds_grad, upstream_grad, got) = results
    torch.testing.assert_close(loss, ref_loss, **tolerance)
    torch.testing.assert_close(embeds_grad, ref_embeds, **tolerance)
    torch.testing.assert_close(upstream_grad, ref_upstream, **tolerance)
    assert_same_grads(got, ref_grads, tolerance)


def test_inputs_embeds_that_require_grad_get_theirs_and_pass_it_on():
    check_inputs_embeds_that_require_grad()


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing(reentrant, monkeypatch):
    """Non-reentrant checkpointing runs one graph at a time; reentrant checkpointing (no
    torch.autograd.grad) keeps every graph. Both give the summed graphs' gradients."""
    ids = batch()
    reference = tiny_model()
    summed_reference(reference, input_ids=ids, labels=ids)[1].backward()
    model = tiny_model()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    calls = count_graph_calls(monkeypatch)
    model(input_ids=ids, labels=ids).loss.backward()
    assert len(calls) == (0 if reentrant else 1)
    assert (model._keeps_every_pattern_graph() is not None) == reentrant
    assert_same_grads(grads(model), grads(reference))


def test_shift_labels_and_packed_rows():
    """Two documents packed in each row (position_ids restart), targets given as shift_labels."""
    ids = batch(seq=30)
    position_ids = torch.cat([torch.arange(12), torch.arange(18)]).expand(2, -1)
    shift = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
    shift[:, 11] = -100  # the first document's last token has no target in the row's next document
    inputs = dict(input_ids=ids, position_ids=position_ids, shift_labels=shift)
    reference = tiny_model()
    ref_outputs, ref_loss = summed_reference(reference, **inputs)
    ref_loss.backward()
    model = tiny_model()
    out = model(**inputs)
    out.loss.backward()
    torch.testing.assert_close(out.loss, ref_loss, **EXACT)
    torch.testing.assert_close(out.pattern_losses, torch.stack([o.loss.detach() for o in ref_outputs]), **EXACT)
    assert_same_grads(grads(model), grads(reference))


# Run in a process of its own, which ends with os._exit: torch's gloo process group joins its worker
# threads in its destructor while the caller holds the GIL, and a worker destroying a collective
# launched in a backward (whose thread-local state holds Python objects) waits for that GIL, so
# tearing gloo down in a test process can deadlock it.
_DDP_STEP = """
import os, sys, traceback
sys.path.insert(0, sys.argv[1])
try:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    import test_rat_plus_joint_objective as t

    ids = t.batch()
    reference = t.tiny_model()
    t.summed_reference(reference, input_ids=ids, labels=ids)[1].backward()
    dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
    model = DistributedDataParallel(t.tiny_model())
    for _ in range(2):  # a second step: the reducer must have finished the first
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
    t.assert_same_grads(t.grads(model.module), t.grads(reference))
    print("SAME GRADIENTS", flush=True)
except BaseException:
    traceback.print_exc()
    sys.stderr.flush()
    os._exit(1)
os._exit(0)
"""


def test_ddp_hooks_see_every_gradient(tmp_path):
    """Under DistributedDataParallel (one gloo process) the reducer's hooks fire once per parameter
    on the caller's backward and the averaged gradients equal the summed graphs'."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", _DDP_STEP, os.path.dirname(__file__), str(tmp_path / "store")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "SAME GRADIENTS" in done.stdout, done.stderr[-6000:]


def test_other_paths_keep_every_graph_and_say_why(monkeypatch):
    model = tiny_model()
    assert model._keeps_every_pattern_graph() is None
    monkeypatch.setattr(model, "context_parallel_group", object(), raising=False)
    assert "context-parallel" in model._keeps_every_pattern_graph()
    monkeypatch.delattr(model, "context_parallel_group")
    model.model.layers[0].mlp.up_proj.weight.ds_id = 7  # what DeepSpeed ZeRO-3 marks its parameters with
    assert "sharded" in model._keeps_every_pattern_graph()
    del model.model.layers[0].mlp.up_proj.weight.ds_id
    with torch.autocast("cpu", dtype=torch.float16):
        assert "float16" in model._keeps_every_pattern_graph()
    assert "float16" in model.half()._keeps_every_pattern_graph()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert "torch.compile" in model._keeps_every_pattern_graph()


def test_bf16_autocast_step_matches_the_summed_graphs():
    """Under bf16 autocast the other patterns' backward runs outside autocast, as the caller's does."""
    ids = batch()
    reference = tiny_model()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = summed_reference(reference, input_ids=ids, labels=ids)[1]
    loss.backward()
    model = tiny_model()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    torch.testing.assert_close(out.loss, loss, atol=0, rtol=0)
    for name, p in model.named_parameters():
        ref = dict(reference.named_parameters())[name].grad
        torch.testing.assert_close(p.grad, ref, atol=2e-3, rtol=2e-2, msg=lambda m: f"{name}: {m}")


def test_the_kept_gradients_scale_in_place_once():
    """The handing-over node scales its buffers by the incoming gradient and gives them away."""
    w = torch.ones(3, requires_grad=True)
    kept = [torch.full((3,), 2.0)]
    total = joint_objective._AddKeptGradients.apply((w * 1.5).sum(), torch.tensor(4.0), kept, w)
    assert total.item() == pytest.approx(8.5)
    (total * 3).backward()
    torch.testing.assert_close(w.grad, torch.full((3,), 1.5 * 3 + 2.0 * 3))


@pytest.mark.parametrize("patterns", [[1.0, 2.0], [1.0, 2.0, 5.0]])
def test_kept_gradients_that_autograd_shares_or_expands_are_owned(patterns):
    """The gradient of a + b is one tensor for both inputs, the gradient of a sum an expanded view:
    each kept gradient is scaled (and added to) in place, so each must be a buffer of its own."""
    from types import SimpleNamespace

    def make():
        p1, p2, p3 = (torch.ones(4, requires_grad=True) for _ in range(3))

        def pattern_forward(pattern, inputs):
            return SimpleNamespace(loss=((p1 + p2) * pattern).sum() + p3.sum() * pattern)

        return (p1, p2, p3), pattern_forward

    params, forward = make()
    _, total, _ = joint_objective.joint_loss(forward, patterns, [1.0] * len(patterns), {}, list(params))
    (total * 3).backward()
    ref_params, ref_forward = make()
    (sum(ref_forward(p, {}).loss for p in patterns) * 3).backward()
    for got, expected in zip(params, ref_params):
        torch.testing.assert_close(got.grad, expected.grad)
