"""Aggregation and plots over the committed CI baseline results, the notebook over five of the committed
CPU sweep's runs (no engine)."""
from __future__ import annotations

import itertools
import json
import math
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from harness.analysis.aggregate import load_runs, main as aggregate_main, score_table, system_table
from tests.support import ROOT
from tests.support.ci_baseline import CI_BASELINE, baseline_policies

# The committed baseline's policies, read from its cells (a newly registered policy has none until
# they are added: tests/engine/test_regression.py says so, and only it).
SWEPT = baseline_policies()
CELLS = 1 + 2 * (len(SWEPT) - 1)  # full cache once, every other policy at two budgets


@pytest.fixture(scope="module")
def frame():
    return load_runs([CI_BASELINE])


@pytest.mark.slow  # the CI baseline's frame: 607 exact test-inverting intervals (about 18 s)
def test_one_row_per_run_and_task_with_every_config_key(frame):
    assert frame["run_dir"].nunique() == CELLS
    assert {"policy.name", "budget", "model.name", "data.name", "block_size", "engine.device", "policy.options.n_sink"} <= set(frame.columns)
    assert set(frame["task"]) == {"single_doc_qa", "key_retrieval", "code_completion"}
    full = frame[frame["policy.name"] == "full"]
    assert full["budget"].isna().all(), "full cache has no budget"
    assert ((full["retention_pct"] == 100) | full["retention_pct"].isna()).all()
    assert (full["throughput_vs_full"] == 1).all()
    evicting = frame[frame["policy.name"] != "full"]
    assert evicting["fidelity_exact_match"].notna().all(), "fidelity to full cache for every non-full run"
    assert (evicting["kv_blocks_peak"] <= full["kv_blocks_peak"].max()).all(), "eviction never holds more KV"


@pytest.mark.slow  # the CI baseline's frame: 607 exact test-inverting intervals (about 18 s)
def test_score_table_is_policy_by_budget(frame):
    table = score_table(frame)
    assert list(table.index) == [("full", "all")] + [(name, budget) for name in SWEPT if name != "full"
                                                     for budget in ("256", "512")]
    assert list(table.columns) == ["code_completion", "key_retrieval", "single_doc_qa", "average"]


def test_tables_read_full_cache_first_and_budgets_in_numeric_order():
    from harness.analysis.aggregate import add_relative_columns, find_runs, run_rows

    # The runs' rows without their intervals (what these two tables show; the intervals of 37 runs
    # and 234 comparisons take half a minute): budgets 256, 512, 1024.
    runs = find_runs([ROOT / "results" / "cpu_accuracy"])
    cpu_sweep = add_relative_columns(pd.DataFrame([row for run in runs for row in run_rows(run)]))
    for table in (score_table(cpu_sweep), system_table(cpu_sweep)):
        rows = list(table.index)
        assert rows[0] == ("full", "all")
        assert rows[1:4] == [("h2o", "256"), ("h2o", "512"), ("h2o", "1024")]  # alphabetical, then by budget
    retention = system_table(cpu_sweep)["retention_avg_pct"]
    averages = score_table(cpu_sweep)["average"]
    assert retention[("full", "all")] == 100
    for row in [("paged", "256"), ("streaming", "1024")]:
        assert retention[row] == pytest.approx(100 * averages[row] / averages[("full", "all")], abs=0.1)


@pytest.mark.slow  # draws six plot files
def test_cli_writes_summary_and_plots(frame, tmp_path, capsys, monkeypatch):
    """The command line over the CI baseline. Its aggregation is the frame fixture's, load_runs of the
    same root with no task dropped (a pure function of the committed files, tested above): the CLI
    is handed a copy of it instead of aggregating the baseline a second time."""
    from harness.analysis import aggregate

    calls = []

    def loaded(roots, drop_tasks=()):
        calls.append((list(roots), tuple(drop_tasks)))
        return frame.copy(deep=True)

    monkeypatch.setattr(aggregate, "load_runs", loaded)
    assert aggregate_main([str(CI_BASELINE), "--out", str(tmp_path)]) == 0
    assert calls == [([CI_BASELINE], ())], "the CLI aggregates the root it was given, no task dropped"
    assert (tmp_path / "summary.csv").read_text().count("\n") == CELLS * 3 + 1
    markdown = (tmp_path / "summary.md").read_text()
    assert "Produced by `python -m harness.analysis.aggregate" in markdown and re.search(r"\| paged +\| 256 +\|", markdown)
    for kind in ("score_vs_budget", "throughput", "tradeoff"):
        for ext in ("png", "pdf"):
            assert (tmp_path / f"smollm2-135m_synthetic_{kind}.{ext}").stat().st_size > 5000
    assert "## smollm2-135m on synthetic" in capsys.readouterr().out


