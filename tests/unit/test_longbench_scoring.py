"""LongBench scoring against its rules and against the official scorers' own packages."""
from __future__ import annotations

import json
import random

import pytest

from harness.tasks.longbench.metrics import (
    classification, code_sim, count, fuzz_ratio, normalize_answer, qa_f1, retrieval,
)
from harness.tasks.metrics import length_bucket, score_sample, score_task, score_task_by_length
from harness.tasks.longbench.rouge import rouge_l_summary

rouge_package = pytest.importorskip("rouge")
fuzz = pytest.importorskip("fuzzywuzzy.fuzz")


def official_rouge(prediction: str, reference: str) -> float:
    """LongBench's rouge_score: the rouge package, any exception scored 0."""
    try:
        return rouge_package.Rouge().get_scores([prediction], [reference], avg=True)["rouge-l"]["f"]
    except Exception:
        return 0.0


def random_text(rng: random.Random, words: int) -> str:
    vocab = ["The", "cat", "sat", "on", "the", "mat", ".", "A", "dog", "ran", "far", "away", ",",
             "and", "then", "it", "slept", "Report", "found", "costs", "rose", "10%", "in", "2024", "\n"]
    return " ".join(rng.choice(vocab) for _ in range(words)).replace(" .", ".")


@pytest.mark.parametrize("seed", range(60))
def test_rouge_equals_the_rouge_package(seed):
    rng = random.Random(seed)
    prediction, reference = random_text(rng, rng.randint(0, 60)), random_text(rng, rng.randint(1, 60))
    assert rouge_l_summary(prediction, reference) == pytest.approx(official_rouge(prediction, reference), abs=1e-12)


@pytest.mark.parametrize(
    "prediction, reference",
    [("", "a summary."), ("...", "a summary."), (" ", "a summary."), ("no periods at all", "one. two. three."),
     ("Same words. Same words.", "Same words."), ("CASE matters.", "case matters.")],
)
def test_rouge_edge_cases_equal_the_package(prediction, reference):
    assert rouge_l_summary(prediction, reference) == pytest.approx(official_rouge(prediction, reference), abs=1e-12)


def test_rouge_differs_from_rouge_score_rougeL():
    """Why the harness does not use rouge-score for LongBench: summary-level union LCS over distinct
    words is not rouge-score's sentence-level rougeL (with its tokenizer and lower-casing)."""
    from rouge_score import rouge_scorer

    prediction, reference = "The cat sat. The cat ran.", "the cat sat on the mat. A dog ran."
    ours = rouge_l_summary(prediction, reference)
    theirs = rouge_scorer.RougeScorer(["rougeL"]).score(reference, prediction)["rougeL"].fmeasure
    assert ours == pytest.approx(official_rouge(prediction, reference))
    assert abs(ours - theirs) > 0.05


@pytest.mark.parametrize("seed", range(40))
def test_fuzz_ratio_equals_fuzzywuzzy(seed):
    rng = random.Random(seed)
    alphabet = "abc de()=._"
    a = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
    b = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
    assert fuzz_ratio(a, b) == fuzz.ratio(a, b)
    assert fuzz_ratio(a, a) == fuzz.ratio(a, a) == 100


def test_normalize_answer():
    assert normalize_answer("The  Eiffel-Tower, in PARIS!") == "eiffeltower in paris"
    assert normalize_answer("an apple a day") == "apple day"
    assert normalize_answer("theatre") == "theatre"


def test_qa_f1_rules():
    assert qa_f1("The Paris.", "paris") == 1.0
    assert qa_f1("", "paris") == 0.0
    assert qa_f1("Paris France", "Paris") == pytest.approx(2 / 3)
    assert qa_f1("a an the", "the") == 0.0  # both normalise to nothing: no overlap


