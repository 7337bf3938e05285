"""Benchmark prompts: English text cut to a set number of tokens, or random token ids.

Lengths are counted with the served model's own tokenizer (the default model's unless told),
so every server under test gets the same prompts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from shared.models.model_files import resolve_model_path
from shared.models.tokenizer import ModelTokenizer, load_tokenizer

# public-domain prose (Melville, Austen, Darwin, Dickens), varied enough that prompts differ
ENGLISH = """Call me Ishmael. Some years ago, never mind how long precisely, having little or no money in
my purse, and nothing particular to interest me on shore, I thought I would sail about a little and
see the watery part of the world. It is a way I have of driving off the spleen and regulating the
circulation. It is a truth universally acknowledged, that a single man in possession of a good
fortune, must be in want of a wife. However little known the feelings or views of such a man may be
on his first entering a neighbourhood, this truth is so well fixed in the minds of the surrounding
families, that he is considered the rightful property of some one or other of their daughters.
When on board H.M.S. Beagle, as naturalist, I was much struck with certain facts in the distribution
of the organic beings inhabiting South America, and in the geological relations of the present to
the past inhabitants of that continent. These facts seemed to throw some light on the origin of
species, that mystery of mysteries, as it has been called by one of our greatest philosophers. It
was the best of times, it was the worst of times, it was the age of wisdom, it was the age of
foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of
Light, it was the season of Darkness, it was the spring of hope, it was the winter of despair, we had
everything before us, we had nothing before us, we were all going direct to Heaven, we were all
going direct the other way. The sea was calm that morning, and the harbour lay quiet under a pale
sky while the fishermen mended their nets and talked of the weather, the price of cod, and the long
winter that was surely coming to the northern coast."""


@dataclass
class Prompt:
    prompt: str | list[int]  # text, or token ids
    num_tokens: int
    max_tokens: int


# short chat questions with short greedy answers: what the fast path's answers are compared on against
# the reference's (bench/agreement.py, tests/test_defaults_stack.py)
CHAT_QUESTIONS = [
    "What is the capital of France?", "Name three primary colors.", "What is 12 times 12?",
    "Who wrote Romeo and Juliet?", "Explain photosynthesis in one sentence.", "What is the boiling point of water?",
    "Give me a synonym for happy.", "What is the largest planet in our solar system?",
    "How many days are in a leap year?", "Translate 'good morning' into Spanish.", "What does a thermometer measure?",
    "Write a haiku about the sea.", "What is the chemical symbol for gold?", "Why is the sky blue?",
    "List two benefits of exercise.", "What is the square root of 81?", "Who painted the Mona Lisa?",
    "What language is spoken in Brazil?", "Describe a cat in five words.", "What is the opposite of cold?"]


def load(model_path: str | None = None) -> ModelTokenizer:
    return load_tokenizer(resolve_model_path(model_path))


def english_prompts(tokenizer: ModelTokenizer, num: int, input_len: int, output_lens: list[int],
                    seed: int = 0, shared_prefix_len: int = 0) -> list[Prompt]:
    """`num` prompts of `input_len` tokens cut from the text at random offsets; an optional shared
    prefix of `shared_prefix_len` tokens (a system prompt) starts every one."""
    rng = random.Random(seed)
    ids = tokenizer.encode(" ".join(ENGLISH.split()))
    while len(ids) < 2 * (input_len + shared_prefix_len) + 1:
        ids = ids + ids
    prefix = ids[:shared_prefix_len]
    prompts = []
    for i in range(num):
        start = rng.randrange(len(ids) - input_len)
        body = prefix + ids[start : start + input_len - shared_prefix_len] if shared_prefix_len else \
            ids[start : start + input_len]
        text = tokenizer.decode(body)
        prompts.append(Prompt(text, len(tokenizer.encode(text)), output_lens[i % len(output_lens)]))
    return prompts


def random_prompts(tokenizer: ModelTokenizer, num: int, input_len: int, output_lens: list[int],
                   seed: int = 0) -> list[Prompt]:
    """Random token ids (never special tokens), sent as ids: exact input lengths."""
    rng = random.Random(seed)
    vocab = [i for i in range(tokenizer.vocab_size) if i not in tokenizer.tokenizer.get_added_tokens_decoder()]
    return [Prompt([rng.choice(vocab) for _ in range(input_len)], input_len, output_lens[i % len(output_lens)])
            for i in range(num)]


def output_lengths(spec: str, num: int, seed: int = 0) -> list[int]:
    """'128' -> all 128; '16-256' -> uniform draws in [16, 256]."""
    if "-" in spec:
        low, high = (int(x) for x in spec.split("-"))
        rng = random.Random(seed + 1)
        return [rng.randint(low, high) for _ in range(num)]
    return [int(spec)] * num
