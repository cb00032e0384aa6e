"""Every vLLM name the harness patches (``harness.engine.patches.PATCHES``) still exists in the
installed vLLM with the parameters the patch was written against: a vLLM upgrade that moves one
fails here, by name, before any engine starts. No engine: vLLM's modules are only imported."""
from __future__ import annotations

import inspect

import pytest

from harness.engine.patches import PATCHES, install, installed


@pytest.mark.parametrize("patch", PATCHES, ids=[patch.target.split(":")[1] for patch in PATCHES])
def test_each_patched_vllm_name_exists_with_its_parameters(patch):
    owner = patch.owner_class()
    if patch.how == "added":
        assert patch.name not in vars(owner) or installed(owner, patch.name), \
            f"vLLM now defines {patch.target} itself: the harness's would hide it"
        return
    method = getattr(owner, patch.name)
    # a wrapped method after install: its signature is vLLM's (functools.wraps keeps __wrapped__)
    original = inspect.unwrap(method)
    assert tuple(inspect.signature(original).parameters) == patch.parameters, patch.target


def test_install_patches_each_name_once_and_only_the_listed_ones():
    install()
    first = {patch.target: getattr(patch.owner_class(), patch.name) for patch in PATCHES}
    install()  # every vLLM process's plugin may call it again: nothing is wrapped twice
    for patch in PATCHES:
        owner = patch.owner_class()
        assert installed(owner, patch.name) == (patch.make is not None), patch.target
        assert getattr(owner, patch.name) is first[patch.target], patch.target
        if patch.how == "wrapped":
            assert "/harness/engine/" in getattr(owner, patch.name).__code__.co_filename, patch.target


def test_every_patch_in_the_engine_room_is_listed():
    """No vLLM attribute is set outside the list: the engine room's modules assign to a vLLM class
    only through ``install`` (a source check: ``<Class>.<name> =`` on a vLLM class)."""
    import re
    from pathlib import Path

    engine = Path(__file__).resolve().parents[2] / "harness" / "engine"
    vllm_classes = {patch.owner.split(":")[1] for patch in PATCHES}
    assignments = [(path.name, line.strip()) for path in engine.glob("*.py") if path.name != "patches.py"
                   for line in path.read_text().splitlines()
                   if re.match(rf"\s*({'|'.join(vllm_classes)})\.\w+\s*=", line)]
    assert assignments == []
