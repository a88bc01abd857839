"""RULER-style needle-in-a-haystack tasks, generated from a seeded RNG (no downloads).

An example is ``[BOS] intro  haystack-with-needles  query-section`` where a *needle* is a sentence
binding a key to a value ("one of the special magic numbers for grumpy-kettle is: 4829103.") and
the query section asks for the value(s) of some key(s), answers included. Only the answer tokens
carry labels, so loss and accuracy measure retrieval alone (teacher forcing: see
``hf_hybrid.eval.needle``).

Tasks (RULER, Hsieh et al. 2024; definitions as in the SE-Attn paper's Table 10):

* ``single``     one key-value needle, asked once;
* ``multikey``   ``num_needles`` needles with distinct keys, one of them asked (the rest distract);
  with ``haystack="needle"`` the whole haystack is distractor needles (RULER multikey_2/3);
* ``multivalue`` one key bound to ``num_values`` values in separate needles; all values asked, in
  their order of appearance;
* ``multiquery`` ``num_needles`` needles, ``num_queries`` of them asked one after the other.

Haystacks: ``noise`` (a fixed block of five sentences repeated, RULER's "repeat"), ``essay``
(random sentences from a small built-in grammar, standing in for RULER's essays), ``needle``
(distractor needles). Keys: ``words`` (adjective-noun) | ``numbers`` | ``uuids``; values:
``numbers`` (``number_digits`` digits) | ``words`` (one noun) | ``uuids``.

Length and depth. ``length`` is the total number of tokens of an example. With the built-in
vocabulary (:class:`NeedleVocab`, one token per word, digit, hex letter or mark) every example is
exactly ``length`` tokens: the haystack is filled with whole sentences and the remainder with the
tail of one more sentence, placed first (the context starts mid-sentence). With a real
``tokenizer`` the text is tokenized as a whole (a fast tokenizer's offsets locate the needle and
the answers) and examples have the largest whole number of haystack sentences that fits, so at
most ``length`` tokens. ``depth`` in [0, 1] is the fraction of the context (haystack and other
needles, between intro and query section) that precedes the first target needle; it is placed at
the sentence boundary nearest to that fraction. Other needles go to uniformly random boundaries.

Examples of one (length, index) share keys, values and haystack across depths, so a depth sweep
compares like with like.
"""
from __future__ import annotations

import random
import uuid
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:  # datasets is needed only to build Dataset objects: imported where one is made
    from datasets import Dataset

IGNORE_INDEX = -100

NEEDLE_TASKS = ("single", "multikey", "multivalue", "multiquery")
HAYSTACKS = ("noise", "essay", "needle")
KEY_TYPES = ("words", "numbers", "uuids")
VALUE_TYPES = ("numbers", "words", "uuids")

# Built-in word list: adjective-noun keys, word values and the essay grammar draw from these.
ADJECTIVES = (
    "ancient", "bitter", "brave", "bright", "calm", "clever", "cold", "crooked", "curious", "damp",
    "dusty", "eager", "early", "empty", "faint", "fancy", "fierce", "gentle", "golden", "grumpy",
    "hollow", "humble", "hungry", "jolly", "late", "lazy", "little", "lively", "lonely", "loud",
    "lucky", "muddy", "narrow", "nervous", "noble", "odd", "pale", "polite", "proud", "quiet",
    "rapid", "rough", "rusty", "shiny", "silent", "sleepy", "sour", "spiritual",
)
NOUNS = (
    "anchor", "apple", "badger", "basket", "beacon", "bottle", "bridge", "candle", "canyon", "castle",
    "cellar", "comet", "copper", "desert", "dragon", "engine", "falcon", "feather", "forest", "garden",
    "glacier", "harbor", "helmet", "island", "kettle", "ladder", "lantern", "meadow", "mirror", "monkey",
    "needle", "orchard", "oven", "parrot", "pebble", "pepper", "pillow", "planet", "puzzle", "rabbit",
    "river", "saddle", "shadow", "spider", "teapot", "thunder", "tunnel", "violin",
)
VERBS = (
    "admires", "borrows", "builds", "carries", "chases", "cleans", "draws", "finds", "follows", "guards",
    "hides", "holds", "keeps", "lifts", "loves", "misses", "moves", "opens", "paints", "pulls",
    "sells", "shakes", "throws", "watches",
)
_NOISE = ("the grass is green .", "the sky is blue .", "the sun is yellow .", "here we go .", "there and back again .")
_ESSAY_PATTERNS = (
    "the {adj} {noun} {verb} the {noun} .",
    "a {noun} {verb} a {adj} {noun} near the {noun} .",
    "every {adj} {noun} {verb} some {noun} .",
    "the {noun} of the {adj} {noun} {verb} the {noun} again .",
    "nobody {verb} the {noun} , but the {noun} {verb} it .",
    "in the {adj} {noun} , a {noun} {verb} the {adj} {noun} .",
)
_PUNCTUATION = (".", ",", ":", "?")
_DIGITS = tuple("0123456789")
_HEX_LETTERS = tuple("abcdef")


