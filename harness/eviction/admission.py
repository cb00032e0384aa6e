"""What eviction settings need of an engine, and the policies they run there: the one admission.

``admit`` is asked by every path that runs settings on an engine: the run's config check
(``harness.config``), the frontend's request check, the scheduler, the worker and the memory
predictions (``harness.engine.llm``, ``harness.config.check_memory``). It builds each layer group's
policy (``build_policy``, ``group_policies``) at the settings' budget and refuses, with one line,
what the engine cannot run: a measured schedule on an asynchronous scheduler, an attention-reading
policy on compiled graphs, a chained turn for a policy that reads queries. What a setting may hold
by itself is checked before, by the one parse (``harness.eviction.settings.parse_settings``, its
field checks in ``harness.eviction.checks``).
"""
from __future__ import annotations

import json
from dataclasses import replace

from policies import Policy, BudgetError, make_policy
from policies.budget_schedules import group_budgets

from harness.eviction.checks import MEASURED_SCHEDULES

# ("EvictionSettings" in the annotations below is harness.eviction.settings' record, which imports
# this module: it is read by its fields, never imported here.)

# The budget a ratio's settings are checked at before any prompt is seen (names and options).
PROBE_BLOCKS = 64


def build_policy(settings: EvictionSettings, block_size: int) -> Policy:
    """The policy these settings run. Settings with a ``budget_ratio`` not yet resolved against a
    prompt (``for_prompt``) are built at a probe budget: enough to check the name and options.
    Its score is tried once on a tiny input (``try_score``): a score that raises or returns the
    wrong shape is refused here, at admission, with its message."""
    budget = settings.budget if settings.budget is not None else PROBE_BLOCKS * block_size
    policy = carrying(make_policy(settings.policy, budget, block_size, **settings.options), settings)
    if settings.budget is None and not policy.fits_prefix(budget):  # a ratio's budget rises to fit it
        policy = carrying(make_policy(settings.policy, policy.min_budget(), block_size, **settings.options), settings)
    policy.check_carried()
    try_score(policy, (settings.policy, json.dumps(settings.options, sort_keys=True), block_size))
    return policy


def carrying(policy: Policy, settings: EvictionSettings) -> Policy:
    """``policy`` with the run settings it carries (``Policy``'s own fields beyond budget and block
    size: decode_eviction, whole_blocks, protect_prefix), as the record declares them
    (``EvictionSettings.policy_fields``); ``Policy.check_carried`` checks them against its budget."""
    for name, value in settings.policy_fields().items():
        setattr(policy, name, value)
    return policy


_TRIED_SCORES: set[tuple] = set()


def try_score(policy: Policy, key: tuple) -> None:
    """An attention-free score run once per policy and options on two blocks of random K/V (two
    heads): what a user's new score gets wrong most often (it raises, or returns other than
    ``[kv_heads, tokens]`` finite numbers) fails its request at admission, not in the engine.
    What depends on real input can still fail there: the engine then ends that request alone
    (``harness.eviction.evictor.PolicyFailure``). Attention scores need a query window and are
    the harness's own (their tests check them)."""
    if key in _TRIED_SCORES or not policy.needs_kv or policy.query_window or policy.reconstructs \
            or not hasattr(policy, "score"):
        return  # (a reconstructing score is not computed from K/V: its passes are the engine's)
    import torch

    from harness.eviction.evictor import PolicyFailure, as_failure, checked_scores

    generator = torch.Generator().manual_seed(0)
    keys, values = (torch.randn(2 * policy.block_size, 2, 8, generator=generator) for _ in range(2))
    try:
        checked_scores(policy, policy.layer_scores(keys, values), keys)
    except Exception as error:
        failure: PolicyFailure = as_failure(policy, error)
        raise ValueError(f"{failure} (tried at admission on {keys.shape[0]} tokens of random K/V)") from None
    _TRIED_SCORES.add(key)


def group_policies(settings: EvictionSettings, block_size: int, num_layers: int, groups: int) -> tuple[Policy, ...]:
    """The policy each of an engine's ``groups`` KV cache groups runs for these settings: the
    budget spread by the settings' schedule (whole blocks, at least two per group, summing to
    ``groups`` x the budget), group 0 holding the first layers. One group: the settings' policy.
    A schedule that leaves a group less than its policy needs (SnapKV's window) is refused."""
    whole = build_policy(settings, block_size)
    if groups > 1:
        check_grouped(whole, groups)
    if groups == 1 or settings.budget is None:
        if settings.budget_schedule != "uniform" and groups == 1:
            raise ValueError(f"budget_schedule={settings.budget_schedule} spreads the budget over the engine's layer "
                             "groups; this engine has one (set engine.layer_groups)")
        return (whole,) * groups
    if settings.budget_schedule in MEASURED_SCHEDULES:
        # measured: the request's own; not yet: the uniform ones, which only say what is the same in
        # every group (window, phases) until the measurement fixes them
        budgets = settings.group_budgets or (settings.budget,) * groups
        if len(budgets) != groups or sum(budgets) > groups * settings.budget:
            raise ValueError(f"group budgets {list(budgets)} for {groups} groups of budget {settings.budget}")
    else:
        budgets = group_budgets(settings.budget_schedule, settings.budget, num_layers, groups, block_size,
                                beta=settings.pyramid_beta, min_blocks=least_blocks(settings, block_size))
    try:
        return tuple(build_policy(replace(settings, budget=budget), block_size) for budget in budgets)
    except BudgetError as error:
        raise ValueError(f"budget_schedule={settings.budget_schedule} gives the layer groups budgets {list(budgets)}: "
                         f"{error}") from None


