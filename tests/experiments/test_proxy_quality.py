"""The proxy study's metrics on cases whose answers are known, and its summary's design line,
verdicts and provenance (issue 65, items 2 and 5), on synthetic and committed data (no model)."""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from harness.records.provenance import LOADED
from tests.support import ROOT

sys.path.insert(0, str(ROOT / "experiments"))
import proxy_quality  # noqa: E402
from proxy_quality import compare  # noqa: E402


def test_a_perfect_proxy_a_reversed_one_and_a_partial_one():
    truth = torch.tensor([[0.5, 0.1, 0.05, 0.3, 0.02, 0.01, 0.007, 0.005, 0.003, 0.002]])
    same = compare(truth * 3, truth)
    assert same["spearman"].item() == pytest.approx(1) and same["recall"].item() == 1 and same["mass"].item() == 1
    reversed_ = compare(-truth, truth)
    assert reversed_["spearman"].item() == pytest.approx(-1) and reversed_["recall"].item() == 0
    # Top 10% of 10 tokens is one token: the proxy picks token 3 (mass 0.3) instead of token 0 (0.5).
    partial = compare(torch.tensor([[0.0, 0, 0, 1, 0, 0, 0, 0, 0, 0]]), truth)
    assert partial["recall"].item() == 0 and partial["mass"].item() == pytest.approx(0.3 / 0.5)


# ---------------------------------------------------------------- the summary: design, verdicts, provenance (issue 65)
TASKS = ("a", "b", "c", "d")


def synthetic_per_head(shift: dict[str, float], prompts_per_task: int = 6) -> pd.DataFrame:
    """One layer and head per prompt; every metric of ``proxy`` is the base's plus ``shift[proxy]``
    and a small prompt-to-prompt wobble, so each paired difference is known."""
    rng = np.random.default_rng(0)
    rows = []
    for prompt in range(len(TASKS) * prompts_per_task):
        base = 0.2 + 0.05 * rng.random()
        for proxy in proxy_quality.PROXIES:
            value = base + shift.get(proxy, 0.0) + (0.002 * rng.standard_normal() if proxy != proxy_quality.BASE else 0)
            rows.append({"prompt": prompt, "task": TASKS[prompt // prompts_per_task], "tokens": 100, "proxy": proxy,
                         "layer": 0, "head": 0, "spearman": value, "recall": value, "mass": value})
    return pd.DataFrame(rows)


def test_each_difference_gets_the_verdict_its_test_and_the_margin_give():
    """||V||/||K|| far below -||K|| and KeyDiff: `worse` (Holm p < 0.05, an interval below 0 that
    inverts the sign-flip test); within 0.002 of recency, inside the margin: `equivalent`."""
    summary = proxy_quality.summarize(synthetic_per_head({"-||K||": 0.3, "keydiff": 0.2, "recency": 0.0}))
    compared = summary[summary.proxy.str.startswith("||V||/||K|| - ")].set_index("proxy")
    assert len(compared) * len(proxy_quality.METRICS) == 9
    for other, word in (("-||K||", "worse"), ("keydiff", "worse"), ("recency", "equivalent")):
        row = compared.loc[f"||V||/||K|| - {other}"]
        for metric in proxy_quality.METRICS:
            assert row[f"{metric}_verdict"] == word, (other, metric, row)
            assert row[f"{metric}_low"] <= row[metric] <= row[f"{metric}_high"]
            if word == "worse":
                assert row[f"{metric}_p_holm"] < 0.05 and row[f"{metric}_high"] < 0
            else:
                assert row[f"{metric}_p_holm"] >= 0.05
                assert -proxy_quality.MARGIN < row[f"{metric}_low"] and row[f"{metric}_high"] < proxy_quality.MARGIN
    # A proxy's own row is descriptive: no p and no verdict.
    assert summary.loc[summary.proxy == "recency", "spearman_verdict"].isna().all()


def test_a_difference_wider_than_the_margin_and_undecided_is_inconclusive():
    """Prompts that disagree in sign, +-0.3 around 0: no test decides and the interval reaches past
    the margin, so the word is `inconclusive`, never `equivalent`."""
    per_head = synthetic_per_head({})
    keydiff = per_head.proxy == "keydiff"
    per_head.loc[keydiff, list(proxy_quality.METRICS)] += np.where(per_head.loc[keydiff, "prompt"] % 2, 0.3, -0.3)[:, None]
    summary = proxy_quality.summarize(per_head).set_index("proxy")
    assert (summary.loc["||V||/||K|| - keydiff", [f"{m}_verdict" for m in proxy_quality.METRICS]] == "inconclusive").all()


def test_a_run_records_its_provenance_and_the_summary_states_its_design(tmp_path):
    """A measuring run writes run.json with the commit and code version it ran at; the summary opens
    with its design (units, test, family, smallest p, whether it can decide, margin) and has a verdict
    column; --summary-only over the same folder names the measuring commit and code version."""
    text = proxy_quality.write_run(tmp_path, synthetic_per_head({"-||K||": 0.3}), "python experiments/proxy_quality.py", 60.0)
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["provenance"]["git_commit"] == LOADED["git_commit"] and run["provenance"]["code_version"] == LOADED["code_version"]
    assert run["margin"] == proxy_quality.MARGIN
    lines = text.splitlines()
    assert lines[0].startswith("# ") and lines[2].startswith("**Design.** Units: prompts (24")
    for phrase in ("percentile bootstrap interval", "no smallest attainable p", "sign-flip test",
                   "Holm-adjusted over those 9", "Smallest p this design can reach: 1e-07", "the family can decide.",
                   f"margin of {proxy_quality.MARGIN:g}", "stated before this run"):
        assert phrase in lines[2], phrase
    assert f"code version {LOADED['code_version']}" in text
    assert "| comparison | metric | difference (95% interval) | p (Holm) | verdict |" in text
    assert "| ‖V‖/‖K‖ - -‖K‖ | spearman | -0.300 (" in text and text.count("| worse |") == 3
    again = tmp_path / "again"
    proxy_quality.summary_only(tmp_path, again)
    rendered = (again / "summary.md").read_text()
    assert (f"Measured at commit {LOADED['git_commit']} (code version {LOADED['code_version']}); summary rendered at "
            f"commit {LOADED['git_commit']} (code version {LOADED['code_version']})") in rendered
    assert "(1.0 min)" in rendered


def test_the_committed_data_rerender_as_measured_and_name_their_clean_code():
    """--summary-only over the committed per_head.csv and run.json: the tables are the committed
    ones (FINDINGS quotes the proxies' own rows), the measuring commit and code version are the
    run's (clean, issue 65's provenance), and the margin was stated before the run."""
    data = ROOT / "results" / "proxy_quality"
    measured = json.loads((data / "run.json").read_text())["provenance"]
    assert not measured["git_commit"].endswith("+dirty") and len(measured["code_version"]) == 12
    with tempfile.TemporaryDirectory() as scratch:
        proxy_quality.summary_only(data, Path(scratch))
        text = (Path(scratch) / "summary.md").read_text()
    tables = [[line for line in t.splitlines() if line.startswith("|")] for t in (text, (data / "summary.md").read_text())]
    assert tables[0] == tables[1]
    assert (f"Measured at commit {measured['git_commit']} (code version {measured['code_version']}); summary rendered "
            f"at commit {LOADED['git_commit']} (code version {LOADED['code_version']})") in text
    assert "stated before this run" in text
    assert "| ‖V‖/‖K‖ | -0.022 (-0.028, -0.015) | +0.120 (+0.115, +0.124) | +0.192 (+0.177, +0.206) |" in text
    assert text.count("| worse |") == 9