@dataclass(frozen=True)
class NeedleTemplate:
    """Word-level sentence templates; ``{kind}``/``{kinds}``, ``{key}`` and ``{value}`` are filled in.

    The query section is, for each asked key, ``question`` then ``answer`` where ``{value}`` is the
    value (or the values joined by ``value_separator``); only the value tokens are labelled.
    """

    intro: str
    needle: str
    question: str
    answer: str
    answer_plural: str
    question_plural: str = ""
    value_separator: str = ","


TEMPLATES = {
    "ruler": NeedleTemplate(
        intro="some special magic {kinds} are hidden inside the following text . remember them , "
        "you will be asked about them afterwards .",
        needle="one of the special magic {kinds} for {key} is : {value} .",
        question="what is the special magic {kind} for {key} mentioned in the text ?",
        answer="the special magic {kind} for {key} is : {value} .",
        answer_plural="the special magic {kinds} for {key} are : {value} .",
        question_plural="what are all the special magic {kinds} for {key} mentioned in the text ?",
    ),
    # No prose: what tiny models trained for seconds can learn (MQAR-like).
    "compact": NeedleTemplate(
        intro="", needle="{key} : {value} .", question="?", answer="{key} : {value} .", answer_plural="{key} : {value} .", question_plural="?"
    ),
}
_KIND_WORDS = {"numbers": ("number", "numbers"), "words": ("word", "words"), "uuids": ("uuid", "uuids")}


def _template_words() -> list[str]:
    words = []
    for template in TEMPLATES.values():
        for text in (template.intro, template.needle, template.question, template.question_plural, template.answer, template.answer_plural, template.value_separator):
            words += [w for w in text.split() if not w.startswith("{")]
    for kind, kinds in _KIND_WORDS.values():
        words += [kind, kinds]
    for text in _NOISE + _ESSAY_PATTERNS:
        words += [w for w in text.split() if not w.startswith("{")]
    return words


class NeedleVocab:
    """The self-made vocabulary of the token-id form: one token per word, digit, hex letter or mark.

    Ids: 0 ``<pad>``, 1 ``<bos>``, 2 ``<eos>``, then marks, digits, hex letters, template words and
    the built-in word list (duplicates removed, order fixed, so ids never change between runs).
    """

    pad = 0
    bos = 1
    eos = 2

    def __init__(self) -> None:
        units = ["<pad>", "<bos>", "<eos>", *_PUNCTUATION, "-", *_DIGITS, *_HEX_LETTERS, *_template_words(), *ADJECTIVES, *NOUNS, *VERBS]
        self.units: tuple[str, ...] = tuple(dict.fromkeys(units))
        self._ids = {unit: index for index, unit in enumerate(self.units)}

    @property
    def size(self) -> int:
        return len(self.units)

    def encode(self, units: Sequence[str]) -> list[int]:
        try:
            return [self._ids[unit] for unit in units]
        except KeyError as error:
            raise ValueError(f"{error.args[0]!r} is not in NeedleVocab; templates may only use built-in words.") from None

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(self.units[i] for i in ids)


# A word is a tuple of units (tokens of the built-in vocabulary); its text is the units joined.
Word = tuple
Sentence = list


