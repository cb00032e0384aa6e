import sys; sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(__file__)))
from tagged import config
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.request import Request
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256

init_none_hash(sha256)
kvc = config(G=3, blocks=64)
mgr = KVCacheManager(kvc, max_model_len=1024, scheduler_block_size=16, hash_block_size=16, enable_caching=True)
co = mgr.coordinator
print("coordinator:", type(co).__name__, "| managers:", [type(m).__name__ for m in co.single_type_managers],
      "| one pool:", len({id(m.block_pool) for m in co.single_type_managers}) == 1, "| pool blocks:", co.block_pool.num_gpu_blocks)
print("prefix-cache lookup SpecGroups:", [(g.spec.budget_group, g.group_ids) for g in co.attention_groups],
      "| full_attention_group_id:", co.full_attention_group_id)
hasher = get_request_block_hasher(16, sha256)
def req(rid, n, offset=0):
    return Request(rid, list(range(offset, offset + n)), SamplingParams(max_tokens=8), None, block_hasher=hasher)

A = req("A", 100)
print("\n-- A: 100-token prompt")
blocks, hit, _ = mgr.get_computed_blocks(A)
print("   cache hit:", hit)
need = co.get_num_blocks_to_allocate("A", 100, ((), (), ()), 0, 0, 0, 100)
print("   coordinator.get_num_blocks_to_allocate(num_tokens=100) =", need, "(= 3 groups x cdiv(100,16)=7)")
free0 = co.block_pool.get_num_free_blocks()
new = mgr.allocate_slots(A, 100)
print("   allocate_slots -> block ids per group:", [[b.block_id for b in g] for g in new.blocks])
print("   free blocks", free0, "->", co.block_pool.get_num_free_blocks())
print("   hashed (cached) blocks per group:", [sum(b.block_hash is not None for b in m.req_to_blocks["A"]) for m in co.single_type_managers])

print("\n-- per-group physical lengths: each group's manager subclassed, as the harness does for group 0")
class PerGroupPhysical(FullAttentionManager):
    evicted: dict
    def get_num_blocks_to_allocate(self, request_id, num_tokens, *a, **k):
        return super().get_num_blocks_to_allocate(request_id, num_tokens - self.evicted.get(request_id, 0), *a, **k)
    def allocate_new_blocks(self, request_id, num_tokens, num_tokens_main_model):
        e = self.evicted.get(request_id, 0)
        return super().allocate_new_blocks(request_id, num_tokens - e, num_tokens_main_model - e)
for g, m in enumerate(co.single_type_managers):
    m.__class__ = PerGroupPhysical
    m.evicted = {"B": [0, 32, 64][g]}
B = req("B", 100, offset=5000)
need = co.get_num_blocks_to_allocate("B", 100, ((), (), ()), 0, 0, 0, 100)
print("   B, 100 tokens, evicted per group (0, 32, 64): get_num_blocks_to_allocate =", need, "(7 + 5 + 3)")
new = mgr.allocate_slots(B, 100)
print("   allocate_slots -> blocks per group:", [len(g) for g in new.blocks])
for m in co.single_type_managers:
    m.__class__ = FullAttentionManager

print("\n-- prefix caching across groups")
C = req("C", 100)
blocks, hit, _ = mgr.get_computed_blocks(C)
print("   C (same prompt as A): hit", hit, "tokens; blocks per group", [len(g) for g in blocks.blocks])
g2 = [b.block_id for b in co.single_type_managers[2].req_to_blocks["A"][3:6]]
mgr.evict_blocks(set(g2))
print(f"   drop group 2's cached blocks 3..5 of A from the prefix cache ({g2})")
blocks, hit, _ = mgr.get_computed_blocks(C)
print("   C again: hit", hit, "tokens; blocks per group", [len(g) for g in blocks.blocks],
      "-> the hit is the shortest over groups; other groups trimmed")