# The committed CPU sweep's runs the notebook test reads: full cache and two policies at two
# budgets, so every table has rows, paired differences and budgets to order, and every plot points.
# (CI time: the notebook's first cell aggregates every run it finds, intervals and comparisons
# included: 62 s for the sweep's 37 runs, 5 s for these 5. The aggregation itself is tested above
# on the CI baseline, the tables' order on the whole sweep.)
NOTEBOOK_RUNS = ("full_bs32_", "paged_b256_", "paged_b512_", "snapkv_b256_", "snapkv_b512_")


@pytest.mark.slow  # a Jupyter kernel runs the whole notebook
def test_notebook_runs_top_to_bottom(tmp_path, monkeypatch):
    """Every cell, top to bottom, as a user runs it on their own results (``KVH_RESULTS``): here
    five of the committed CPU sweep's runs (``NOTEBOOK_RUNS``), their files linked into a results
    tree of the same layout."""
    import nbformat
    from nbclient import NotebookClient

    sweep = ROOT / "results" / "cpu_accuracy"
    chosen = [run for run in sorted(sweep.glob("*/*/*")) if run.is_dir() and run.name.startswith(NOTEBOOK_RUNS)]
    assert len(chosen) == len(NOTEBOOK_RUNS), chosen
    for run in chosen:
        linked = tmp_path.joinpath(*run.relative_to(sweep).parts)
        linked.mkdir(parents=True)
        for file in run.iterdir():  # (find_runs does not descend into a linked directory: link the files)
            (linked / file.name).symlink_to(file)
    notebook = nbformat.read(ROOT / "notebooks" / "analysis.ipynb", as_version=4)
    monkeypatch.setenv("KVH_ROOT", str(ROOT))  # (the kernel inherits this process's environment)
    monkeypatch.setenv("KVH_RESULTS", str(tmp_path))
    NotebookClient(notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT / "notebooks")}}).execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    printed = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert f"{len(NOTEBOOK_RUNS)} runs, " in printed, "the notebook read the results it was pointed at"
    assert sum("image/png" in o.get("data", {}) for o in outputs) >= 2, "the plots are drawn"


def textbook_bca(by_task: dict[str, np.ndarray], scale: float = 100) -> tuple[float, float, bool]:
    """Efron's BCa for the mean over tasks of the task means, written out, and whether it is exact.

    The bootstrap distribution: where every task's samples take so few values that there are at
    most 100,000 distinct resamples in all, exactly, every resample of a task enumerated as how
    often each distinct value is drawn (multinomial probabilities), tasks combined; else from
    1,000,000 resamples per task of a generator seeded 0. z0 from its share below the estimate
    (ties counted half), the acceleration from the jackknife leaving out one sample at a time,
    the bounds its quantiles at the shifted levels."""
    from statistics import NormalDist

    tasks = sorted(by_task)
    values = [scale * np.asarray(by_task[t], dtype=float) for t in tasks]
    estimate = np.mean([v.mean() for v in values])
    distinct = [np.unique(v, return_counts=True) for v in values]
    exact = math.prod(math.comb(len(v) + len(u) - 1, len(u) - 1) for v, (u, _) in zip(values, distinct)) <= 100_000
    if exact:
        outcomes = {0.0: 1.0}
        for v, (u, c) in zip(values, distinct):
            task = {}
            for drawn in itertools.combinations_with_replacement(range(len(u)), len(v)):
                counts = np.bincount(drawn, minlength=len(u))
                probability = math.factorial(len(v)) / math.prod(math.factorial(k) for k in counts) * math.prod(
                    (ci / len(v)) ** k for ci, k in zip(c, counts))
                key = round(float(counts @ u) / len(v) / len(values), 9)
                task[key] = task.get(key, 0.0) + probability
            combined = {}
            for a, pa in outcomes.items():
                for b, pb in task.items():
                    combined[round(a + b, 9)] = combined.get(round(a + b, 9), 0.0) + pa * pb
            outcomes = combined
        support = np.array(sorted(outcomes))
        probabilities = np.array([outcomes[x] for x in support])
    else:
        rng = np.random.default_rng(0)
        support = np.sort(np.mean([v[rng.integers(0, len(v), size=(1_000_000, len(v)))].mean(axis=1) for v in values],
                                  axis=0))
        probabilities = np.full(len(support), 1 / len(support))
    normal = NormalDist()
    tie = np.abs(support - estimate) <= 1e-9 * max(1.0, abs(estimate))
    z0 = normal.inv_cdf(probabilities[(support < estimate) & ~tie].sum() + 0.5 * probabilities[tie].sum())
    jack = np.array([np.mean([np.delete(v, i).mean() if k == j else w.mean() for k, w in enumerate(values)])
                     for j, v in enumerate(values) for i in range(len(v))])
    spread = jack.mean() - jack
    a = np.sum(spread ** 3) / (6 * np.sum(spread ** 2) ** 1.5)
    levels = [normal.cdf(z0 + (z0 + z) / (1 - a * (z0 + z))) for z in (normal.inv_cdf(0.025), normal.inv_cdf(0.975))]
    cumulative = np.cumsum(probabilities)
    low, high = (float(support[min(np.searchsorted(cumulative, level), len(support) - 1)]) for level in levels)
    return low, high, exact