@dataclass(frozen=True)
class NeedleTask:
    """One needle task configuration; ``None`` counts take the task's RULER default.

    Counts: ``num_needles`` key-value needles with distinct keys (asked + distractors; not counting
    a ``needle`` haystack), ``num_values`` values per asked key, ``num_queries`` keys asked.
    """

    task: str = "single"
    haystack: str = "essay"
    key_type: str = "words"
    value_type: str = "numbers"
    num_needles: int | None = None
    num_values: int | None = None
    num_queries: int | None = None
    number_digits: int = 7
    template: str = "ruler"
    name: str | None = None

    def __post_init__(self) -> None:
        for field_name, value, choices in (
            ("task", self.task, NEEDLE_TASKS),
            ("haystack", self.haystack, HAYSTACKS),
            ("key_type", self.key_type, KEY_TYPES),
            ("value_type", self.value_type, VALUE_TYPES),
            ("template", self.template, tuple(TEMPLATES)),
        ):
            if value not in choices:
                raise ValueError(f"NeedleTask.{field_name} must be one of {choices}, got {value!r}.")
        defaults = {"single": (1, 1, 1), "multikey": (4, 1, 1), "multivalue": (1, 4, 1), "multiquery": (4, 1, 4)}[self.task]
        needles, values, queries = (d if v is None else v for v, d in zip((self.num_needles, self.num_values, self.num_queries), defaults))
        for field_name, value in (("num_needles", needles), ("num_values", values), ("num_queries", queries), ("number_digits", self.number_digits)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"NeedleTask.{field_name} must be a positive integer, got {value!r}.")
        if queries > needles:
            raise ValueError(f"NeedleTask.num_queries ({queries}) cannot exceed num_needles ({needles}).")
        expected = {"single": lambda: (needles, values, queries) == (1, 1, 1), "multikey": lambda: values == 1 and queries == 1,
                    "multivalue": lambda: values > 1 and queries == 1, "multiquery": lambda: values == 1 and queries > 1}
        if not expected[self.task]():
            raise ValueError(
                f"NeedleTask(task={self.task!r}) does not fit num_needles={needles}, num_values={values}, "
                f"num_queries={queries}: single is 1/1/1, multikey asks 1 key, multivalue has num_values > 1, "
                "multiquery has num_queries > 1."
            )
        object.__setattr__(self, "num_needles", needles)
        object.__setattr__(self, "num_values", values)
        object.__setattr__(self, "num_queries", queries)

    @property
    def label(self) -> str:
        return self.name or self.task


# The eight RULER NIAH tasks (SE-Attn paper Table 10; "repeat" noise is our "noise", Paul Graham
# essays are replaced by the built-in essay grammar).
RULER_TASKS = {
    "single_1": NeedleTask("single", "noise", "words", "numbers", name="single_1"),
    "single_2": NeedleTask("single", "essay", "words", "numbers", name="single_2"),
    "single_3": NeedleTask("single", "essay", "words", "uuids", name="single_3"),
    "multikey_1": NeedleTask("multikey", "essay", "words", "numbers", num_needles=4, name="multikey_1"),
    "multikey_2": NeedleTask("multikey", "needle", "words", "numbers", num_needles=1, name="multikey_2"),
    "multikey_3": NeedleTask("multikey", "needle", "uuids", "uuids", num_needles=1, name="multikey_3"),
    "multivalue": NeedleTask("multivalue", "essay", "words", "numbers", name="multivalue"),
    "multiquery": NeedleTask("multiquery", "essay", "words", "numbers", name="multiquery"),
}


def resolve_task(task: str | NeedleTask, **overrides) -> NeedleTask:
    """A NeedleTask from a RULER name (``single_1`` ... ``multiquery``), a task name, or a NeedleTask."""
    if isinstance(task, NeedleTask):
        return replace(task, **overrides) if overrides else task
    if task in RULER_TASKS:
        return replace(RULER_TASKS[task], **overrides) if overrides else RULER_TASKS[task]
    if task in NEEDLE_TASKS:
        return NeedleTask(task=task, **overrides)
    raise ValueError(f"task must be a NeedleTask, one of {NEEDLE_TASKS} or a RULER task {tuple(RULER_TASKS)}; got {task!r}.")


# ----------------------------------------------------------------------------------------------
# payloads and sentences (word level)


def _payload(rng: random.Random, kind: str, digits: int, as_key: bool) -> Word:
    if kind == "numbers":
        return (rng.choice("123456789"), *(rng.choice("0123456789") for _ in range(digits - 1)))
    if kind == "uuids":
        return tuple(str(uuid.UUID(int=rng.getrandbits(128), version=4)))
    if as_key:
        return (rng.choice(ADJECTIVES), "-", rng.choice(NOUNS))
    return (rng.choice(NOUNS),)


def _distinct(count: int, make: Callable[[], Word]) -> list[Word]:
    found: list[Word] = []
    for _ in range(1000 * count):
        item = make()
        if item not in found:
            found.append(item)
            if len(found) == count:
                return found
    raise ValueError(f"could not draw {count} distinct payloads; use a larger key/value space (e.g. key_type='uuids').")


