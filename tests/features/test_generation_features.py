"""generate() as a transformers user reaches for it, on every model type (tiny CPU models):
pipeline("text-generation") from a saved folder, streamers, seeded sampling, beam search with
several returned sequences, left-padded batches, and use_cache=False, each compared with the
model's own cached greedy / step-by-step result."""
from __future__ import annotations

import threading

import pytest
import torch
from transformers import TextIteratorStreamer, TextStreamer, pipeline
from transformers.generation.streamers import BaseStreamer

from tiny_models import MODEL_TYPES, PAD, left_pad, random_ids, three_prompts, tiny_model, word_tokenizer, words

pytestmark = pytest.mark.filterwarnings("ignore:.*falling back.*")

NEW_TOKENS = 6


def greedy(model, ids, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=PAD, **kwargs
        )


# ------------------------------------------------------------------------------------ pipeline


@pytest.mark.parametrize("name", MODEL_TYPES)
def test_text_generation_pipeline_from_saved_folder_equals_generate(name, tmp_path):
    model, tokenizer = tiny_model(name), word_tokenizer()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    # Model and tokenizer from the folder; on the CPU like the model it is compared with (a pipeline
    # would otherwise pick a GPU where there is one).
    generator = pipeline("text-generation", model=str(tmp_path), device="cpu")
    assert type(generator.model) is type(model)

    texts = [words(p) for p in three_prompts()]
    settings = dict(max_new_tokens=NEW_TOKENS, do_sample=False)
    for text in texts:
        expected = greedy(model, torch.tensor([tokenizer(text)["input_ids"]]))[0]
        out = generator(text, return_tensors=True, **settings)[0]
        assert out["generated_token_ids"] == expected.tolist()
        (out,) = generator(text, **settings)  # the prompt, then the new tokens decoded on their own
        new_text = tokenizer.decode(expected[len(tokenizer(text)["input_ids"]) :], skip_special_tokens=True)
        assert out["generated_text"] == text + new_text

    # Batched through the pipeline: the tokenizer pads on the left, each row as when run alone.
    batched = generator(texts, batch_size=3, return_tensors=True, **settings)
    width = max(len(tokenizer(text)["input_ids"]) for text in texts)
    for text, (out,) in zip(texts, batched):
        prompt = tokenizer(text)["input_ids"]
        padding = out["generated_token_ids"][: width - len(prompt)]
        assert padding == [PAD] * (width - len(prompt))  # the returned ids keep the left padding
        assert out["generated_token_ids"][width - len(prompt) :] == greedy(model, torch.tensor([prompt]))[0].tolist()


def test_pipeline_hands_a_per_call_sparse_config_to_rat_plus(tmp_path):
    """RAT+ served sparse per call: pipeline keywords reach generate() and the model's forward."""
    from hf_hybrid import SparseInferenceConfig

    model, tokenizer = tiny_model("rat_plus"), word_tokenizer()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    generator = pipeline("text-generation", model=str(tmp_path), device="cpu")
    pattern = SparseInferenceConfig(dilation=4, local_window=1, num_sink_tokens=1)
    prompt = random_ids(1, 17, seed=10)
    sparse, dense = greedy(model, prompt, sparse_config=pattern), greedy(model, prompt)
    assert not torch.equal(sparse, dense), "this prompt must tell the pattern from dense attention"
    (out,) = generator(words(prompt[0]), max_new_tokens=NEW_TOKENS, do_sample=False, return_tensors=True, sparse_config=pattern)
    assert out["generated_token_ids"] == sparse[0].tolist()


# ------------------------------------------------------------------------------------ streamers


class RecordingStreamer(BaseStreamer):
    """Keeps every tensor generate() hands to put(), and whether end() was called."""

    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.clone())

    def end(self):
        self.ended = True


class CapturingTextStreamer(TextStreamer):
    """TextStreamer whose printed text is collected instead of printed."""

    def __init__(self, tokenizer, **kwargs):
        super().__init__(tokenizer, **kwargs)
        self.text = ""

    def on_finalized_text(self, text: str, stream_end: bool = False):
        self.text += text


@pytest.mark.parametrize("name", MODEL_TYPES)
def test_streamers_receive_exactly_the_generated_tokens(name):
    model, tokenizer = tiny_model(name), word_tokenizer()
    ids = torch.tensor([three_prompts()[0]])
    expected = greedy(model, ids)[0]
    new = expected[ids.shape[1] :]

    recorder = RecordingStreamer()
    greedy(model, ids, streamer=recorder)
    assert recorder.ended
    assert torch.equal(recorder.chunks[0].reshape(-1), ids[0])  # the prompt first, then one token per step
    assert [chunk.numel() for chunk in recorder.chunks[1:]] == [1] * len(new)
    assert torch.equal(torch.cat([chunk.reshape(-1) for chunk in recorder.chunks[1:]]), new)

    text_streamer = CapturingTextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    greedy(model, ids, streamer=text_streamer)
    assert text_streamer.text.strip() == tokenizer.decode(new, skip_special_tokens=True)

    iterator = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True, timeout=60)
    worker = threading.Thread(target=greedy, args=(model, ids), kwargs={"streamer": iterator})
    worker.start()
    streamed = "".join(iterator)
    worker.join()
    assert streamed.strip() == tokenizer.decode(new, skip_special_tokens=True)


