"""The model's attention layers as G KV cache groups (``engine.layer_groups``): the ground per-layer
budgets stand on (issue 36; ``design/layer_groups_verification.md`` is the reading of vLLM this
rests on, ``design/layer_groups_checks/`` the checks).

vLLM 0.32 already runs several KV cache groups over one block pool, each group with its own block
table, slot mapping and attention metadata, for models that mix attention types
(``HybridKVCacheCoordinator``, ``vllm/v1/core/kv_cache_coordinator.py:1024-1038``). Here the
model's full-attention layers are split into G contiguous groups of equal size by tagging each
layer's ``FullAttentionSpec`` with its group (``BudgetGroupSpec``, made in the worker's
``get_kv_cache_spec``, ``vllm/v1/worker/gpu_model_runner.py:7146``); vLLM forms the groups itself
(``get_kv_cache_groups``, ``vllm/v1/core/kv_cache_utils.py:2159``). A block then holds the K/V of
one group's layers: the pool holds G times as many blocks in the same memory, and a request of n
tokens holds G x ceil(n / block_size) of them.

G = 1 leaves vLLM's specs untouched (today's engine, bit for bit). With G > 1 every group evicts on
its own: the scheduler keeps each group's block list and evicted count per request
(``harness.engine.scheduler``), the worker each group's slot mapping, attention lengths, view,
policy state and query window (``harness.engine.worker_patch``), and a request's budget is spread
over the groups by its ``budget_schedule`` (``harness.eviction.settings.group_policies``).
"""
from __future__ import annotations

import dataclasses
import functools

from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

from harness.eviction.admission import admit, hybrid_refusal
from harness.eviction.settings import EvictionSettings, check_layer_groups
from harness.engine.compatibility import layer_groups_of
from policies import Policy
from policies.full import FullCache


@dataclasses.dataclass(frozen=True, kw_only=True)
class BudgetGroupSpec(FullAttentionSpec):
    """A full-attention layer's spec tagged with its budget group. Layers of two groups must land
    in two KV cache groups; vLLM keeps them apart only if their specs neither merge nor count as
    one "uniform type" (``vllm/v1/core/kv_cache_utils.py:2184-2191``; layer_groups_verification.md
    A3: a strict ``merge`` alone still gives one group)."""

    budget_group: int = 0

    @classmethod
    def merge(cls, specs):
        tags = {spec.budget_group for spec in specs}
        if len(tags) != 1:
            raise AssertionError(f"layers of budget groups {sorted(tags)} cannot share a KV cache group")
        # FullAttentionSpec.merge rebuilds the spec from its AttentionSpec fields
        # (vllm/v1/kv_cache_interface.py:622-673) and would reset the tag: carry it over.
        return dataclasses.replace(super().merge(specs), budget_group=tags.pop())

    def is_uniform_with_collection(self, kv_cache_specs) -> bool:
        # vLLM asks whether every spec is an instance of the registered base class
        # (kv_cache_interface.py:274-286), which every tag is: one tag per group is not uniform.
        return super().is_uniform_with_collection(kv_cache_specs) and all(
            getattr(spec, "budget_group", None) == self.budget_group for spec in kv_cache_specs.values())


def check_engine(vllm_config) -> None:
    """What G > 1 cannot run with, refused before the model loads."""
    groups = layer_groups_of(vllm_config)
    check_layer_groups(groups)
    if groups > 1 and vllm_config.scheduler_config.disable_hybrid_kv_cache_manager:
        # Without the hybrid manager vLLM promotes every spec to one type and would stop at start
        # ("Failed to promote local KV cache specs", kv_cache_utils.py:1760); say why first. A KV
        # connector without hybrid support turns the manager off by itself (vllm/config/vllm.py:2170-2193).
        raise ValueError(f"layer_groups={groups} needs vLLM's hybrid KV cache manager; it is disabled "
                         "(disable_hybrid_kv_cache_manager, or a KV connector that does not support it)")


