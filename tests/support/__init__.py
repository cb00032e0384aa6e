"""Helpers the tests share (``from tests.support.engine_support import run_engine``): engines in their
own processes and the agreement rules (``engine_support``; the engines kept between batches,
``engine_pool``), the plain references that share no code
with ``policies/`` or ``harness/`` (``plain_reference``), the registry-derived policy matrix
(``policy_matrix``), a policy's decisions on plain tensors (``policy_probe``), the committed CI
baseline read from disk (``ci_baseline``) and the tiny throughput setting (``throughput``)."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository
