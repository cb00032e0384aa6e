"""The eviction settings record's fields are declared once (``harness.eviction.settings``: each field
with ``setting(...)``), and every form derives from that declaration: the wire form, the run's
fields and a cell's identity, the policy's key, the names, the ``Policy`` fields the record sets and
the registry's list of what is not a policy option. These tests hold each form to the declaration
with one valid value away from each field's default (``AWAY``: a new field must add its own)."""
from __future__ import annotations

import dataclasses
from dataclasses import replace

import pytest

from harness.eviction.settings import (DECLARED, DEFAULTS, KEY_FIELDS, NAMED_FIELDS, RUN_FIELDS, WIRE_FIELDS,
                                       EvictionSettings, build_policy, parse_settings)
from policies import REGISTRY, Policy, default_options
from policies.registry import NOT_OPTIONS
from tests.support import ROOT

BASE = EvictionSettings("paged", 64)
CONTEXT = {"decode_eviction": False, "compress": "context"}
# Per field: the changes that take it away from its default, with what it needs beside it (its own
# value last), all valid together.
AWAY = {
    "policy": {"policy": "knorm"},
    "budget": {"budget": 128},
    "options": {"options": {"per_head": True}},
    "budget_ratio": {"budget": None, "budget_ratio": 0.5},
    "decode_eviction": {"decode_eviction": False},
    "compress": CONTEXT,
    "context_tokens": {**CONTEXT, "context_tokens": 90},
    "budget_schedule": {"budget_schedule": "pyramid"},
    "pyramid_beta": {"budget_schedule": "pyramid", "pyramid_beta": 5.0},
    "share_context": {"share_context": False},
    "chain": {**CONTEXT, "chain": True},
    "protect_prefix": {"protect_prefix": 16},
    "group_budgets": {"group_budgets": (96, 32)},
    "reconstruction": {"reconstruction": {"prefix_tokens": 1, "first": [5], "later": [6], "suffix": [7]}},
}


def away(name: str) -> tuple[EvictionSettings, EvictionSettings]:
    """The settings with ``name`` away from its default, and the same without that change."""
    changes = AWAY[name]
    before = {key: value for key, value in changes.items() if key != name}
    return replace(BASE, **changes), replace(BASE, **before)


def test_every_field_is_declared_and_has_a_value_away_from_its_default_here():
    assert list(AWAY) == list(DECLARED) == [f.name for f in dataclasses.fields(EvictionSettings)]
    for name in DECLARED:
        moved, stayed = away(name)
        assert getattr(moved, name) != getattr(stayed, name), name


@pytest.mark.parametrize("name", list(AWAY))
def test_the_wire_form_carries_a_field_where_it_is_declared_wire_and_reads_back(name):
    moved, stayed = away(name)
    wire, plain = moved.as_dict(), stayed.as_dict()
    changed = {key for key in wire.keys() | plain.keys() if wire.get(key, "absent") != plain.get(key, "absent")}
    assert changed == ({name} if name in WIRE_FIELDS else set()), name
    assert list(wire) == [key for key in WIRE_FIELDS if key in wire], "in the declaration's order"
    if name in WIRE_FIELDS:
        assert parse_settings(wire, "test") == moved and parse_settings(moved.as_extra_args()["kv_eviction"], "t") == moved
    else:
        with pytest.raises(ValueError, match=f"unknown key.*'{name}'"):
            parse_settings({**wire, name: getattr(moved, name)}, "test")


@pytest.mark.parametrize("name", list(AWAY))
def test_the_key_the_identity_and_the_names_follow_the_declaration(name):
    moved, stayed = away(name)
    assert (moved.key != stayed.key) == (name in KEY_FIELDS) == DECLARED[name].key, name
    changed = {key for key in moved.identity().keys() | stayed.identity().keys()
               if moved.identity().get(key) != stayed.identity().get(key)}
    assert changed == ({name} if DECLARED[name].run else set()), name
    if name in NAMED_FIELDS and DECLARED[name].names.slug is not None:
        assert moved.slug() != stayed.slug(), f"{name} names the cell's directory"
    if name not in NAMED_FIELDS:
        assert (moved.slug(), moved.label(), moved.variant_marks(3)) == \
               (stayed.slug(), stayed.label(), stayed.variant_marks(3)), f"{name} is named nowhere"


