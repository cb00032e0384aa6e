"""Where a prompt's context ends (``Prompt.context_tokens``, what query-agnostic compression evicts
at): for every family, with and without a chat template where the family uses one, the ids before
the boundary end with the sample's context and the ids after it start with the question part; the
token ids are the ones the harness sent before the boundary existed (committed results depend on
them); where no boundary can be found it is None, explicitly. The embedded model's tokenizer only:
no engine, no model."""
from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

from harness.config import DataSettings
from harness.config.models import EMBEDDED_PREFIX, SMOLLM2, resolve_model_path
from harness.tasks import load_samples, task_spec
from harness.tasks.embedded import dataset as synthetic
from harness.tasks.longbench.tasks import longbench_templates
from harness.tasks.prompts import build_prompt, middle_truncate, question_text
from harness.tasks.ruler import dataset as ruler
from harness.tasks.sample import Sample
from harness.tasks.spec import TaskSpec
from tests.unit.test_data import bos_writing_tokenizer

MAX_PROMPT_TOKENS = 7500  # SmolLM2's (conf/model)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path(EMBEDDED_PREFIX + SMOLLM2))


def ids_before_the_boundary(sample: Sample, spec: TaskSpec, tokenizer, max_prompt_tokens: int) -> list[int]:
    """``build_prompt``'s token ids as the harness computed them before ``context_tokens`` existed
    (its code at cdce320, verbatim in effect): the ids must not move by a single token."""
    text = sample.meta.get("preamble", "") + spec.template.format(context=sample.context, input=sample.input)
    text = middle_truncate(text, tokenizer, max_prompt_tokens)
    chat = bool(spec.chat and getattr(tokenizer, "chat_template", None))
    if chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    text += sample.meta.get("answer_prefix", "")
    return list(tokenizer(text, add_special_tokens=not chat)["input_ids"])


def check(sample: Sample, spec: TaskSpec, tokenizer, max_prompt_tokens: int = MAX_PROMPT_TOKENS):
    """The boundary of one prompt: inside it, after the context's end, before the question."""
    prompt = build_prompt(sample, spec, tokenizer, max_prompt_tokens)
    assert prompt.token_ids == ids_before_the_boundary(sample, spec, tokenizer, max_prompt_tokens), sample.id
    count = prompt.context_tokens
    assert count is not None and 0 < count < len(prompt.token_ids), (sample.id, count)
    assert prompt.question_tokens == len(prompt.token_ids) - count
    context = tokenizer.decode(prompt.token_ids[:count])
    question = tokenizer.decode(prompt.token_ids[count:])
    # the context's end (a middle-truncated prompt keeps it), up to whitespace
    assert context.rstrip().endswith(sample.context.rstrip()[-100:]), (sample.id, context[-100:])
    assert question.lstrip().startswith(question_text(sample, spec).strip()), (sample.id, question[:100])
    return prompt


def without_chat(spec: TaskSpec) -> TaskSpec:
    return replace(spec, chat=False)


@pytest.mark.slow  # every task's prompts tokenized (about 8 s)
def test_embedded_suite_every_task(tokenizer):
    """Seed 0, every task (record_listing too); code_completion has no chat template and its
    question part is lcc's "Next line of code:" (its input is empty)."""
    samples = synthetic.generate(seed=0, tasks=list(synthetic.TASKS))
    for sample in samples:
        spec = task_spec(sample.task)
        prompt = check(sample, spec, tokenizer)
        if spec.chat:
            assert tokenizer.decode(prompt.token_ids[:prompt.context_tokens]).startswith("<|im_start|>system")
            assert tokenizer.decode(prompt.token_ids[prompt.context_tokens:]).endswith(
                "<|im_end|>\n<|im_start|>assistant\n" + sample.meta.get("answer_prefix", ""))
            check(sample, without_chat(spec), tokenizer)
    code = next(s for s in samples if s.task == "code_completion")
    prompt = build_prompt(code, task_spec(code.task), tokenizer, MAX_PROMPT_TOKENS)
    assert tokenizer.decode(prompt.token_ids[prompt.context_tokens:]) == "Next line of code:\n"


# The start of each RULER family's question, as kvpress's RULER dataset finds it (NVIDIA/kvpress,
# evaluation/benchmarks/ruler/create_huggingface_dataset.py: the context is the text before the
# pattern's last match), in RULER's singular wording too ("What is the special magic number").
KVPRESS_QUESTION = {
    "niah": r"What (?:is|are all) the special magic",
    "variable_tracking": r"Question: Find all variables that are assigned the value",
    "common_words_extraction": r"Question: What are the 10 most common words in the above list\?",
    "freq_words_extraction": r"Question: Do not provide any explanation\.",
    "qa": r"Answer the question based on the given documents\.",
}