def test_classification_reproduces_the_official_list_walk():
    classes = ["Location", "City", "Country", "Other location"]
    assert classification("Location", "Location", classes) == 1.0
    assert classification("City or Location", "City", classes) == 0.5
    # Substring matching is case-sensitive: "Location" is not inside "Other location", both count.
    assert classification("Location and Other location", "Other location", classes) == 0.5
    assert classification("Country", "City", classes) == 0.0
    # The official loop skips the element after a removal: with two removable terms in a row the
    # second survives, so the score is 1/2, not 1.
    classes = ["ab", "abc", "abcd"]
    assert classification("ab abc abcd", "abcd", classes) == 0.5


def test_retrieval_and_count():
    assert retrieval("Paragraph 12", "Paragraph 12") == 1.0
    assert retrieval("Paragraph 12 or Paragraph 3", "Paragraph 12") == 0.5
    assert retrieval("I do not know", "Paragraph 12") == 0.0
    assert count("There are 7 unique paragraphs, 7.", "7") == 1.0
    assert count("3 or 4", "4") == 0.5
    assert count("", "4") == 0.0


def test_code_sim_skips_comment_and_fence_lines():
    answer = "        return self._x"
    assert code_sim("```python\n# the next line\n        return self._x\n", answer) == 1.0
    assert code_sim("\n\n// c-style\nreturn self._x", answer) == fuzz.ratio("return self._x", answer) / 100
    assert code_sim("", answer) == 0.0


def test_first_line_rule_for_few_shot_tasks():
    assert score_sample("triviaqa", "\n\nParis\nLondon is wrong", ["Paris"]) == 1.0
    assert score_sample("hotpotqa", "Paris\nLondon", ["Paris"]) == pytest.approx(2 / 3)
    assert score_sample("trec", "Location\nCity", ["Location"], all_classes=["Location", "City"]) == 1.0


def test_max_over_answers_and_task_score_rounding():
    assert score_sample("hotpotqa", "Paris", ["London", "Paris"]) == 1.0
    assert score_task("hotpotqa", ["Paris", "Rome", "Paris France"], [["Paris"], ["Paris"], ["Paris"]]) == 55.56
    assert score_sample("gov_report", "", ["A summary."]) == 0.0


def test_longbench_e_buckets():
    assert [length_bucket(n) for n in (0, 3999, 4000, 7999, 8000, 20000)] == ["0-4k", "0-4k", "4-8k", "4-8k", "8k+", "8k+"]
    buckets = score_task_by_length("hotpotqa_e", ["Paris", "Rome"], [["Paris"], ["Paris"]], [100, 5000])
    assert buckets == {"0-4k": 100.0, "4-8k": 0.0}


def test_key_retrieval_scores_whether_the_code_is_in_the_answer():
    """The task asks for the code: a sentence stating it answers, as RULER scores a needle. The
    same sentence under LongBench's multifieldqa_en keeps LongBench's token F1 (0.25)."""
    from harness.tasks import task_spec

    sentence = "The access code of Greta Grell is 23205."
    assert task_spec("key_retrieval").metric == "string_match_all"
    assert score_sample("key_retrieval", sentence, ["23205"]) == 1.0
    assert score_sample("key_retrieval", "23205", ["23205"]) == 1.0
    assert score_sample("key_retrieval", "The access code of Greta Grell is 23250.", ["23205"]) == 0.0
    assert score_sample("key_retrieval", "Nils Wilde is the access code of Nils Wilde.", ["68228"]) == 0.0
    assert score_sample("multifieldqa_en", sentence, ["23205"]) == pytest.approx(0.25)
    assert score_task("key_retrieval", [sentence, "no idea"], [["23205"], ["11111"]]) == 50.0


