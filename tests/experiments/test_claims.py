"""The documents' numbers come from the committed summaries: RESULTS.md is generated from them, and
every number the Results section of docs/results.md and FINDINGS.md quote appears in RESULTS.md or in the
summary its paragraph names (``harness.analysis.report``)."""
from __future__ import annotations

import functools
import re

import pytest

from harness.analysis import report
from tests.support import ROOT


RENDER, PRINTED = report.render, report.printed  # the real functions, whatever a test patches


@functools.cache
def rendered() -> str:
    """``report.render(ROOT)``: a pure function of the committed summaries, rendered once for the
    session (the check below and ``report --check`` in the planted test both need it)."""
    return RENDER(ROOT)


@functools.cache
def committed_printed() -> report.Printed:
    """``report.printed(ROOT)``: every accuracy summary's intervals, a pure function of the committed
    files, read once for the session instead of once per ``misattributed``/``check_documents`` call."""
    return PRINTED(ROOT)


@pytest.fixture(autouse=True)
def summaries_read_once(monkeypatch):
    """Every check of this module reads the committed summaries through ``report.printed(ROOT)``: it
    gets the one reading ``committed_printed`` made with the real ``report.printed`` (another root
    still reads its own files). What the checks do with it runs in full every time."""
    monkeypatch.setattr(report, "printed", lambda root=ROOT: committed_printed() if root == ROOT else PRINTED(root))


@pytest.mark.slow  # renders every committed summary
def test_results_md_is_what_the_summaries_give():
    committed = (ROOT / report.OUT).read_text()
    assert committed == rendered(), "results/RESULTS.md is stale: run `python -m harness.analysis.report`"


def test_every_quoted_number_is_in_a_summary():
    assert report.check_documents(ROOT) == []


def findings() -> str:
    return (ROOT / "results/FINDINGS.md").read_text()


@pytest.mark.parametrize("quoted, changed", [
    ("+17.89", "+17.98"),   # a typo in a difference
    ("-0.022", "+0.022"),   # a sign flipped
    ("-29.89", "-29.9"),    # a number rounded twice
    ("12.53%", "12.5%"),
])
def test_a_changed_number_is_caught(quoted, changed):
    """What this part of the check catches: a number no named summary holds. What it cannot: a sign
    flipped to one the summary prints for the reverse comparison (its tables show both directions);
    a number on the wrong comparison is the next check's (``report.misattributed``)."""
    text = findings()
    assert quoted in text, f"the test's example {quoted} is no longer quoted in FINDINGS.md: pick another"
    problems = report.unsupported(text.replace(quoted, changed, 1), ROOT)
    assert any(problem.startswith(changed.rstrip("%") + ":") for problem in problems), problems


def test_a_number_from_an_unnamed_summary_is_caught():
    """-0.022 is in results/proxy_quality/summary.md: quoted where no paragraph or heading names
    that summary, it is not backed."""
    paragraph = "## Elsewhere\n\nThe rank correlation is -0.022 (-0.028, -0.015)."
    assert report.unsupported(paragraph, ROOT)
    named = "## Proxy (`results/proxy_quality/summary.md`)\n\nThe rank correlation is -0.022 (-0.028, -0.015)."
    assert report.unsupported(named, ROOT) == []


def test_identifiers_and_code_are_not_claims():
    text = "Run `vllm 0.32.0` with Llama-3.1-8B (arXiv `2509.04377`); [link](results/x_1.5.md) and 1 of the rest."
    assert report.quoted(text) == []
    assert report.quoted("It reached 2.04x, 11.13% and 6 of 36.") == ["2.04", "11.13", "6 of 36"]


def test_a_block_of_commands_quotes_nothing():
    assert report.quoted("    tool.sh    # version 0.5.5 (it pins x < 5.3)\n    run.py --ratios 0.5 0.75\n") == []
    assert report.quoted("Prose at 2.5,\n    indented in a list at 3.5\n") == ["2.5", "3.5"]


def test_section_reads_to_the_next_heading_of_its_level():
    text = "# T\n\n## Results\n\nSee 1.5.\n\n### Sub\n\n2.5\n\n## Next\n\n3.5\n"
    assert report.quoted(report.section(text, "## Results")) == ["1.5", "2.5"]


