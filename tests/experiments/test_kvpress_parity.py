"""The kvpress parity driver's own logic (experiments/kvpress_parity.py): no engine, no kvpress."""
from __future__ import annotations

import sys

import pytest

from tests.support import ROOT

sys.path.insert(0, str(ROOT / "experiments"))

import kvpress_parity as parity  # noqa: E402
from policies import make_policy  # noqa: E402


@pytest.mark.parametrize("prompt_tokens", [33, 100, 893, 1000, 1912, 2048, 4001, 7500])
def test_press_ratio_makes_kvpress_keep_the_harness_count(prompt_tokens):
    for kept in range(1, prompt_tokens + 1, max(1, prompt_tokens // 97)):
        ratio = parity.press_ratio(kept, prompt_tokens)
        assert 0 <= ratio < 1
        assert parity.kvpress_kept(prompt_tokens, ratio) == kept
        # StreamingLLMPress prunes k_len - int(k_len * (1 - ratio)) tokens: the same count.
        assert prompt_tokens - int(prompt_tokens * (1 - ratio)) == prompt_tokens - kept or ratio == 0


def test_press_ratio_edges():
    assert parity.press_ratio(10, 10) == 0.0
    for kept, total in ((0, 10), (11, 10), (-1, 10)):
        with pytest.raises(ValueError):
            parity.press_ratio(kept, total)


def test_harness_kept_is_whole_blocks_of_the_ratio():
    # (1 - 0.5) x 893 = 446.5 tokens -> 14 blocks of 32
    assert parity.harness_kept("knorm", {"protect_edges": False}, 0.5, 893, 32) == 448
    assert parity.harness_kept("streaming", {"n_sink": 4}, 0.75, 1912, 32) == 480
    # a ratio whose budget is at least the prompt keeps it all
    assert parity.harness_kept("knorm", {"protect_edges": False}, 0.01, 100, 32) == 96  # 99 tokens: 3 blocks
    assert parity.harness_kept("knorm", {"protect_edges": False}, 0.0, 100, 32) == 100  # ratio 0 keeps the prompt
    # SnapKV's 64-token window needs a budget above it: a short prompt's budget grows to fit
    assert parity.harness_kept("snapkv", {"window": 64, "kernel": 5}, 0.75, 200, 32) == 96


def test_pairs_are_valid_harness_policies_with_kvpress_settings():
    by_policy = {pair.policy: pair for pair in parity.PAIRS}
    assert set(by_policy) == {"knorm", "streaming", "snapkv", "tova", "keydiff", "h2o"}
    # The tokens each token selection keeps whatever the scores (first, last): kvpress protects
    # none, but SnapKV's window (kept by both) and TOVA's last token (kept by kvpress only: README).
    protected = {"knorm": (0, 0), "keydiff": (0, 0), "snapkv": (0, 64), "tova": (0, 0), "h2o": (0, 0)}
    for pair in parity.PAIRS:
        policy = make_policy(pair.policy, 512, 32, **pair.harness_options(2048))
        if pair.policy == "streaming":
            assert policy.n_sink == 4
            continue
        edges = policy.score.token_edges(512, 32)
        if edges is None:
            edges = (32, 32) if policy.protect_edges else (0, 0)
        assert edges == protected[pair.policy]
        assert policy.shares_per_head() or policy.score.share == "layer"  # per layer and KV head (TOVA: per layer)
    assert by_policy["streaming"].options["n_sink"] == by_policy["streaming"].press_options["n_sink"] == 4
    snapkv = by_policy["snapkv"]
    assert (snapkv.options["window"], snapkv.options["kernel"]) == (snapkv.press_options["window_size"],
                                                                    snapkv.press_options["kernel_size"]) == (64, 5)
    h2o = by_policy["h2o"].harness_options(2048)
    assert h2o == {"recent": 0, "window": 2048}  # every prompt query counted, no recent half


def samples(*lengths):
    return [{"id": f"s{i}", "task": "t", "length": 1024, "prompt_token_ids": list(range(n)), "max_new_tokens": 8,
             "stops": []} for i, n in enumerate(lengths)]


def test_build_jobs():
    rows = samples(893, 900)
    kept = {("knorm", 0.5): {"s0": 448, "s1": 448}, ("h2o", 0.75): {"s0": 224, "s1": 224}}
    jobs = parity.build_jobs(rows, kept, parity.PAIRS, "/model", [2], threads=2)
    assert jobs["samples"] is rows and jobs["eos_token_id"] == [2] and jobs["threads"] == 2
    cells = {cell["name"]: cell for cell in jobs["cells"]}
    assert list(cells) == ["no_press", "knorm_r0.5", "observed_attention_r0.75"]
    assert cells["no_press"]["kept"] is None
    assert cells["observed_attention_r0.75"]["press"] == "observed_attention"
    for name in ("knorm_r0.5", "observed_attention_r0.75"):
        cell = cells[name]
        for row in rows:
            ratio = cell["press_ratio"][row["id"]]
            assert parity.kvpress_kept(len(row["prompt_token_ids"]), ratio) == cell["kept"][row["id"]]
    assert parity.jobs_digest(jobs) == parity.jobs_digest(parity.build_jobs(rows, kept, parity.PAIRS, "/model", [2], 2))
    fewer = {("knorm", 0.5): {"s0": 448, "s1": 416}, ("h2o", 0.75): {"s0": 224, "s1": 224}}
    assert parity.jobs_digest(jobs) != parity.jobs_digest(parity.build_jobs(rows, fewer, parity.PAIRS, "/model", [2], 2))


def row(tokens, tops):
    return {"output_token_ids": tokens, "top_logprobs": tops}


def test_verdicts():
    same = row([5, 6, 2], [[[5, -0.1], [7, -3.0]], [[6, -0.2], [1, -2.0]], [[2, -0.01], [3, -5.0]]])
    assert parity.verdict(same, same) == ("identical", None)
    # parting where each side's two best were 5e-4 nats apart: a near tie
    a = row([5, 6, 2], [[[5, -0.1], [7, -3.0]], [[6, -0.6930], [1, -0.6935]], [[2, -0.01], [3, -5.0]]])
    b = row([5, 1, 2], [[[5, -0.1], [7, -3.0]], [[1, -0.6931], [6, -0.6934]], [[2, -0.01], [3, -5.0]]])
    assert parity.verdict(a, b) == ("near_tie", None)
    # a clear preference is a difference, and so is a different length
    c = row([5, 1, 2], [[[5, -0.1], [7, -3.0]], [[1, -0.1], [6, -2.5]], [[2, -0.01], [3, -5.0]]])
    result, why = parity.verdict(a, c)
    assert result == "differ" and "diverges at output token 1" in why
    result, why = parity.verdict(same, row([5, 6], same["top_logprobs"][:2]))
    assert result == "differ" and "different lengths" in why


def test_count_and_table():
    comparisons = [
        {"policy": "full", "press": "no_press", "ratio": 0.0, "verdict": "identical"},
        {"policy": "knorm", "press": "knorm", "ratio": 0.5, "verdict": "identical"},
        {"policy": "knorm", "press": "knorm", "ratio": 0.5, "verdict": "near_tie"},
        {"policy": "knorm", "press": "knorm", "ratio": 0.5, "verdict": "differ"},
        {"policy": "knorm", "press": "knorm", "ratio": 0.75, "verdict": "differ"},
    ]
    counts = parity.count(comparisons)
    assert [(c["policy"], c["ratio"]) for c in counts] == [("full", 0.0), ("knorm", 0.5), ("knorm", 0.75)]
    knorm = counts[1]
    assert (knorm["samples"], knorm["identical"], knorm["near_tie"], knorm["differ"], knorm["agree"]) == (3, 1, 1, 1, 2)
    table = parity.counts_table(counts)
    assert "| full | no_press | - | 1 | 1 | 0 | 0 | 1/1 |" in table
    assert "| knorm | knorm | 0.5 | 3 | 1 | 1 | 1 | 2/3 |" in table


def test_cells_compose_prompt_only_with_kvpress_options():
    cells = [parity.cell_overrides(pair.policy, pair.harness_options(1024), 0.5, [1024], 1, ["niah_single_1"], False)
             for pair in parity.PAIRS]
    runs = parity.compose_runs(cells)
    for pair, run in zip(parity.PAIRS, runs):
        assert run.policy == pair.policy and run.budget_ratio == 0.5 and run.budget is None
        assert run.decode_eviction is False and run.likelihood is False
        assert run.model.name == "smollm2-135m" and run.data.name == "ruler" and run.data.lengths == (1024,)
        for key, value in pair.harness_options(1024).items():
            assert run.options[key] == value
        assert str(run.run_dir).startswith(str(parity.HARNESS_DIR))


def test_ranking_rows_expected_and_counted():
    rows = samples(893, 60)
    kept = {("knorm", 0.5): {"s0": 448, "s1": 60}}  # the short prompt is not cut: no ranking row
    jobs = parity.build_jobs(rows, kept, parity.PAIRS, "/model", [2])
    assert parity.ranking_expected(jobs) == {("knorm_r0.5", "s0")}
    counts = parity.count([
        {"policy": "knorm", "press": "knorm", "ratio": 0.5, "verdict": "identical", "heads": 90, "heads_differing": 2,
         "tokens_differing": 3},
        {"policy": "knorm", "press": "knorm", "ratio": 0.5, "verdict": "identical", "heads": None,
         "heads_differing": None, "tokens_differing": None},
    ])
    assert (counts[0]["heads"], counts[0]["heads_differing"], counts[0]["tokens_differing"]) == (90, 2, 3)
    assert "| 2/2 | 2/90 (3 tokens) |" in parity.counts_table(counts)
