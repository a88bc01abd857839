"""Packed (padding-free) rows compute each document as if it were alone, for every model type.

The collators that pack (transformers' DataCollatorWithFlattening, TRL's padding-free packing)
concatenate documents in one row and mark them by position_ids that restart, plus cu_seq_lens_q/k
or seq_idx when asked. Checked: logits and every parameter gradient of the packed row against the
documents run alone (float32, 1e-5), documents shorter and longer than RAT's chunk, the windows and
SE's blocks, a one-token document, several packed rows, padding between packed rows, and the
boundaries given by each of the three markings.
"""
from __future__ import annotations

import pytest
import torch
from transformers import DataCollatorWithFlattening

from hf_hybrid.models.packed_sequences import MAX_PADDING_RATIO, _group_by_length, find_packed_documents

from tiny_models import MODEL_TYPES, VOCAB, tiny_model

LENGTHS = (13, 21, 1, 17)  # around RAT's chunk (4), the windows (3, 6) and SE's blocks; one single token


def _documents(lengths=LENGTHS, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=generator) for n in lengths]


def _packed(documents):
    input_ids = torch.cat(documents)[None]
    position_ids = torch.cat([torch.arange(len(d)) for d in documents])[None]
    return input_ids, position_ids


def _alone_logits(model, documents):
    return [model(d[None]).logits[0] for d in documents]


