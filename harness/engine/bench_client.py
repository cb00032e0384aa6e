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


# -------------------------------------------------------------------------------- conversations
# vLLM's benchmark sends requests at times drawn before the run (serve.py:1025-1081) and keeps only a
# request's text (endpoint_request_func.py:273-277); a conversation's next turn can be sent only when
# the last one returns, and it must continue the last prompt and answer token for token (a chained
# turn's cache is found by its token ids: a text round trip may tokenize the answer differently). So
# conversations arrive by vLLM's own arrival process (``get_request``, serve.py:402), every turn goes
# through vLLM's own request function (``ASYNC_REQUEST_FUNCS["vllm"]``) on a session that keeps the
# streamed bytes, and the figures are vLLM's ``calculate_metrics`` (serve.py:573), in the keys
# ``benchmark()`` saves (serve.py:1280-1397).
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
NOT_SENT = "not sent: an earlier turn of its conversation failed"  # a turn's error after its conversation ended


class _KeptStream:
    """A stand-in for the aiohttp session vLLM's request function posts through: the same post, with
    every streamed byte kept, so the token ids and cached-token count that function drops can be read
    after it (``answer``). Nothing is added to the request or its timing."""

    def __init__(self, session):
        self.session, self.chunks = session, []

    def post(self, **kwargs):
        return _KeptPost(self.session.post(**kwargs), self.chunks)

    def answer(self) -> tuple[list[int], int | None]:
        """The streamed output token ids (the server's ``return_token_ids``) and the prompt tokens it
        found cached (``usage.prompt_tokens_details``, with ``--enable-prompt-tokens-details``)."""
        import json

        from vllm.benchmarks.lib.endpoint_request_func import StreamedResponseHandler

        ids, cached = [], None
        for message in StreamedResponseHandler().add_chunk(b"".join(self.chunks)):
            data = message.removeprefix("data: ")
            if message.startswith(":") or data == "[DONE]":
                continue
            chunk = json.loads(data)
            for choice in chunk.get("choices") or []:
                ids += choice.get("token_ids") or []
            details = (chunk.get("usage") or {}).get("prompt_tokens_details") or {}
            cached = details.get("cached_tokens", cached)
        return ids, cached


class _KeptPost:
    def __init__(self, post, chunks):
        self.post, self.chunks = post, chunks

    async def __aenter__(self):
        return _KeptResponse(await self.post.__aenter__(), self.chunks)

    async def __aexit__(self, *exc):
        return await self.post.__aexit__(*exc)


class _KeptResponse:
    def __init__(self, response, chunks):
        self.response, self.content = response, _KeptContent(response.content, chunks)

    def __getattr__(self, name):
        return getattr(self.response, name)


class _KeptContent:
    def __init__(self, content, chunks):
        self.stream, self.chunks = content, chunks

    async def iter_any(self):
        async for data in self.stream.iter_any():
            self.chunks.append(data)
            yield data


def conversations(base_url: str, model: str, tokenizer, firsts: list, turns: int, follow, rate: float, *,
                  ignore_eos: bool, goodput: dict[str, float], percentiles: tuple[float, ...], extra_body: dict,
                  max_concurrency: int | None = None) -> dict:
    """Conversations of ``turns`` turns each: conversation c's first request ``firsts[c]`` (a
    ``SampleRequest``) arrives by vLLM's arrival process at ``rate`` conversations per second
    (Poisson, burstiness 1.0), and each later turn is sent when the one before it returns:
    ``follow(c, turn, prompt, answer_ids)`` gives its ``SampleRequest`` from the last prompt's ids
    and the answer's token ids. At most ``max_concurrency`` conversations at once (1: one after
    another). A turn goes out as soon as the one before returns (no think time between turns). A
    failed turn (or one whose answer cannot be read back, or whose next request cannot be made) ends
    its conversation, the others go on; the turns it did not send count as failed (``NOT_SENT``).

    Returns ``benchmark()``'s result keys (vLLM's own metrics over every turn; lists in conversation
    then turn order), and per turn ``output_token_ids`` and ``cached_tokens``; ``conversations``,
    ``turns`` and ``conversation_throughput`` (conversations whose every turn completed, per second)."""
    return asyncio.run(_conversations(base_url, model, tokenizer, firsts, turns, follow, rate, ignore_eos, goodput,
                                      percentiles, extra_body, max_concurrency))


