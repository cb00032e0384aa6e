"""Shared helpers for engine tests: real-text prompts, engines in their own processes, the oracle."""
from __future__ import annotations

import random
from functools import cache
from pathlib import Path

from harness.data.token_prompts import token_prompts
from harness.engine.batch_run import run_in_subprocess
from harness.models import EMBEDDED_PREFIX, resolve_model_path

BLOCK = 32
# Two fp32 runs of the same model may round the last bits of a logit differently (kernel blocking
# depends on buffer alignment, batch shape and CPU): where the two best tokens are closer than
# this (in nats), either is a correct greedy choice and the continuations may part.
TIE_NATS = 1e-3
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
    """One engine configuration in a fresh process (python -m harness.engine.batch_run)."""
    spec = {
        "model_path": model_path(model), "prompts": prompts, "max_new_tokens": max_new_tokens,
        "block_size": BLOCK, "max_model_len": 4096, "top_logprobs": 3, **spec,
    }
    return run_in_subprocess(spec, tmp_path, timeout_s=1800)


def reference_outputs(model: str, policy, prompts, max_new_tokens: int) -> list[list[int]]:
    from harness.engine.reference import ReferenceEngine

    engine = ReferenceEngine(model_path(model), policy)
    return [engine.generate(prompt, max_new_tokens) for prompt in prompts]


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def assert_same_outputs(expected: dict, actual: dict, tie_nats: float = TIE_NATS) -> None:
    """Two engine runs generated the same tokens: each request's output is identical, or the two
    part at a position where both runs saw a near-tie (the two tokens within TIE_NATS of each other
    in each run's own log-probabilities). A real disagreement, even by one token, fails."""
    assert len(expected["outputs"]) == len(actual["outputs"])
    for index, (want, got) in enumerate(zip(expected["outputs"], actual["outputs"])):
        if want == got:
            continue
        at = common_prefix(want, got)
        assert at < min(len(want), len(got)), f"request {index}: outputs of different lengths {len(want)} / {len(got)}"
        for name, run, chosen, other in (("first", expected, want[at], got[at]), ("second", actual, got[at], want[at])):
            top = dict((token, logprob) for token, logprob in run["top_logprobs"][index][at])
            gap = top[chosen] - top.get(other, float("-inf"))
            assert gap <= tie_nats, (
                f"request {index} diverges at output token {at} ({want[at]} vs {got[at]}): the {name} run "
                f"preferred its token by {gap:.2e} nats, more than a rounding tie ({tie_nats})"
            )