def test_record_listing_rouge_falls_with_each_entry_lost():
    """The long-output task's ROUGE-L: the register copied whole scores 1; each entry dropped or
    replaced by a copy of another costs, since every entry has a code no other shares. Bare
    "Entry k:" lines keep the numbering's words (ROUGE-L counts distinct words): a floor of ~0.35."""
    from harness.tasks.embedded import dataset as synthetic

    sample = synthetic.generate(tasks=["record_listing"], samples_per_task=1)[0]
    reference = sample.answers[0]
    lines = reference.split("\n")
    scores = [score_sample("record_listing", "\n".join(lines[:keep]), [reference]) for keep in (16, 12, 8, 4)]
    assert scores[0] == pytest.approx(1.0) and scores == sorted(scores, reverse=True) and scores[-1] < 0.5
    repeated = "\n".join(lines[:4] + [lines[3].replace("Entry 4:", f"Entry {k}:") for k in range(5, 17)])
    assert score_sample("record_listing", repeated, [reference]) < scores[1]
    bare = "\n".join(f"Entry {k}:" for k in range(1, 17))
    assert 0.25 < score_sample("record_listing", bare, [reference]) < 0.45
    assert score_sample("record_listing", reference, [reference]) == pytest.approx(official_rouge(reference, reference))


def write_run(directory, rows, scores):
    directory.mkdir(parents=True)
    (directory / "config.yaml").write_text("policy: {name: full}\n")
    (directory / "perf.json").write_text("{}\n")
    (directory / "predictions.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    (directory / "scores.json").write_text(json.dumps(scores, indent=2) + "\n")


def test_rescore_rewrites_stale_scores_in_both_files_and_keeps_the_rest(tmp_path, capsys):
    """A run scored when key_retrieval used token F1: the rescore command finds it under a root,
    rewrites each row's score and scores.json to agree with the current metric, keeps what does not
    depend on the metric, leaves unchanged rows byte for byte, and --check then passes."""
    from harness.scoring.rescore import main

    rows = [
        {"task": "key_retrieval", "id": "k0", "prediction": "The access code of Ada Pike is 12345.",
         "answers": ["12345"], "all_classes": None, "length": 10, "score": 0.25},
        {"task": "key_retrieval", "id": "k1", "prediction": "54321", "answers": ["54321"], "all_classes": None,
         "length": 10, "score": 1.0},
        {"task": "single_doc_qa", "id": "s0", "prediction": "Ada Pike", "answers": ["Ada Pike"], "all_classes": None,
         "length": 10, "score": 1.0},
    ]
    old = {"tasks": {"key_retrieval": {"metric": "qa_f1", "samples": 2, "score": 62.5},
                     "single_doc_qa": {"metric": "qa_f1", "samples": 1, "score": 100.0}},
           "average": 81.25, "average_definition": "x", "samples": 3, "skipped": 0, "skipped_by_task": {},
           "skipped_samples": [], "likelihood": {"answer_logprob": -1.5}, "fidelity": {"exact_match": 0.5}}
    run = tmp_path / "results" / "m" / "synthetic" / "full_bs32_abc"
    write_run(run, rows, old)
    before = (run / "predictions.jsonl").read_text().splitlines()

    assert main(["--check", str(tmp_path / "results")]) == 1
    assert json.loads((run / "scores.json").read_text()) == old, "--check changes nothing"
    assert main([str(tmp_path / "results")]) == 0
    assert "key_retrieval qa_f1->string_match_all 62.5->100.0" in capsys.readouterr().out

    scores = json.loads((run / "scores.json").read_text())
    assert scores["tasks"]["key_retrieval"] == {"metric": "string_match_all", "samples": 2, "score": 100.0}
    assert scores["tasks"]["single_doc_qa"]["score"] == 100.0 and scores["average"] == 100.0
    assert scores["likelihood"] == old["likelihood"] and scores["fidelity"] == old["fidelity"]
    assert scores["rescored"]["changed"] == {"key_retrieval": {"metric": ["qa_f1", "string_match_all"], "score": [62.5, 100.0]}}
    after = (run / "predictions.jsonl").read_text().splitlines()
    assert [json.loads(line)["score"] for line in after] == [1.0, 1.0, 1.0]
    assert after[1:] == before[1:], "rows whose score did not change stay byte for byte"
    assert main(["--check", str(run)]) == 0


def test_rescore_refuses_a_path_without_runs(tmp_path, capsys):
    from harness.scoring.rescore import main

    assert main([str(tmp_path)]) == 2
    assert "no complete run directory" in capsys.readouterr().err
