"""Variant: one spec class per tag instead of a field (registered or not, merge overridden or not)."""
from dataclasses import dataclass
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.core import kv_cache_utils as U
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry
import sys; sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(__file__))); from tagged import cfg

def make(register, strict_merge):
    classes = []
    for t in range(3):
        ns = {}
        if strict_merge:
            def merge(cls, specs, _t=t):
                if any(type(s) is not cls for s in specs):
                    raise AssertionError("mixed tag classes")
                return FullAttentionSpec.merge.__func__(cls, specs)
            ns["merge"] = classmethod(merge)
        c = dataclass(frozen=True, kw_only=True)(type(f"Tag{t}Spec_{int(register)}{int(strict_merge)}", (FullAttentionSpec,), ns))
        if register:
            KVCacheSpecRegistry.register(c, FullAttentionManager)  # its own uniform_type_base_spec
        classes.append(c)
    return classes

base = dict(block_size=16, num_kv_heads=3, head_size=64, dtype=torch.float32)
for register in (False, True):
    for strict in (False, True):
        cls = make(register, strict)
        specs = {f"model.layers.{i}.self_attn.attn": cls[i % 3](**base) for i in range(30)}
        try:
            groups = U.get_kv_cache_groups(cfg(), specs)
            print(f"class per tag, registered={register}, merge refuses other classes={strict}: {len(groups)} group(s),",
                  [type(g.kv_cache_spec).__name__ for g in groups])
        except Exception as e:
            print(f"registered={register}, strict={strict}: raised {type(e).__name__}: {e}")
