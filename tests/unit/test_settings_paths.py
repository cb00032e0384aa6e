"""Every bad value of every eviction setting, through every path settings enter by, is refused with
one line before any model loads: a run's Hydra config (``harness.config.run_settings``, what
``run.py`` and a sweep's cells read), the wire form (``parse_settings``, what an engine's
``additional_config`` and a request's ``extra_args`` carry through ``vllm serve`` and the ``LLM``
API, and ``request_settings``, the frontend's read with the policy built), a batch_run spec (its
engine default and each request's own, ``harness.engine.batch_run.check_spec``) and the throughput
bench's cells (``harness.bench.throughput``). No engine is started: ``Engine`` itself refuses to
start here."""
from __future__ import annotations

import subprocess
import sys

import pytest

from harness.config import ConfigError, run_settings
from harness.eviction.settings import CONFIG_KEY, DECLARED, RUN_FIELDS, WIRE_FIELDS, parse_settings, request_settings
from tests.support import ROOT
from tests.unit.test_config import compose_cfg

PAGED = {"policy": "paged", "budget": 64}
CONTEXT = {**PAGED, "decode_eviction": False, "compress": "context"}

# Each setting's bad values: (the wire settings, what the one line says). Every one of them is a
# field's own check (harness.eviction.checks), refused on every path alike.
BAD = {
    "policy": [({"policy": "oracle", "budget": 64}, "unknown policy 'oracle'; valid: full, h2o")],
    "budget": [({"policy": "paged", "budget": "many"}, "budget must be an integer number of tokens, got 'many'"),
               ({"policy": "paged", "budget": 1.5}, "budget must be an integer"),
               ({"policy": "paged", "budget": True}, "budget must be an integer")],
    "options": [({**PAGED, "options": "fast"}, "options must be a mapping, got 'fast'")],
    "budget_ratio": [({"policy": "paged", "budget": None, "budget_ratio": 1.0}, "budget_ratio is the share of the "
                      "prompt removed, a number in [0, 1); got 1.0"),
                     ({"policy": "paged", "budget": None, "budget_ratio": "half"}, "budget_ratio is the share"),
                     ({**PAGED, "budget_ratio": 0.5}, "budget_ratio=0.5 sets each request's budget from its prompt: "
                      "pass budget=null with it (budget=64 was also given)")],
    "decode_eviction": [({**PAGED, "decode_eviction": "maybe"}, "decode_eviction must be true or false, got 'maybe'")],
    "compress": [({**PAGED, "compress": "question"}, "compress must be one of prompt, context"),
                 ({**PAGED, "decode_eviction": True, "compress": "context"}, "pass decode_eviction=false with it")],
    "context_tokens": [({**PAGED, "context_tokens": 90}, "context_tokens is the boundary compress=context evicts at"),
                       ({**CONTEXT, "context_tokens": "90"}, "context_tokens must be a positive number of tokens"),
                       ({**CONTEXT, "context_tokens": 0}, "context_tokens must be a positive number of tokens")],
    "budget_schedule": [({**PAGED, "budget_schedule": "cake"}, "budget_schedule must be one of uniform, pyramid, "
                         "attention, kvzip, got 'cake'")],
    "pyramid_beta": [({**PAGED, "budget_schedule": "pyramid", "pyramid_beta": 0.5}, "pyramid_beta is the pyramid's "
                      "slope, a number >= 1"),
                     ({**PAGED, "pyramid_beta": 5}, "pyramid_beta shapes budget_schedule=pyramid; this one is uniform")],
    "share_context": [({**CONTEXT, "share_context": "maybe"}, "share_context must be true, false or null"),
                      ({**PAGED, "share_context": True}, "share_context=true, but compress=prompt keeps what the "
                       "question attends to"),
                      ({**CONTEXT, "budget_schedule": "attention", "share_context": True},
                       "share_context=true, but budget_schedule=attention measures")],
    "chain": [({**CONTEXT, "chain": "maybe"}, "chain must be true or false, got 'maybe'"),
              ({**PAGED, "chain": True}, "chain=true carries a turn's compressed context into the next turn; it "
               "needs compress=context"),
              ({**CONTEXT, "budget_schedule": "attention", "chain": True}, "chain=true, but budget_schedule=attention")],
    "protect_prefix": [({**PAGED, "protect_prefix": -1}, "protect_prefix is how many of the request's first tokens are "
                        "never evicted, an integer >= 0; got -1"),
                       ({**PAGED, "protect_prefix": "all"}, "protect_prefix is how many of the request's first tokens"),
                       ({**PAGED, "protect_prefix": 2.5}, "protect_prefix is how many of the request's first tokens")],
    "group_budgets": [({**PAGED, "group_budgets": [64, 64]}, "unknown key(s) ['group_budgets']")],
    "reconstruction": [({**CONTEXT, "reconstruction": [1, 2]}, "reconstruction must be a mapping of prefix_tokens"),
                       ({**CONTEXT, "reconstruction": {"prefix_tokens": 1, "first": [], "later": [2], "suffix": []}},
                        "reconstruction.first and .later are the repeat prompts")],
}
CASES = [pytest.param(raw, message, id=f"{name}-{index}") for name, cases in BAD.items()
         for index, (raw, message) in enumerate(cases)]


