"""Shared helpers for engine tests: real-text prompts, engines in their own processes, the oracle."""
from __future__ import annotations

import json
import random
import subprocess
import sys
from functools import cache
from pathlib import Path

from harness.data import synthetic
from harness.models import EMBEDDED_PREFIX, resolve_model_path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 32
MODELS = {"tiny": "tiny-llama", "smollm2": "smollm2-135m-instruct"}


@cache
def model_path(model: str) -> str:
    return resolve_model_path(EMBEDDED_PREFIX + MODELS[model])


@cache
def corpus_ids(model: str) -> tuple[int, ...]:
    """Token ids of the embedded suite's generated text: real words, no download."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path(model))
    text = "\n".join(s.context for s in synthetic.generate(seed=7, tasks=["multi_doc_qa", "single_doc_qa"]))
    return tuple(tokenizer(text, add_special_tokens=False)["input_ids"])


def text_prompts(model: str, lengths: list[int], seed: int = 0) -> list[list[int]]:
    ids = corpus_ids(model)
    rng = random.Random(seed)
    prompts = []
    for length in lengths:
        start = rng.randrange(len(ids) - length)
        prompts.append(list(ids[start : start + length]))
    return prompts


def run_engine(tmp_path: Path, model: str, prompts, max_new_tokens: int, **spec) -> dict:
    """One engine configuration in a fresh process (python -m harness.engine.batch_run)."""
    spec = {
        "model_path": model_path(model), "prompts": prompts, "max_new_tokens": max_new_tokens,
        "block_size": BLOCK, "max_model_len": 4096, **spec,
    }
    tag = f"{model}-{len(list(tmp_path.glob('spec-*')))}"
    spec_file, out_file = tmp_path / f"spec-{tag}.json", tmp_path / f"out-{tag}.json"
    spec_file.write_text(json.dumps(spec))
    done = subprocess.run(
        [sys.executable, "-m", "harness.engine.batch_run", str(spec_file), str(out_file)],
        capture_output=True, text=True, timeout=1800, cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out_file.read_text())


def reference_outputs(model: str, policy, prompts, max_new_tokens: int) -> list[list[int]]:
    from harness.engine.reference import ReferenceEngine

    engine = ReferenceEngine(model_path(model), policy)
    return [engine.generate(prompt, max_new_tokens) for prompt in prompts]


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
