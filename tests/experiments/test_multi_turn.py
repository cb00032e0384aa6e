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


def test_the_chain_runs_beside_its_recompressing_twin_for_attention_free_policies_only(experiment):
    """``--chain``: each attention-free policy's chained configuration right after its twin (SnapKV
    reads queries, which a chained turn does not carry: none for it); the summary puts each chain
    beside its twin, turn 2 on, with its hits."""
    configurations = experiment.configurations(chain=True)
    names = [name for name, _, _ in configurations]
    assert [name for name in names if experiment.chained(name)] == [
        "paged context chained", "streaming context chained", "keydiff context chained"]
    assert names.index("paged context chained") == names.index("paged context") + 1
    assert experiment.configurations() == [c for c in configurations if not experiment.chained(c[0])]
    rows = []
    for name in ("full", "paged context", "paged context chained"):
        for turn in (1, 2, 3):
            chain = experiment.chained(name) and turn > 1
            rows.append({"configuration": name, "turn": turn, "wall_s": 1.0, "history_tokens": 100.0 * turn,
                         "computed_tokens": 10.0 if chain else 40.0, "ttft_s": 0.5 if chain else 1.0,
                         "kv_blocks_peak": 50, "kv_blocks_mean": 20.0 if chain else 30.0, "prefill_evictions": 2,
                         "score": 50.0, "chain_hits": 2 if chain else 0,
                         "chain_misses": 2 if experiment.chained(name) and turn == 1 else 0,
                         "chain_reused_tokens": 180 if chain else 0})
    text = experiment.markdown(rows, "python experiments/multi_turn.py --chain", 2, 3, 0.5, "smollm2-135m", 100)
    chain_table = text.split("## The chain beside recompression")[1]
    assert "| paged context chained | 10 | 0.25 | 0.50 | 0.50 | 20.0 | 0.67 | 50 | 1.00 | 4/4 | 180 | 50.0 | 50.0 |" \
        in chain_table
    assert "## The chain beside recompression" not in experiment.markdown(
        [r for r in rows if not experiment.chained(r["configuration"])], "c", 2, 3, 0.5, "m", 100)
    named = experiment.markdown(rows, "c", 2, 3, 0.5, "m", 100, {"git_commit": "abc123", "code_version": "0123456789ab"})
    assert "Command: `c` (commit abc123, code version 0123456789ab)" in named
