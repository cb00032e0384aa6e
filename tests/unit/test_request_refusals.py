"""No request can stop the engine: what the engine cannot run for a request is refused at the frontend
(HTTP 400 from ``vllm serve``: ``harness.engine.frontend.check_request``), and where a request
reaches the scheduler all the same (a frontend without the plugin), the scheduler ends that request
with an error and the reason, and serves the others (an exception from ``Scheduler.add_request``
would leave vLLM's engine core and stop it). No model: the real ``EvictionScheduler`` on a real
block pool, the fake worker of ``test_async_scheduling``, and a real ``VllmConfig``.

The end-to-end proof, through ``vllm serve``, is ``tests/engine/test_serve.py``'s fuzzer."""
from __future__ import annotations

import pytest

from harness.engine.compatibility import REFUSED
from harness.eviction.settings import CONFIG_KEY
from tests.unit.test_async_scheduling import BLOCK, Worker, make_scheduler

PROMPT, CONTEXT = 37, 24
SHARED = {"policy": "paged", "budget_ratio": 0.5, "decode_eviction": False, "compress": "context",
          "context_tokens": CONTEXT, "share_context": True}
CHAINED = {**SHARED, "share_context": None, "chain": True}


def params(settings: dict | None, **sampling):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=3, ignore_eos=True, extra_args={CONFIG_KEY: settings} if settings else None,
                          **sampling)


