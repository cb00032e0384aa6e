from dataclasses import dataclass, replace
from types import SimpleNamespace
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.core import kv_cache_utils as U

@dataclass(frozen=True, kw_only=True)
class TaggedSpecA(FullAttentionSpec):
    """The note's recipe: FullAttentionSpec + budget_group; merge refuses mixed tags."""
    budget_group: int = 0
    @classmethod
    def merge(cls, specs):
        tags = {s.budget_group for s in specs}
        if len(tags) != 1:
            raise AssertionError(f"mixed budget groups {tags}")
        return replace(FullAttentionSpec.merge.__func__(cls, specs), budget_group=tags.pop())

@dataclass(frozen=True, kw_only=True)
class TaggedSpec(TaggedSpecA):
    """The fix: the uniform-type check refuses mixed tags too."""
    def is_uniform_with_collection(self, kv_cache_specs):
        return super().is_uniform_with_collection(kv_cache_specs) and all(
            getattr(s, "budget_group", None) == self.budget_group for s in kv_cache_specs.values())

def cfg(blocks=None):
    return SimpleNamespace(
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False),
        speculative_config=None, attention_config=SimpleNamespace(hisparse_config=None),
        cache_config=SimpleNamespace(get_resolved_kv_cache_layout=lambda: U.KVCacheLayout.LBHNC,
                                     num_gpu_blocks_override=blocks, prefix_cache_retention_interval=None),
        model_config=None)

def config(num_layers=30, G=3, blocks=64, block_size=16):
    base = dict(block_size=block_size, num_kv_heads=3, head_size=64, dtype=torch.float32)
    specs = {f"model.layers.{i}.self_attn.attn": TaggedSpec(**base, budget_group=i % G) for i in range(num_layers)}
    groups = U.get_kv_cache_groups(cfg(), specs)
    return U.get_kv_cache_config_from_groups(cfg(blocks), groups, 10**9)