# ------------------------------------------------------------------------------------ sampling


def sample_step_by_step(model, ids: torch.Tensor, seed: int, eos_token_id: int) -> torch.Tensor:
    """Plain multinomial sampling from the *uncached* full forward's last logits, one token at a
    time, drawing from the global generator as generate() does; finished rows continue with pad."""
    torch.manual_seed(seed)
    unfinished = torch.ones(ids.shape[0], dtype=torch.bool)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = model(ids, attention_mask=torch.ones_like(ids), use_cache=False).logits[:, -1].float()
            token = torch.multinomial(torch.softmax(logits, dim=-1), num_samples=1).squeeze(1)
            token = torch.where(unfinished, token, torch.full_like(token, PAD))
            ids = torch.cat([ids, token[:, None]], dim=1)
            unfinished &= token != eos_token_id
            if not unfinished.any():
                break
    return ids


@pytest.mark.parametrize("name", MODEL_TYPES)
def test_seeded_sampling_uses_the_cache_and_equals_uncached_step_by_step_sampling(name):
    model = tiny_model(name)
    cache_class = type(model).base_model_class.cache_class
    ids = random_ids(2, 11)
    # No top-k / top-p / temperature processing: generate() samples softmax(logits) directly.
    settings = dict(do_sample=True, top_k=0, top_p=1.0, temperature=1.0, max_new_tokens=NEW_TOKENS, pad_token_id=PAD)
    runs = []
    for seed in (0, 0, 1, 2):
        torch.manual_seed(seed)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), return_dict_in_generate=True, **settings)
        assert isinstance(out.past_key_values, cache_class), "generate() did not decode with the model's cache"
        assert out.past_key_values.get_seq_length() == out.sequences.shape[1] - 1
        runs.append(out.sequences)
    assert torch.equal(runs[0], runs[1]), "the same seed must give the same sample"
    assert not (torch.equal(runs[0], runs[2]) and torch.equal(runs[0], runs[3])), "the seed changes nothing"
    assert torch.equal(runs[0], sample_step_by_step(model, ids, seed=0, eos_token_id=model.config.eos_token_id))

    torch.manual_seed(0)
    with torch.no_grad():
        uncached = model.generate(ids, attention_mask=torch.ones_like(ids), use_cache=False, **settings)
    assert torch.equal(runs[0], uncached)

    # Several samples per prompt: the cache is built for the expanded batch.
    samples = []
    for use_cache in (True, False):
        torch.manual_seed(4)
        with torch.no_grad():
            samples.append(
                model.generate(ids, attention_mask=torch.ones_like(ids), num_return_sequences=3, use_cache=use_cache, **settings)
            )
    assert samples[0].shape[0] == 6 and torch.equal(samples[0], samples[1])


# ------------------------------------------------------------------------------------ beam search / no cache


@pytest.mark.parametrize("name", MODEL_TYPES)
def test_beam_search_with_several_returned_sequences_equals_uncached(name):
    model = tiny_model(name)
    ids = random_ids(2, 10)
    settings = dict(num_beams=3, num_return_sequences=2, do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=PAD)
    settings.update(attention_mask=torch.ones_like(ids), output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        cached = model.generate(ids, **settings)
        uncached = model.generate(ids, use_cache=False, **settings)
    assert cached.sequences.shape[0] == 4
    assert torch.equal(cached.sequences, uncached.sequences)
    torch.testing.assert_close(cached.sequences_scores, uncached.sequences_scores, rtol=1e-5, atol=1e-5)
    # Each returned pair starts with its own row's prompt (the cache was expanded and reordered per row).
    assert torch.equal(cached.sequences[:, : ids.shape[1]], ids.repeat_interleave(2, dim=0))


@pytest.mark.parametrize("name", MODEL_TYPES)
def test_generate_without_cache_equals_cached_generate(name):
    model = tiny_model(name)
    ids = random_ids(2, 12)
    assert torch.equal(greedy(model, ids), greedy(model, ids, use_cache=False))


# ------------------------------------------------------------------------------------ left padding


@pytest.mark.parametrize("name", MODEL_TYPES)
def test_left_padded_batch_equals_each_row_alone(name):
    model = tiny_model(name)
    rows = three_prompts()
    ids, mask = left_pad(rows)
    width = ids.shape[1]
    beams = dict(num_beams=3, num_return_sequences=2)
    with torch.no_grad():
        padded_logits = model(ids, attention_mask=mask).logits
        batched = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=PAD)
        batched_beams = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=PAD, **beams)
        for row, prompt in enumerate(rows):
            alone = torch.tensor([prompt])
            start = width - len(prompt)
            torch.testing.assert_close(padded_logits[row, start:], model(alone).logits[0], rtol=0, atol=1e-4)
            assert batched[row, width:].tolist() == greedy(model, alone)[0, len(prompt) :].tolist(), f"row {row}"
            alone_beams = greedy(model, alone, **beams)
            assert batched_beams[2 * row : 2 * row + 2, width:].tolist() == alone_beams[:, len(prompt) :].tolist(), row
