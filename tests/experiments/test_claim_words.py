"""Words that claim more than a verdict gives are caught (issue 65, items 1 and 6): each statement
the issue lists, planted into a paragraph, makes ``report.unbacked_claims`` (what
``python -m harness.analysis.report --check`` runs over FINDINGS.md and README's "What it shows")
fail; the same comparison worded by its verdict passes."""
from __future__ import annotations

import pytest

from harness.analysis import report
from tests.support import ROOT

RULER = "## RULER (`results/ruler_context`)\n\n"
SHARED = "## One context (`results/shared_context/summary.md`)\n\n"


@pytest.mark.parametrize("planted", [
    # undecided read as level (issue 65's first list)
    RULER + "So whether PagedEviction parts between the two modes here as it did not on RULER is open.",
    RULER + "It does not beat the attention-free scores: KVzip minus PagedEviction is +0.74 (-5.95, +7.40).",
    RULER + "KVzip keeps no more of the answer than PagedEviction: +0.74 (-5.95, +7.40).",
    RULER + "The two policies are level: +0.74 (-5.95, +7.40).",
    RULER + "KVzip and SnapKV score alike at r0.5.",
    # a design that cannot decide reported as a finding
    SHARED + "Accuracy: no difference is decided between the configurations.",
    # false or stale statements
    SHARED + "Dead questions: 19 of the 48 score 0 in every configuration (all of them later questions).",
    SHARED + "Compressing the context before the question scores lowest.",
    SHARED + "Sharing is what lifts PagedEviction from 0.71x to 0.82x.",
    RULER + "29 cells ran at code version 114c4ea051a4 and were replayed equal at the current one.",
])
def test_each_planted_statement_is_caught(planted):
    assert report.unbacked_claims(planted, ROOT), planted


CPU = "## Throughput (`results/throughput/cpu/summary.md`)\n\n"


@pytest.mark.parametrize("planted", [
    # provenance that is not the cells' (issue 65: FINDINGS named code versions and a trial count that
    # were not those of the cells)
    CPU + "Where memory binds, four trials at code 0123456789ab give PagedEviction 1.82 (1.74, 1.91).",
    CPU + "Where memory binds, three trials at code 645facb5daaf give PagedEviction 1.82 (1.74, 1.91).",
])
def test_provenance_that_is_not_the_cells_is_caught(planted):
    assert report.misdated(planted, ROOT), planted


def test_the_cells_own_provenance_passes():
    assert report.misdated(CPU + "Where memory binds, four trials at code 645facb5daaf give PagedEviction 1.82 "
                                 "(1.74, 1.91). The earlier run of this setting, three trials, read less.", ROOT) == []


@pytest.mark.parametrize("worded", [
    RULER + "KVzip minus PagedEviction is +0.74 (-5.95, +7.40): inconclusive at the 5-point margin, neither decided "
            "nor shown alike.",
    RULER + "KVzip is equivalent to PagedEviction at the 5-point margin: +0.74 (-3.95, +4.40).",
    RULER + "KVzip is non-inferior to PagedEviction at the 5-point margin, so it keeps no more than 5 points less "
            "of the answer than it: +0.74 (-3.95, +7.40).",
    RULER + "Undecided is not level, and an undecided difference says nothing about the two being alike.",
    RULER + "4 of 29 cells were replayed equal at the current code version.",
])
def test_the_same_comparison_worded_by_its_verdict_passes(worded):
    assert report.unbacked_claims(worded, ROOT) == []


def test_an_equivalence_claim_needs_the_interval_inside_the_margin():
    """"equivalent" beside an interval reaching past the margin is not backed."""
    assert report.unbacked_claims(RULER + "KVzip is equivalent to PagedEviction, the two are level: "
                                          "+0.74 (-5.95, +7.40).", ROOT)


def test_the_committed_documents_pass():
    assert report.check_documents(ROOT) == []