@pytest.mark.slow  # the CI baseline's frame: 607 exact test-inverting intervals (about 18 s)
def test_intervals_recomputed_from_the_per_sample_scores_match(frame):
    """The documented intervals, for one task, the average and one paired difference, recomputed
    from predictions.jsonl: a cell's BCa interval with numpy and the textbook formula, equal where
    the bootstrap distribution is exact (a task's few score values), within the reported Monte
    Carlo error where it is drawn; the difference's interval (the shifts its sign-flip test does not
    reject) by tests/support/recompute_intervals.py, which shares no code with harness/."""
    def scores(run):
        rows = [json.loads(line) for line in (Path(run["run_dir"].iloc[0]) / "predictions.jsonl").read_text().splitlines()]
        return {task: pd.Series({r["id"]: r["score"] for r in rows if r["task"] == task})
                for task in sorted({r["task"] for r in rows})}

    def agrees(low, high, mc, by_task):
        textbook_low, textbook_high, exact = textbook_bca(by_task)
        if exact:
            return mc == 0 and (low, high) == (round(textbook_low, 2), round(textbook_high, 2))
        # Both drawn: 4 of the summary's standard errors, plus the textbook's own (a third as large) and rounding.
        return mc > 0 and max(abs(low - textbook_low), abs(high - textbook_high)) <= 5 * mc + 0.01

    run = frame[(frame["policy.name"] == "paged") & (frame["budget"] == 512)]
    other = frame[(frame["policy.name"] == "streaming") & (frame["budget"] == 512)]
    mine, theirs = scores(run), scores(other)
    task = "single_doc_qa"
    row = run[run["task"] == task].iloc[0]
    assert textbook_bca({task: mine[task].to_numpy()})[2], "few score values: an exact interval"
    assert agrees(row["score_low"], row["score_high"], row["score_mc"], {task: mine[task].to_numpy()})
    assert not textbook_bca({t: v.to_numpy() for t, v in mine.items()})[2], "code completion's many values: drawn"
    assert agrees(row["average_low"], row["average_high"], row["average_mc"], {t: v.to_numpy() for t, v in mine.items()})
    assert row["score_low"] <= row["score"] <= row["score_high"]
    differences = {t: (mine[t] - theirs[t][mine[t].index]).to_numpy() for t in mine}
    from tests.support.recompute_intervals import interval

    _, low, high, p = interval(differences, 100)
    assert row["avg_vs_streaming_p"] == pytest.approx(p, abs=0.02)
    mc = row["avg_vs_streaming_mc"]  # 0 when exact; the recomputation's 400,000 patterns add a third as much
    tolerance = 5 * mc + 0.011
    assert abs(row["avg_vs_streaming_low"] - low) <= tolerance and abs(row["avg_vs_streaming_high"] - high) <= tolerance, (
        row[["avg_vs_streaming_low", "avg_vs_streaming_high", "avg_vs_streaming_mc"]].tolist(), low, high)
    assert row["avg_vs_streaming_diff"] == pytest.approx(100 * np.mean([d.mean() for d in differences.values()]), abs=0.006)