def _fill(text: str, kind: str, key: Word = (), value: Sequence[Word] = (), separator: str = ",") -> tuple[Sentence, list[int]]:
    """Template text -> sentence of words, and the indices of the value words in it."""
    singular, plural = _KIND_WORDS[kind]
    sentence, value_at = [], []
    for token in text.split():
        if token == "{key}":
            sentence.append(key)
        elif token == "{value}":
            for i, word in enumerate(value):
                if i:
                    sentence.append((separator,))
                value_at.append(len(sentence))
                sentence.append(word)
        else:
            sentence.append(({"{kind}": singular, "{kinds}": plural}.get(token, token),))
    return sentence, value_at


def _essay_sentence(rng: random.Random) -> Sentence:
    pattern = rng.choice(_ESSAY_PATTERNS)
    pools = {"{adj}": ADJECTIVES, "{noun}": NOUNS, "{verb}": VERBS}
    return [(rng.choice(pools[w]) if w in pools else w,) for w in pattern.split()]


def _word_text(word: Word) -> str:
    return "".join(word)


def sentence_text(sentence: Sentence) -> str:
    """Readable text: words joined by spaces, no space before punctuation."""
    out = ""
    for word in sentence:
        text = _word_text(word)
        out += text if (not out or text in _PUNCTUATION) else " " + text
    return out


# ----------------------------------------------------------------------------------------------
# one example


@dataclass
class _Layout:
    """The pieces of one example before rendering: sentences, and which of them matter."""

    intro: Sentence
    context: list[Sentence]  # haystack and needles, in order
    target: int  # index in context of the depth-placed needle
    query: list[Sentence]
    answer_words: list[tuple[int, int]] = field(default_factory=list)  # (query sentence, word index)
    answers: list[str] = field(default_factory=list)


def _draw(rng: random.Random, task: NeedleTask):
    """Keys and values of one example: asked needles, distractor needles, asked keys (shuffled)."""
    template = TEMPLATES[task.template]
    kind = task.value_type
    digits = task.number_digits
    keys = _distinct(task.num_needles, lambda: _payload(rng, task.key_type, digits, True))
    targets = keys[: task.num_queries]
    needles: list[tuple[Word, Word]] = []  # (key, value); asked keys first
    values_of: dict[Word, list[Word]] = {}
    for key in keys:
        count = task.num_values if key in targets else 1
        values_of[key] = _distinct(count, lambda: _payload(rng, kind, digits, False))
        needles += [(key, value) for value in values_of[key]]
    target_needles = [n for n in needles if n[0] in targets]
    distractors = [n for n in needles if n[0] not in targets]

    def distractor_needle() -> Sentence:
        key = _payload(rng, task.key_type, digits, True)
        while key in targets:
            key = _payload(rng, task.key_type, digits, True)
        return _fill(template.needle, kind, key, [_payload(rng, kind, digits, False)])[0]

    asked = list(targets)
    rng.shuffle(asked)
    return template, kind, target_needles, distractors, asked, distractor_needle


def _haystack_sentence(rng: random.Random, haystack: str, index: int, distractor_needle) -> Sentence:
    if haystack == "noise":
        return [(w,) for w in _NOISE[index % len(_NOISE)].split()]
    if haystack == "essay":
        return _essay_sentence(rng)
    return distractor_needle()


def _nearest_boundary(costs: Sequence[int], fraction: float) -> int:
    """Index b (0..len) whose prefix cost sum(costs[:b]) is nearest to fraction * sum(costs)."""
    goal = fraction * sum(costs)
    best, best_gap, prefix = 0, goal, 0
    for b, cost in enumerate(costs, start=1):
        prefix += cost
        if abs(prefix - goal) < best_gap:
            best, best_gap = b, abs(prefix - goal)
    return best


