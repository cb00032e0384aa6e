"""The plain references (tests/plain_reference.py, no shared code) agree with the harness's
Hugging Face reference engine, which runs the harness's own evictor and policies."""
from __future__ import annotations

import pytest

from engine_support import BLOCK, model_path, reference_outputs, text_prompts
from plain_reference import PlainPolicy, PlainReference
from policies import REGISTRY, make_policy

EVICTING = [name for name, cls in REGISTRY.items() if cls.granularity != "none"]


def test_the_plain_reference_imports_no_harness_code():
    from pathlib import Path

    lines = (Path(__file__).parent / "plain_reference.py").read_text().splitlines()
    imports = [line.strip() for line in lines if line.strip().startswith(("import ", "from "))]
    assert imports and not [line for line in imports if "policies" in line or "harness" in line], imports


@pytest.fixture(scope="module")
def plain():
    return PlainReference(model_path("tiny"))


@pytest.mark.parametrize("policy", EVICTING)
def test_plain_rule_equals_the_harness_reference(plain, policy):
    prompts = text_prompts("tiny", [700, 1000], seed=2)
    ours = [plain.generate(prompt, 64, PlainPolicy(policy, 128, BLOCK)) for prompt in prompts]
    assert all(counts["prefill"] == 1 and counts["decode"] >= 1 for _, counts in ours), "both phases evict"
    assert [ids for ids, _ in ours] == reference_outputs("tiny", make_policy(policy, 128, BLOCK), prompts, 64)
