import dataclasses, torch
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadataBuilder, _get_attn_isa

def common(seq_lens, query_lens, num_blocks=8):
    q = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0)), dtype=torch.int32)
    n = len(seq_lens)
    return CommonAttentionMetadata(
        query_start_loc=q, query_start_loc_cpu=q, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        num_reqs=n, num_actual_tokens=int(q[-1]), max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        block_table_tensor=torch.zeros(n, num_blocks, dtype=torch.int32),
        slot_mapping=torch.zeros(int(q[-1]), dtype=torch.int64), causal=True)

# CPU_ATTN builder without a model: bypass __init__ (which reads layers from the vLLM config) and set
# the attributes build() reads (cpu_attn.py:131-167)
b = CPUAttentionMetadataBuilder.__new__(CPUAttentionMetadataBuilder)
b.num_heads, b.num_kv_heads, b.head_dim, b.dtype, b.block_size = 9, 3, 64, torch.float32, 32
b.window_size, b.kv_cache_dtype = -1, "auto"
b.is_cross_attention = b.is_encoder_only_attention = False
b.isa = _get_attn_isa(torch.float32, 32, 64, "auto")
print("CPU_ATTN isa:", b.isa, "| supports_update_block_table:", CPUAttentionMetadataBuilder.supports_update_block_table)
cm = common([100, 40], [1, 1])
per_group = {0: [100, 40], 1: [68, 40], 2: [36, 24]}  # physical lengths of each group (logical 100 / 40)
for g, lens in per_group.items():
    cm_g = dataclasses.replace(cm, seq_lens=torch.tensor(lens, dtype=torch.int32))
    md = b.build(0, cm_g)
    print(f"  group {g}: metadata.seq_lens={md.seq_lens.tolist()} (same tensor object as passed: {md.seq_lens is cm_g.seq_lens})"
          f" max_seq_len={md.max_seq_len} scheduler_metadata bytes={md.scheduler_metadata.numel()}")
md_a = b.build(0, dataclasses.replace(cm, seq_lens=torch.tensor([100, 40], dtype=torch.int32)))
md_b = b.build(0, dataclasses.replace(cm, seq_lens=torch.tensor([36, 24], dtype=torch.int32)))
print("  scheduler_metadata depends on seq_lens:", not torch.equal(md_a.scheduler_metadata, md_b.scheduler_metadata))

try:
    from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadataBuilder
    print("FLASH_ATTN builder: supports_update_block_table =", FlashAttentionMetadataBuilder.supports_update_block_table)
except Exception as e:
    print("FLASH_ATTN builder import failed on this CPU build:", type(e).__name__, e)
