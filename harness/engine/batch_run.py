"""Run token-id prompts through one engine configuration, in a process of its own, as JSON.

    python -m harness.engine.batch_run SPEC.json OUT.json

vLLM engines do not share a process well (threads, memory), so tests and benchmarks start one
process per engine configuration. SPEC keys: model_path, prompts (lists of token ids),
max_new_tokens, block_size, max_model_len, and optionally eviction ({policy, budget, options}),
kv_blocks (pool size in blocks), stock (true: vLLM without this plugin), in_process (engine core in
this process, default true). OUT holds each request's output ids and preemptions, the free blocks
before and after, and the scheduler's ledger (in-process only).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def run(spec: dict) -> dict:
    if spec.get("stock"):
        os.environ["VLLM_PLUGINS"] = "stock-vllm-without-plugins"  # no plugin has this name
    from omegaconf import OmegaConf

    from harness.engine.llm import Engine
    from harness.engine.settings import EvictionSettings

    eviction = EvictionSettings(**spec["eviction"]) if spec.get("eviction") else None
    model_cfg = OmegaConf.create({"dtype": spec.get("dtype", "float32"), "max_model_len": spec["max_model_len"]})
    engine_cfg = OmegaConf.create({
        "device": spec.get("device", "cpu"), "threads": None, "enforce_eager": True, "in_process": spec.get("in_process", True),
        "max_num_seqs": spec.get("max_num_seqs", 64), "max_num_batched_tokens": spec.get("max_num_batched_tokens", 8192),
        "kv_cache_gib": spec.get("kv_cache_gib", 1.0), "num_kv_blocks": spec.get("kv_blocks"),
    })
    engine = Engine(spec["model_path"], model_cfg, engine_cfg, spec["block_size"], eviction=eviction)
    free_before = engine.free_blocks()
    results = engine.generate_ids(spec["prompts"], spec["max_new_tokens"], ignore_eos=spec.get("ignore_eos", True))
    ledger = engine.ledger()
    return {
        "outputs": [r["token_ids"] for r in results],
        "preemptions": [r["preemptions"] for r in results],
        "free_blocks_before": free_before,
        "free_blocks_after": engine.free_blocks(),
        "ledger": ledger.snapshot() if ledger else None,
        "pool_blocks": engine.facts()["kv_pool_blocks"],
    }


def main(argv: list[str]) -> int:
    spec_path, out_path = map(Path, argv)
    result = run(json.loads(spec_path.read_text()))
    tmp = out_path.with_name(out_path.name + ".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, out_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
