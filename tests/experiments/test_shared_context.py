"""The shared-context workload asks what it says (no engine): every question of a context shares
the context's tokens, each configuration's requests carry the boundary their mode evicts at."""
from __future__ import annotations

import json
import math

import importlib.util
import sys

import pytest

from tests.support import ROOT


@pytest.fixture(scope="module")
def experiment():
    spec = importlib.util.spec_from_file_location("shared_context", ROOT / "experiments" / "shared_context.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def prompts(experiment):
    from transformers import AutoTokenizer

    from harness.config.models import EMBEDDED_PREFIX, resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(EMBEDDED_PREFIX + "smollm2-135m-instruct"))
    return tokenizer, [(shared, experiment.prompts_of(shared, tokenizer, 3500)) for shared in experiment.workload(2)]


def test_each_context_is_asked_its_questions_with_their_own_answers(experiment):
    codes, births = experiment.workload(2)
    assert (codes.task, births.task) == ("key_retrieval", "multi_doc_qa")
    for shared in (codes, births):
        assert len(shared.questions) == experiment.QUESTIONS
        for text, (answer,) in shared.questions:
            assert answer in shared.context and text not in shared.context
        assert len({answer for _, answer in shared.questions}) == experiment.QUESTIONS


def test_each_mode_evicts_where_it_says(experiment, prompts):
    tokenizer, asked = prompts
    (shared, questions), _ = asked
    context = questions[0].context_tokens
    full = experiment.requests_for(("full", None), asked, 0.5, tokenizer)
    assert all(r.settings == {"policy": "full"} for r in full)
    agnostic = experiment.requests_for(("context", "snapkv"), asked, 0.5, tokenizer)
    assert [r.settings["context_tokens"] for r in agnostic[:6]] == [context] * 6
    assert [r.token_ids for r in agnostic] == [r.token_ids for r in full]
    aware = experiment.requests_for(("prompt", "paged"), asked, 0.5, tokenizer)
    assert all("compress" not in r.settings and r.settings["policy"] == "paged" for r in aware)
    reused = experiment.requests_for(("first question", "snapkv"), asked, 0.5, tokenizer)
    assert "compress" not in reused[0].settings and reused[0].token_ids == questions[0].token_ids
    footer = experiment.footer_tokens(tokenizer, questions)
    assert footer > 0
    for request, own in zip(reused[1:6], questions[1:6]):
        boundary = request.settings["context_tokens"]
        # the context and the first question (its chat footer aside) are compressed; the later
        # question's own part follows, unchanged
        assert request.token_ids[:boundary] == questions[0].token_ids[:len(questions[0].token_ids) - footer]
        assert request.token_ids[boundary:] == own.token_ids[own.context_tokens:]


def test_rounds_send_one_question_of_every_context_at_a_time_in_order(experiment, prompts):
    tokenizer, asked = prompts
    requests = experiment.requests_for(("context", "paged"), asked, 0.5, tokenizer)
    assert experiment.arrival_rounds(requests, "together") == [list(range(len(requests)))]
    rounds = experiment.arrival_rounds(requests, "rounds")
    assert len(rounds) == experiment.QUESTIONS and sorted(i for batch in rounds for i in batch) == list(range(len(requests)))
    for question, batch in enumerate(rounds):
        assert [requests[i].question for i in batch] == [question] * len(asked)
        assert len({requests[i].shared.id for i in batch}) == len(asked)  # one question of every context


