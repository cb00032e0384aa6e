"""The suite's layout, checked at collection: ``tests/engine/`` holds the tests that start a vLLM
engine (marked ``engine``, shared per module as each file's fixtures say), and only those;
``tests/unit/`` and ``tests/experiments/`` (the ``experiments/`` scripts and the committed results
and claims) start none, so ``pytest -m "not engine"`` is exactly everything outside
``tests/engine/``. Shared helpers live in ``tests/support/`` (``from tests.support... import``)."""
from __future__ import annotations

from pathlib import Path

import pytest

ENGINE_DIR = Path(__file__).resolve().parent / "engine"


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects anything
def pytest_collection_modifyitems(config, items):
    misplaced = []
    for item in items:
        in_engine_dir = ENGINE_DIR in Path(str(item.path)).resolve().parents
        if in_engine_dir != (item.get_closest_marker("engine") is not None):
            where = "is not marked engine" if in_engine_dir else "is marked engine outside tests/engine/"
            misplaced.append(f"{item.nodeid} {where}")
    if misplaced:
        raise pytest.UsageError("tests/engine/ holds exactly the engine-marked tests:\n  " + "\n  ".join(misplaced))