@pytest.mark.slow  # the CI baseline's frame: 607 exact test-inverting intervals (about 18 s)
def test_every_score_and_paired_difference_has_its_interval_and_p_values(frame):
    assert frame[["score_low", "score_high", "score_mc", "average_low", "average_high", "average_mc"]].notna().all().all()
    evicting = frame[frame["policy.name"] != "full"]
    for stem in ("vs_full", "avg_vs_full"):
        for part in ("diff", "low", "high", "mc", "p", "p_mc", "p_flips", "p_settled", "p_holm", "p_bh"):
            assert evicting[f"{stem}_{part}"].notna().all(), f"{stem}_{part}"
    # Every bound's Monte Carlo error is below 0.1 point; an exact p-value has none.
    assert (frame.filter(regex=r"(^score|^average|vs_.*)_mc$").max() < 0.1).all()
    exact = evicting["avg_vs_full_p_flips"] == 0
    assert (evicting.loc[exact, "avg_vs_full_p_mc"] == 0).all() and (evicting.loc[~exact, "avg_vs_full_p_mc"] > 0).all()
    assert evicting["avg_vs_full_p_settled"].all()
    assert evicting["avg_vs_full_detectable"].notna().all()
    paged = evicting[evicting["policy.name"] == "paged"]
    assert paged[["avg_vs_streaming_diff", "avg_vs_knorm_low", "avg_vs_keydiff_high", "avg_vs_keydiff_p_holm"]].notna().all().all()
    assert (frame["avg_vs_full_p"].dropna().between(0, 1)).all()
    assert (frame["avg_vs_full_p_holm"].dropna() >= frame["avg_vs_full_p"].dropna()).all()
    # A paired difference is the difference of the two runs' scores on the same samples, and the
    # pair read the other way round is the same comparison: negated, with the same p-values.
    for _, row in paged.iterrows():
        streaming = evicting[(evicting["policy.name"] == "streaming") & (evicting["budget"] == row["budget"])
                             & (evicting["task"] == row["task"])].iloc[0]
        assert row["vs_streaming_diff"] == pytest.approx(row["score"] - streaming["score"], abs=0.01)
        assert (streaming["vs_paged_low"], streaming["vs_paged_high"]) == (-row["vs_streaming_high"], -row["vs_streaming_low"])
        assert (streaming["vs_paged_mc"], streaming["avg_vs_paged_mc"]) == (row["vs_streaming_mc"], row["avg_vs_streaming_mc"])
        for part in ("avg_vs_{}_p", "avg_vs_{}_p_mc", "avg_vs_{}_p_flips", "avg_vs_{}_p_holm", "vs_{}_p_bh"):
            assert streaming[part.format("paged")] == row[part.format("streaming")]


@pytest.mark.slow  # the CI baseline's frame: 607 exact test-inverting intervals (about 18 s)
def test_a_table_is_one_family_adjusted_by_holm_and_bh(frame):
    from harness.analysis.aggregate import table_comparisons
    from harness.analysis.stats import benjamini_hochberg, holm

    family = table_comparisons(frame)
    evicting = len(SWEPT) - 1
    # Each evicting policy against full cache at both budgets, each pair of them once per budget.
    assert len(family) == 2 * evicting + 2 * evicting * (evicting - 1) // 2
    assert family["p_holm"].tolist() == pytest.approx(holm(family["p"].tolist()))
    assert family["p_bh"].tolist() == pytest.approx(benjamini_hochberg(family["p"].tolist()))
    # Per task, the family is the same comparisons on that task.
    rows = frame[(frame["task"] == "key_retrieval") & (frame["policy.name"] != "full")]
    on_task = {}
    for _, row in rows.iterrows():
        for other in ["full"] + list(rows["variant"].unique()):
            if row.get(f"vs_{other}_p") == row.get(f"vs_{other}_p"):  # not NaN: a comparison
                key = frozenset([(row["variant"], row["budget"]), (other, None if other == "full" else row["budget"])])
                on_task[key] = (row[f"vs_{other}_p"], row[f"vs_{other}_p_holm"])
    assert len(on_task) == len(family)
    p, adjusted = zip(*on_task.values())
    assert list(adjusted) == pytest.approx(holm(list(p)))


