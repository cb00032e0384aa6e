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


def test_a_failed_policy_s_message_reaches_the_server_s_error_for_its_request_only():
    """The frontend notes a policy failure under the request id the output carries and the
    server's error check raises it for that request (a completion's prompts carry "-<index>");
    any other error keeps vLLM's own text, and a note is taken once."""
    from vllm.exceptions import GenerationError
    from vllm.v1.engine import FinishReason

    from harness.engine import frontend

    made = []

    class State:
        external_req_id = "cmpl-7-1"

        def make_request_output(self, new_token_ids, pooling_output, finish_reason, stop_reason, *rest):
            made.append(stop_reason)

    def raise_if_error(self, finish_reason, request_id):
        if finish_reason == "error":
            raise GenerationError("Internal server error")

    make = frontend.wrap_make_request_output(State.make_request_output)
    check = frontend.wrap_raise_if_error(raise_if_error)
    make(State(), [], None, FinishReason.ERROR, "policy faulty_late failed: ZeroDivisionError: boom")
    make(State(), [], None, FinishReason.ERROR, "an engine error")  # not a policy's: not noted
    assert made == ["policy faulty_late failed: ZeroDivisionError: boom", "an engine error"]
    check(None, "stop", "cmpl-7")
    with pytest.raises(GenerationError, match="Internal server error"):
        check(None, "error", "cmpl-8")
    with pytest.raises(GenerationError, match="policy faulty_late failed: ZeroDivisionError: boom"):
        check(None, "error", "cmpl-7")
    with pytest.raises(GenerationError, match="Internal server error"):
        check(None, "error", "cmpl-7")  # taken once
