"""Every use the serving benchmark makes of vLLM's own benchmark code (``vllm/benchmarks/``), in one
module, so a vLLM upgrade meets them in one place: its request type, its ``prefix_repetition``
dataset, its goodput parser and its ``benchmark()``. It lives in harness/engine/, the one room that
imports vLLM (tests/unit/test_rooms.py); ``harness.serving`` reaches vLLM's benchmark only through it."""
from __future__ import annotations

import asyncio
from argparse import Namespace


def sample_request(prompt: list[int], output_len: int, overrides: dict | None = None):
    """vLLM's ``SampleRequest`` (datasets.py:73-91): a token-id prompt (sent as ids, so no
    re-tokenizing moves a boundary), its output length and the fields merged into its request body
    on top of the bench's ``extra_body`` (``request_overrides``; serve.py:69-73, :1048)."""
    from vllm.benchmarks.datasets.datasets import SampleRequest

    return SampleRequest(prompt=list(prompt), prompt_len=len(prompt), expected_output_len=output_len,
                         request_overrides=overrides)


def prefix_repetition(tokenizer, num_requests: int, prefix_len: int, suffix_len: int, num_prefixes: int,
                      output_len: int, seed: int) -> list[str]:
    """The prompts of vLLM's ``prefix_repetition`` dataset (``PrefixRepetitionRandomDataset``,
    datasets.py:4181, as ``--dataset-name prefix_repetition --prefix-repetition-*`` samples it), in
    its (shuffled) order: text, decoded from random tokens."""
    from vllm.benchmarks.datasets.datasets import PrefixRepetitionRandomDataset

    sampled = PrefixRepetitionRandomDataset(random_seed=seed).sample(
        tokenizer, num_requests, prefix_len=prefix_len, suffix_len=suffix_len, num_prefixes=num_prefixes,
        output_len=output_len)
    return [request.prompt for request in sampled]


def parse_goodput(text: str) -> dict[str, float]:
    """``"ttft:5000 tpot:250"`` -> {"ttft": 5000.0, "tpot": 250.0}, by vLLM's own ``--goodput``
    parser and checks (serve.py:1473-1492); ValueError for a bad one."""
    from vllm.benchmarks.serve import check_goodput_args

    try:
        return check_goodput_args(Namespace(goodput=text.split()))
    except Exception as error:  # vLLM raises argparse.ArgumentTypeError for a malformed pair
        raise ValueError(f"--goodput {text!r}: {error}") from None


def benchmark(base_url: str, model: str, tokenizer, requests: list, rate: float, *, ignore_eos: bool,
              goodput: dict[str, float], percentiles: tuple[float, ...], extra_body: dict,
              max_concurrency: int | None = None) -> dict:
    """vLLM's ``benchmark()`` (serve.py:786) on the completions endpoint with Poisson arrivals
    (burstiness 1.0) at ``rate``, at most ``max_concurrency`` requests in flight (its
    ``--max-concurrency``; 1 sends them one at a time); its result dict. The initial test request is skipped
    (``ready_check_timeout_sec=0``, serve.py:876-891): it would send the first request before the
    timed run and leave its context in the prefix cache."""
    from vllm.benchmarks.serve import TaskType, benchmark as vllm_benchmark

    return asyncio.run(vllm_benchmark(
        task_type=TaskType.GENERATION, endpoint_type="vllm", api_url=f"{base_url}/v1/completions", base_url=base_url,
        model_id=model, model_name=model, tokenizer=tokenizer, input_requests=requests, logprobs=None,
        request_rate=rate, burstiness=1.0, disable_tqdm=True, num_warmups=0, profile=False,
        selected_percentile_metrics=["ttft", "tpot", "itl", "e2el"], selected_percentiles=list(percentiles),
        ignore_eos=ignore_eos, goodput_config_dict=goodput, max_concurrency=max_concurrency, lora_modules=None,
        extra_headers=None, extra_body=extra_body, ready_check_timeout_sec=0))
