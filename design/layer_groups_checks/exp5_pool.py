import sys; sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(__file__)))
import torch
from tagged import TaggedSpec, cfg
from vllm.v1.core import kv_cache_utils as U
base = dict(block_size=16, num_kv_heads=3, head_size=64, dtype=torch.float32)
mem = 256 * 2**20
for G in (1, 3, 4):
    specs = {f"model.layers.{i}.self_attn.attn": TaggedSpec(**base, budget_group=i % G) for i in range(30)}
    groups = U.get_kv_cache_groups(cfg(), specs)
    kvc = U.get_kv_cache_config_from_groups(cfg(), groups, mem)
    bpb = U._get_kv_cache_bytes_per_block(groups, U.KVCacheLayout.LBHNC)
    print(f"G={G}: {len(groups)} groups of {[len(g.layer_names) for g in groups]} layers; bytes/block={bpb}; "
          f"blocks in 256 MiB={kvc.num_blocks}; token-slots per layer={kvc.num_blocks*16//len(groups)}")