async def _conversations(base_url, model, tokenizer, firsts, turns, follow, rate, ignore_eos, goodput, percentiles,
                         extra_body, max_concurrency):
    import dataclasses
    import traceback
    import contextlib
    import time

    import aiohttp
    from vllm.benchmarks.lib.endpoint_request_func import ASYNC_REQUEST_FUNCS, RequestFuncInput, RequestFuncOutput
    from vllm.benchmarks.serve import _merge_overrides, calculate_metrics, get_request

    request_func = ASYNC_REQUEST_FUNCS["vllm"]
    # as benchmark() opens its session (serve.py:824-841)
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, limit_per_host=0, ttl_dns_cache=300,
                                                                   use_dns_cache=True, keepalive_timeout=60,
                                                                   enable_cleanup_closed=True, force_close=False),
                                    trust_env=True, timeout=aiohttp.ClientTimeout(total=6 * 60 * 60))
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    sent: dict[tuple[int, int], tuple] = {}

    async def converse(c: int, request) -> None:
        async with limit:
            for turn in range(turns):
                kept = _KeptStream(session)
                body = {**(_merge_overrides(extra_body, request.request_overrides) or {}), "return_token_ids": True}
                output = await request_func(request_func_input=RequestFuncInput(
                    prompt=request.prompt, api_url=f"{base_url}/v1/completions", prompt_len=request.prompt_len,
                    output_len=request.expected_output_len, model=model, model_name=model, extra_body=body,
                    ignore_eos=ignore_eos), session=kept)
                ids, cached, following = [], None, None
                try:
                    ids, cached = kept.answer()
                    if output.success and turn + 1 < turns:
                        following = follow(c, turn + 1, list(request.prompt), ids)
                except Exception:  # this conversation's failure, counted as its turn's; the others go on
                    output = dataclasses.replace(output, success=False, error=traceback.format_exc())
                sent[c, turn] = (request, output, ids, cached)
                if following is None:
                    return
                request = following

    index = {id(request): c for c, request in enumerate(firsts)}  # get_request yields the objects it was given
    started = time.perf_counter()
    tasks = []
    async for request, _ in get_request(firsts, rate, 1.0):
        tasks.append(asyncio.create_task(converse(index[id(request)], request)))
    try:
        await asyncio.gather(*tasks)
    finally:
        duration = time.perf_counter() - started
        await session.close()
    keys = [(c, turn) for c in range(len(firsts)) for turn in range(turns)]
    unsent = RequestFuncOutput(success=False, error=NOT_SENT)
    outputs = [sent[key][1] if key in sent else unsent for key in keys]
    metrics, output_lens = calculate_metrics(input_requests=[sent[key][0] for key in keys if key in sent],
                                             outputs=outputs, dur_s=duration, tokenizer=tokenizer,
                                             selected_percentiles=list(percentiles), goodput_config_dict=goodput)
    whole = sum(all(key in sent and sent[key][1].success for key in keys if key[0] == c) for c in range(len(firsts)))
    result = {
        "duration": duration, "completed": metrics.completed, "failed": metrics.failed,
        "total_input_tokens": metrics.total_input, "total_output_tokens": metrics.total_output,
        "request_throughput": metrics.request_throughput,
        "request_goodput": metrics.request_goodput if goodput else None,
        "output_throughput": metrics.output_throughput, "total_token_throughput": metrics.total_token_throughput,
        "input_lens": [output.prompt_len for output in outputs], "output_lens": output_lens,
        "ttfts": [output.ttft for output in outputs], "itls": [output.itl for output in outputs],
        "latencies": [output.latency for output in outputs], "start_times": [output.start_time for output in outputs],
        "queue_times": [output.client_queue_time for output in outputs],
        "generated_texts": [output.generated_text for output in outputs],
        "errors": [output.error for output in outputs],
        "max_output_tokens_per_s": metrics.max_output_tokens_per_s,
        "max_concurrent_requests": metrics.max_concurrent_requests, "rtfx": metrics.rtfx,
        "conversations": len(firsts), "turns": turns, "conversation_throughput": whole / duration,
        "output_token_ids": [sent[key][2] if key in sent else [] for key in keys],
        "cached_tokens": [sent[key][3] if key in sent else None for key in keys],
    }
    for name in PERCENTILE_METRICS:  # as benchmark()'s process_one_metric names them (serve.py:1361-1397)
        for kind in ("mean", "median", "std"):
            result[f"{kind}_{name}_ms"] = getattr(metrics, f"{kind}_{name}_ms")
        for p, value in getattr(metrics, f"percentiles_{name}_ms"):
            result[f"p{int(p) if int(p) == p else p}_{name}_ms"] = value
    return result
