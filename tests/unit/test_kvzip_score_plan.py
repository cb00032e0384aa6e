"""The scheduler's part of the worker's kept KVzip scores (``harness.engine.reconstruction``,
``RecentScores``), without a model: every plan carries the cache salts of its scheduled requests that
evict (the worker's request state has none: ``CachedRequestState``, vllm/v1/worker/gpu_input_batch.py:35-58)
and the count of prefix-cache resets, which only the scheduler sees (vllm/v1/engine/core.py:871-876),
so that a worker keys scores by salt and drops them once the count moves (``test_kvzip_passes``)."""
from __future__ import annotations

from harness.eviction.messages import PLAN_ATTRIBUTE
from harness.eviction.settings import CONFIG_KEY
from tests.unit.test_async_scheduling import make_scheduler


def test_each_plan_carries_its_requests_cache_salts_and_the_count_of_prefix_cache_resets():
    from vllm import SamplingParams
    from vllm.v1.request import Request

    scheduler = make_scheduler(False)
    for request_id, salt, settings in (("salted", "tenant-a", {"policy": "knorm", "budget": 12}),
                                       ("plain", None, {"policy": "knorm", "budget": 12}),
                                       ("full", "tenant-b", None)):  # does not evict: in no plan's settings
        params = SamplingParams(max_tokens=3, ignore_eos=True,
                                extra_args={CONFIG_KEY: settings} if settings else None)
        scheduler.add_request(Request(request_id, [7] * 20, params, None, cache_salt=salt))
    first = scheduler.schedule().__dict__[PLAN_ATTRIBUTE]
    assert set(first.settings) == {"salted", "plain"}
    assert first.cache_salts == {"salted": "tenant-a"} and first.prefix_cache_resets == 0
    # every reset asked for moves the count, whether or not vLLM's own succeeds (it fails while
    # requests hold blocks: vllm/v1/core/sched/scheduler.py:2868): weights may have changed either way
    scheduler.reset_prefix_cache()
    scheduler.reset_prefix_cache(reset_running_requests=True)
    assert scheduler.schedule().__dict__[PLAN_ATTRIBUTE].prefix_cache_resets == 2