@pytest.fixture(autouse=True)
def no_engine(monkeypatch):
    """A path that got as far as starting an engine (loading a model) fails the test."""
    from harness.engine import llm

    def refuse(*args, **kwargs):
        raise AssertionError("an engine was started: the settings were not refused before the model loads")

    monkeypatch.setattr(llm.Engine, "__init__", refuse)


def refused(call, message: str, kind=ValueError, where: str = "") -> str:
    """``call`` raises ``kind`` in one line, starting with ``where`` and saying ``message``."""
    with pytest.raises(kind) as error:
        call()
    text = str(error.value)
    assert message in text and text.startswith(where) and "\n" not in text, text
    return text


def test_every_setting_has_its_bad_values_here():
    """A new setting adds its bad values to ``BAD`` (and so is walked through every path)."""
    assert set(BAD) == set(DECLARED)


@pytest.mark.parametrize("raw, message", CASES)
def test_the_wire_form_refuses_it(raw, message):
    """An engine's ``additional_config`` and a request's ``extra_args`` (as a mapping or its JSON
    text, as ``vllm serve``'s ``vllm_xargs`` carries it); the frontend's read with its policy built."""
    import json

    refused(lambda: parse_settings(raw, "request kv_eviction"), message, where="request kv_eviction")
    refused(lambda: parse_settings(json.dumps(raw), "request kv_eviction"), message)
    refused(lambda: request_settings({CONFIG_KEY: raw}, None, 32), message)


def hydra_overrides(raw: dict) -> list[str]:
    """The run config that gives ``raw``: its policy group (or name, for an unknown one), budget and
    the run fields by their names."""
    from policies import REGISTRY

    def text(value):
        return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)

    policy = raw["policy"]
    overrides = [f"policy={policy}" if policy in REGISTRY else f"policy.name={policy}", f"budget={text(raw['budget'])}"]
    return overrides + [f"{name}={text(value)}" for name, value in raw.items() if name in RUN_FIELDS]


@pytest.mark.parametrize("raw, message", [case for case in CASES
                                          if set(case.values[0]) <= {"policy", "budget", *RUN_FIELDS}])
def test_a_run_refuses_it(raw, message):
    """The run's config (``run.py``, and every cell of a sweep: ``harness.run.sweep`` checks each
    with ``run_settings``): a ``ConfigError``, which ``run.py`` prints as its one line."""
    refused(lambda: run_settings(compose_cfg(*hydra_overrides(raw))), message, ConfigError)


def test_a_run_gives_no_field_a_request_alone_has():
    """context_tokens and reconstruction are each request's own (its prompt's): no run field."""
    assert set(WIRE_FIELDS) - {"policy", "budget", "options"} - set(RUN_FIELDS) == {"context_tokens", "reconstruction"}


