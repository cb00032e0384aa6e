"""Shared helpers for engine tests: real-text prompts, engines in their own processes (kept for
later batches of the same configuration: ``tests.support.engine_pool``), the oracle."""
from __future__ import annotations

import math
import random
from dataclasses import asdict, fields
from functools import cache
from pathlib import Path

from harness.tasks.embedded.token_prompts import token_prompts
from harness.engine.batch_run import run_in_subprocess
from harness.config import EngineSettings, engine_defaults, engine_settings
from harness.config.models import EMBEDDED_PREFIX, resolve_model_path
from harness.analysis.regression import TIE_NATS, first_difference, parting

BLOCK = engine_defaults("cpu")["block_size"]  # the engine tests' block size: cpu.yaml's (32)
# New tokens that take a request past budget + one block after its prefill eviction (a token rule
# then holds the budget, a block rule the budget and under a block more), so it evicts in decode
# too, at 5/8 of the cost of 64 (CI time).
DECODE_EVICTING_TOKENS = BLOCK + 8
ENGINE_FIELDS = frozenset(f.name for f in fields(EngineSettings))
MODELS = {"tiny": "tiny-llama", "smollm2": "smollm2-135m-instruct"}


@cache
def model_path(model: str) -> str:
    return resolve_model_path(EMBEDDED_PREFIX + MODELS[model])


def mixed_lengths(count: int, low: int, high: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(low, high) for _ in range(count)]


def text_prompts(model: str, lengths: list[int], seed: int = 0) -> list[list[int]]:
    return token_prompts(model_path(model), lengths, seed)


def run_engine(tmp_path: Path, model: str, prompts, max_new_tokens: int, **spec) -> dict:
    """One batch through one engine configuration, as ``python -m harness.engine.batch_run`` runs it:
    on an engine of the test file's pool where its configuration is running one already and can be
    shared (``tests.support.engine_pool``: each batch its own ledger and counts, the prefix cache
    emptied between batches), else in a fresh process. Keywords that name ``EngineSettings``
    fields (num_kv_blocks, layer_groups, device, ...) change the engine from its device's defaults
    (``conf/engine/<device>.yaml``, as Hydra runs use them); the rest are batch_run's own spec keys."""
    engine = {name: spec.pop(name) for name in list(spec) if name in ENGINE_FIELDS}
    spec = {
        "model_path": model_path(model), "prompts": prompts, "max_new_tokens": max_new_tokens,
        "max_model_len": 4096, "top_logprobs": 3, **spec, "engine": asdict(engine_settings(**engine)),
    }
    return run_spec(spec, tmp_path)


def run_spec(spec: dict, tmp_path: Path, timeout_s: float = 1800) -> dict:
    """A whole batch_run spec: on a kept engine of the open pool where it can share one
    (``tests.support.engine_pool.pool_for``), else in a fresh ``python -m harness.engine.batch_run``."""
    from tests.support.engine_pool import pool_for

    pool = pool_for(spec)
    if pool is not None:
        return pool.run(spec, tmp_path, timeout_s=timeout_s)
    return run_in_subprocess(spec, tmp_path, timeout_s=timeout_s)


def stock_and_policy_runs(model: str, prompts, policies: list[str], budget: int, new_tokens: int, directories,
                          runner=run_spec):
    """The three engine runs the hybrid-model tests compare, each made on first use and kept:
    ``stock`` (vLLM without the plugin), ``unreached`` (PagedEviction at a budget no prompt reaches:
    the plugin's physical-length machinery on, nothing evicted) and ``evicting`` (each prompt once
    per policy of ``policies`` at ``budget``, the first as the engine's default, the others as
    per-request settings). ``directories``: pytest's ``tmp_path_factory``; ``runner``: ``run_spec``
    (the pool) or ``run_in_subprocess`` (a fresh process)."""
    specs = {
        "stock": dict(stock=True),
        "unreached": dict(eviction={"policy": "paged", "budget": 2048}),
        "evicting": dict(prompts=prompts * len(policies), eviction={"policy": policies[0], "budget": budget},
                         request_eviction=[None if policy == policies[0] else {"policy": policy, "budget": budget}
                                           for policy in policies for _ in prompts]),
    }
    done = {}

    def get(name: str) -> dict:
        if name not in done:
            spec = {"model_path": model, "prompts": prompts, "max_new_tokens": new_tokens, "max_model_len": 4096,
                    "top_logprobs": 3, **specs[name], "engine": asdict(engine_settings())}
            done[name] = runner(spec, directories.mktemp(name), timeout_s=900)
        return done[name]

    return get


