"""Prompts of exact token lengths cut from the embedded suite's generated text.

Engine tests and the throughput benchmark need prompts of a given length in tokens, made of real
words (a model's attention and K/V norms on random ids look nothing like on text), with no download.
"""
from __future__ import annotations

import random
from functools import cache

from harness.tasks.embedded import dataset as synthetic


@cache
def corpus_ids(model_path: str) -> tuple[int, ...]:
    """The suite's contexts (seed 7) tokenized with the model's tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    text = "\n".join(s.context for s in synthetic.generate(seed=7, tasks=["multi_doc_qa", "single_doc_qa"]))
    return tuple(tokenizer(text, add_special_tokens=False)["input_ids"])


def token_prompts(model_path: str, lengths: list[int], seed: int = 0) -> list[list[int]]:
    """One prompt per length: a window of the corpus starting at a seeded random offset."""
    ids = corpus_ids(model_path)
    too_long = [n for n in lengths if n >= len(ids)]
    if too_long:
        raise ValueError(f"prompt lengths {too_long} exceed the {len(ids)}-token corpus")
    rng = random.Random(seed)
    prompts = []
    for length in lengths:
        start = rng.randrange(len(ids) - length)
        prompts.append(list(ids[start : start + length]))
    return prompts