def check_layer_groups(groups: object, num_layers: int | None = None) -> int:
    """``engine.layer_groups`` itself: a positive integer dividing the model's layer count (equal
    groups: vLLM sizes a block by its largest group, so unequal ones waste memory, and tags of
    unequal sizes split into more groups than tags, vllm/v1/core/kv_cache_utils.py:1467-1501)."""
    if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1:
        raise ValueError(f"layer_groups must be a positive integer, got {groups!r}")
    if num_layers is not None and num_layers % groups:
        raise ValueError(f"layer_groups={groups} does not divide the model's {num_layers} attention layers "
                         f"into equal groups; choose a divisor of {num_layers}")
    return groups


_ADMITTED: dict[tuple, tuple[Policy, ...]] = {}


def admit(settings: EvictionSettings, block_size: int, num_layers: int, groups: int, *, enforce_eager: bool,
          async_scheduling: bool) -> tuple[Policy, ...]:
    """The one admission of eviction settings on an engine: what the engine needs of them (an
    attention schedule synchronous scheduling and eager mode, an attention-reading policy eager
    mode), their budget spread over the engine's ``groups`` KV cache groups, and the policy each
    group runs; ``ValueError`` says what cannot run and why. The run's config check, the frontend's
    request check, the scheduler, the worker and the memory predictions all ask here; the answer
    is cached per settings and engine."""
    key = (settings.key, block_size, num_layers, groups, bool(enforce_eager), bool(async_scheduling))
    policies = _ADMITTED.get(key)
    if policies is None:
        check_schedule_runs(settings, enforce_eager, async_scheduling)
        policies = group_policies(settings, block_size, num_layers, groups)
        for policy in {id(policy): policy for policy in policies}.values():
            check_policy_runs(policy, enforce_eager)
            check_reconstructing_policy(settings, policy)
            if settings.chain:
                check_chain_policy(policy)
        if len(_ADMITTED) >= 4096:  # ratio budgets differ per prompt length: bounded, not a leak
            _ADMITTED.clear()
        _ADMITTED[key] = policies
    return policies


def scheduling_is_async(async_scheduling: bool | None, device: str) -> bool:
    """Whether vLLM will schedule asynchronously: as asked, or by default where the platform has
    it: on a GPU, not on CPU (vllm/platforms/cpu.py:329-331)."""
    return async_scheduling if async_scheduling is not None else device == "cuda"


def least_blocks(settings: EvictionSettings, block_size: int) -> int:
    """The fewest blocks a group's budget may have: two (a first block and a recent one), or more
    where the policy needs them (SnapKV's window inside its budget); at most the whole budget."""
    return min(build_policy(settings, block_size).min_budget(), settings.budget) // block_size


def check_grouped(policy: Policy, groups: int) -> None:
    """What a policy cannot do on an engine of several layer groups (each group scores and evicts
    its own layers, ``harness.engine.worker_patch``)."""
    if getattr(policy, "score_layers", "all") != "all":
        raise ValueError(f"score_layers names one layer of the model; with layer_groups={groups} each group scores "
                         "its own layers")


def check_schedule_runs(settings: EvictionSettings, enforce_eager: bool, async_scheduling: bool) -> None:
    """What a measured schedule needs of the engine: it evicts in the step it measures in (so the
    scheduler learns the budgets from that step's report); the attention schedule reads the
    prompt's queries through the hooks compiled graphs skip; the kvzip schedule reads KVzip's
    reconstruction scores, so it needs that policy, and it is built for a context compressed alone."""
    if settings.budget_schedule == "kvzip":
        if not settings.reconstructs:
            raise ValueError(f"budget_schedule=kvzip sets the layer groups' budgets from KVzip's reconstruction "
                             f"scores; policy {settings.policy} computes none: use policy=kvzip (or another schedule)")
        if settings.compress != "context":
            raise ValueError("budget_schedule=kvzip is built for compress=context only (KVzip's query-agnostic "
                             "setting, the context compressed once before the question; compress=prompt is untested "
                             "with it): pass compress=context")
        if async_scheduling:
            raise ValueError(needs_sync("kvzip"))
        return
    if settings.budget_schedule != "attention":
        return
    if async_scheduling:
        raise ValueError(needs_sync("attention"))
    if not enforce_eager:
        raise ValueError("budget_schedule=attention reads the prompt's queries through hooks that compiled graphs "
                         "skip: run with enforce_eager (engine.enforce_eager=true, vllm serve --enforce-eager)")


