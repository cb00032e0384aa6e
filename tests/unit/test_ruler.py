"""RULER generated here: sizes in the model's tokens, needles where the depth says, stratified
depths, the authors' string-match scoring, and refusals before any model loads (no engine)."""
from __future__ import annotations

import json

import pytest

from harness.tasks import DataError, load_samples, task_spec
from harness.tasks.ruler import dataset as ruler
from harness.tasks.prompts import build_prompt
from harness.tasks.metrics import score_sample
from harness.config.models import resolve_model_path

LENGTHS = (1024, 2048)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path("embedded:smollm2-135m-instruct"))


@pytest.fixture(scope="module")
def samples(tokenizer):
    return ruler.generate(tokenizer, seed=0, lengths=LENGTHS, samples_per_length=3)


def test_every_task_at_every_length_fits_its_length_with_the_answer(samples, tokenizer):
    assert {s.task for s in samples} == set(ruler.TASKS) and len(samples) == len(ruler.TASKS) * len(LENGTHS) * 3
    for sample in samples:
        spec = task_spec(sample.task)
        prompt = build_prompt(sample, spec, tokenizer, max_prompt_tokens=10**6)
        total = len(prompt.token_ids) + spec.max_new_tokens
        assert sample.length - 160 <= total <= sample.length, (sample.id, total)
        assert prompt.text.endswith(sample.meta["answer_prefix"]), "the answer prefix ends the prompt"
        context = sample.meta.get("preamble", "") + sample.context
        for answer in sample.answers:
            assert answer in context, (sample.id, answer)
        if sample.task.startswith("niah"):  # each asked key's needles, and no other needle, name it
            for key in sample.input.replace(", and ", ", ").split(", "):
                assert context.count(f" for {key} is: ") == len(sample.answers) // (sample.input.count(",") + 1), sample.id


def test_a_sample_is_the_same_for_the_same_seed_and_differs_for_another(tokenizer, samples):
    again = ruler.generate(tokenizer, seed=0, tasks=["niah_single_1", "cwe"], lengths=(1024,), samples_per_length=2)
    first = {s.id: s for s in samples}
    assert all(s == first[s.id] for s in again)
    other = ruler.generate(tokenizer, seed=1, tasks=["niah_single_1"], lengths=(1024,), samples_per_length=1)
    assert other[0].answers != first["niah_single_1-1024-0"].answers


