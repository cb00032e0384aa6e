"""LongBench's generation rules: template, middle truncation, chat template where it applies."""
from __future__ import annotations

from harness.data.sample import Sample
from harness.data.tasks import TaskSpec


def middle_truncate(text: str, tokenizer, max_tokens: int) -> str:
    """Keep the first and last ``max_tokens // 2`` tokens of an over-long prompt (LongBench's rule)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) <= max_tokens:
        return text
    half = max_tokens // 2
    return tokenizer.decode(ids[:half], skip_special_tokens=True) + tokenizer.decode(
        ids[-half:], skip_special_tokens=True
    )


def build_prompt(sample: Sample, spec: TaskSpec, tokenizer, max_prompt_tokens: int) -> str:
    """The exact text handed to the engine for one sample."""
    prompt = spec.template.format(context=sample.context, input=sample.input)
    prompt = middle_truncate(prompt, tokenizer, max_prompt_tokens)
    if spec.chat and getattr(tokenizer, "chat_template", None):
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
    return prompt
