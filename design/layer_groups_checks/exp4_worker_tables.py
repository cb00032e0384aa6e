"""Worker side, no model: vLLM's MultiGroupBlockTable with 3 groups on CPU; per-group rows and
per-group slot mappings from per-group physical positions (positions - evicted_g)."""
import torch
from vllm.platforms import current_platform
current_platform.register_triton_kernel_overrides()
from vllm.v1.worker.block_table import MultiGroupBlockTable
bt = MultiGroupBlockTable(max_num_reqs=4, max_num_batched_tokens=64, pin_memory=False, device=torch.device("cpu"),
                          block_sizes=[16, 16, 16], max_num_blocks=[8, 8, 8])
print("block tables:", len(bt.block_tables), "| width per group:", [t.max_num_blocks_per_req for t in bt.block_tables])
# one request (row 0), logical length 100, evicted per group (0, 32, 64) -> 7, 5, 3 blocks
bt.add_row(([1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12], [15, 16, 17]), 0)
bt.commit_block_table(1)
print("rows:", [t.block_table.np[0, :t.num_blocks_per_row[0]].tolist() for t in bt.block_tables])
qsl = torch.tensor([0, 1], dtype=torch.int32)
logical = torch.tensor([100], dtype=torch.int64)  # decode: the token at logical position 100
bt.compute_slot_mapping(1, qsl, logical)
print("MultiGroupBlockTable.compute_slot_mapping(positions=100): slots", [int(t.slot_mapping.gpu[0]) for t in bt.block_tables],
      "(one positions tensor for every group; block index 6 is past groups 1 and 2's rows)")
for g, evicted in enumerate((0, 32, 64)):
    bt[g].compute_slot_mapping(1, qsl, logical - evicted)
print("per group bt[g].compute_slot_mapping(positions - evicted_g): slots", [int(t.slot_mapping.gpu[0]) for t in bt.block_tables],
      "= (7*16+4, 12*16+4, 17*16+4)")
