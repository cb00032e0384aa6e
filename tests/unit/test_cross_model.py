"""The cross-model table (harness.analysis.cross_model) on small hand-made studies in the run-directory
format: which comparisons against full cache decide alike, Kendall's tau between the orders of
policies with its bootstrap interval, and the refusal of two studies that differ in cells or samples."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from harness.analysis.aggregate import load_runs, write_summary
from harness.analysis.cross_model import Refused, agreement, compare_studies, kendall_tau, main, order_agreement
from harness.analysis.report import across_models_lines
from harness.analysis.studies import Study
from harness.analysis.verdicts import ACROSS_MODELS
from tests.support.recompute_intervals import comparisons
from tests.unit.test_aggregate import write_run

FULL = np.tile([1.0, 0.0], 10)  # 20 samples per task: full cache answers every other one


def write_cell(root: Path, model: str, policy: str, budget, per_sample: dict[str, np.ndarray],
               ratio: float | None = None) -> Path:
    """One cell (``write_run``'s files) of ``model``, at a token budget or a compression ratio."""
    write_run(root, "d", policy, budget, {task: [{"score": float(s)} for s in scores]
                                          for task, scores in per_sample.items()})
    run = root / "m" / "d" / f"{policy}_{budget}"
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["model"]["name"] = model
    if ratio is not None:
        config["budget_ratio"] = ratio
        run = run.rename(run.with_name(f"{policy}_r{ratio}"))
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    return run


def write_study(root: Path, model: str, cells: dict[str, np.ndarray], budget=256) -> Path:
    """Full cache and one cell per policy at ``budget``, the same scores on tasks qa and code."""
    write_cell(root, model, "full", None, {"qa": FULL, "code": FULL})
    for policy, scores in cells.items():
        write_cell(root, model, policy, budget, {"qa": scores, "code": scores})
    return root


def test_each_comparison_is_classified_by_how_it_decides_on_both_models(tmp_path, capsys):
    """Known answers: paged loses every answer on both models (worse on both); snapkv is full cache
    on a and loses every answer on b (decided on b only); knorm answers everything on a and nothing on
    b (better, then worse: opposite); streaming differs from full cache by one sample on a and not at
    all on b (undecided on both, and never called agreement)."""
    one_off = FULL.copy()
    one_off[1] = 1.0
    a = write_study(tmp_path / "a", "a-model", {"paged": np.zeros(20), "snapkv": FULL, "knorm": np.ones(20),
                                                "streaming": one_off})
    b = write_study(tmp_path / "b", "b-model", {"paged": np.zeros(20), "snapkv": np.zeros(20), "knorm": np.zeros(20),
                                                "streaming": FULL})
    study_a, study_b, frame, _ = compare_studies(a, b)
    verdicts = frame.set_index("policy")[["a_verdict", "b_verdict", "across_models"]]
    assert verdicts.loc["paged"].tolist() == ["worse", "worse", "same direction on both"]
    assert verdicts.loc["snapkv", "across_models"] == "decided on b-model only"
    assert verdicts.loc["knorm"].tolist() == ["better", "worse", "opposite ways"]
    assert verdicts.loc["streaming", "across_models"] == "undecided on both"
    # Each side's difference and Holm-adjusted p are its own study's (aggregate's columns, unchanged).
    own = load_runs([a]).drop_duplicates("run_dir").set_index("policy.name")
    assert frame.set_index("policy").loc["knorm", "a_minus_full"] == own.loc["knorm", "avg_vs_full_diff"] == 50.0
    assert frame.set_index("policy").loc["knorm", "a_minus_full_p_holm"] == own.loc["knorm", "avg_vs_full_p_holm"]

    assert main([str(a), str(b), "--out", str(tmp_path / "out"), "--no-plots"]) == 0
    markdown = (tmp_path / "out" / "summary.md").read_text()
    assert capsys.readouterr().out.startswith(markdown)
    design = markdown.splitlines()[2]
    assert design.startswith("What this design can decide: a-model: 2 of 4 decided") and "b-model: 3 of 4 decided" in design
    assert ("1 same direction on both, 1 opposite ways, 0 decided on a-model only, 1 decided on b-model only, "
            "1 undecided on both") in markdown
    listed = [line for line in markdown.splitlines() if line.startswith("- ")]
    assert "- undecided on both (1): streaming 256 (non-inferior / equivalent)" in listed
    assert not any("agree" in line for line in listed)
    csv = pd.read_csv(tmp_path / "out" / "summary.csv")
    assert len(csv) == 5 and set(csv["across_models"].dropna()) == {
        "same direction on both", "decided on b-model only", "opposite ways", "undecided on both"}
    # Each interval with a p beside it is the difference's: the committed-interval check
    # (tests/support/recompute_intervals.py) reads every <stem>low/high/p trio as one comparison,
    # so an average's BCa interval must not share a stem with the difference's p.
    assert {stem for _, stem in comparisons(csv)} == {"a_minus_full_", "b_minus_full_"}


def test_agreement_counts_only_holm_decisions():
    """Only better/worse are decided; equivalent, non-inferior, inconclusive and no verdict are not."""
    assert agreement("worse", "worse", "a", "b") == ACROSS_MODELS[0]
    assert agreement("better", "worse", "a", "b") == "opposite ways"
    assert agreement("worse", "equivalent", "a", "b") == "decided on a only"
    assert agreement("no verdict", "better", "a", "b") == "decided on b only"
    for undecided in ("equivalent", "non-inferior", "inconclusive", "no verdict"):
        assert agreement(undecided, "inconclusive", "a", "b") == "undecided on both"


def test_kendall_tau_b_counts_pairs_and_ties():
    x = np.array([[1.0, 2.0, 3.0, 4.0]])
    assert kendall_tau(x, x)[0] == 1.0 and kendall_tau(x, -x)[0] == -1.0
    assert kendall_tau(x, np.array([[2.0, 1.0, 3.0, 4.0]]))[0] == pytest.approx(4 / 6)  # one of six pairs swapped
    tied = np.array([[1.0, 1.0, 3.0, 4.0]])
    assert kendall_tau(tied, x)[0] == pytest.approx(5 / np.sqrt(5 * 6))  # tau-b: the tied pair left out of one side
    assert np.isnan(kendall_tau(np.ones((1, 4)), x)[0])  # every policy tied: undefined


def policies(rng: np.random.Generator, samples: int, means: list[float]) -> list[dict[str, pd.Series]]:
    """Per policy, noisy per-sample scores on two tasks around its mean."""
    ids = {task: [f"{task}-{i}" for i in range(samples)] for task in ("qa", "code")}
    return [{task: pd.Series(rng.normal(mean, 0.5, samples), index=ids[task]) for task in ids} for mean in means]


def test_tau_is_one_for_the_same_order_and_minus_one_reversed_with_an_interval_that_narrows():
    rng = np.random.default_rng(7)
    means = [0.1, 0.3, 0.5, 0.7, 0.9]
    shifted = [{task: series + 0.2 for task, series in cell.items()} for cell in policies(rng, 200, means)]
    same = order_agreement("d", "256", shifted, [{t: s * 2 for t, s in cell.items()} for cell in shifted])
    assert (same.tau, same.low, same.high) == (1.0, 1.0, 1.0)  # every resample keeps the order
    reversed_ = order_agreement("d", "256", shifted, shifted[::-1])
    assert (reversed_.tau, reversed_.low, reversed_.high) == (-1.0, -1.0, -1.0)

    # Two models with the same true order, each with its own noise: tau's interval holds the
    # estimate, and is narrower with more samples.
    widths = []
    for samples in (10, 160):
        found = order_agreement("d", "256", policies(rng, samples, means), policies(rng, samples, means))
        assert found.low <= found.tau <= found.high
        assert found.mc_error < 0.0025 or found.resamples >= 1_280_000
        widths.append(found.high - found.low)
    assert widths[1] < widths[0]
    assert found.low > 0 and found.reading == "excludes 0: the orders agree"
    # Seeded from the data: the same scores give the same interval.
    first, second = policies(np.random.default_rng(3), 40, means), policies(np.random.default_rng(4), 40, means)
    assert order_agreement("d", "256", first, second) == order_agreement("d", "256", first, second)


def test_a_study_against_its_copy_reads_its_summary_and_agrees_everywhere(tmp_path):
    """Ratios as keys (RULER's cells), the study's own summary.csv read where it matches its runs and
    recomputed where it does not; the same runs on both sides: tau 1 at every ratio and every decided
    comparison decided the same way."""
    rng = np.random.default_rng(1)
    root = tmp_path / "ruler"
    write_cell(root, "m", "full", None, {"qa": FULL, "code": FULL})
    for ratio, loss in ((0.25, 0.1), (0.75, 0.6)):
        for index, policy in enumerate(("paged", "snapkv", "knorm")):
            keep = rng.random(20) > loss * (1 + index) / 2
            write_cell(root, "m", policy, None, {"qa": FULL * keep, "code": FULL * (rng.random(20) > loss)}, ratio)
    write_summary(load_runs([root]), root, "python -m harness.analysis.aggregate ruler")
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    scores = copy / "m" / "d" / "paged_r0.25" / "scores.json"
    scores.write_text(json.dumps(dict(json.loads(scores.read_text()), average=99.0)))  # out of step with its summary

    a, b, frame, found = compare_studies(root, copy)
    assert a.source == "its `summary.csv`" and "does not match its runs" in b.source
    assert [(o.budget, o.tau, o.low, o.high) for o in found] == [("r0.25", 1.0, 1.0, 1.0), ("r0.75", 1.0, 1.0, 1.0)]
    assert set(frame["budget"]) == {"all", "r0.25", "r0.75"}
    assert set(frame["across_models"].dropna()) <= {"same direction on both", "undecided on both"}
    evicting = frame[frame["policy"] != "full"]
    assert (evicting["a_verdict"] == evicting["b_verdict"]).all() and (evicting["a_minus_full_p_holm"] == evicting["b_minus_full_p_holm"]).all()


def test_studies_with_other_cells_or_other_samples_are_refused_in_one_line(tmp_path, capsys):
    a = write_study(tmp_path / "a", "a-model", {"paged": np.zeros(20), "snapkv": FULL})
    fewer = write_study(tmp_path / "fewer", "b-model", {"paged": np.zeros(20)})
    with pytest.raises(Refused, match=r"do not have the same cells \(only in .*/a: snapkv 256\)"):
        compare_studies(a, fewer)

    other = write_study(tmp_path / "other", "b-model", {"paged": np.zeros(20), "snapkv": FULL})
    predictions = other / "m" / "d" / "snapkv_256" / "predictions.jsonl"
    rows = [json.loads(line) for line in predictions.read_text().splitlines()]
    rows[0]["id"] = "qa-elsewhere"
    predictions.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert main([str(a), str(other), "--out", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "did not score the same samples: snapkv 256 qa" in error
    assert not (tmp_path / "out").exists()


def test_results_md_sets_a_second_models_study_beside_the_first_from_its_across_models_folder(tmp_path):
    """``report.across_models_lines``: RESULTS.md gives each second-model study the counts of how its
    comparisons decide on both models and tau per budget, read from the folder cross_model wrote;
    nothing where the study repeats none, or the folder is not there yet."""
    a = write_study(tmp_path / "a", "a-model", {"paged": np.zeros(20), "knorm": np.ones(20), "streaming": FULL})
    b = write_study(tmp_path / "b", "b-model", {"paged": np.zeros(20), "knorm": np.zeros(20), "streaming": FULL})
    study = Study("second", "On the second model", "paged", across="first")
    assert across_models_lines(study, tmp_path) == []  # not compared yet
    out = tmp_path / "results" / "second" / "across_models"
    assert main([str(a), str(b), "--out", str(out), "--no-plots"]) == 0
    lines = across_models_lines(study, tmp_path)
    assert lines[0].startswith("**Across models**: `results/second/across_models/summary.md`")
    assert "Of the 3 comparisons against full cache" in lines[0]
    assert ("1 same direction on both, 1 opposite ways, 0 decided on a-model only, 0 decided on b-model only, "
            "1 undecided on both.") in lines[0]  # every class, in cross_model's order, the empty ones too
    orders = pd.read_csv(out / "orders.csv")
    assert lines[-2] == (f"| d | 256 | 3 | {orders['kendall_tau'][0]:+.2f} ({orders['low'][0]:+.2f}, "
                         f"{orders['high'][0]:+.2f}) |")
    assert across_models_lines(Study("second", "On the second model", "paged"), tmp_path) == []