def test_ruler_every_task_splits_where_kvpress_splits(tokenizer):
    """RULER at 1024 tokens, one sample a task: the ids before the boundary decode to exactly
    kvpress's context (the text before the question pattern's last match: cwe's worked example,
    which asks the same question, stays context), with and without the chat template."""
    samples = ruler.generate(tokenizer, seed=0, lengths=(1024,), samples_per_length=1)
    assert {s.task for s in samples} == set(ruler.TASKS)
    for sample in samples:
        spec = task_spec(sample.task)
        plain = check(sample, without_chat(spec), tokenizer)
        *_, last = re.finditer(KVPRESS_QUESTION[ruler.TASK_FAMILIES[sample.task]], plain.text)
        assert tokenizer.decode(plain.token_ids[:plain.context_tokens]) == plain.text[:last.start()], sample.id
        chat = check(sample, spec, tokenizer)
        assert chat.question_tokens > plain.question_tokens, "the chat footer is question part"
        assert tokenizer.decode(chat.token_ids[chat.context_tokens:]).endswith(sample.meta["answer_prefix"])


def test_longbench_format_jsonl_every_task(tmp_path, tokenizer):
    """A JSONL record per LongBench task (context from the record's ``context``, question from
    ``input``), some long enough to be middle-truncated; a context that contains the question part's
    very text does not move the boundary (the question is found from the end)."""
    records = []
    for index, task in enumerate(longbench_templates()):
        words = 7000 if index % 3 == 0 else 300  # every third is cut in the middle
        context = " ".join(f"line{i} of the {task} record." for i in range(words // 4))
        records.append({"dataset": task, "_id": task, "context": context + "\n", "input": f"What is line7 of {task}?",
                        "answers": ["x"]})
    echo = dict(records[3], _id="echo", input="Who?")  # hotpotqa
    echo["context"] += question_text(Sample("hotpotqa", "echo", "", "Who?", []), task_spec("hotpotqa")) + "\nMore."
    records.append(echo)
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    samples = load_samples(DataSettings(name="x", source="jsonl", path=str(path)))
    assert len(samples) == len(longbench_templates()) + 1
    truncated = 0
    for sample in samples:
        spec = task_spec(sample.task)
        prompt = check(sample, spec, tokenizer)
        truncated += len(prompt.token_ids) >= MAX_PROMPT_TOKENS
        if spec.chat:
            check(sample, without_chat(spec), tokenizer)
    assert truncated >= 5
    prompt = build_prompt(samples[-1], task_spec("hotpotqa"), tokenizer, MAX_PROMPT_TOKENS)
    assert tokenizer.decode(prompt.token_ids[:prompt.context_tokens]).rstrip().endswith("More.")


def test_a_bos_a_trimming_chat_template_and_a_plain_prompt(tmp_path):
    """A tokenizer that adds BOS to text (empty character span): the BOS is context. A chat
    template that trims the message (as Llama-3's does) still has the question found."""
    tokenizer, bos_id = bos_writing_tokenizer(tmp_path)
    code = synthetic.generate(tasks=["code_completion"], samples_per_task=1)[0]
    plain = check(code, task_spec(code.task), tokenizer)
    assert plain.token_ids[0] == bos_id
    tokenizer.chat_template = tokenizer.chat_template.replace("m['content']", "m['content'] | trim")
    qa = synthetic.generate(tasks=["key_retrieval"], samples_per_task=1)[0]
    prompt = check(qa, TaskSpec("custom", "Read this.\n{context}\n\nQuestion: {input}\n\n", 16, "qa_f1"), tokenizer)
    assert prompt.token_ids[0] == bos_id and prompt.text.endswith("Answer with the number only.<|im_end|>\n"
                                                                 "<|im_start|>assistant\n"), "trimmed"


def test_an_empty_question_part_and_no_question_part_found(tokenizer):
    """Only whitespace after ``{context}``: the whole user message is context, the question part is
    the chat footer and answer prefix, or nothing (question_tokens 0). None, explicitly, where the
    question part is not at the end of the prompt (middle truncation cut into it) or the template
    has no ``{context}``."""
    sample = Sample("custom", "s", "Some words. " * 50, "", [])
    plain = build_prompt(sample, TaskSpec("custom", "Read this.\n{context}\n", 8, "qa_f1", chat=False), tokenizer, 7500)
    assert plain.context_tokens == len(plain.token_ids) and plain.question_tokens == 0
    spec = TaskSpec("custom", "Read this.\n{context}\n", 8, "qa_f1")
    chat = build_prompt(replace(sample, meta={"answer_prefix": "Answer:"}), spec, tokenizer, 7500)
    assert tokenizer.decode(chat.token_ids[chat.context_tokens:]) == "<|im_end|>\n<|im_start|>assistant\nAnswer:"

    long_question = Sample("custom", "q", "Some words. " * 200, "Why " * 300 + "?", [])
    spec = TaskSpec("custom", "{context}\n\nQuestion: {input}", 8, "qa_f1")
    cut = build_prompt(long_question, spec, tokenizer, 200)
    assert "Question:" not in cut.text, "truncation cut into the question part"
    assert cut.context_tokens is None and cut.question_tokens is None
    whole = build_prompt(long_question, spec, tokenizer, 7500)
    assert whole.context_tokens is not None

    nothing = build_prompt(sample, TaskSpec("custom", "Say hello.", 8, "qa_f1"), tokenizer, 7500)
    assert nothing.context_tokens is None and nothing.question_tokens is None