def check_policy_runs(policy: Policy, enforce_eager: bool) -> None:
    """What a policy needs of the engine beyond eviction itself: an attention-aware policy's query
    window is copied by Python hooks on the attention layers, which compiled graphs skip."""
    if (policy.query_window or policy.reconstructs) and not enforce_eager:
        raise ValueError(
            f"{policy.name} reads attention queries through hooks that compiled graphs skip: "
            "run with enforce_eager (engine.enforce_eager=true, vllm serve --enforce-eager)")

def needs_sync(schedule: str) -> str:
    """Why an asynchronous scheduler cannot run a measured schedule (the scheduler, the request check
    and the run's config check say it alike)."""
    source = {"attention": "attention", "kvzip": "reconstruction scores"}[schedule]
    return (f"budget_schedule={schedule} sets each layer group's budget from the {source} of the step that "
            "reaches the eviction point, and evicts in that step; an asynchronous scheduler plans the next step "
            "before that step's report, so it could not know what the eviction left: run with synchronous "
            "scheduling (engine.async_scheduling=false, vllm serve --no-async-scheduling)")



def check_reconstructing_policy(settings: EvictionSettings, policy: Policy) -> None:
    """What a reconstructing policy (KVzip) needs of its settings: it compresses once, at the
    eviction point, from passes that repeat what came before it (``policies.kvzip``)."""
    if not policy.reconstructs:
        return
    if settings.decode_eviction:
        raise ValueError(f"{policy.name} scores the context by reconstructing it once, before the eviction; it has no "
                         "rule for generated tokens: pass decode_eviction=false (with compress=context or prompt)")
    if settings.chain:
        raise ValueError(f"chain=true, but {policy.name} reconstructs the pristine context; a chained turn holds the "
                         "previous turn's compressed cache: use chain=false")
    if settings.budget_schedule == "attention":
        raise ValueError(f"budget_schedule=attention measures layer budgets from the prompt's last queries; {policy.name}"
                         " evicts from its reconstruction passes in the same step, which that measurement does not "
                         "follow: use uniform, pyramid or kvzip")


def check_reconstruction(settings: EvictionSettings, policy: Policy, eviction_point: int) -> None:
    """A request's reconstruction inputs, against its policy and where it evicts."""
    if not policy.reconstructs:
        if settings.reconstruction is not None:
            raise ValueError(f"reconstruction gives the ids a reconstructing policy (kvzip) repeats the context with; "
                             f"{policy.name} does not reconstruct")
        return
    if settings.reconstruction is None:
        raise ValueError(f"{policy.name} reconstructs the request's context: the request must give its reconstruction "
                         "ids (reconstruction: prefix_tokens, first, later, suffix; harness.eviction.settings.Reconstruction)")
    if settings.reconstruction.prefix_tokens >= eviction_point:
        raise ValueError(f"reconstruction.prefix_tokens={settings.reconstruction.prefix_tokens} leaves nothing of the "
                         f"{eviction_point} tokens before the eviction point to reconstruct")


def check_chain_policy(policy: Policy) -> None:
    """What a chained turn cannot give a policy: the next request holds the previous turn's kept K/V,
    not its queries, so a rule reading a window of queries before the boundary (SnapKV, TOVA) or
    summing every query (H2O, LRU) would see only the new tokens' few."""
    if policy.query_window or policy.accumulates:
        raise ValueError(f"chain=true, but {policy.name} reads attention queries (a window before the boundary or "
                         "every query so far); a chained turn carries the previous turn's kept K/V, not its queries: "
                         "use an attention-free policy or chain=false")


def hybrid_refusal(settings: EvictionSettings) -> str | None:
    """What eviction does not do yet on a model with sliding-window layers, in one line (None: these
    settings run). Asked before any model loads (``harness.config.check_run_layer_groups``), by the
    frontend per request, and by the scheduler's groups (``harness.engine.layer_groups``)."""
    if settings.budget_schedule != "uniform":
        return (f"budget_schedule={settings.budget_schedule} on a model with sliding-window layers is not built: "
                "its global layers evict as one group (budget_schedule=uniform)")
    if settings.chain or (settings.compress == "context" and settings.share_context):
        return ("sharing a compressed context (share_context=true, chain=true) on a model with sliding-window "
                "layers is not built: the entry would have to hold each sliding-window group's window too")
    return None
