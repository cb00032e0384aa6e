"""LongBench's generation rules: template, middle truncation, chat template where it applies,
and the token ids the engine is given."""
from __future__ import annotations

from dataclasses import dataclass

from harness.tasks.sample import Sample
from harness.tasks.spec import TaskSpec


@dataclass(frozen=True)
class Prompt:
    text: str               # what is recorded in predictions.jsonl
    token_ids: list[int]    # exactly what the model sees


def middle_truncate(text: str, tokenizer, max_tokens: int) -> str:
    """Keep the first and last ``max_tokens // 2`` tokens of an over-long prompt (LongBench's rule)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) <= max_tokens:
        return text
    half = max_tokens // 2
    return tokenizer.decode(ids[:half], skip_special_tokens=True) + tokenizer.decode(
        ids[-half:], skip_special_tokens=True
    )


def build_prompt(sample: Sample, spec: TaskSpec, tokenizer, max_prompt_tokens: int) -> Prompt:
    """The exact text and token ids handed to the engine for one sample.

    The engine gets token ids, never text: given text, vLLM tokenizes with the tokenizer's special
    tokens added, so a chat template that already writes ``<|begin_of_text|>`` (Llama-3) would start
    with two BOS tokens. A chat prompt is therefore encoded with no extra special tokens (the
    template wrote all it wants); a plain prompt gets the tokenizer's own, as LongBench's
    ``tokenizer(prompt)`` and vLLM's text path give it.
    """
    text = sample.meta.get("preamble", "") + spec.template.format(context=sample.context, input=sample.input)
    text = middle_truncate(text, tokenizer, max_prompt_tokens)
    chat = bool(spec.chat and getattr(tokenizer, "chat_template", None))
    if chat:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
    # A generated task may start the answer for the model (RULER's answer prefix), after the
    # assistant's header, as its authors append it to the prompt.
    text += sample.meta.get("answer_prefix", "")
    token_ids = tokenizer(text, add_special_tokens=not chat)["input_ids"]
    return Prompt(text, list(token_ids))