@pytest.mark.slow  # the CI baseline's frame: 607 exact test-inverting intervals (about 18 s)
def test_summary_marks_only_adjusted_significance_and_says_how(frame, tmp_path):
    from harness.analysis.aggregate import differences_table, p_digits, table_comparisons, to_markdown

    table = differences_table(frame)
    runs = frame.drop_duplicates("run_dir").set_index(["variant", "budget"])
    digits = p_digits(table_comparisons(frame))
    marks = {"*": 0, "+": 0, "": 0}
    printed = {}
    for (variant, budget), row in table.iterrows():
        run = runs.loc[(variant, int(budget))]
        for column, cell in row.items():
            if not cell:
                continue
            stem = f"avg_vs_{column.removeprefix('minus ')}"
            # "diff (low, high) p=... [mark] verdict": the verdict last (harness.analysis.verdicts)
            found = re.search(r"p=\S+(?: ([*+?]))? (better|worse|equivalent|non-inferior|inconclusive|no verdict)$", cell)
            assert found, cell
            mark = found.group(1) or ""
            marks[mark] += 1
            expected = "*" if run[f"{stem}_p_holm"] < 0.05 else "+" if run[f"{stem}_p_bh"] < 0.05 else ""
            assert mark == expected, (variant, budget, column, cell)
            assert f"p={run[f'{stem}_p']:.{digits}g}" in cell and digits >= 3
            pair = frozenset([(variant, budget), (column.removeprefix("minus "), budget)])
            printed[pair] = (float(re.search(r"p=(\S+)", cell).group(1)), mark)
    assert marks["*"] and marks[""], "some differences pass Holm, some nothing"
    # A reader can redo every mark from the printed p-values (each comparison once, its family the table).
    p_values, expected_marks = zip(*printed.values())
    from harness.analysis.aggregate import significance_mark
    from harness.analysis.stats import benjamini_hochberg, holm

    redone = [significance_mark(h, b).strip() for h, b in zip(holm(list(p_values)), benjamini_hochberg(list(p_values)))]
    assert redone == list(expected_marks)
    markdown = to_markdown(frame, "python -m harness.analysis.aggregate results/ci_baseline")
    assert "95% BCa bootstrap intervals" in markdown and "`*` Holm-adjusted p < 0.05" in markdown
    # The method as it is now, and each table's Monte Carlo error where a reader sees it.
    assert "seeded by a hash of its own data" in markdown and "Every sign pattern counted where a comparison has at most 20" in markdown
    assert "Verdicts at the study's margin of 5 points" in markdown and "Smallest p this design can reach" in markdown
    assert "up to 10,000,000" in markdown and "shared seed" not in markdown and "seed 0" not in markdown
    assert re.search(r"Monte Carlo error of the bounds \(standard error\): at most 0\.0\d* points in this table", markdown)
    # The differences' bounds: exact (0) where every shifted test is enumerated, else below 0.1 point.
    assert re.search(r"Monte Carlo error \(standard error; a rerun draws the same\): bounds at most (0|0\.0\d*) points", markdown)
    assert re.search(r"The family is the table's \d+ distinct comparisons", markdown)
    assert re.search(r"Smallest true difference of the average found with 80% power .*median \d+\.\d+ points", markdown)


def test_variants_are_named_by_what_differs_from_their_defaults():
    from harness.analysis.labels import variant_label

    defaults = {"per_head": False, "candidates": "global", "local_blocks": 3, "score_layers": "all"}
    engine = {"block_size": 32}
    assert variant_label({"policy": {"name": "paged", "options": defaults}, "block_size": 32, "engine": engine}) == "paged"
    per_head = {"policy": {"name": "paged", "options": dict(defaults, per_head=True)}, "block_size": 64, "engine": engine}
    assert variant_label(per_head) == "paged[per_head=True, block_size=64]"
    assert variant_label({"policy": {"name": "knorm", "options": {"per_head": True}}, "engine": engine}) == "knorm"
    assert variant_label({"policy": {"name": "full", "options": {}}, "block_size": 32, "engine": engine}) == "full"
    snapkv = {"policy": {"name": "snapkv", "options": {}}, "block_size": 32, "engine": engine, "decode_eviction": False}
    assert variant_label(snapkv) == "snapkv[decode_eviction=False]"  # the whole prompt, question included
    assert variant_label(dict(snapkv, compress="context")) == "snapkv[compress=context]"  # before the question