def needle_example(
    rng: random.Random,
    task: str | NeedleTask,
    length: int,
    depth: float,
    vocab: NeedleVocab | None = None,
    tokenizer=None,
) -> dict:
    """One example as ``input_ids`` / ``labels`` (labels only on answer tokens) plus metadata.

    Metadata: ``task``, ``length`` (requested), ``depth`` (requested), ``needle_start`` (token
    index of the depth-placed needle), ``needle_depth`` (the depth it really got, in tokens),
    ``answer_spans`` ([start, end) token ranges of the answer values, one per value) and
    ``answers`` (their text). The RNG state decides everything but ``depth``: calling this with
    equal RNG states and different depths moves the same needle through the same haystack.
    """
    task = resolve_task(task)
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must lie in [0, 1] (fraction of the context before the needle), got {depth!r}.")
    if tokenizer is not None and vocab is not None:
        raise ValueError("pass either vocab (token ids of the built-in vocabulary) or tokenizer (text), not both.")
    vocab = vocab or (NeedleVocab() if tokenizer is None else None)
    template, kind, target_needles, distractors, asked, distractor_needle = _draw(rng, task)

    intro = _fill(template.intro, kind)[0] if template.intro else []
    needles = target_needles + distractors
    needle_sentences = [_fill(template.needle, kind, key, [value])[0] for key, value in needles]
    # placement fractions drawn up front so that a text-mode refit does not change them
    other_fractions = [rng.random() for _ in needle_sentences[1:]]

    def query_section(order: Sequence[int]) -> tuple[list[Sentence], list[tuple[int, int]], list[str]]:
        """Questions and answers; a key's values are listed in their order of appearance."""
        query, answer_words, answers = [], [], []
        for key in asked:
            values = [needles[n][1] for n in order if needles[n][0] == key]
            question = (template.question_plural or template.question) if len(values) > 1 else template.question
            if question:
                query.append(_fill(question, kind, key)[0])
            text = template.answer_plural if len(values) > 1 else template.answer
            sentence, value_at = _fill(text, kind, key, values, template.value_separator)
            answer_words += [(len(query), i) for i in value_at]
            answers += [_word_text(v) for v in values]
            query.append(sentence)
        return query, answer_words, answers

    cost = (lambda s: sum(len(w) for w in s)) if tokenizer is None else _tokenizer_cost(tokenizer)
    fixed = 1 + sum(map(cost, [intro, *needle_sentences, *query_section(range(len(needles)))[0]]))
    budget = length - fixed
    if budget < 0:
        raise ValueError(f"length={length} is too short for task {task.label!r}: its needles and questions alone take {fixed} tokens.")
    haystack: list[Sentence] = []
    used = 0
    while True:
        sentence = _haystack_sentence(rng, task.haystack, len(haystack), distractor_needle)
        c = cost(sentence)
        if used + c > budget:
            break
        haystack.append(sentence)
        used += c
    if tokenizer is None and budget > used:  # exact length: the tail of one more sentence goes first
        tail = [(u,) for word in sentence for u in word][-(budget - used):]
        haystack.insert(0, tail)

    def layout(haystack: list[Sentence]) -> _Layout:
        context: list[tuple[Sentence, int | None]] = [(s, None) for s in haystack]  # (sentence, needle index)
        positions = sorted(((round(f * len(haystack)), i + 1) for i, f in enumerate(other_fractions)), reverse=True)
        for boundary, n in positions:
            context.insert(boundary, (needle_sentences[n], n))
        target = _nearest_boundary([cost(s) for s, _ in context], depth)
        context.insert(target, (needle_sentences[0], 0))
        query, answer_words, answers = query_section([n for _, n in context if n is not None])
        return _Layout(intro, [s for s, _ in context], target, query, answer_words, answers)

    if tokenizer is None:
        row = _render_ids(layout(haystack), vocab)
        assert len(row["input_ids"]) == length
    else:
        while True:  # drop haystack sentences until the whole text fits
            row = _render_text(layout(haystack), tokenizer)
            if len(row["input_ids"]) <= length or not haystack:
                break
            haystack.pop()
        if len(row["input_ids"]) > length:
            raise ValueError(f"length={length} is too short for task {task.label!r} with this tokenizer ({len(row['input_ids'])} tokens without haystack).")
    return {"task": task.label, "length": length, "depth": float(depth), **row}


def _render_ids(layout: _Layout, vocab: NeedleVocab) -> dict:
    ids = [vocab.bos]
    needle_start = needle_end = context_start = context_end = 0
    spans = []
    for part, sentences in (("intro", [layout.intro]), ("context", layout.context), ("query", layout.query)):
        if part == "context":
            context_start = len(ids)
        for s_index, sentence in enumerate(sentences):
            if part == "context" and s_index == layout.target:
                needle_start = len(ids)
            for w_index, word in enumerate(sentence):
                if part == "query" and (s_index, w_index) in layout.answer_words:
                    spans.append([len(ids), len(ids) + len(word)])
                ids += vocab.encode(word)
            if part == "context" and s_index == layout.target:
                needle_end = len(ids)
        if part == "context":
            context_end = len(ids)
    return _finish(ids, spans, (needle_start, needle_end), (context_start, context_end), layout.answers)


