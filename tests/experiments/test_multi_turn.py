"""The multi-turn workload builds what it says (no engine): each turn's prompt is the previous
prompt, the model's answer and the next question in the chat template's own form."""
from __future__ import annotations

import importlib.util
import sys

import pytest

from tests.support import ROOT


@pytest.fixture(scope="module")
def experiment():
    spec = importlib.util.spec_from_file_location("multi_turn", ROOT / "experiments" / "multi_turn.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from harness.config.models import EMBEDDED_PREFIX, resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path(EMBEDDED_PREFIX + "smollm2-135m-instruct"))


def test_a_later_turn_is_the_conversation_the_chat_template_renders(experiment, tokenizer):
    shared_context = experiment.shared_context_module()
    shared = shared_context.workload(2, questions=3)[0]
    prompts = shared_context.prompts_of(shared, tokenizer, 3500)
    footer = shared_context.footer_tokens(tokenizer, prompts)
    questions = experiment.question_texts(prompts, tokenizer, footer)
    assert all(text and text not in shared.context for text in questions)
    assert shared.questions[1][0] in questions[1]
    first = prompts[0]
    user_message = tokenizer.decode(first.token_ids).split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
    for answer_text, ends_turn in (("The access code is 12345.", True), ("12345", False)):
        answer = tokenizer(answer_text, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if ends_turn else [])
        turn_two = first.token_ids + answer + experiment.next_turn_tokens(tokenizer, questions[1], answer)
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": user_message}, {"role": "assistant", "content": answer_text},
             {"role": "user", "content": questions[1]}], tokenize=False, add_generation_prompt=True)
        assert tokenizer.decode(turn_two) == rendered


def test_every_compressing_configuration_is_beside_full_cache_and_one_recomputes_its_history(experiment):
    configurations = experiment.configurations()
    assert configurations[0] == ("full", None, False)
    assert {policy for _, policy, _ in configurations[1:]} == set(experiment.POLICIES)
    assert [name for name, _, cold in configurations if cold] == [experiment.COLD]