def write_run(root: Path, data: str, policy: str, budget, samples: dict[str, list[dict]]) -> None:
    """A complete run directory as run.py writes one (the files aggregate reads)."""
    run = root / "m" / data / f"{policy}_{budget}"
    run.mkdir(parents=True)
    config = {"policy": {"name": policy, "options": {}}, "model": {"name": "m"}, "data": {"name": data},
              "engine": {"block_size": 32}, "budget": budget, "block_size": 32}
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    rows = [dict(task=task, id=f"{task}-{i}", **values) for task, per_sample in samples.items()
            for i, values in enumerate(per_sample)]
    (run / "predictions.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    tasks = {task: {"metric": "qa_f1", "samples": len(v), "score": round(100 * np.mean([r["score"] for r in v]), 2)}
             for task, v in samples.items()}
    (run / "scores.json").write_text(json.dumps({"tasks": tasks, "average": round(np.mean([t["score"] for t in tasks.values()]), 2)}))
    (run / "perf.json").write_text(json.dumps({"output_tokens_per_s": 1.0}))


def test_another_per_sample_field_gets_its_own_compared_table_only_where_every_run_has_it(tmp_path):
    """Synthetic runs whose prediction rows carry ``answer_logprob`` (not on a 0-100 scale): in
    data "with", every run has it and it is compared like the score, in its own units; in data
    "without", one run lacks it and nothing about it appears."""
    from harness.analysis.aggregate import QUANTITIES, table_comparisons, to_markdown

    rng = np.random.default_rng(0)
    tasks = {"qa": 12, "code": 10}
    full = {t: rng.normal(-1.5, 0.4, n) for t, n in tasks.items()}
    # paged loses 0.6 nats/token on every sample (give or take); snapkv only noise around full.
    logprob = {"full": full, "paged": {t: v - 0.6 + rng.normal(0, 0.1, len(v)) for t, v in full.items()},
               "snapkv": {t: v + rng.normal(0, 0.05, len(v)) for t, v in full.items()}}
    score = {name: {t: (rng.random(n) < 0.4).astype(float) for t, n in tasks.items()} for name in logprob}
    # KL to full cache: 0 for full cache itself; one paged sample has no value (an empty full-cache output).
    kl = {"full": {t: np.zeros(n) for t, n in tasks.items()},
          "paged": {t: rng.gamma(2.0, 0.2, n) for t, n in tasks.items()},
          "snapkv": {t: rng.gamma(2.0, 0.01, n) for t, n in tasks.items()}}
    for data in ("with", "without"):
        for name in logprob:
            samples = {t: [{"score": s, "answer_logprob": None if (data == "without" and name == "snapkv") else float(lp),
                            "kl_to_full": None if (name == "paged" and t == "qa" and i == 0) else float(k)}
                           for i, (s, lp, k) in enumerate(zip(score[name][t], logprob[name][t], kl[name][t]))]
                       for t in tasks}
            write_run(tmp_path, data, name, None if name == "full" else 256, samples)
    frame = load_runs([tmp_path])
    quantity = next(q for q in QUANTITIES if q.field == "answer_logprob")
    with_it, without_it = frame[frame["data.name"] == "with"], frame[frame["data.name"] == "without"]

    paged = with_it[with_it["policy.name"] == "paged"].iloc[0]
    expected = np.mean([(logprob["paged"][t] - full[t]).mean() for t in sorted(tasks)])
    assert paged["answer_logprob_avg_vs_full_diff"] == pytest.approx(expected, abs=0.005)  # its own units, not x100
    assert paged["answer_logprob_avg_vs_full_low"] < expected < paged["answer_logprob_avg_vs_full_high"] < 0
    assert paged["answer_logprob_average"] == pytest.approx(np.mean([logprob["paged"][t].mean() for t in tasks]), abs=0.005)
    assert paged["answer_logprob_avg_vs_full_p_holm"] < 0.05 and paged["answer_logprob_avg_vs_snapkv_p_holm"] < 0.05
    snapkv = with_it[with_it["policy.name"] == "snapkv"].iloc[0]
    assert snapkv["answer_logprob_avg_vs_full_p"] > 0.05  # noise only
    assert snapkv["answer_logprob_avg_vs_paged_diff"] == -paged["answer_logprob_avg_vs_snapkv_diff"]
    family = table_comparisons(with_it, quantity)
    assert len(family) == 3 and (family["p_holm"] >= family["p"]).all()
    # The score is compared as before, on its own 0-100 scale, in both groups.
    assert with_it["avg_vs_full_p"].notna().sum() and without_it["avg_vs_full_p"].notna().sum()
    # Where a run lacks the field, no column of the group has a value.
    assert without_it.filter(like="answer_logprob").isna().all().all()

    markdown = to_markdown(frame, "python -m harness.analysis.aggregate synthetic")
    with_part, without_part = markdown.split("## m on without")  # groups in name order: "with" first
    assert "### Reference-answer log-likelihood per token" in with_part
    assert "log-likelihood" not in without_part
    section = with_part.split("### Reference-answer log-likelihood")[1]
    assert re.search(r"\| paged +\| +256 \| -0\.\d{3} \(-0\.\d{3}, -0\.\d{3}\) p=\d\.?\d*(e-\d+)? \*", section)
    assert "nats/token" in section and "The family is the table's 3 distinct comparisons" in section
    # A field some samples lack is compared on the samples that have it, and the table says so.
    kl_section = with_part.split("### KL divergence to full cache")[1]
    assert "lower is better" in kl_section and "left out of their run's statistics and its pairs: paged 256 1." in kl_section
    assert paged["kl_to_full_samples"] == sum(tasks.values()) - 1
    kept = {t: kl["paged"][t][1:] if t == "qa" else kl["paged"][t] for t in tasks}
    assert paged["kl_to_full_avg_vs_full_diff"] == pytest.approx(np.mean([v.mean() for v in kept.values()]), abs=5e-5)