def _render_text(layout: _Layout, tokenizer) -> dict:
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("tokenizer must be a fast (Rust) tokenizer: its offset mapping locates needles and answers.")
    text, char_spans = "", []

    def add(sentence: Sentence, answer_at: set = frozenset()) -> int:
        """Append a sentence; returns the character where its first word starts."""
        nonlocal text
        first = len(text) + (1 if text else 0)
        for w_index, word in enumerate(sentence):
            word_text = _word_text(word)
            glue = "" if (not text or word_text in _PUNCTUATION) else " "
            if w_index in answer_at:
                char_spans.append((len(text) + len(glue), len(text) + len(glue) + len(word_text)))
            text += glue + word_text
        return first

    add(layout.intro)
    context_char = len(text) + (1 if text else 0)
    for s_index, sentence in enumerate(layout.context):
        first = add(sentence)
        if s_index == 0:
            context_char = first
        if s_index == layout.target:
            needle_char, needle_end_char = first, len(text)
    context_end_char = len(text)
    for q_index, sentence in enumerate(layout.query):
        add(sentence, {w for q, w in layout.answer_words if q == q_index})
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(encoded["input_ids"]), list(encoded["offset_mapping"])
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    shift = len(bos)

    def first_token_at_or_after(char: int) -> int:
        return next((i for i, (_, end) in enumerate(offsets) if end > char), len(offsets)) + shift

    spans = []
    for start, end in char_spans:
        covered = [i for i, (a, b) in enumerate(offsets) if a < end and b > start and b > a]
        spans.append([covered[0] + shift, covered[-1] + 1 + shift])
    at = first_token_at_or_after
    return _finish(bos + ids, spans, (at(needle_char), at(needle_end_char)), (at(context_char), at(context_end_char)), layout.answers)


def _tokenizer_cost(tokenizer) -> Callable[[Sentence], int]:
    return lambda sentence: len(tokenizer(" " + sentence_text(sentence), add_special_tokens=False)["input_ids"])


def _finish(ids, spans, needle: tuple[int, int], context: tuple[int, int], answers) -> dict:
    labels = [IGNORE_INDEX] * len(ids)
    for start, end in spans:
        labels[start:end] = ids[start:end]
    # depth: share of the rest of the context (all but this needle) that lies before the needle
    rest = (context[1] - context[0]) - (needle[1] - needle[0])
    return {
        "input_ids": ids,
        "labels": labels,
        "needle_start": needle[0],
        "needle_depth": (needle[0] - context[0]) / rest if rest > 0 else 0.0,
        "answer_spans": spans,
        "answers": answers,
    }


def make_needle_dataset(
    num_examples: int,
    task: str | NeedleTask = "single",
    lengths: Sequence[int] = (256,),
    depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0),
    seed: int = 0,
    vocab: NeedleVocab | None = None,
    tokenizer=None,
    **task_overrides,
) -> Dataset:
    """``num_examples`` examples for every (length, depth) cell, as a ``datasets.Dataset``.

    Columns: input_ids, labels, task, length, depth, needle_start, needle_depth, answer_spans,
    answers. ``task`` is a RULER name (``single_1`` ... ``multiquery``), one of NEEDLE_TASKS or a
    NeedleTask; ``task_overrides`` replace its fields (e.g. ``template="compact"``). Without
    ``tokenizer`` the ids are over :class:`NeedleVocab` (``vocab.size`` tokens) and every row of a
    length is exactly that long; with a (fast) tokenizer the text is tokenized by it.
    """
    if num_examples < 1:
        raise ValueError(f"num_examples must be >= 1, got {num_examples}.")
    if not lengths or not depths:
        raise ValueError("lengths and depths must each hold at least one value.")
    spec = resolve_task(task, **task_overrides)
    vocab = vocab or (NeedleVocab() if tokenizer is None else None)
    rows = []
    for length in lengths:
        for index in range(num_examples):
            for depth in depths:
                # one RNG stream per (length, index): depths move the same needle
                rng = random.Random(f"needle/{seed}/{spec}/{length}/{index}")
                rows.append(needle_example(rng, spec, length, depth, vocab=vocab, tokenizer=tokenizer))
    from datasets import Dataset

    return Dataset.from_list(rows)