def tag_specs(specs: dict, groups: int) -> dict:
    """``specs`` (layer name -> spec, as the worker makes them) with the full-attention layers
    tagged into ``groups`` contiguous groups of equal size, in layer order."""
    from vllm.model_executor.models.utils import extract_layer_index

    others = sorted({type(spec).__name__ for spec in specs.values() if type(spec) is not FullAttentionSpec})
    if others or any(spec.sliding_window is not None for spec in specs.values()):
        raise ValueError(f"layer_groups={groups} needs a model whose every attention layer is full attention; "
                         f"this one also has {', '.join(others) or 'sliding-window layers'}")
    check_layer_groups(groups, len(specs))
    names = sorted(specs, key=extract_layer_index)
    size = len(names) // groups
    tagged = {}
    for index, name in enumerate(names):
        spec = specs[name]
        fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.init}
        tagged[name] = BudgetGroupSpec(**fields, budget_group=index // size)
    return tagged


def wrap_get_kv_cache_spec(original):
    """Tag the specs where the worker makes them (also on its profiling path,
    gpu_model_runner.py:6208-6232); G = 1 returns vLLM's own (installed by ``harness.engine.patches``)."""

    @functools.wraps(original)
    def get_kv_cache_spec(self):
        specs = original(self)
        groups = layer_groups_of(self.vllm_config)
        if groups == 1 or not specs:
            return specs
        check_engine(self.vllm_config)
        return tag_specs(specs, groups)

    return get_kv_cache_spec


# --- hybrid models: sliding-window layers beside full-attention ones (Gemma 3, issue 66) -------------
#
# vLLM's hybrid KV cache manager gives such a model several KV cache groups of equal layer counts
# (``get_kv_cache_groups``, vllm/v1/core/kv_cache_utils.py:2159), some of ``SlidingWindowSpec`` layers,
# some of ``FullAttentionSpec`` ones, each with its own manager (``HybridKVCacheCoordinator``,
# vllm/v1/core/kv_cache_coordinator.py:1024-1038). A sliding-window group's ``SlidingWindowManager``
# frees the blocks that left the window by logical position (``remove_skipped_blocks``,
# vllm/v1/core/single_type_kv_cache_manager.py:672-711, 1135-1150: a query at position p reads p-W+1..p)
# and puts the null block in their place. Eviction leaves those groups to it: their block lists,
# slots and lengths stay logical (evicted count 0, never reshaped), and a policy acts on the
# full-attention groups' layers only, with the budget counted there.

def evicting(spec) -> bool:
    """Whether a KV cache group of this spec is one eviction acts on: full attention, no window."""
    return isinstance(spec, FullAttentionSpec) and getattr(spec, "sliding_window", None) is None


def hybrid_reason(vllm_config, specs) -> str | None:
    """Why eviction cannot run on an engine whose KV cache groups have ``specs`` (None: it can): every
    group full attention, or sliding-window groups (left to vLLM) beside at least one full one."""
    if sliding_window_layers(vllm_config.model_config) and vllm_config.scheduler_config.disable_hybrid_kv_cache_manager:
        # vLLM then promotes the sliding-window layers to full attention, in the global layers' groups
        # (unify_hybrid_kv_cache_specs, vllm/v1/core/kv_cache_utils.py:1799-1822): eviction would evict them too
        return ("KV eviction needs a model's sliding-window layers in KV cache groups of their own; vLLM's hybrid "
                "KV cache manager is off (disable_hybrid_kv_cache_manager, or a KV connector without hybrid support)")
    kinds = [type(spec).__name__ for spec in specs]
    if not any(evicting(spec) for spec in specs):
        return f"KV eviction needs full-attention layers to act on; this model's KV cache groups are {kinds}"
    if any(not evicting(spec) and type(spec) is not SlidingWindowSpec for spec in specs):
        return ("KV eviction supports full-attention layers, beside sliding-window layers it leaves to vLLM; "
                f"this model's KV cache groups are {kinds}")
    return None


def sliding_window_layers(model_config) -> list[int]:
    """A model's sliding-window layers, as its config declares them (``layer_types``: transformers'
    Gemma 3, gpt-oss and others); what a process without the KV cache groups (the frontend, a run's
    config check) can ask before any model loads."""
    kinds = getattr(model_config.hf_text_config, "layer_types", None) or ()
    return [index for index, kind in enumerate(kinds) if kind == "sliding_attention"]


def policies_by_group(settings: EvictionSettings, block_size: int, groups: list[tuple[object, int]], *,
                      enforce_eager: bool, async_scheduling: bool) -> tuple[Policy, ...]:
    """The policy each KV cache group runs for ``settings``; ``groups``: each group's (spec, layer count)
    in the engine's group order. Without sliding-window groups: ``admit``'s answer over all of them
    (unchanged). With them: the full-attention groups share ``admit``'s answer for their own layers
    (the budget is theirs) and each sliding-window group gets ``FullCache`` (never evicts: its
    evicted count stays 0, so its blocks, slots and lengths stay vLLM's)."""
    full = [index for index, (spec, _) in enumerate(groups) if evicting(spec)]
    layers = sum(count for spec, count in groups if evicting(spec))
    if len(full) == len(groups):
        return admit(settings, block_size, layers, len(full), enforce_eager=enforce_eager,
                     async_scheduling=async_scheduling)
    refusal = hybrid_refusal(settings)
    if refusal is not None:
        raise ValueError(refusal)
    acting = admit(settings, block_size, layers, len(full), enforce_eager=enforce_eager,
                   async_scheduling=async_scheduling)
    keep = FullCache(budget=acting[0].budget, block_size=block_size)
    policies = [keep] * len(groups)
    for index, policy in zip(full, acting):
        policies[index] = policy
    return tuple(policies)


def acting_policy(policies: tuple[Policy, ...]) -> Policy:
    """The first policy of a group tuple that evicts (what every group's has in common: window,
    phases); the first where none does."""
    return next((policy for policy in policies if policy.evicts), policies[0])
