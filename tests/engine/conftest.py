"""The engine tests share engines: every batch they run through
``tests.support.engine_support.run_engine`` goes to a kept engine of its configuration where one
is running (``tests.support.engine_pool``: each batch on an emptied prefix cache and a whole pool,
the two most recently used configurations kept), so a configuration that several tests, or
consecutive files, ask for starts once.

The files that run such batches go first, in ``SHARING_ORDER``, where most files' first
configuration is one the file before left running (when it was set: their 44 batches on 24
engines, against 29 in alphabetical order, which this order replaced; 23 since
test_context_compression.py ends, and test_prefix_caching.py starts, on SmolLM2 with prefix
caching). The kept engines close before
any other file runs (those start engines of their own: ``run.py``, ``vllm serve``) and when the
engine tests end, so that none holds memory beside them. A file not listed runs after the listed
ones, in pytest's order, sharing engines among its own tests."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.engine_pool import close_engines, shared_engines

ENGINE_DIR = Path(__file__).resolve().parent
SHARING_ORDER = (
    "test_h2o_within_budget",      # SmolLM2, H2O the engine's default, without and with prefix caching
    "test_kvzip_schedule",         # prefix caching, two layer groups, 256-token steps
    "test_kvzip",                  # no default policy (the next three files' engine), then the one above
    "test_context_compression",    # no default policy (and a small pool), then with prefix caching
    "test_engine_budget_ratio",
    "test_policy_matrix",
    "test_prefix_caching",         # prefix caching (the engine test_context_compression left), then
                                   # SmolLM2 defaults and tiny: no default policy, small pools
    "test_layer_groups",           # SmolLM2 with prefix caching, one and three groups
    "test_forced_decoding",        # tiny, PagedEviction at 128 the default
    "test_load",
    "test_engine",                 # ... ends with tiny without a default policy
    "test_engine_tensor_parallel",
)


def module_name(item) -> str:
    return Path(str(item.path)).stem


def in_engine_dir(item) -> bool:
    return ENGINE_DIR in Path(str(item.path)).resolve().parents


def pytest_collection_modifyitems(items):
    """The engine tests in ``SHARING_ORDER``, the others after them, each file's tests in its own
    order (a stable sort of the engine tests, in the places they held among all the items)."""
    places = [index for index, item in enumerate(items) if in_engine_dir(item)]
    rank = {name: position for position, name in enumerate(SHARING_ORDER)}
    ordered = sorted((items[index] for index in places), key=lambda item: rank.get(module_name(item), len(rank)))
    for index, item in zip(places, ordered):
        items[index] = item


@pytest.fixture(scope="session", autouse=True)
def shared_engine_pool():
    with shared_engines() as pool:
        yield pool


def pytest_runtest_teardown(item, nextitem):
    """Close the kept engines where the next test is in another file that is not listed (or none)."""
    if nextitem is None or not in_engine_dir(nextitem) or (
            module_name(nextitem) != module_name(item) and module_name(nextitem) not in SHARING_ORDER):
        close_engines()


def pytest_terminal_summary(terminalreporter):
    from tests.support import engine_pool

    pool = engine_pool.last_pool
    if pool is not None and pool.batches:
        terminalreporter.write_line(f"engine tests: {pool.batches} batches on kept engines, {pool.started} engine(s) "
                                    f"started for them (tests/support/engine_pool.py)")