def test_trials_alternate_their_order_and_ratios_pair_configurations_within_a_trial(experiment):
    orders = experiment.trial_orders(["full", "a", "b"], 4)
    assert orders == [["full", "a", "b"], ["b", "a", "full"], ["full", "a", "b"], ["b", "a", "full"]]
    # every configuration at the same mean position over an even number of trials
    assert len({sum(order.index(name) for order in orders) for name in ("full", "a", "b")}) == 1
    # a machine slowing by 2% per position, "a" really 0.8x full: the per-trial ratios move with
    # the order, the fit with a time trend recovers 0.8
    trials, position = [], 0
    for trial, order in enumerate(orders, start=1):
        for name in order:
            level = {"full": 10.0, "a": 8.0, "b": 10.0}[name] * 0.98 ** position
            trials.append({"configuration": name, "trial": trial, "position": position, "output_tok_s": level,
                           "running_peak": 3, "preemptions": 0, "outputs_digest": name})
            position += 1
    table = {line["configuration"]: line for line in experiment.throughput_table(trials)}
    assert abs(table["a"]["trend_ratio"] - 0.8) < 1e-9 and table["a"]["trend_low"] < 0.8 < table["a"]["trend_high"] + 1e-9
    assert table["a"]["ratio_low"] < 0.8 < table["a"]["ratio_high"] and all(line["same_outputs"] for line in table.values())
    text = "\n".join(experiment.throughput_markdown(list(table.values()), trials, 300))
    assert "trial 2: b > a > full" in text and "| a | 7.8, " in text


def test_kvzip_compresses_the_context_once_with_the_prompt_builders_reconstruction_ids(experiment, prompts):
    """KVzip's configuration (issue 50): the context mode of the others, at their ratio, each request
    with its prompt's reconstruction ids as run.py's requests carry them (``CellWork.eviction_for``:
    ``EvictionSettings.for_request`` with the prompt builder's ``Prompt.reconstruction``), which the
    engine's own checks accept; no other configuration carries any."""
    from harness.eviction.settings import CONFIG_KEY, EvictionSettings, request_settings

    tokenizer, asked = prompts
    admitted = lambda raw, tokens: request_settings({CONFIG_KEY: raw}, None, 32).for_prompt(len(tokens), 32)
    assert ("context", "kvzip") in experiment.configurations() and ("context", "kvzip") in experiment.configurations(True)
    kvzip = experiment.requests_for(("context", "kvzip"), asked, 0.5, tokenizer)
    paged = experiment.requests_for(("context", "paged"), asked, 0.5, tokenizer)
    built = [prompt for _, questions in asked for prompt in questions]
    assert len(kvzip) == len(built) == 2 * experiment.QUESTIONS
    cell = EvictionSettings(policy="kvzip", budget=None, compress="context", budget_ratio=0.5, decode_eviction=False)
    for request, twin, prompt in zip(kvzip, paged, built):
        assert request.token_ids == twin.token_ids == prompt.token_ids
        reconstruction = request.settings.pop("reconstruction")
        # the same ratio, boundary and sharing as the other context-compressing configurations
        assert request.settings == {**twin.settings, "policy": "kvzip"}
        assert reconstruction is prompt.reconstruction  # the prompt builder's ids, not a second derivation
        assert reconstruction == cell.for_request(prompt.context_tokens, prompt.reconstruction).reconstruction.as_dict()
        assert reconstruction["prefix_tokens"] > 0 and reconstruction["suffix"]  # SmolLM2's chat header and footer
        request.settings["reconstruction"] = reconstruction
        # as the engine admits a request (its parse and checks, reconstruction ids included)
        settings = admitted(request.settings, request.token_ids)
        assert settings.reconstruction is not None and settings.eviction_point(len(request.token_ids)) == prompt.context_tokens
        assert settings.budget == admitted(twin.settings, twin.token_ids).budget
    # a context's questions carry the same ids, so the context compressed by the first is the one the others need
    for shared_requests in (kvzip[:experiment.QUESTIONS], kvzip[experiment.QUESTIONS:]):
        assert len({json_of(r.settings["reconstruction"]) for r in shared_requests}) == 1
    for configuration in experiment.configurations():
        if configuration[1] != "kvzip":
            made = experiment.requests_for(configuration, asked, 0.5, tokenizer)
            assert not any("reconstruction" in r.settings for r in made), configuration


def json_of(value) -> str:
    import json

    return json.dumps(value, sort_keys=True)


def test_a_context_without_reconstruction_ids_is_refused(experiment, prompts):
    from dataclasses import replace

    tokenizer, asked = prompts
    (shared, questions), rest = asked[0], asked[1:]
    broken = [(shared, [replace(questions[0], reconstruction=None)] + questions[1:])] + rest
    with pytest.raises(RuntimeError, match="no chat header"):
        experiment.requests_for(("context", "kvzip"), broken, 0.5, tokenizer)
    experiment.requests_for(("context", "paged"), broken, 0.5, tokenizer)  # only a reconstructing policy needs them