def test_single_needles_sit_at_their_recorded_depth_and_depths_are_stratified(samples, tokenizer):
    singles = [s for s in samples if s.task in ("niah_single_1", "niah_single_2_generated", "qa_generated")]
    for sample in singles:
        needle = sample.answers[0] if sample.task != "qa_generated" else sample.input.split(" was ")[1].removesuffix(" born?")
        where = sample.context.find(needle) / len(sample.context)
        assert abs(100 * where - sample.meta["depth"]) < 12, (sample.id, where, sample.meta["depth"])
    # Ten samples at one length cover at least eight of ten depth bands (any prefix spreads).
    ten = ruler.generate(tokenizer, seed=3, tasks=["niah_single_1"], lengths=(1024,), samples_per_length=10)
    assert len({int(s.meta["depth"] // 10.01) for s in ten}) >= 8
    assert "depth" not in next(s for s in samples if s.task == "niah_multivalue_generated").meta


def test_texts_follow_the_authors_templates(samples):
    one = next(s for s in samples if s.task == "niah_single_1")
    assert task_spec("niah_single_1").template.startswith("A special magic number is hidden within the following text.")
    assert one.meta["answer_prefix"] == f" The special magic number for {one.input} mentioned in the provided text is"
    assert "One of the special magic numbers for " + one.input + " is: " + one.answers[0] + "." in one.context
    many = next(s for s in samples if s.task == "niah_multiquery_generated")
    assert many.input.count(", ") == 3 and ", and " in many.input and len(many.answers) == 4
    chain = next(s for s in samples if s.task == "vt")
    assert f"VAR {chain.answers[0]} = {chain.input}" in chain.context
    assert chain.meta["answer_prefix"].startswith(" Answer: According to the chain(s) of variable assignment in the "
                                                  f"text above, 5 variables are assigned the value {chain.input}")
    words = next(s for s in samples if s.task == "cwe")
    assert words.meta["preamble"].count("Question: What are the 10 most common words") == 1 and len(words.answers) == 10
    assert ruler.templates()["_source"].startswith("Task texts of RULER (NVIDIA/RULER")


def test_scoring_is_string_match():
    assert task_spec("vt").metric == "string_match_all" and task_spec("qa_generated").metric == "string_match_part"
    assert score_sample("vt", "they are: ABCDE, fghij and KLM", ["abcde", "FGHIJ", "XYZ", "QQQ"]) == 0.5
    assert score_sample("niah_single_1", "is 1234567.", ["1234567"]) == 1.0
    assert score_sample("qa_generated", "Arlen or Brisk", ["Brisk", "Calder"]) == 1.0
    assert score_sample("qa_generated", "Dunmore", ["Brisk", "Calder"]) == 0.0


def test_bad_ruler_configs_are_refused_before_any_model_loads(tmp_path):
    from harness.config import ConfigError, DataSettings, run_settings

    from tests.unit.test_config import compose_cfg

    def check(*overrides):
        run_settings(compose_cfg("data=ruler", f"output_dir={tmp_path}", *overrides))

    check("data.lengths=[1024,8192]")  # SmolLM2's context: accepted
    with pytest.raises((ConfigError, DataError), match=r"data.lengths \[16384\] exceed model .*max_model_len=8192"):
        check("data.lengths=[1024,16384]")
    with pytest.raises((ConfigError, DataError), match="data.lengths is a list of RULER sample lengths"):
        check("data.lengths=[100]")
    with pytest.raises((ConfigError, DataError), match="unknown task.*niah_single_2 for ruler; valid: niah_single_1"):
        check("data.tasks=[niah_single_2]")

    with pytest.raises(DataError, match="needs its tokenizer"):
        load_samples(DataSettings("ruler", "ruler", limit=1, lengths=(1024,)))


def test_needle_heatmaps_place_scores_by_depth_and_length(tmp_path):
    import pandas as pd

    from harness.analysis.plots import depth_samples, needle_heatmaps

    runs = []
    for variant, budget, hit in (("full", float("nan"), 1.0), ("paged", 256.0, 0.0)):
        run_dir = tmp_path / variant
        run_dir.mkdir()
        rows = [{"task": "niah_single_1", "id": f"x{i}", "score": hit, "length": length, "depth": depth}
                for i, (length, depth) in enumerate([(1024, 5.0), (2048, 95.0)])]
        rows.append({"task": "cwe", "id": "y", "score": 0.5, "length": 1024, "depth": None})
        (run_dir / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        runs.append({"run_dir": str(run_dir), "variant": variant, "budget": budget})
    table = depth_samples(pd.DataFrame(runs))
    assert sorted(table["band"]) == [0, 0, 9, 9] and set(table["score"]) == {0.0, 100.0}
    figures = needle_heatmaps(pd.DataFrame(runs), "test")
    assert [budget for budget, _ in figures] == ["256"]
    axes = figures[0][1].axes
    assert [ax.get_title() for ax in axes[:2]] == ["full", "paged b256"]
    full_grid = axes[0].images[0].get_array()
    assert full_grid[0, 0] == 100 and full_grid[9, 1] == 100 and full_grid.mask[5, 0]


def test_needle_heatmap_titles_fit_their_panels(tmp_path):
    """RULER's variants all carry decode_eviction=False: spelled out in each panel's title
    (``h2o[decode_eviction=False] r0.5``) they ran into each other. The option every evicting panel
    shares goes to the figure's title once; what sets a panel apart stays, wrapped under it."""
    import pandas as pd

    from harness.analysis.plots import needle_heatmaps, panel_titles

    titles, common = panel_titles(["full", "h2o[decode_eviction=False]", "paged[decode_eviction=False]",
                                   "paged[candidates=local, decode_eviction=False, per_head=True]"], "r0.5")
    assert common == ["decode_eviction=False"]
    assert titles == ["full", "h2o r0.5", "paged r0.5", "paged r0.5\n[candidates=local,\nper_head=True]"]
    assert max(len(line) for title in titles for line in title.splitlines()) <= 24
    assert panel_titles(["full", "paged", "paged[per_head=True]"], "256") == (
        ["full", "paged b256", "paged b256\n[per_head=True]"], [])

    runs = []
    for variant, ratio in (("full", float("nan")), ("h2o[decode_eviction=False]", 0.5),
                           ("paged[decode_eviction=False]", 0.5)):
        run_dir = tmp_path / variant.split("[")[0]
        run_dir.mkdir()
        row = {"task": "niah_single_1", "id": "x", "score": 1.0, "length": 1024, "depth": 50.0}
        (run_dir / "predictions.jsonl").write_text(json.dumps(row) + "\n")
        runs.append({"run_dir": str(run_dir), "variant": variant, "budget": float("nan"), "budget_ratio": ratio})
    ((budget, figure),) = needle_heatmaps(pd.DataFrame(runs), "test")
    assert budget == "r0.5"
    assert [ax.get_title() for ax in figure.axes[:3]] == ["full", "h2o r0.5", "paged r0.5"]
    assert figure._suptitle.get_text() == ("test, budget r0.5; every policy but full cache with "
                                           "decode_eviction=False (blank: no sample)")


def test_variable_tracking_is_the_same_in_every_process():
    """A chain drawn through a set would follow the process's string hash seed."""
    import subprocess
    import sys

    code = ("import random; from harness.tasks.ruler.dataset import variable_tracking; "
            "print(variable_tracking(random.Random('s'), 5, [10, 30, 50, 70, 90])['answers'])")
    chains = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={"PYTHONHASHSEED": str(seed), "PATH": ""}).stdout for seed in (1, 2, 3)}
    assert len(chains) == 1, chains


def test_common_words_keep_ten_common_and_an_uncommon_word_at_4096(tokenizer):
    samples = ruler.generate(tokenizer, seed=0, lengths=(4096,), samples_per_length=4, tasks=["cwe"])
    for sample in samples:
        assert len(sample.answers) == 10, (sample.id, len(sample.answers))
        words = set(sample.context.split()) - {w for w in sample.context.split() if w.endswith(".")}
        assert len(words) > 10, (sample.id, "no uncommon word listed")
