"""RAT+'s joint objective as one forward over the patterns' rows stacked along the batch
(hf_hybrid/models/rat_plus/stacked_patterns.py, RowPatterns in the layer) equals the plain sum of
one forward per pattern: loss, pattern_losses, logits and every gradient (float32, CPU), with
left-padded rows, packed rows (position_ids restarting, cu_seq_lens_q), labels with -100,
shift_labels, num_items_in_batch, inputs_embeds that require grad, head-hybrid and top-k patterns,
PEFT LoRA; and every module runs once per step."""
from __future__ import annotations

import pytest
import torch

import hf_hybrid  # noqa: F401
from hf_hybrid.models.rat_plus.stacked_patterns import stack_rows
from hf_hybrid.sparse import RowPatterns, SparseInferenceConfig

from test_rat_plus_joint_objective import (
    VOCAB, assert_same_grads, batch, check_inputs_embeds_that_require_grad, grads, summed_reference, tiny_model,
)

EXACT = dict(atol=1e-6, rtol=1e-6)


def stacked(model, monkeypatch):
    """``model`` taking the stacked path, as it does with sharded parameters (FSDP2, ZeRO-3)."""
    monkeypatch.setattr(model, "_keeps_every_pattern_graph", lambda: "the test asks for the stacked forward")
    return model


def assert_close_grads(got, expected):
    assert_same_grads(got, expected, EXACT)


def check_against_summed_forwards(monkeypatch, make_model=tiny_model, scale=1.0, **inputs):
    reference = make_model()
    ref_outputs, ref_loss = summed_reference(reference, **dict(inputs))
    (ref_loss * scale).backward()
    model = stacked(make_model(), monkeypatch)
    out = model(**inputs)
    (out.loss * scale).backward()
    torch.testing.assert_close(out.loss, ref_loss, **EXACT)
    torch.testing.assert_close(out.pattern_losses, torch.stack([o.loss.detach() for o in ref_outputs]), **EXACT)
    if ref_outputs[0].logits is not None:
        torch.testing.assert_close(out.logits, ref_outputs[0].logits, **EXACT)  # the first pattern's rows
    assert_close_grads(grads(model), grads(reference))
    return out


MIXED = [1, {"dilation": 4, "local_window": 2, "num_sink_tokens": 1}, {"dilation": 8, "head_overrides": {1: "dense"}}]


@pytest.mark.parametrize("dilations", [None, MIXED, [{"top_k": 2, "block_size": 8, "num_sink_tokens": 1}, 1]])
def test_equals_the_summed_forwards(dilations, monkeypatch):
    ids = batch()
    out = check_against_summed_forwards(monkeypatch, scale=0.37, input_ids=ids, labels=ids, training_dilations=dilations)
    assert out.logits.shape == (2, ids.shape[1], VOCAB)


def test_every_module_runs_once(monkeypatch):
    """One forward: each layer, the final norm and the LM head run once, over every pattern's rows."""
    ids = batch()
    model = stacked(tiny_model(), monkeypatch)
    seen = []
    modules = [*model.model.layers, model.model.norm, model.lm_head]
    for module in modules:
        module.register_forward_hook(lambda m, args, out: seen.append((m, out.shape[0])))
    model(input_ids=ids, labels=ids, training_dilations=[1, 4, 8])
    assert [m for m, _ in seen] == modules
    assert all(rows == 3 * ids.shape[0] for _, rows in seen)


def test_left_padded_rows_and_ignored_labels(monkeypatch):
    ids = batch(rows=3)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    mask[2, :11] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, 7:12] = -100
    check_against_summed_forwards(monkeypatch, input_ids=ids.masked_fill(mask == 0, 0), attention_mask=mask, labels=labels)


def test_packed_rows_with_shift_labels(monkeypatch):
    """Two documents packed in each row (position_ids restart), the documents of different lengths
    per row so that the document batches mix rows of every pattern."""
    ids = batch(seq=30)
    position_ids = torch.stack([torch.cat([torch.arange(12), torch.arange(18)]), torch.cat([torch.arange(7), torch.arange(23)])])
    shift = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
    shift[0, 11] = shift[1, 6] = -100  # a document's last token has no target in the next document
    check_against_summed_forwards(monkeypatch, input_ids=ids, position_ids=position_ids, shift_labels=shift,
                                  training_dilations=MIXED)


def test_packed_rows_by_cu_seq_lens_and_num_items(monkeypatch):
    ids = batch(seq=20)
    cu = torch.tensor([0, 9, 20, 26, 40], dtype=torch.int32)  # over the flattened [2, 20] batch
    labels = ids.clone()
    labels[:, :2] = -100
    check_against_summed_forwards(monkeypatch, input_ids=ids, labels=labels, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                                  max_length_q=14, max_length_k=14, num_items_in_batch=torch.tensor(31))


def test_inputs_embeds_that_require_grad(monkeypatch):
    check_inputs_embeds_that_require_grad(lambda model: stacked(model, monkeypatch), EXACT)