def test_a_ratio_may_carry_its_x():
    """A ratio quoted as the summaries write it, "0.92x", is read as 0.92 and found where a summary
    writes 0.92x; the x ends the number only where a word would begin after it."""
    assert report.quoted("H2O at 0.87x PagedEviction (0.85x-0.90x), on Llama-3.1-8B") == ["0.87", "0.85", "0.90"]
    source = "h2o b512 over 4 trials: 1.44x full cache (1.42-1.46); 0.87x PagedEviction (0.85-0.90)"
    assert report.appears("0.87", source) and report.appears("1.44", source)
    assert not report.appears("0.8", source) and not report.appears("+0.87", source)
    assert not report.appears("0.92", "a 0.92xyz token") and not report.appears("0.92", "0.92x3")
    paragraph = ("## Attention (`results/throughput/attention/summary.md`)\n\n"
                 "H2O reaches 0.87x PagedEviction's output tok/s (0.85-0.90) and 1.44x full cache.")
    assert report.unsupported(paragraph, ROOT) == []
    # A number at four decimals, which no summary prints (0.66, then 0.46, each entered RESULTS.md
    # with a later study and made this test fail for a reason that was not its own)
    wrong = report.unsupported(paragraph.replace("0.87x", "0.4321x"), ROOT)
    assert [problem.split(":")[0] for problem in wrong] == ["0.4321"]


def interval_of(study: str, quantity: str, other: str | None, budget: str, variant: str = "paged") -> str:
    """An interval as a summary prints it (``report.study_intervals``), signed like a difference."""
    decimals = next(q.decimals for q in report.QUANTITIES if q.field == quantity)
    found = [q for q in report.study_intervals(next(s for s in report.ACCURACY if s.folder == study), ROOT)
             if (q.quantity, q.other, q.budget, q.variant) == (quantity, other, budget, variant)]
    assert len(found) == 1, (study, quantity, other, budget, found)
    return report.interval_text(*found[0].values, decimals)


def test_a_number_on_the_wrong_comparison_is_caught():
    """Two differences swapped between the policies a sentence names: each is in a summary, so only
    the attachment check sees it; in the right places (or quoted the other way round, with
    KeyDiff minus PagedEviction) it passes."""
    snapkv = interval_of("cpu_accuracy", "score", "snapkv", "256")
    keydiff = interval_of("cpu_accuracy", "score", "keydiff", "512")
    right = (f"## Embedded (`results/cpu_accuracy`)\n\nPagedEviction minus SnapKV at 256 is {snapkv}; "
             f"minus KeyDiff at 512 it is {keydiff}.")
    assert report.misattributed(right, ROOT) == [] and report.unsupported(right, ROOT) == []
    swapped = right.replace(snapkv, "@").replace(keydiff, snapkv).replace("@", keydiff)
    assert report.unsupported(swapped, ROOT) == [], "each number is still in a summary"
    problems = report.misattributed(swapped, ROOT)
    assert len(problems) == 2 and "minus keydiff at 512" in problems[0] and "minus snapkv at 256" in problems[1], problems
    wrong_budget = right.replace("SnapKV at 256", "SnapKV at 512")
    assert len(report.misattributed(wrong_budget, ROOT)) == 1


def test_a_link_before_the_number_does_not_move_what_its_sentence_names():
    """A sentence that links a summary before it quotes a number is read where the number is: the
    check once found the number in the sentence without the link's target and cut the sentence with
    it at that offset, so a link as long as the words between two names ended the cut before the
    name the number belongs to (here at KeyDiff, not SnapKV)."""
    snapkv = interval_of("cpu_accuracy", "score", "snapkv", "256")
    link = "[s](cpu_accuracy/" + "x" * 8 + "/summary.md)"  # a target of 34 characters, "(...)"
    text = (f"## E (`results/cpu_accuracy`)\n\nSee {link} on KeyDiff, and PagedEviction minus SnapKV at 256 "
            f"is {snapkv}.")
    assert report.misattributed(text, ROOT) == []
    assert len(report.misattributed(text.replace("minus SnapKV", "minus H2O"), ROOT)) == 1