def request(request_id: str, settings: dict | None, **sampling):
    """A request as vLLM's engine core makes it, with its block hasher (prefix caching is on)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    return Request(request_id, [100 + int(request_id[1:])] * PROMPT, params(settings, **sampling), None,
                   block_hasher=get_request_block_hasher(BLOCK, hash_fn))


@pytest.mark.parametrize("settings, what", [(SHARED, "share_context=true"), (CHAINED, "chain=true")])
@pytest.mark.parametrize("sampling", [{"prompt_logprobs": 1}, {"skip_reading_prefix_cache": True}])
def test_the_frontend_refuses_settings_that_need_the_prefix_cache_for_a_request_that_skips_it(settings, what, sampling):
    """vLLM skips the prefix cache for a request asking prompt log-probabilities
    (``SamplingParams.__post_init__``), so no shared context or chain entry could reach it."""
    from vllm.exceptions import VLLMValidationError

    from harness.engine.frontend import check_request

    config = make_scheduler(False, prefix_caching=True).vllm_config
    with pytest.raises(VLLMValidationError, match=f"{what}: .* but the request skips the prefix cache"):
        check_request(config, params(settings, **sampling), PROMPT)
    check_request(config, params(settings), PROMPT)  # the same settings without: admitted
    check_request(config, params({**SHARED, "share_context": None}, **sampling), PROMPT)  # where exact: not shared


@pytest.mark.parametrize("settings, what", [(SHARED, "share_context=true"), (CHAINED, "chain=true")])
def test_the_frontend_refuses_them_on_an_engine_with_a_kv_connector_or_without_prefix_caching(settings, what):
    from vllm.config import KVTransferConfig
    from vllm.exceptions import VLLMValidationError

    from harness.engine.frontend import check_request

    config = make_scheduler(False, prefix_caching=True).vllm_config
    config.kv_transfer_config = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both")
    with pytest.raises(VLLMValidationError, match=f"{what}: .* but this engine has a KV connector"):
        check_request(config, params(settings), PROMPT)
    config = make_scheduler(False, prefix_caching=False).vllm_config
    with pytest.raises(VLLMValidationError, match=f"{what}: .* but this engine takes no prefix-cache hits"):
        check_request(config, params(settings), PROMPT)


class TolerantWorker(Worker):
    """The fake worker, letting go of finished requests it never ran, as the model runner does
    (``self.requests.pop(req_id, None)``: vllm/v1/worker/gpu_model_runner.py:1183-1184)."""

    def step(self, output):
        output.finished_req_ids = {rid for rid in output.finished_req_ids if rid in self.requests}
        return super().step(output)


def step(scheduler, worker) -> dict:
    """One step in vLLM's synchronous order (``EngineCore.step``: update_from_output follows every
    schedule, tokens or none); the finished outputs by request id."""
    output = scheduler.schedule()
    outputs = scheduler.update_from_output(output, worker.step(output))
    return {o.request_id: o for batch in outputs.values() for o in batch.outputs if o.finish_reason is not None}


@pytest.mark.parametrize("settings, sampling, reason", [
    (SHARED, {"prompt_logprobs": 1}, "share_context=true: .* but the request skips the prefix cache"),
    (CHAINED, {"prompt_logprobs": 1}, "chain=true: .* but the request skips the prefix cache"),
    ({"policy": "paged", "budget": 42}, {}, "budget"),                          # not a multiple of the block
    ({"policy": "streaming", "budget": 64, "options": {"n_sink": "x"}}, {}, ""),  # an option of the wrong type
    ({"policy": "no_such_policy", "budget": 64}, {}, "no_such_policy"),
])
def test_the_scheduler_ends_a_request_it_cannot_run_with_its_reason_and_serves_the_others(settings, sampling, reason):
    from vllm.v1.engine import FinishReason
    from vllm.v1.request import RequestStatus

    scheduler = make_scheduler(False, pool=64, prefix_caching=True)
    worker = TolerantWorker(64)
    scheduler.add_request(request("r1", settings, **sampling))  # no exception: the engine goes on
    scheduler.add_request(request("r2", {"policy": "paged", "budget": 16}))
    finished = step(scheduler, worker)
    refused = finished["r1"]
    assert refused.finish_reason == FinishReason.ERROR and refused.new_token_ids == []
    assert refused.stop_reason.startswith(REFUSED)
    assert __import__("re").search(reason, refused.stop_reason), refused.stop_reason
    assert "r1" not in scheduler.requests or scheduler.requests["r1"].status == RequestStatus.FINISHED_ERROR
    assert "r1" not in scheduler.kv_request_settings
    while "r2" not in finished:
        finished = step(scheduler, worker)
    assert finished["r2"].finish_reason == FinishReason.LENGTH
    assert scheduler.kv_request_counters["r2"].evictions["prefill"] == 1  # evicted by its own settings
    step(scheduler, worker)
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 64 - 1, "every block is back"


def test_without_prefix_caching_the_scheduler_ends_a_chained_request_with_its_reason():
    from vllm.v1.engine import FinishReason

    scheduler = make_scheduler(False, pool=64, prefix_caching=False)
    scheduler.add_request(request("r1", CHAINED))
    refused = step(scheduler, TolerantWorker(64))["r1"]
    assert refused.finish_reason == FinishReason.ERROR
    assert "chain=true: a turn's compressed cache reaches the next turn through vLLM's prefix-cache hits, but this " \
           "engine takes no prefix-cache hits" in refused.stop_reason


def test_a_partial_prefill_samples_without_its_cpu_generator_which_is_left_where_it_was():
    """vLLM rewinds the generator of a request whose prefill is partial this step (its sampled token
    is discarded) by ``set_offset``, which a CPU generator lacks: the worker raised and the engine
    stopped. The generator is held out of that step's sampling instead, and stays where it was."""
    from types import SimpleNamespace

    import numpy as np
    import torch

    from harness.engine.worker_patch import hold_unrewindable_generators

    with pytest.raises(RuntimeError, match="does not use offset"):  # what vLLM's rewind meets on a CPU
        torch.Generator().set_offset(0)
    partial, whole = torch.Generator().manual_seed(5), torch.Generator().manual_seed(6)
    runner = SimpleNamespace(input_batch=SimpleNamespace(num_reqs=3, generators={0: partial, 2: whole}),
                             discard_request_mask=SimpleNamespace(np=np.array([True, True, False, True])))
    held = hold_unrewindable_generators(runner)
    assert held == {0: partial} and runner.input_batch.generators == {2: whole}  # (index 3: not in the batch)