def test_configs_runs_the_named_configurations_beside_full_cache(experiment):
    assert list(experiment.selected()) == [experiment.name_of(c) for c in experiment.configurations()]
    assert list(experiment.selected(False, "kvzip context")) == ["full", "kvzip context"]
    assert list(experiment.selected(True, "paged context unshared, kvzip context")) == [
        "full", "kvzip context", "paged context unshared"]
    for wrong in ("kvzip", "paged prompt", ""):
        with pytest.raises(ValueError, match="the configurations are"):
            experiment.selected(True, wrong)


def fake_run(experiment, names: list[str], seed: int, questions: int = 3) -> tuple[list[dict], dict]:
    """Rows and per-configuration (wall, ledger) as a run leaves them, scores from ``seed``."""
    import random

    rng = random.Random(seed)
    rows, runs = [], {}
    for name in names:
        for task, prefix in (("key_retrieval", "codes"), ("multi_doc_qa", "births")):
            for c in range(3):
                for q in range(questions):
                    score = float(rng.random() < 0.4)
                    rows.append({"configuration": name, "task": task, "context": f"{prefix}-{c}", "question": q,
                                 "prompt_tokens": 2000, "context_tokens": None if name == "full" else 1980,
                                 "prediction": f"{name}-{task}-{c}-{q}" if name != "full" else f"full-{task}-{c}-{q}",
                                 "answers": ["x"], "output_tokens": 10, "score": score})
        ledger = {"kv_blocks_used_peak": 500 if name == "full" else 300, "kv_blocks_used_mean": 400.0,
                  "evictions": {"prefill": 0 if name == "full" else 6}, "evicted_tokens": 0,
                  "shared_contexts": {"hits": 0 if name == "full" else 12}, "evict_s": 2.5}
        if name == "kvzip context":
            ledger.update(reconstruct_tokens=12_000, reconstruct_s=1.5)
        runs[name] = (20.0, ledger)
    return rows, runs


def write_run(experiment, out, rows, runs, command: str, pool: int = 2912) -> None:
    import pandas as pd

    out.mkdir(parents=True, exist_ok=True)
    table = experiment.summarize(rows, runs)
    code = experiment.record_code(out, command)  # as the script's own run records it
    (out / "summary.md").write_text(experiment.markdown(table, command, 6, 0.5, "smollm2-135m", pool,
                                                        experiment.comparisons(rows), 3,
                                                        dead=experiment.dead_questions(rows), code=code))
    pd.DataFrame(table).to_csv(out / "summary.csv", index=False)
    (out / "requests.jsonl").write_text("".join(json_of(row) + "\n" for row in rows))


def test_the_summary_reports_kvzips_reconstruction_cost_and_compares_it_with_paged(experiment, tmp_path):
    rows, runs = fake_run(experiment, ["full", "paged context", "kvzip context"], seed=1)
    table = experiment.summarize(rows, runs)
    line = next(line for line in table if line["configuration"] == "kvzip context")
    assert (line["reconstruct_tokens"], line["reconstruct_s"], line["evict_s"]) == (12_000, 1.5, 2.5)
    assert "reconstruct_tokens" not in next(line for line in table if line["configuration"] == "paged context")
    families = experiment.comparisons(rows)
    for family in families.values():
        assert {(e["row"], e["column"]) for e in family} >= {("kvzip context", "full"), ("kvzip context", "paged context")}
    text = experiment.markdown(table, "python experiments/shared_context.py", 6, 0.5, "smollm2-135m", 2912, families, 3)
    assert ("`kvzip context` reconstructed its contexts with 12,000 tokens of passes in 1.5 s" in text
            and "2,000 tokens and 0.25 s per compressed context, 8% of its wall time" in text)
    # --reanalyse keeps the figures (summary.csv holds them) and rewrites the same summary
    out = tmp_path / "run"
    write_run(experiment, out, rows, runs, "python experiments/shared_context.py --out x")
    before = (out / "summary.md").read_text()
    assert experiment.reanalyse(out) == 0
    assert (out / "summary.md").read_text() == before
    assert before.count("Code: the engine ran `python experiments/shared_context.py --out x` at commit ") == 1
    recorded = json.loads((out / experiment.PROVENANCE).read_text())
    assert len(recorded["engine_runs"]) == 1 and recorded["statistics"]["code_version"]