def test_a_listed_comparison_reads_its_place_in_the_list():
    """"SnapKV at 256 and 512 (a and b)": each number belongs to one of the listed budgets; a budget
    written right after a number ("a at `r0.5`") is that number's."""
    at_256, at_512 = (interval_of("cpu_accuracy", "score", "snapkv", b) for b in ("256", "512"))
    listed = f"## E (`results/cpu_accuracy`)\n\nBelow SnapKV at 256 and 512 ({at_256} and {at_512})."
    assert report.misattributed(listed, ROOT) == []
    assert report.misattributed(listed.replace("256 and 512", "1024"), ROOT)
    after = f"## E (`results/cpu_accuracy`)\n\nBelow SnapKV ({at_256} at 256, {at_512} at 512)."
    assert report.misattributed(after, ROOT) == []
    assert len(report.misattributed(after.replace("at 512)", "at 1024)"), ROOT)) == 1


def test_budget_words_are_the_budget_labels_the_summaries_have():
    """The budgets a sentence can name come from the studies' cells (a study with new budgets needs
    no list edited), full cache's "all" aside; a budget no study has names no comparison."""
    summaries = report.printed(ROOT)
    studies = report.present(report.ACCURACY, ROOT)
    assert set(summaries.intervals) == {study.folder for study in studies}
    labels = {q.budget for intervals in summaries.intervals.values() for q in intervals}
    assert summaries.budgets == labels - {"all"} and {"256", "1024", "r0.5"} <= summaries.budgets
    at_256 = interval_of("cpu_accuracy", "score", "snapkv", "256")
    sentence = f"## E (`results/cpu_accuracy`)\n\nBelow SnapKV at 4096 ({at_256})."
    assert report.misattributed(sentence, ROOT) == []  # 4096 is no study's budget: not read as one
    more = report.Printed(summaries.intervals, summaries.focus, summaries.budgets | {"4096"})
    assert len(report.misattributed(sentence, ROOT, more)) == 1  # once a study has it, it is checked


def test_the_intro_defines_every_mark_the_tables_use():
    intro = (ROOT / report.OUT).read_text().split("\n## ", 1)[0]
    assert "`*`: Holm-adjusted p < 0.05" in intro and "`?`: a comparison whose" in intro


def planted(tmp_path, monkeypatch, text: str) -> list[str]:
    """``report --check``'s document problems with ``text`` as the only checked document."""
    document = tmp_path / "planted.md"
    document.write_text(text)
    monkeypatch.setattr(report, "CHECKED_DOCUMENTS", {str(document): None})
    return report.check_documents(ROOT)


@pytest.mark.slow  # runs the whole documents check twice
def test_a_difference_quoted_the_wrong_way_round_fails_the_check(tmp_path, monkeypatch, capsys):
    """FINDINGS once quoted SnapKV minus PagedEviction at `r0.75` in a sentence reading PagedEviction
    ahead of SnapKV (issue 51): every number was in the summary, and the check, accepting either
    direction, passed it. Planted again, --check fails; the right way round it passes."""
    paged, snapkv = "paged[decode_eviction=False, layer_groups=3]", "snapkv[decode_eviction=False, layer_groups=3]"
    right = interval_of("layer_budgets", "score", snapkv, "r0.75", variant=paged)
    estimate, low, high = (float(v) for v in re.match(r"(\S+) \((\S+), (\S+)\)", right).groups())
    reverse = report.interval_text(-estimate, -high, -low, 2)
    sentence = ("## Budgets (`results/layer_budgets`)\n\nPagedEviction stays ahead of SnapKV at `r0.5`; at `r0.75` "
                "the difference is undecided ({} uniform).\n")
    assert planted(tmp_path, monkeypatch, sentence.format(right)) == []
    problems = planted(tmp_path, monkeypatch, sentence.format(reverse))
    assert len(problems) == 1 and "on the wrong comparison" in problems[0] and reverse in problems[0], problems
    # report --check over the planted document. Its first step compares RESULTS.md with the committed
    # summaries' rendering: the same text test_results_md_is_what_the_summaries_give checks, rendered
    # once (a stale RESULTS.md still fails here, with no planted number in stderr); its documents
    # check then runs in full and must fail on the planted sentence.
    monkeypatch.setattr(report, "render", lambda root=ROOT: rendered() if root == ROOT else RENDER(root))
    assert report.main(["--check"]) == 1 and reverse in capsys.readouterr().err
    # Stated the other way round, the reversed numbers are right.
    assert planted(tmp_path, monkeypatch, sentence.replace("PagedEviction stays ahead of SnapKV",
                                                           "SnapKV stays behind PagedEviction").format(reverse)) == []


