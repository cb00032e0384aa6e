"""The shared-context workload asks what it says (no engine): every question of a context shares
the context's tokens, each configuration's requests carry the boundary their mode evicts at."""
from __future__ import annotations

import importlib.util
import sys

import pytest

from tests.support import ROOT


@pytest.fixture(scope="module")
def experiment():
    spec = importlib.util.spec_from_file_location("shared_context", ROOT / "experiments" / "shared_context.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def prompts(experiment):
    from transformers import AutoTokenizer

    from harness.config.models import EMBEDDED_PREFIX, resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(EMBEDDED_PREFIX + "smollm2-135m-instruct"))
    return tokenizer, [(shared, experiment.prompts_of(shared, tokenizer, 3500)) for shared in experiment.workload(2)]


def test_each_context_is_asked_its_questions_with_their_own_answers(experiment):
    codes, births = experiment.workload(2)
    assert (codes.task, births.task) == ("key_retrieval", "multi_doc_qa")
    for shared in (codes, births):
        assert len(shared.questions) == experiment.QUESTIONS
        for text, (answer,) in shared.questions:
            assert answer in shared.context and text not in shared.context
        assert len({answer for _, answer in shared.questions}) == experiment.QUESTIONS


def test_each_mode_evicts_where_it_says(experiment, prompts):
    tokenizer, asked = prompts
    (shared, questions), _ = asked
    context = questions[0].context_tokens
    full = experiment.requests_for(("full", None), asked, 0.5, tokenizer)
    assert all(r.settings == {"policy": "full"} for r in full)
    agnostic = experiment.requests_for(("context", "snapkv"), asked, 0.5, tokenizer)
    assert [r.settings["context_tokens"] for r in agnostic[:6]] == [context] * 6
    assert [r.token_ids for r in agnostic] == [r.token_ids for r in full]
    aware = experiment.requests_for(("prompt", "paged"), asked, 0.5, tokenizer)
    assert all("compress" not in r.settings and r.settings["policy"] == "paged" for r in aware)
    reused = experiment.requests_for(("first question", "snapkv"), asked, 0.5, tokenizer)
    assert "compress" not in reused[0].settings and reused[0].token_ids == questions[0].token_ids
    footer = experiment.footer_tokens(tokenizer, questions)
    assert footer > 0
    for request, own in zip(reused[1:6], questions[1:6]):
        boundary = request.settings["context_tokens"]
        # the context and the first question (its chat footer aside) are compressed; the later
        # question's own part follows, unchanged
        assert request.token_ids[:boundary] == questions[0].token_ids[:len(questions[0].token_ids) - footer]
        assert request.token_ids[boundary:] == own.token_ids[own.context_tokens:]


def test_rounds_send_one_question_of_every_context_at_a_time_in_order(experiment, prompts):
    tokenizer, asked = prompts
    requests = experiment.requests_for(("context", "paged"), asked, 0.5, tokenizer)
    assert experiment.arrival_rounds(requests, "together") == [list(range(len(requests)))]
    rounds = experiment.arrival_rounds(requests, "rounds")
    assert len(rounds) == experiment.QUESTIONS and sorted(i for batch in rounds for i in batch) == list(range(len(requests)))
    for question, batch in enumerate(rounds):
        assert [requests[i].question for i in batch] == [question] * len(asked)
        assert len({requests[i].shared.id for i in batch}) == len(asked)  # one question of every context


def test_trials_alternate_their_order_and_ratios_pair_configurations_within_a_trial(experiment):
    orders = experiment.trial_orders(["full", "a", "b"], 4)
    assert orders == [["full", "a", "b"], ["b", "a", "full"], ["full", "a", "b"], ["b", "a", "full"]]
    # every configuration at the same mean position over an even number of trials
    assert len({sum(order.index(name) for order in orders) for name in ("full", "a", "b")}) == 1
    # a machine slowing by 2% per position, "a" really 0.8x full: the per-trial ratios move with
    # the order, the fit with a time trend recovers 0.8
    trials, position = [], 0
    for trial, order in enumerate(orders, start=1):
        for name in order:
            level = {"full": 10.0, "a": 8.0, "b": 10.0}[name] * 0.98 ** position
            trials.append({"configuration": name, "trial": trial, "position": position, "output_tok_s": level,
                           "running_peak": 3, "preemptions": 0, "outputs_digest": name})
            position += 1
    table = {line["configuration"]: line for line in experiment.throughput_table(trials)}
    assert abs(table["a"]["trend_ratio"] - 0.8) < 1e-9 and table["a"]["trend_low"] < 0.8 < table["a"]["trend_high"] + 1e-9
    assert table["a"]["ratio_low"] < 0.8 < table["a"]["ratio_high"] and all(line["same_outputs"] for line in table.values())
    text = "\n".join(experiment.throughput_markdown(list(table.values()), trials, 300))
    assert "trial 2: b > a > full" in text and "| a | 7.8, " in text