@pytest.mark.parametrize("raw, message", CASES)
def test_a_batch_run_spec_refuses_it(raw, message, tmp_path):
    """As the engine's default (``eviction``), as one request's own (``request_eviction``) and as a
    conversation's: refused before the engine's process starts (``run_in_subprocess`` checks first)."""
    from harness.engine.batch_run import check_spec, run_in_subprocess

    refused(lambda: check_spec({"eviction": raw}), message, where="batch_run spec eviction")
    refused(lambda: check_spec({"request_eviction": [None, raw]}), message, where="batch_run spec request_eviction[1]")
    if raw.get("compress") == "context" and "context_tokens" not in raw:  # (each turn gives its boundary)
        conversation = {"prompt": [1, 2, 3], "context_tokens": 2, "messages": [], "max_new_tokens": 1, "eviction": raw}
        refused(lambda: check_spec({"conversations": [conversation]}), message,
                where="batch_run spec conversations[0] eviction")
    refused(lambda: run_in_subprocess({"eviction": raw}, tmp_path / "never-made"), message)
    assert not (tmp_path / "never-made").exists()


@pytest.mark.parametrize("raw, message", [case for case in CASES if set(case.values[0]) <= {"policy", "budget",
                                                                                            "budget_schedule"}])
def test_a_benchmark_cell_refuses_it(raw, message):
    """A throughput cell's settings (its fields named as the record's) through the same parse."""
    from harness.bench.throughput import Cell, check_setting
    from tests.support.throughput import FULL, setting

    cell = Cell(**raw)
    refused(lambda: cell.settings, message)
    refused(lambda: check_setting(setting(FULL, cell)), message)


# What needs the engine (block size, layer groups, eager mode): the one admission, on the paths that
# know the engine before any model loads (a request's own is admitted by the engine, per request).
ADMISSION = [
    ({"policy": "paged", "budget": 100}, "budget=100 is not a multiple of block_size=32"),
    ({**PAGED, "options": {"windw": 2}}, "has no option windw"),
    ({**PAGED, "budget_schedule": "pyramid"}, "budget_schedule=pyramid spreads the budget over the engine's layer "
     "groups; this engine has one"),
    ({**CONTEXT, "policy": "snapkv", "chain": True}, "a chained turn carries the previous turn's kept K/V"),
    ({**PAGED, "protect_prefix": 40}, "protect_prefix=40 leaves 0 of budget=64 tokens beside the 2 block(s) holding it; "
     "paged needs 32 there"),
]


@pytest.mark.parametrize("raw, message", ADMISSION)
def test_what_the_engine_cannot_run_is_refused_before_it_starts(raw, message):
    from harness.bench.throughput import Cell, check_setting
    from harness.engine.batch_run import check_spec
    from tests.support.throughput import FULL, setting

    refused(lambda: run_settings(compose_cfg(*hydra_overrides(raw), *(
        [f"+policy.options.{k}={v}" for k, v in raw.get("options", {}).items()]))), message, ConfigError)
    refused(lambda: check_spec({"eviction": raw}), message, where="batch_run spec eviction")
    if set(raw) <= {"policy", "budget", "budget_schedule"}:
        refused(lambda: check_setting(setting(FULL, Cell(**raw))), message)
    parse_settings(raw, "a request's own: parsed here, admitted by the engine")


@pytest.mark.parametrize("overrides, message", [
    (["share_context=true"], "error: the run: share_context=true, but compress=prompt keeps what the question attends to"),
    pytest.param(["share_context=maybe"], "error: the run: share_context must be true, false or null",
                 marks=pytest.mark.slow),
])
def test_run_py_refuses_a_share_setting_in_one_line_before_a_model_loads(tmp_path, overrides, message):
    """Before: ``run.py policy=paged budget=512 share_context=true`` loaded the model and died in
    vLLM's engine core 30 s later (issue 63)."""
    done = subprocess.run([sys.executable, str(ROOT / "run.py"), f"output_dir={tmp_path / 'runs'}", "policy=paged",
                           "budget=512", *overrides], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode != 0 and len(lines) == 1 and lines[0].startswith(message), done.stderr
    runs = tmp_path / "runs"
    assert not runs.exists() or not any(runs.rglob("*.json*")), "no run files"
