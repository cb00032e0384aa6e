"""The proxy study's metrics on cases whose answers are known (no model)."""
from __future__ import annotations

import sys

import pytest
import torch

from tests.support import ROOT

sys.path.insert(0, str(ROOT / "experiments"))
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
