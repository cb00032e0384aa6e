"""Every vLLM name the harness patches (``harness.engine.patches.PATCHES``) still exists in the
installed vLLM with the parameters the patch was written against (a method's parameters; an
attribute added on a vLLM object absent from vLLM; a field written still declared; a swapped-in
class still a stateless direct subclass): a vLLM upgrade that moves one fails here, by name, before
any engine starts. No engine: vLLM's modules are only imported. That nothing outside the list
changes vLLM is ``test_patch_guard``'s."""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import re

import pytest

from harness.engine import patches
from harness.engine.patches import CLASS_KINDS, PATCHES, install, installed


def _id(patch) -> str:
    return f"{patch.owner.split(':')[1]}.{patch.name}[{patch.how}]"


def _harness_class(dotted: str):
    module, name = dotted.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("patch", PATCHES, ids=[_id(patch) for patch in PATCHES])
def test_each_patched_vllm_name_exists_with_its_parameters(patch):
    owner = patch.owner_class()
    if patch.how == "added":
        assert patch.name not in vars(owner) or installed(owner, patch.name), \
            f"vLLM now defines {patch.target} itself: the harness's would hide it"
        return
    if patch.how == "added on an instance":
        # vLLM neither defines the name on the class nor sets it in any of its classes' code, and the
        # objects have a __dict__ to hold it
        assert not hasattr(owner, patch.name), f"vLLM now defines {patch.target}"
        for cls in owner.__mro__:
            if cls.__module__.startswith("vllm"):
                assert not re.search(rf"\.{re.escape(patch.name)}\b", inspect.getsource(cls)), \
                    f"vLLM's {cls.__qualname__} now uses {patch.name}"
        assert owner.__dictoffset__ != 0, f"{owner.__qualname__}'s objects hold no attribute of their own"
        return
    if patch.how == "field set on an instance":
        declared = getattr(owner, "__struct_fields__", None) or [field.name for field in dataclasses.fields(owner)]
        assert patch.name in declared, f"{patch.target} is no longer a field vLLM declares"
        return
    if patch.how == "class swapped on an instance":
        swapped_in = _harness_class(patch.by)
        assert swapped_in.__bases__ == (owner,), f"{patch.by} must subclass {owner.__qualname__} directly"
        assert "__init__" not in vars(swapped_in) and "__slots__" not in vars(swapped_in), \
            f"{patch.by} is swapped onto objects vLLM made: it can hold no state of its own"
        return
    method = getattr(owner, patch.name)
    # a wrapped method after install: its signature is vLLM's (functools.wraps keeps __wrapped__)
    original = inspect.unwrap(method)
    assert tuple(inspect.signature(original).parameters) == patch.parameters, patch.target


def test_install_patches_each_name_once_and_only_the_listed_ones():
    install()
    on_classes = [patch for patch in PATCHES if patch.how in CLASS_KINDS]
    # (looked up statically: a classmethod's bound method is a new object at every getattr)
    first = {patch.target: inspect.getattr_static(patch.owner_class(), patch.name) for patch in on_classes}
    install()  # every vLLM process's plugin may call it again: nothing is wrapped twice
    for patch in PATCHES:
        owner = patch.owner_class()
        assert installed(owner, patch.name) == (patch.make is not None), patch.target
        if patch.how not in CLASS_KINDS:
            continue
        assert inspect.getattr_static(owner, patch.name) is first[patch.target], patch.target
        if patch.how == "wrapped":
            assert "/harness/engine/" in getattr(owner, patch.name).__code__.co_filename, patch.target


def test_the_messages_attributes_are_the_listed_ones():
    from harness.eviction.messages import PLAN_ATTRIBUTE, REPORT_ATTRIBUTE

    added = {patch.name for patch in PATCHES if patch.how == "added on an instance"}
    assert {PLAN_ATTRIBUTE, REPORT_ATTRIBUTE} <= added


def test_the_object_helpers_refuse_an_unlisted_name_and_put_back_what_was_there():
    """``set_on``/``take_from``/``replaced_on``/``swap_class``: the only writes to a vLLM object outside
    ``patches``, each refusing a name the list does not have for one object; ``replaced_on`` leaves
    the object as it found it (its own value, or none: the class's again)."""
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

    from harness.engine.scheduler import PhysicalLengthManager

    class Layer:
        def forward(self):
            return "class"

    layer = Layer()
    with pytest.raises(RuntimeError, match="'speed' is not listed"):
        patches.set_on(layer, "speed", 1)
    with pytest.raises(RuntimeError, match="not listed"):
        patches.take_from(layer, "speed")
    with patches.replaced_on(layer, "forward", lambda: "pass"):
        assert layer.forward() == "pass"
    assert layer.forward() == "class" and "forward" not in vars(layer)
    patches.set_on(layer, "forward", lambda: "own")
    with patches.replaced_on(layer, "forward", lambda: "pass"):
        assert layer.forward() == "pass"
    assert layer.forward() == "own"
    assert patches.take_from(layer, "forward")() == "own" and layer.forward() == "class"
    assert patches.take_from(layer, "_kv_step") is None

    manager = FullAttentionManager.__new__(FullAttentionManager)
    with pytest.raises(TypeError, match="not a listed direct subclass"):
        patches.swap_class(manager, type("Other", (FullAttentionManager,), {}))
    with pytest.raises(TypeError, match="not a listed direct subclass"):
        patches.swap_class(layer, PhysicalLengthManager)
    patches.swap_class(manager, PhysicalLengthManager)
    assert type(manager) is PhysicalLengthManager


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