def test_configs_join_an_earlier_run_keeping_its_configurations_and_its_full_cache(experiment, tmp_path):
    import pandas as pd

    out = tmp_path / "run"
    command = "python experiments/shared_context.py --out x"
    earlier_rows, earlier_runs = fake_run(experiment, ["full", "paged context", "paged context unshared"], seed=2)
    write_run(experiment, out, earlier_rows, earlier_runs, command)
    found = experiment.previous_run(out)
    assert (found.command, found.pool, found.ratio, found.added) == (command, 2912, 0.5, [])
    new_rows, new_runs = fake_run(experiment, ["full", "kvzip context"], seed=3)
    new_rows = [dict(row, prediction="changed") if row["configuration"] == "full" and row["question"] == 0 else row
                for row in new_rows]
    new_table = experiment.summarize(new_rows, new_runs)
    order = [experiment.name_of(c) for c in experiment.configurations()]
    rows, table, check = experiment.merge(found.rows, found.table, new_rows, new_table, order)
    assert [line["configuration"] for line in table] == ["full", "paged context", "kvzip context", "paged context unshared"]
    kept_full = [row for row in rows if row["configuration"] == "full"]
    assert kept_full == [row for row in earlier_rows if row["configuration"] == "full"]  # the earlier full cache stays
    assert [row for row in rows if row["configuration"] == "kvzip context"] == [
        row for row in new_rows if row["configuration"] == "kvzip context"]
    assert check["full_same"] == 18 - 6 and check["full_requests"] == 18 and check["configurations"] == ["kvzip context"]
    # written as main writes it, then the summary from the joined files
    (out / experiment.ADDED).write_text(json_of([{"command": command + " --configs 'kvzip context'", **check}]))
    pd.DataFrame(table).to_csv(out / "summary.csv", index=False)
    (out / "requests.jsonl").write_text("".join(json_of(row) + "\n" for row in rows))
    experiment.reanalyse(out)
    text = (out / "summary.md").read_text()
    assert f"Command: `{command}`" in text and "| kvzip context |" in text and "| paged context unshared |" in text
    assert "Added by `python experiments/shared_context.py --out x --configs 'kvzip context'`" in text
    assert "12 of its 18 answers are the same text as the full cache above" in text
    assert "reconstructed its contexts with 12,000 tokens" in text
    # the earlier configurations' lines are as they were
    old = pd.read_csv(tmp_path / "run" / "summary.csv").set_index("configuration")
    earlier = pd.DataFrame(experiment.summarize(earlier_rows, earlier_runs)).set_index("configuration")
    assert old.loc["paged context", "later"] == earlier.loc["paged context", "later"]
    # a run of other settings is not joined
    with pytest.raises(ValueError, match="same questions"):
        experiment.merge(found.rows, found.table, [r for r in new_rows if r["question"] < 2], new_table, order)


def test_the_summary_plans_a_design_that_could_decide_from_the_per_context_spread(experiment):
    """Each comparison with full cache carries the contexts per task that would show it non-inferior
    within the margin (5 points) with 80% power: recomputed here from the per-context mean
    differences by the normal formula ((z_0.975 + z_0.8) S / 5)^2, S = sqrt(sum of the tasks'
    variances) / tasks; a family too small to decide says how many contexts would let Holm decide."""
    from statistics import NormalDist, fmean, variance

    rows, runs = fake_run(experiment, ["full", "paged context", "kvzip context"], seed=3)
    later = experiment.comparisons(rows)["Later questions"]
    entry = next(e for e in later if (e["row"], e["column"]) == ("paged context", "full"))
    score = {(r["configuration"], r["context"], r["question"]): r["score"] for r in rows if r["question"] > 0}
    variances = []
    for prefix in ("codes", "births"):
        means = [100 * fmean(score[("paged context", f"{prefix}-{c}", q)] - score[("full", f"{prefix}-{c}", q)]
                             for q in (1, 2)) for c in range(3)]
        variances.append(variance(means))
    spread = sum(variances) ** 0.5 / 2
    z = NormalDist().inv_cdf(0.975) + NormalDist().inv_cdf(0.8)
    assert entry["clusters_needed"] == max(6, math.ceil((z * spread / 5) ** 2 - 1e-9))
    text = "\n".join(experiment_section(later))
    assert f"paged context {entry['clusters_needed']}" in text
    # 6 contexts: the smallest p 1/65 times 3 comparisons is 0.046 (can decide); over 16 it cannot
    assert "would let Holm decide at all" not in text
    assert "9 clusters per comparison would let Holm decide at all over 16" in "\n".join(experiment_section((later * 6)[:16]))


