"""Pure-Python run of vLLM 0.32's KV cache grouping on hand-made specs (no engine, no model)."""
import copy, logging, os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dataclasses import dataclass, replace
from types import SimpleNamespace
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec
from vllm.v1.core import kv_cache_utils as U
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

def cfg(disable_hma=False, layout="LBHNC", blocks=None):
    return SimpleNamespace(
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=disable_hma),
        speculative_config=None,
        attention_config=SimpleNamespace(hisparse_config=None),
        cache_config=SimpleNamespace(
            get_resolved_kv_cache_layout=lambda: U.KVCacheLayout[layout] if hasattr(U, "KVCacheLayout") else None,
            num_gpu_blocks_override=blocks, prefix_cache_retention_interval=None),
        model_config=None,
    )

# (A) the note's recipe: a FullAttentionSpec subclass + budget_group, merge refuses mixed tags;
# (B) the same, and it also refuses to be "uniform type" with a differently tagged spec (tagged.py)
from tagged import TaggedSpec as TaggedSpecB, TaggedSpecA  # noqa: E402

def specs(cls, tags):
    base = dict(block_size=16, num_kv_heads=3, head_size=64, dtype=torch.float32)
    return {f"model.layers.{i}.self_attn.attn": cls(**base, budget_group=t) for i, t in enumerate(tags)}

def show(title, cls, tags, disable_hma=False):
    print(f"\n== {title}: {cls.__name__}, layers per tag {[tags.count(t) for t in sorted(set(tags))]}")
    try:
        groups = U.get_kv_cache_groups(cfg(disable_hma), specs(cls, tags))
    except Exception as e:
        print("   raised", type(e).__name__, ":", e); return None
    print(f"   {len(groups)} group(s)")
    for g, grp in enumerate(groups):
        idx = [int(n.split('.')[2]) for n in grp.layer_names]
        print(f"   group {g}: spec={type(grp.kv_cache_spec).__name__}"
              f" tag={getattr(grp.kv_cache_spec,'budget_group','-')} layers={idx}")
    return groups

three = [i % 3 for i in range(30)]             # 10/10/10, interleaved
blocks3 = [i // 10 for i in range(30)]         # 10/10/10, contiguous
uneven = [0]*20 + [1]*5 + [2]*5                # 20/5/5
four = [i % 4 for i in range(30)]              # 8/8/7/7
print("uniform_type_base_spec of TaggedSpecA:", KVCacheSpecRegistry.get_uniform_type_base_spec(specs(TaggedSpecA,[0])["model.layers.0.self_attn.attn"]).__name__,
      "| manager:", KVCacheSpecRegistry.get_manager_class(specs(TaggedSpecA,[0])["model.layers.0.self_attn.attn"]).__name__)
show("A: merge refuses mixed tags only", TaggedSpecA, three)
gB = show("B: + is_uniform_with_collection refuses mixed tags", TaggedSpecB, three)
show("B, contiguous tags", TaggedSpecB, blocks3)
show("B, uneven 20/5/5", TaggedSpecB, uneven)
show("B, 30 layers / 4 tags (8/8/7/7)", TaggedSpecB, four)
show("B, 30 layers / 1 tag", TaggedSpecB, [0]*30)
show("A with disable_hybrid_kv_cache_manager=True", TaggedSpecA, three, disable_hma=True)
show("B with disable_hybrid_kv_cache_manager=True", TaggedSpecB, three, disable_hma=True)

# KV cache config and tensor sharing for B / 3 groups
print("\n== KVCacheConfig for B, 3 groups, 64 blocks, LBHNC (CPU_ATTN's only layout)")
kvc = U.get_kv_cache_config_from_groups(cfg(blocks=64), gB, 10**9)
print("   num_blocks", kvc.num_blocks)
for t in kvc.kv_cache_tensors:
    print(f"   KVCacheTensor size={t.size} offset={t.offset} layer_stride={t.layer_stride} block_stride={t.block_stride} layers={[int(n.split('.')[2]) for n in t.layers]}")
from vllm.v1.worker.utils import allocate_kv_cache
caches = allocate_kv_cache(kvc, torch.device("cpu"), U.KVCacheLayout.LBHNC)
ptr = {n: c.data_ptr() for n, c in caches.items()}
base = min(ptr.values())
print("   per-layer view shape", tuple(next(iter(caches.values())).shape), "; one backing storage:",
      len({c.untyped_storage().data_ptr() for c in caches.values()}) == 1)
for g, grp in enumerate(gB):
    print(f"   group {g}: byte offsets of its layers' views from the buffer start:",
          [ptr[n]-base for n in grp.layer_names][:4], "...")
l0, l1 = gB[0].layer_names[0], gB[1].layer_names[0]
caches[l0][5].fill_(1.0)
print(f"   write block 5 of {l0} (group 0, slot 0) -> block 5 of {l1} (group 1, slot 0) now sums to", float(caches[l1][5].sum()),
      "(aliased)")