def assert_policy_equals_plain_reference(run, model: str, prompts, policies: list[str], policy: str, budget: int,
                                         new_tokens: int) -> None:
    """``policy``'s outputs in ``run("evicting")`` (``stock_and_policy_runs``) evicted once in
    prefill and in decode too, equal the plain reference's (near-tie rule), and differ from stock's."""
    from tests.support.plain_reference import PlainReference

    evicting = run("evicting")
    at = policies.index(policy) * len(prompts)
    outputs = evicting["outputs"][at:at + len(prompts)]
    counters = evicting["request_counters"][at:at + len(prompts)]
    assert all(c is not None and c["policy"] == policy and c["evictions"]["prefill"] == 1 for c in counters)
    assert sum(c["evictions"]["decode"] for c in counters) >= len(prompts)  # decode eviction ran too
    plain = PlainReference(model)
    expected = [plain.generate(prompt, new_tokens, plain_policy(policy, budget))[0] for prompt in prompts]
    assert_mostly_equal(outputs, expected)
    # and eviction changed what the model generates (the check could fail)
    assert sum(o != s for o, s in zip(outputs, run("stock")["outputs"])) >= len(prompts) // 2


def plain_policy(name: str, budget: int, block: int = BLOCK, granularity: str | None = None):
    """The plain reference's rule for a registered policy at its default options: its score (an
    alias names its base score), its granularity and the selection options it is configured with."""
    from tests.support.plain_reference import PlainPolicy
    from policies import REGISTRY

    entry = REGISTRY[name]
    if granularity in (None, entry.granularity):
        options = {key: entry.options[key] for key in ("per_head", "protect_edges", "weights") if key in entry.options}
        return PlainPolicy(entry.alias_of or name, entry.granularity, budget, block, **options)
    return PlainPolicy(name, granularity, budget, block, weights=entry.options.get("weights"))


def kvzip_reconstruction(model: str, prefix_tokens: int) -> dict:
    """A KVzip request's reconstruction ids (``harness.eviction.settings.Reconstruction``'s wire form):
    kvpress 0.5.5's repeat prompts, as the prompt builder has them, and the chat footer, as the
    model's tokenizer writes them, with ``prefix_tokens`` of header."""
    from transformers import AutoTokenizer

    from harness.tasks.prompts import REPEAT_FIRST, REPEAT_LATER, chat_footer

    tokenizer = AutoTokenizer.from_pretrained(model_path(model))
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)
    return {"prefix_tokens": prefix_tokens, "first": encode(REPEAT_FIRST), "later": encode(REPEAT_LATER),
            "suffix": encode(chat_footer(tokenizer))}


def scored_contexts(requests) -> list[int]:
    """Of KVzip requests ``(prompt, raw settings)`` run on one engine, the indices of those whose
    passes run: the first of each context (its ids up to the eviction point, its reconstruction ids
    and chunk size). The worker keeps a context's scores (``harness.engine.reconstruction``,
    ``RecentScores``), so a later request about the same context runs none (the ledger's
    ``reconstruct_reused``)."""
    from harness.eviction.settings import EvictionSettings

    seen, first = set(), []
    for index, (prompt, raw) in enumerate(requests):
        settings = EvictionSettings(**raw).for_prompt(len(prompt), BLOCK)
        spec = settings.reconstruction
        key = (tuple(prompt[:settings.eviction_point(len(prompt))]), spec.prefix_tokens, spec.first, spec.later,
               spec.suffix, raw.get("options", {}).get("chunk_size", 2048))
        if key not in seen:
            seen.add(key)
            first.append(index)
    return first


def reference_outputs(model: str, policy, prompts, max_new_tokens: int) -> list[list[int]]:
    from harness.eviction.hf_reference import HFReferenceEngine

    engine = HFReferenceEngine(model_path(model), policy)
    return [engine.generate(prompt, max_new_tokens) for prompt in prompts]


def common_prefix(a: list[int], b: list[int]) -> int:
    at = first_difference(a, b)
    return len(a) if at is None else at


def assert_mostly_equal(engine: list[list[int]], reference: list[list[int]]) -> None:
    """Engine outputs against a reference engine's (Hugging Face, no top log-probabilities to apply
    the near-tie rule with): at least 95% identical, and any that differ agree for 16 tokens."""
    equal = sum(e == r for e, r in zip(engine, reference))
    prefixes = [common_prefix(e, r) for e, r in zip(engine, reference)]
    assert equal >= math.ceil(0.95 * len(engine)), f"{equal}/{len(engine)} equal; common prefixes {prefixes}"
    assert min(prefixes) >= 16, f"a differing output diverged early: {prefixes}"


def assert_same_outputs(expected: dict, actual: dict, tie_nats: float = TIE_NATS) -> None:
    """Two engine runs generated the same tokens: each request's output is identical, or the two
    part at a position where both runs saw a near-tie (the two tokens within ``tie_nats`` of each
    other in each run's own log-probabilities; ``harness.analysis.regression.parting``). A real
    disagreement, even by one token, fails and names the request."""
    assert len(expected["outputs"]) == len(actual["outputs"])
    for index, (want, got) in enumerate(zip(expected["outputs"], actual["outputs"])):
        why = parting(want, got, expected["top_logprobs"][index], actual["top_logprobs"][index], tie_nats)
        assert why is None, f"request {index} {why}"
