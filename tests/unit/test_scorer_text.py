"""The learned scorer's training text (``experiments/scorer_text.py``): no sentence and no answer of
it in any evaluation family's text, at sentence level; a check that does find planted evaluation
text (and the old training text, the embedded suite at seed 101); prompts sized like the embedded
suite's, the same for the same seed. Tokenizer only (RULER is sized in tokens), no model."""
from __future__ import annotations

import dataclasses
import sys

import pytest

from tests.support import ROOT

sys.path.insert(0, str(ROOT / "experiments"))
import scorer_text as text  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer
    from harness.config.models import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path("embedded:smollm2-135m-instruct"))


@pytest.fixture(scope="module")
def evaluation(tokenizer):
    return text.evaluation_corpora(tokenizer)


@pytest.fixture(scope="module")
def training():
    """What ``experiments/train_scorer.py`` trains on by default."""
    return text.generate(seed=text.SEED, per_shape=text.PER_SHAPE)


def test_sentences_are_cut_at_stops_and_line_breaks_normalised_and_short_pieces_dropped():
    found = text.sentences("The grass is  GREEN. Here we go!\nWho keeps the key, then?\n"
                           '    STOCK["tin_kettle_3"] = count\n    return self._quiet_river_3\nPassage 3:\nx')
    # (the stop in "self._quiet_river_3" cuts it into two pieces of 2 and 3 words)
    assert found == {"the grass is green", "who keeps the key then", "stock tin kettle 3 count"}


@pytest.mark.slow  # builds every evaluation family's text (about 28 s)
def test_the_training_text_shares_no_sentence_and_no_answer_with_any_evaluation_family(training, evaluation):
    # The evaluation side is all there: the embedded suite at 200 per task and the committed
    # configs' sizes, RULER at 1k-8k tokens, every family's templates, the generators' word lists.
    assert set(evaluation) == {"embedded", "ruler", "templates", "word lists"}
    assert evaluation["embedded"].prompts == 200 * 5 + 10 * 4 + 6 * 4 + 2 * 4 + 24 * 2
    assert len(evaluation["embedded"].sentences) > 200_000 and evaluation["ruler"].prompts == 12 * (12 + 4 + 1) + 1
    assert len(evaluation["templates"].sentences) > 50
    corpus = text.training_corpus(training)
    assert len(corpus.sentences) > 4000
    found = text.overlap(corpus, evaluation)
    assert not found.sentences and not found.answers, found.describe()
    assert text.vocabulary_check(corpus, training, evaluation) == []
    text.require_disjoint(training, None, evaluation=evaluation)  # what the script runs: no refusal


@pytest.mark.slow  # the same corpora
def test_the_check_finds_evaluation_text_planted_in_training_text(training, evaluation):
    from harness.tasks.embedded import dataset as embedded

    first = embedded.generate(seed=0, tasks=["single_doc_qa"], samples_per_task=1)[0]  # cpu_accuracy's first prompt
    stolen = first.context.split(". ")[3] + "."
    planted = dataclasses.replace(training[0], context=training[0].context + "  " + stolen.upper())
    found = text.overlap(text.training_corpus([planted, *training[1:]]), evaluation)
    assert found.sentences == {text.normalise(stolen)} and found.shared["embedded"] == found.sentences
    noise = dataclasses.replace(training[1], context=training[1].context + "\nThe grass is green.")
    assert text.overlap(text.training_corpus([noise]), evaluation).shared["ruler"] == {"the grass is green"}
    answer = dataclasses.replace(training[2], answers=[first.answers[0]])
    found = text.overlap(text.training_corpus([answer]), evaluation)
    assert found.answers == {text.normalise(first.answers[0])} and not found.sentences
    with pytest.raises(SystemExit, match="1 of"):
        text.require_disjoint([planted], None, evaluation=evaluation)
    # A planted generator word in evaluation text, and a training sentence without a marker.
    spoiled = {**evaluation, "embedded": dataclasses.replace(evaluation["embedded"],
                                                               words=evaluation["embedded"].words | {"tregarthen"})}
    plain = dataclasses.replace(training[3], context=training[3].context + " It rained all day long.")
    problems = text.vocabulary_check(text.training_corpus([plain]), [plain], spoiled)
    assert len(problems) == 2 and "tregarthen" in problems[0] and "it rained all day long" in problems[1]


@pytest.mark.slow  # the evaluation corpora
def test_the_old_training_text_fails_the_check(evaluation):
    from harness.tasks import task_spec
    from harness.tasks.embedded import dataset as embedded

    old = text.corpus("seed 101", embedded.generate(seed=101, samples_per_task=6), task_spec)
    found = text.overlap(old, evaluation)
    assert len(found.sentences) > 0.5 * len(old.sentences) and found.answers


def test_prompts_are_sized_like_the_embedded_suite_and_the_same_for_the_same_seed(training, tokenizer):
    from harness.tasks.prompts import build_prompt

    assert training == text.generate(seed=text.SEED, per_shape=text.PER_SHAPE)
    other = text.generate(seed=text.SEED + 1, per_shape=text.PER_SHAPE)
    assert all(a.context != b.context for a, b in zip(training, other))
    assert len(training) == len(text.SHAPES) * text.PER_SHAPE
    for sample in training:
        rules = text.spec(sample.task)
        prompt = build_prompt(sample, rules, tokenizer, 10**6)
        assert 1000 <= len(prompt.token_ids) <= 7500, (sample.id, len(prompt.token_ids))
        if rules.chat:  # a question ends the prompt; its answer is stated once in the context
            assert sample.input in prompt.text and sample.answers[0] in sample.context
        else:  # code: the next line follows the pattern, and is not in the file
            assert sample.answers[0] not in sample.context and prompt.text.endswith("):\n")
