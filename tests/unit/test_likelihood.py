"""The teacher-forced measures computed from log-probabilities (``harness.scoring.likelihood``)."""
from __future__ import annotations

import math

import pytest

from harness.scoring.likelihood import agreement, reference_answer, step_kl, summarize_likelihood


def top(*pairs):
    return [[token, math.log(p)] for token, p in pairs]


def test_kl_of_a_distribution_with_itself_is_zero():
    full = top((1, 0.5), (2, 0.3), (3, 0.1))
    assert step_kl(full, full) == pytest.approx(0.0, abs=1e-12)


def test_kl_over_the_listed_tokens_and_the_rest_bucket():
    full = top((1, 0.5), (2, 0.3))     # rest 0.2
    cell = top((2, 0.5), (1, 0.3))     # rest 0.2
    expected = 0.5 * math.log(0.5 / 0.3) + 0.3 * math.log(0.3 / 0.5)
    assert step_kl(full, cell) == pytest.approx(expected, rel=1e-9)


def test_a_token_missing_from_the_cells_list_takes_its_last_listed_probability():
    full = top((1, 0.6), (2, 0.3))             # rest 0.1
    cell = top((1, 0.7), (5, 0.2))             # token 2 unlisted: at most 0.2
    q2, rest_q = 0.2, 1 - 0.7 - 0.2
    expected = 0.6 * math.log(0.6 / 0.7) + 0.3 * math.log(0.3 / q2) + 0.1 * math.log(0.1 / rest_q)
    assert step_kl(full, cell) == pytest.approx(expected, rel=1e-9)


def test_agreement_is_the_share_of_rank_one_steps_and_the_mean_kl():
    full = [top((1, 0.9)), top((2, 0.6), (3, 0.4))]
    cell = [top((1, 0.9)), top((3, 0.6), (2, 0.4))]
    result = agreement(full, [1, 2], cell)
    assert result["top1_agreement"] == 0.5
    assert result["kl_to_full"] == pytest.approx((0 + 0.6 * math.log(1.5) + 0.4 * math.log(0.4 / 0.6)) / 2)
    assert agreement([], [], []) == {"top1_agreement": None, "kl_to_full": None}


def test_reference_answer_joins_every_answer_only_where_all_are_asked_for():
    assert reference_answer(["Paris", "paris"], "qa_f1") == "Paris"
    assert reference_answer(["123", "456"], "string_match_all") == "123, 456"


def test_summary_is_per_task_and_the_unweighted_mean_over_tasks():
    rows = [{"task": "a", "answer_logprob": -1.0, "top1_agreement": 1.0, "kl_to_full": 0.0},
            {"task": "a", "answer_logprob": -3.0, "top1_agreement": 0.5, "kl_to_full": 0.2},
            {"task": "b", "answer_logprob": -4.0, "top1_agreement": 0.0, "kl_to_full": 1.0}]
    summary = summarize_likelihood(rows)
    assert summary["tasks"]["a"] == {"answer_logprob": -2.0, "top1_agreement": 0.75, "kl_to_full": 0.1}
    assert summary["answer_logprob"] == -3.0 and summary["top1_agreement"] == 0.375
    assert summary["kl_to_full"] == pytest.approx(0.55)
