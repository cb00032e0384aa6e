"""Every registered policy at every granularity it runs at, derived from the registry: what the
generic tests (evictor, plain reference, Hugging Face reference, engine) iterate over. A new
registered score joins every one of them with no test edited.

Scores that ``reconstruct`` (KVzip) are left out: they compress once, from extra passes the engine
runs at the eviction point, and need the request's reconstruction ids, which the generic tests'
requests (decode eviction, no such ids) cannot give; ``tests/unit/test_kvzip.py`` and
``tests/engine/test_kvzip.py`` put them through the same evictor, references and engine."""
from __future__ import annotations

from policies import REGISTRY


def policy_matrix() -> list[tuple[str, dict]]:
    """(name, options) pairs: each evicting policy as registered, plus each score at the other
    granularity where no alias names it already (``h2o`` with ``granularity=block``)."""
    cases = [(name, {}) for name, entry in REGISTRY.items() if entry.evicts and not entry.reconstructs]
    named = {(entry.alias_of or name, entry.granularity) for name, entry in REGISTRY.items() if entry.score}
    for name, entry in REGISTRY.items():
        if entry.score is None or entry.fixed_granularity or entry.reconstructs:
            continue
        for granularity in ("token", "block"):
            if (name, granularity) not in named:
                cases.append((name, {"granularity": granularity}))
    return cases


def case_id(name: str, options: dict) -> str:
    return name + "".join(f"[{key}={value}]" for key, value in options.items())


MATRIX = policy_matrix()
MATRIX_IDS = [case_id(name, options) for name, options in MATRIX]


# The cases a test comparing whole model generations keeps in the fast loop (a per-head rule reading
# queries, a block rule); a model-level test marks every other case slow (seconds each: CI runs them,
# and the evictor test puts every case against the plain rule in the fast loop).
FAST_MODEL_CASES = ("snapkv", "paged")


def model_cases() -> list:
    """MATRIX as pytest params, every case but FAST_MODEL_CASES (at their defaults) marked slow."""
    import pytest

    return [pytest.param(name, options, id=case_id(name, options),
                         marks=() if name in FAST_MODEL_CASES and not options else pytest.mark.slow)
            for name, options in MATRIX]