def test_peft_lora(monkeypatch):
    from peft import LoraConfig, get_peft_model

    def lora_model():
        config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "lm_head"], init_lora_weights=False)
        return get_peft_model(tiny_model(), config)

    ids = batch()
    reference = lora_model()
    summed_reference(reference, input_ids=ids, labels=ids)[1].backward()
    model = lora_model()
    stacked(model.base_model.model, monkeypatch)
    model(input_ids=ids, labels=ids).loss.backward()
    got = grads(model)
    assert {n for n, g in got.items() if g is not None} == {n for n, p in model.named_parameters() if p.requires_grad}
    assert_close_grads(got, grads(reference))


def test_fused_loss_takes_each_row_groups_loss(monkeypatch):
    """Where the LM head and the loss run fused (kernels/linear_cross_entropy on CUDA; here a
    PyTorch stand-in of the same call), each pattern's loss is fused over its own rows and no
    logits are returned."""
    import torch.nn.functional as F

    from hf_hybrid.layers import loss as loss_module

    def fused_stand_in(hidden, weight, targets, ignore_index, reduction, backend):
        return F.cross_entropy(F.linear(hidden, weight).float(), targets, ignore_index=ignore_index, reduction=reduction)

    monkeypatch.setattr(loss_module, "fused_loss_applies", lambda x: True)
    monkeypatch.setattr(loss_module, "linear_cross_entropy", fused_stand_in)
    ids = batch()
    labels = ids.clone()
    labels[0, :4] = -100
    out = check_against_summed_forwards(monkeypatch, input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(50))
    assert out.logits is None


def test_hidden_states_are_the_first_patterns(monkeypatch):
    ids = batch()
    reference = tiny_model()
    expected = reference(input_ids=ids, labels=ids, sparse_config=reference.config.training_patterns()[0][0],
                         output_hidden_states=True).hidden_states
    got = stacked(tiny_model(), monkeypatch)(input_ids=ids, labels=ids, output_hidden_states=True).hidden_states
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, **EXACT)


def test_sharded_parameters_take_the_stacked_forward(monkeypatch):
    """What DeepSpeed ZeRO-3 marks its parameters with (ds_id) routes the joint objective to one forward."""
    ids = batch()
    model = tiny_model()
    model.model.layers[0].mlp.up_proj.weight.ds_id = 7
    calls = []
    model.model.layers[1].register_forward_hook(lambda *args: calls.append(1))
    model(input_ids=ids, labels=ids).loss.backward()
    assert len(calls) == 1


# ------------------------------------------------------------------------------ RowPatterns


def test_row_patterns_in_any_row_order():
    """Rows in any order (what packed rows give the layer): each row computes what it computes
    under its own pattern alone."""
    ids = batch(rows=4)
    model = tiny_model().eval()
    sparse = SparseInferenceConfig(dilation=4, local_window=1, num_sink_tokens=1)
    rows = RowPatterns([SparseInferenceConfig(dilation=1, num_sink_tokens=0), sparse], [1, 0, 1, 0])
    with torch.no_grad():
        got = model(input_ids=ids, sparse_config=rows, use_cache=False).logits
        dense = model(input_ids=ids, use_cache=False).logits
        dilated = model(input_ids=ids, sparse_config=sparse, use_cache=False).logits
    for row, expected in enumerate([dilated, dense, dilated, dense]):
        torch.testing.assert_close(got[row], expected[row], **EXACT)


def test_row_patterns_select_rows_and_groups():
    rows = RowPatterns.stacked([{"dilation": 1}, {"dilation": 4}], 2)
    assert rows.row_pattern == (0, 0, 1, 1)
    assert [r for _, r in rows.row_groups()] == [(0, 1), (2, 3)]
    picked = rows.select_rows([3, 0, 2])
    assert picked.row_pattern == (1, 0, 1)
    assert [(p.dilation, r) for p, r in picked.row_groups()] == [(1, (1,)), (4, (0, 2))]
    with pytest.raises(ValueError, match="row_pattern"):
        RowPatterns([{"dilation": 1}], [0, 1])


def test_row_patterns_are_refused_with_a_cache_or_the_wrong_batch():
    ids = batch()
    model = tiny_model().eval()
    with pytest.raises(ValueError, match="use_cache=False"):
        model(input_ids=ids, sparse_config=RowPatterns.stacked([{"dilation": 1}], 2), use_cache=True)
    with pytest.raises(ValueError, match="3 rows but the batch has 2"):
        model(input_ids=ids, sparse_config=RowPatterns.stacked([{"dilation": 1}], 3), use_cache=False)


def test_stack_rows_continues_cumulative_lengths():
    ids = torch.zeros(2, 5, dtype=torch.long)
    out = stack_rows(dict(input_ids=ids, position_ids=torch.arange(5)[None], cu_seq_lens_q=torch.tensor([0, 3, 10])), 3, 2)
    assert out["input_ids"].shape == (6, 5)
    assert out["position_ids"].shape == (1, 5)  # one row shared by every row
    assert out["cu_seq_lens_q"].tolist() == [0, 3, 10, 13, 20, 23, 30]