def test_full_cache_alone_summarises_without_a_differences_table(tmp_path):
    from harness.analysis.aggregate import to_markdown

    write_run(tmp_path, "d", "full", None, {"qa": [{"score": s} for s in (0.0, 1.0, 1.0, 0.5)]})
    markdown = to_markdown(load_runs([tmp_path]), "python -m harness.analysis.aggregate d")
    assert "| full     | all      | 62.5 (" in markdown and "No paired differences" in markdown


def test_an_unsettled_comparison_gets_no_mark_either_way():
    """A comparison whose adjusted p sits within Monte Carlo error of the level after the most
    flips is shown `?` and never `*` or `+`, whichever side its point estimate falls."""
    from harness.analysis.aggregate import significance_mark

    assert significance_mark(0.049, 0.01) == " *" and significance_mark(0.2, 0.04) == " +"
    assert significance_mark(0.049, 0.01, settled=False) == " ?"
    assert significance_mark(0.051, 0.01, settled=False) == " ?"


def test_group_scores_reads_run_dirs_under_a_root_on_the_rows_tasks(tmp_path):
    """One way to read a table's per-sample scores, for aggregate (run_dir as found) and report
    (a committed summary.csv's run_dir, relative to the repository): keyed by the rows' run_dir,
    read under ``root``, on the tasks the rows keep; a run with no score is refused."""
    from harness.analysis.aggregate import group_scores

    write_run(tmp_path, "d", "paged", 256, {"qa": [{"score": 1.0}, {"score": 0.0}], "code": [{"score": 0.5}]})
    relative = "m/d/paged_256"
    rows = pd.DataFrame({"run_dir": [relative], "task": ["qa"]})  # a view without code
    scores = group_scores(rows, tmp_path)
    assert list(scores) == [relative] and list(scores[relative]) == ["qa"]
    assert scores[relative]["qa"].to_dict() == {"qa-0": 1.0, "qa-1": 0.0}
    absolute = group_scores(rows.assign(run_dir=str(tmp_path / relative)))  # no root: run_dir as it is
    assert absolute[str(tmp_path / relative)]["qa"].equals(scores[relative]["qa"])
    (tmp_path / relative / "predictions.jsonl").write_text(json.dumps({"task": "qa", "id": "qa-0"}) + "\n")
    with pytest.raises(ValueError, match="no sample has a score"):
        group_scores(rows, tmp_path)
