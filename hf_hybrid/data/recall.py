"""Multi-query associative recall (MQAR) over a synthetic token stream.

One example: ``BOS k1 v1 k2 v2 ... kN vN  SEP  noise...  SEP  q1 a1 q2 a2 ... qM aM`` where every
query q is one of the stored keys and its answer a is the value stored with it. Only answer
positions carry labels, so the loss and accuracy measure recall alone. Keys and values come
from disjoint token ranges; the noise section stretches the distance between storage and recall.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # datasets is needed only to build Dataset objects: imported where one is made
    from datasets import Dataset

IGNORE_INDEX = -100


@dataclass(frozen=True)
class RecallVocab:
    """Token layout: 0 pad, 1 bos, 2 sep, then keys, values and noise tokens."""

    num_keys: int = 64
    num_values: int = 64
    num_noise: int = 64

    pad: int = 0
    bos: int = 1
    sep: int = 2

    @property
    def first_key(self) -> int:
        return 3

    @property
    def first_value(self) -> int:
        return self.first_key + self.num_keys

    @property
    def first_noise(self) -> int:
        return self.first_value + self.num_values

    @property
    def size(self) -> int:
        return self.first_noise + self.num_noise


def mqar_example(rng: random.Random, vocab: RecallVocab, num_pairs: int, num_queries: int, noise_length: int) -> dict:
    """One MQAR sequence as ``input_ids`` / ``labels`` (labels only on answer tokens)."""
    if num_pairs > vocab.num_keys:
        raise ValueError(f"num_pairs ({num_pairs}) cannot exceed the number of key tokens ({vocab.num_keys}).")
    keys = rng.sample(range(vocab.first_key, vocab.first_key + vocab.num_keys), num_pairs)
    values = [rng.randrange(vocab.first_value, vocab.first_value + vocab.num_values) for _ in keys]
    tokens = [vocab.bos]
    for key, value in zip(keys, values):
        tokens += [key, value]
    tokens.append(vocab.sep)
    tokens += [rng.randrange(vocab.first_noise, vocab.first_noise + vocab.num_noise) for _ in range(noise_length)]
    tokens.append(vocab.sep)
    labels = [IGNORE_INDEX] * len(tokens)
    for index in rng.sample(range(num_pairs), min(num_queries, num_pairs)):
        tokens += [keys[index], values[index]]
        labels += [IGNORE_INDEX, values[index]]
    return {"input_ids": tokens, "labels": labels}


def make_mqar_dataset(
    num_examples: int,
    num_pairs: int = 8,
    num_queries: int = 8,
    noise_length: int = 16,
    vocab: RecallVocab = RecallVocab(),
    seed: int = 0,
) -> Dataset:
    """A ``datasets.Dataset`` of equal-length MQAR examples (columns input_ids, labels)."""
    rng = random.Random(seed)
    rows = [mqar_example(rng, vocab, num_pairs, num_queries, noise_length) for _ in range(num_examples)]
    from datasets import Dataset

    return Dataset.from_list(rows)
