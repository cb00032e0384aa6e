"""One word per comparison, and only what its data decide (issue 65, item 1)."""
from __future__ import annotations

import math

from harness.analysis.verdicts import ratio_verdict, verdict


def test_decided_differences_are_better_or_worse_by_their_sign_and_direction():
    assert verdict(+3.0, +1.0, +5.0, 0.01, 5.0) == "better"
    assert verdict(-3.0, -5.0, -1.0, 0.01, 5.0) == "worse"
    assert verdict(+0.3, +0.1, +0.5, 0.01, 0.05, higher_is_better=False) == "worse"  # KL: higher is worse
    assert verdict(+3.0, +1.0, +5.0, 0.01, 5.0, settled=False) != "better"  # a `?` decides nothing


def test_undecided_is_equivalent_only_inside_the_margin_on_both_sides():
    assert verdict(+0.5, -2.0, +3.0, 0.6, 5.0) == "equivalent"
    # The example: +0.74 (-5.95, +7.40) leaves either side up to 6-7 points: inconclusive.
    assert verdict(+0.74, -5.95, +7.40, 0.8, 5.0) == "inconclusive"
    # Its bound on the worse side inside the margin, the other outside: non-inferior.
    assert verdict(+3.0, -2.0, +8.0, 0.3, 5.0) == "non-inferior"
    assert verdict(-3.0, -8.0, +2.0, 0.3, 5.0) == "inconclusive"
    # Lower is better (KL): non-inferior when the upper bound is inside the margin.
    assert verdict(-0.02, -0.09, +0.03, 0.3, 0.05, higher_is_better=False) == "non-inferior"
    assert verdict(+0.5, -2.0, +3.0, 0.6, None) == "inconclusive"  # no margin stated: never "equivalent"
    assert verdict(+0.5, -math.inf, math.inf, 1.0, 5.0) == "inconclusive"


def test_a_design_that_cannot_decide_enters_no_verdict():
    assert verdict(+0.5, -2.0, +3.0, 0.6, 5.0, decidable=False) == "no verdict"
    assert verdict(+9.0, +5.0, +13.0, 0.001, 5.0, decidable=False) == "no verdict"


def test_ratios_against_a_baseline():
    assert ratio_verdict(1.82, 1.74, 1.91, 0.05) == "better"
    assert ratio_verdict(0.978, 0.965, 0.991, 0.05) == "worse"
    assert ratio_verdict(1.01, 0.98, 1.03, 0.05) == "equivalent"  # plugin overhead: inside 0.95x-1.053x
    assert ratio_verdict(1.04, 0.99, 1.09, 0.05) == "non-inferior"
    assert ratio_verdict(1.01, 0.88, 1.17, 0.05) == "inconclusive"
    assert ratio_verdict(3.98, 3.39, 4.67, 0.05, higher_is_better=False) == "worse"  # prefill seconds