@pytest.mark.parametrize("name", MODEL_TYPES)
def test_packed_row_equals_documents_alone(name):
    model = tiny_model(name)
    documents = _documents()
    input_ids, position_ids = _packed(documents)
    with torch.no_grad():
        packed = model(input_ids, position_ids=position_ids).logits[0]
        alone = _alone_logits(model, documents)
    torch.testing.assert_close(packed, torch.cat(alone), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", MODEL_TYPES)
def test_packed_gradients_equal_documents_alone(name):
    """The packed loss (collator labels: -100 at each document's first token) and every parameter's
    gradient equal those of the documents' summed per-token losses run alone."""
    model = tiny_model(name).train()
    documents = _documents((9, 14, 6))
    batch = DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": d.tolist()} for d in documents])
    out = model(**batch, skip_logits=False)
    count = sum(len(d) - 1 for d in documents)
    (out.loss * count).backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    total = 0.0
    for d in documents:
        loss = model(d[None], labels=d[None], skip_logits=False).loss * (len(d) - 1)
        loss.backward()
        total = total + loss.detach()
    torch.testing.assert_close(out.loss * count, total, atol=1e-5, rtol=1e-5)
    alone_grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert packed_grads.keys() == alone_grads.keys()
    for n in packed_grads:
        torch.testing.assert_close(packed_grads[n], alone_grads[n], atol=1e-5, rtol=1e-4, msg=n)


@pytest.mark.parametrize("marking", ["position_ids", "cu_seq_lens", "seq_idx"])
def test_each_boundary_marking(marking):
    model = tiny_model("rat")
    documents = _documents((7, 10, 5))
    input_ids, position_ids = _packed(documents)
    lengths = torch.tensor([len(d) for d in documents])
    if marking == "position_ids":
        kwargs = {"position_ids": position_ids}
    elif marking == "cu_seq_lens":
        cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
        kwargs = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": 10, "max_length_k": 10}
    else:
        kwargs = {"seq_idx": torch.repeat_interleave(torch.arange(3), lengths)[None].to(torch.int32)}
    with torch.no_grad():
        packed = model(input_ids, **kwargs).logits[0]
        alone = _alone_logits(model, documents)
    torch.testing.assert_close(packed, torch.cat(alone), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["rat_swa", "fox_pro", "se_hybrid"])
def test_several_packed_rows_with_padding(name):
    """Two packed rows of different lengths, the shorter right-padded (attention_mask 0)."""
    model = tiny_model(name)
    first, second = _documents((8, 11)), _documents((5, 3, 9), seed=1)
    row_a, pos_a = _packed(first)
    row_b, pos_b = _packed(second)
    pad = row_a.shape[1] - row_b.shape[1]
    input_ids = torch.cat([row_a, torch.nn.functional.pad(row_b, (0, pad))])
    position_ids = torch.cat([pos_a, torch.nn.functional.pad(pos_b, (0, pad))])
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, row_b.shape[1]:] = 0
    with torch.no_grad():
        logits = model(input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
        torch.testing.assert_close(logits[0], torch.cat(_alone_logits(model, first)), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(logits[1, : row_b.shape[1]], torch.cat(_alone_logits(model, second)), atol=1e-5, rtol=1e-5)


def test_left_padded_batch_is_not_packed():
    """generate()'s left padding with its position_ids is an ordinary batch (one document a row)."""
    attention_mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    position_ids = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
    assert find_packed_documents(2, 5, position_ids, attention_mask) is None
    assert find_packed_documents(2, 5, None, None) is None


def test_packed_rows_refuse_a_cache():
    model = tiny_model("rat")
    input_ids, position_ids = _packed(_documents((4, 5)))
    with pytest.raises(ValueError, match="use_cache"):
        model(input_ids, position_ids=position_ids, use_cache=True)
    # The config's default use_cache builds no cache for packed rows (as in training).
    assert model(input_ids, position_ids=position_ids).past_key_values is None


def test_bad_cu_seq_lens_named():
    model = tiny_model("fox_llama")
    input_ids, _ = _packed(_documents((4, 5)))
    with pytest.raises(ValueError, match="cu_seq_lens_q"):
        model(input_ids, cu_seq_lens_q=torch.tensor([0, 4, 7], dtype=torch.int32))


def test_groups_bound_padding():
    lengths = [3000, 40, 35, 30, 2900, 1, 800, 700]
    groups = _group_by_length(lengths)
    assert sorted(d for g in groups for d in g) == list(range(len(lengths)))
    for group in groups:
        longest = max(lengths[d] for d in group)
        assert len(group) * longest <= MAX_PADDING_RATIO * sum(lengths[d] for d in group) or len(group) == 1
    assert len(groups) <= 4


def test_hidden_states_repacked():
    model = tiny_model("rattention")
    documents = _documents((6, 9))
    input_ids, position_ids = _packed(documents)
    with torch.no_grad():
        packed = model(input_ids, position_ids=position_ids, output_hidden_states=True).hidden_states
        alone = [model(d[None], output_hidden_states=True).hidden_states for d in documents]
    assert len(packed) == len(alone[0])
    for layer, states in enumerate(packed):
        torch.testing.assert_close(states[0], torch.cat([a[layer][0] for a in alone]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["rat", "rat_plus", "fox_llama", "rattention", "se_hybrid"])
def test_sft_trainer_packing(name, tmp_path):
    """TRL's SFTTrainer with packing=True (best-fit packing, padding-free batches): the packed batch's
    loss equals the documents' per-token losses run alone, and training steps run."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset
    from tiny_models import word_tokenizer

    model = tiny_model(name).train()
    generator = torch.Generator().manual_seed(3)
    documents = [torch.randint(4, VOCAB, (int(n),), generator=generator).tolist() for n in torch.randint(3, 19, (10,), generator=generator)]
    args = trl.SFTConfig(
        output_dir=str(tmp_path), packing=True, max_length=48, per_device_train_batch_size=2, max_steps=2,
        learning_rate=1e-3, report_to=[], save_strategy="no", use_cpu=True, logging_steps=1, dataloader_num_workers=0,
    )
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"input_ids": documents}),
                             processing_class=word_tokenizer())
    batch = next(iter(trainer.get_train_dataloader()))
    assert batch["input_ids"].shape[0] == 1 and "attention_mask" not in batch  # padding-free
    starts = (batch["position_ids"][0] == 0).nonzero().flatten().tolist() + [batch["input_ids"].shape[1]]
    assert len(starts) > 2  # several documents in the row
    with torch.no_grad():
        packed_loss = model(**batch, skip_logits=False).loss
        total, count = 0.0, 0
        for begin, end in zip(starts[:-1], starts[1:]):
            ids, labels = batch["input_ids"][:, begin:end], batch["labels"][:, begin:end]
            n = int((labels[:, 1:] != -100).sum())
            if n:
                total += float(model(ids, labels=labels, skip_logits=False).loss) * n
                count += n
    assert abs(float(packed_loss) - total / count) < 1e-5
    result = trainer.train()
    assert torch.isfinite(torch.tensor(result.training_loss))


@pytest.mark.parametrize("name", MODEL_TYPES)
def test_shift_labels_honoured(name):
    """shift_labels (pre-shifted targets, as context-parallel trainers pass them) are the targets:
    the same loss as labels when they are labels shifted, a different one when they differ, and a
    loss with labels=None."""
    from hf_hybrid.layers.loss import shifted_labels

    model = tiny_model(name).train()
    ids = _documents((15,))[0][None]
    with torch.no_grad():
        reference = model(ids, labels=ids, skip_logits=False).loss
        same = model(ids, shift_labels=shifted_labels(ids), skip_logits=False).loss
        other_targets = torch.roll(shifted_labels(ids), 1, dims=1)
        other = model(ids, labels=ids, shift_labels=other_targets, skip_logits=False).loss
    torch.testing.assert_close(same, reference)
    assert not torch.allclose(other, reference)


def test_shift_labels_in_the_loss_from_hidden_states():
    """The fused-loss entry point (kernels/linear_cross_entropy on CUDA; float32 logits elsewhere) takes shift_labels too."""
    from hf_hybrid.layers.loss import causal_lm_loss_from_hidden, shifted_labels

    generator = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(2, 9, 8, generator=generator), torch.randn(VOCAB, 8, generator=generator)
    labels = torch.randint(0, VOCAB, (2, 9), generator=generator)
    targets = torch.randint(0, VOCAB, (2, 9), generator=generator)
    torch.testing.assert_close(
        causal_lm_loss_from_hidden(hidden, weight, None, shift_labels=shifted_labels(labels)),
        causal_lm_loss_from_hidden(hidden, weight, labels),
    )
    expected = torch.nn.functional.cross_entropy((hidden @ weight.T).reshape(-1, VOCAB), targets.reshape(-1))
    torch.testing.assert_close(causal_lm_loss_from_hidden(hidden, weight, labels, shift_labels=targets), expected)