def experiment_section(table: list[dict]) -> list[str]:
    from harness.analysis.clustered import section

    return section({"Later questions": table}, "one context")


def test_kvzips_schedule_across_layer_groups_needs_groups_and_asks_the_context_mode_with_its_allocation(
        experiment, prompts, tmp_path):
    """``--layer-groups G`` adds KVzip's own allocation across the groups (issue 65, item 4): the
    requests of ``kvzip context`` with ``budget_schedule=kvzip``, which the engine's parse admits on
    G groups and refuses on one; without groups the configuration is refused by name before
    anything loads, and the summary says how the engine ran and that its requests share nothing."""
    from harness.eviction.admission import admit
    from harness.eviction.settings import CONFIG_KEY, request_settings

    scheduled = f"kvzip {experiment.SCHEDULED}"
    assert scheduled not in experiment.selected()
    assert list(experiment.selected(True, None, 3))[-1] == scheduled
    assert list(experiment.selected(True, f"{scheduled}, kvzip context", 3)) == ["full", "kvzip context", scheduled]
    with pytest.raises(ValueError, match="needs --layer-groups 2 or more"):
        experiment.selected(True, scheduled)
    tokenizer, asked = prompts
    measured = experiment.requests_for((experiment.SCHEDULED, "kvzip"), asked, 0.5, tokenizer)
    uniform = experiment.requests_for(("context", "kvzip"), asked, 0.5, tokenizer)
    for request, twin in zip(measured, uniform):
        assert request.token_ids == twin.token_ids
        assert request.settings == {**twin.settings, "budget_schedule": "kvzip"}
    parsed = request_settings({CONFIG_KEY: measured[0].settings}, None, 32).for_prompt(len(measured[0].token_ids), 32)
    assert parsed.budget_schedule == "kvzip"
    admit(parsed, 32, 30, 3, enforce_eager=True, async_scheduling=False)  # three groups of ten layers: admitted
    with pytest.raises(ValueError, match="this engine has one"):
        admit(parsed, 32, 30, 1, enforce_eager=True, async_scheduling=False)  # one group: nothing to allocate
    # the comparisons put it beside full cache and pair-uniform; the summary names the engine's groups
    rows, runs = fake_run(experiment, ["full", "kvzip context", scheduled], seed=4)
    families = experiment.comparisons(rows)
    assert {(e["row"], e["column"]) for e in families["Later questions"]} == {
        ("kvzip context", "full"), (scheduled, "full"), (scheduled, "kvzip context")}
    command = "python experiments/shared_context.py --layer-groups 3 --context-only --out x"
    out = tmp_path / "groups"
    write_run(experiment, out, rows, runs, command)
    text = experiment.markdown(experiment.summarize(rows, runs), command, 6, 0.5, "smollm2-135m", 2912, families, 3,
                               layer_groups=3)
    assert "its attention layers as 3 KV cache groups" in text and "share no compressed context" in text
    # the ledger counts an eviction per group: 6 per run here is 2 contexts compressed, 6,000 tokens each
    assert "6,000 tokens and 0.75 s per compressed context" in text and "3 per context compressed" in text
    assert experiment.previous_run(out).layer_groups == 3  # the engine sentence still parses; groups from the command
    experiment.reanalyse(out)  # the groups come back from the command
    assert "its attention layers as 3 KV cache groups" in (out / "summary.md").read_text()