def test_a_count_of_decided_comparisons_over_the_wrong_scope_fails_the_check(tmp_path, monkeypatch):
    """FINDINGS once gave the whole table's count, full cache and the whole-prompt cells included,
    for "the other policies compressing the context alone" (issue 51). Planted again, --check fails;
    the scope's own count passes."""
    study = next(s for s in report.ACCURACY if s.folder == "ruler_context")
    everything = report.decided_counts(study, ROOT, report.QUANTITIES[0], lambda variant: True)
    scope = report.decided_counts(study, ROOT, report.QUANTITIES[0],
                                  lambda variant: "compress=context" in variant and variant != "full")
    assert everything != scope and scope[1] < everything[1]
    sentence = ("## Context (`results/ruler_context`)\n\nAgainst the other policies compressing the context alone, "
                "{} of {} comparisons are decided, PagedEviction better in {}.\n")
    assert planted(tmp_path, monkeypatch, sentence.format(*scope)) == []
    problems = planted(tmp_path, monkeypatch, sentence.format(*everything))
    assert len(problems) == 1 and "miscounted" in problems[0], problems
    # (that such a problem fails `report --check` itself is the slow test above's: a whole
    # documents check, 9 s)
    wrong_better = (scope[0], scope[1], scope[2] - 1)
    assert planted(tmp_path, monkeypatch, sentence.format(*wrong_better))


def test_each_serving_sweep_gives_its_verdict_under_its_workloads_name(tmp_path):
    """RESULTS.md's Serving section is each ``results/serving/<workload>/summary.md``'s verdict, read
    to the summary's next section, with the command that made it and a link from results/."""
    folder = tmp_path / "results" / "serving" / "copy"
    folder.mkdir(parents=True)
    (folder / "summary.md").write_text("# Serving benchmark: copy\n\nCommand: `python experiments/serving.py`\n\n"
                                       "intro\n\n## Verdict\n\n* paged context: goodput 1.50x (1.35-1.70)\n\n"
                                       "## Every rate\n\n| rate |\n")
    text = "\n".join(report.serving_sections(tmp_path))
    assert "### `copy`" in text and "[results/serving/copy/summary.md](serving/copy/summary.md)" in text
    assert "Command: `python experiments/serving.py`" in text and "goodput 1.50x (1.35-1.70)" in text
    assert "## Every rate" not in text and report.serving_sections(tmp_path / "nothing") == []


def test_a_verified_serving_sweep_says_where_it_was_verified_and_what_moved(tmp_path):
    """``experiments/serving.py --verify`` leaves ``verified.json`` beside the sweep; the Serving
    section says at which code, by which command, how many replayed requests gave the committed text,
    and names what moved."""
    import json

    folder = tmp_path / "results" / "serving" / "copy"
    folder.mkdir(parents=True)
    (folder / "summary.md").write_text("# Serving benchmark: copy\n\nCommand: `x`\n\n## Verdict\n\n* v\n\n## Every rate\n")
    record = {"verdict": "verified", "code_version": "abc123abc123", "git_commit": "0123456789abcdef", "date": "2026-11-29",
              "ran_at": "fedcba987654", "command": "python experiments/serving.py --verify --out results/serving/copy",
              "moved": [], "replayed": [{"equal": True}] * 8}
    (folder / "verified.json").write_text(json.dumps(record))
    text = "\n".join(report.serving_sections(tmp_path))
    assert ("Verified at code version abc123abc123 (commit 01234567, 2026-11-29; the sweep ran at fedcba987654) by "
            "`python experiments/serving.py --verify --out results/serving/copy`: the summaries recomputed from the "
            "saved runs and 8 requests replayed alone, 8 of them the committed text; nothing moved.") in text
    record.update(verdict="moved", moved=["summary.md: rebuilt from the saved runs, it differs"],
                  replayed=[{"equal": True}] * 7 + [{"equal": False}])
    (folder / "verified.json").write_text(json.dumps(record))
    text = "\n".join(report.serving_sections(tmp_path))
    assert "7 of them the committed text; 1 moved: summary.md: rebuilt from the saved runs, it differs." in text