def test_the_derived_lists_are_the_declaration_read_in_field_order():
    assert WIRE_FIELDS == ("policy", "budget", "options", "budget_ratio", "decode_eviction", "compress",
                           "context_tokens", "budget_schedule", "pyramid_beta", "share_context", "chain",
                           "protect_prefix", "reconstruction")
    assert RUN_FIELDS == ("budget_ratio", "decode_eviction", "compress", "budget_schedule", "pyramid_beta",
                          "share_context", "chain", "protect_prefix")
    assert set(KEY_FIELDS) == set(DECLARED) - {"context_tokens", "share_context", "reconstruction"}
    assert all(DECLARED[name].check is not None for name in WIRE_FIELDS), "every field a user gives is checked"
    assert set(DEFAULTS) == set(DECLARED) - {"policy", "budget"}
    from harness.config import RECORD_FIELDS

    assert RECORD_FIELDS == set(DECLARED), "a run reads every field of its record as its own"


def test_a_runs_config_gives_every_run_field_at_the_records_default_and_it_is_documented():
    """``conf/config.yaml`` holds each run field at the record's default (so a cell that does not
    set it keeps its name), and docs/configuration.md names each."""
    from tests.unit.test_config import compose_cfg

    cfg = compose_cfg()
    docs = (ROOT / "docs" / "configuration.md").read_text()
    for name in RUN_FIELDS:
        assert cfg[name] == DEFAULTS[name], name
        assert f"`{name}" in docs, f"docs/configuration.md does not name {name}"


def test_a_run_field_away_from_its_default_names_another_cell():
    from harness.config import run_settings
    from tests.unit.test_config import compose_cfg

    base = ("policy=paged", "budget=null", "budget_ratio=0.5", "engine.layer_groups=3")
    pairs = {"budget_ratio": ((), ("budget_ratio=0.25",)), "decode_eviction": ((), ("decode_eviction=false",)),
             "compress": (("decode_eviction=false",), ("compress=context",)),
             "budget_schedule": ((), ("budget_schedule=pyramid",)),
             "pyramid_beta": (("budget_schedule=pyramid",), ("pyramid_beta=5",)),
             "share_context": ((), ("share_context=false",)), "chain": (("compress=context",), ("chain=true",)),
             "protect_prefix": ((), ("protect_prefix=16",))}
    assert set(pairs) == set(RUN_FIELDS)
    for name, (before, change) in pairs.items():
        plain, other = run_settings(compose_cfg(*base, *before)), run_settings(compose_cfg(*base, *before, *change))
        assert getattr(other, name) != getattr(plain, name) and other.cell_name != plain.cell_name, name


def test_the_policy_fields_the_record_sets_are_policys_own_and_never_options():
    """``Policy``'s fields beyond its budget and block size are the run settings it carries: the
    record declares which of its fields sets each (``policy_field``), ``build_policy`` sets them,
    and the registry's ``NOT_OPTIONS`` is derived from the same fields, so none ever enters a
    policy's options (and a committed cell's name)."""
    carried = {declared.policy_field for declared in DECLARED.values() if declared.policy_field}
    own = {f.name for f in dataclasses.fields(Policy)} - {"budget", "block_size"}
    assert carried == own == NOT_OPTIONS - {"budget", "block_size", "score"}
    for name, declared in DECLARED.items():
        if declared.policy_field:
            moved, _ = away(name)
            assert getattr(build_policy(moved, 32), declared.policy_field) == declared.policy_value(getattr(moved, name))
    for policy in REGISTRY:
        assert not NOT_OPTIONS & set(default_options(policy)), policy


def test_a_cells_eviction_fields_are_the_records():
    """The throughput bench's ``Cell`` varies eviction settings by the record's own names; its
    engine gets them in the wire form, each away from its default."""
    from harness.bench.throughput import Cell, cell_settings

    assert cell_settings() == ("policy", "budget", "budget_schedule")
    cell = Cell("paged", 256, layer_groups=3, budget_schedule="pyramid")
    assert cell.settings == EvictionSettings("paged", 256, budget_schedule="pyramid")
    assert cell.eviction == {"policy": "paged", "budget": 256, "budget_schedule": "pyramid"}
    assert Cell("paged", 64).eviction == {"policy": "paged", "budget": 64} and Cell("full").settings is None
