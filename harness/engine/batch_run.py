"""Run token-id prompts through one engine configuration, in a process of its own, as JSON.

    python -m harness.engine.batch_run SPEC.json OUT.json

vLLM engines do not share a process well (threads, memory), so tests and benchmarks start one
process per engine configuration. SPEC keys: model_path, prompts (lists of token ids),
max_new_tokens, max_model_len, dtype (default float32), and engine: the engine's settings by
``harness.config.EngineSettings``' own field names (device, block_size, kv_cache_gib, num_kv_blocks,
max_num_seqs, in_process, enforce_eager, async_scheduling, tensor_parallel_size,
distributed_executor_backend, layer_groups, ...), each one not given at its device's default
(``conf/engine/<device>.yaml``, the defaults Hydra runs use; device defaults to cpu), built by
``harness.config.engine_settings``. Optionally: eviction ({policy, budget, options}: the engine's
default; like every eviction setting here, read by the one parse before any engine starts,
``spec_eviction``), stock (true: vLLM without this plugin), top_logprobs (that many best tokens per generated
position), repeats (generate the same batch that many times on the one engine; ``perf`` has one
entry per repeat, the other keys describe the last), one_by_one (each prompt alone, in order,
instead of one batch), prefix_caching (vLLM's prefix cache on), request_eviction (per prompt, that
request's own {policy, budget, options}, or null for the engine's default), warm_cache (first
prefill every prompt with a one-token full-cache request, snapshot every block the prefix cache
then holds, and after the run report how many of those still registered under the same hash
changed; needs engine.in_process), forced (per prompt, the tokens that request must emit, or null:
teacher forcing, ``harness.engine.forced_decoding``), ignore_eos (default true), conversations
(after everything above, on the same engine: multi-turn conversations run turn by turn, every
conversation's turn in one batch; each ``{"prompt": turn 1's ids, "context_tokens": its boundary,
"messages": each later turn's new ids, "eviction": its settings without context_tokens,
"max_new_tokens": n}``; a later turn's prompt is the previous prompt, its output and the message, its
boundary the output's end; reported under ``conversations``, with the K/V of every block a chain
entry holds compared before and after each later turn: needs engine.in_process). Any other key is
refused with one line.
OUT holds each request's output ids, the model's log-probability and rank of each emitted token
(when logprobs were asked for or forced), preemptions and eviction counters (request_counters:
``harness.eviction.counters.RequestCounters`` as a dict, null for a request that did not evict),
the free blocks before and after, and the scheduler's ledger (null for stock vLLM).
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

SPEC_KEYS = frozenset((
    "model_path", "prompts", "max_new_tokens", "max_model_len", "dtype", "engine", "eviction", "stock",
    "top_logprobs", "repeats", "one_by_one", "prefix_caching", "request_eviction", "warm_cache", "forced",
    "ignore_eos", "conversations",
))


def check_spec(spec: dict):
    """The spec's engine settings (``harness.config.EngineSettings``), or ``ValueError`` in one line
    for a key the spec does not have, an engine setting ``EngineSettings`` does not name, eviction
    settings the one parse refuses (``spec_eviction``), or an engine default the admission refuses
    on this engine (``harness.config.admit_on``): before any engine starts. (Each request's own
    settings are then admitted by the engine, as every request's are: offline, vLLM refuses the
    whole call.)"""
    from harness.config import admit_on, engine_settings
    from harness.config.models import model_shape

    unknown = sorted(set(spec) - SPEC_KEYS)
    if unknown:
        raise ValueError(f"batch_run spec has unknown key(s) {', '.join(unknown)}; valid: {', '.join(sorted(SPEC_KEYS))} "
                         "(the engine's settings go under 'engine', by EngineSettings' field names)")
    engine = engine_settings(**spec.get("engine", {}))
    default, _ = spec_eviction(spec)
    if default is not None and not spec.get("stock"):
        shape = model_shape(spec["model_path"], spec.get("dtype", "float32")) if spec.get("model_path") else None
        try:
            admit_on(default, engine, shape.layers if shape else engine.layer_groups)
        except (TypeError, ValueError) as error:  # (a TypeError: an option of the wrong type)
            raise ValueError(f"batch_run spec eviction: {error}") from None
    return engine


def spec_eviction(spec: dict):
    """The spec's eviction settings through the one parse (``harness.eviction.settings.parse_settings``):
    the engine's default (None: none, or full cache) and each request's ``extra_args`` (None: the
    engine's default), or None where the spec gives no ``request_eviction``. A conversation's
    settings are checked with its first turn's boundary."""
    from harness.eviction.settings import CONFIG_KEY, NO_EVICTION, parse_settings

    default = parse_settings(spec["eviction"], "batch_run spec eviction") if spec.get("eviction") else None
    extra = None
    if spec.get("request_eviction"):
        extra = []
        for index, raw in enumerate(spec["request_eviction"]):
            settings = None if raw is None else parse_settings(raw, f"batch_run spec request_eviction[{index}]")
            extra.append(None if raw is None else {CONFIG_KEY: NO_EVICTION} if settings is None
                         else settings.as_extra_args())
    for index, conversation in enumerate(spec.get("conversations") or ()):
        parse_settings({**conversation["eviction"], "context_tokens": conversation["context_tokens"]},
                       f"batch_run spec conversations[{index}] eviction")
    return default, extra


def run(spec: dict) -> dict:
    settings = check_spec(spec)
    if spec.get("stock"):
        os.environ["VLLM_PLUGINS"] = "stock-vllm-without-plugins"  # no plugin has this name
    from harness.config import ModelSettings
    from harness.engine.llm import Engine
    from harness.records.perf import summarize_perf
    from harness.eviction.settings import CONFIG_KEY, NO_EVICTION

    eviction, extra = spec_eviction(spec)
    model = ModelSettings(name=Path(spec["model_path"]).name, path=spec["model_path"], max_model_len=spec["max_model_len"],
                          max_prompt_tokens=spec["max_model_len"], dtype=spec.get("dtype", "float32"))
    engine = Engine(spec["model_path"], model, settings, settings.block_size, eviction=eviction,
                    stock=bool(spec.get("stock")), prefix_caching=bool(spec.get("prefix_caching")))
    free_before = engine.free_blocks()
    keep_all = {CONFIG_KEY: NO_EVICTION}
    top_logprobs = spec.get("top_logprobs", 0)
    snapshot = None
    if spec.get("warm_cache"):
        engine.generate(spec["prompts"], 1, settings=[keep_all] * len(spec["prompts"]), top_logprobs=0, progress=False)
        snapshot = cached_blocks(engine)
    perf = []
    for _ in range(spec.get("repeats", 1)):
        engine.ledger(reset=True)
        if not spec.get("stock"):
            engine.rank_seconds(reset=True)
        started = time.perf_counter()
        count = len(spec["prompts"])
        batches = [[i] for i in range(count)] if spec.get("one_by_one") else [list(range(count))]
        results = [
            result
            for batch in batches
            for result in engine.generate([spec["prompts"][i] for i in batch], spec["max_new_tokens"],
                                          settings=[extra[i] for i in batch] if extra else None,
                                          ignore_eos=spec.get("ignore_eos", True), top_logprobs=top_logprobs,
                                          forced=[spec["forced"][i] for i in batch] if spec.get("forced") else None,
                                          progress=False)
        ]
        wall = time.perf_counter() - started
        ledger = engine.ledger()
        counters = engine.request_counters([r.request_id for r in results])  # handed over: this repeat's alone
        perf.append(summarize_perf(results, wall, engine.facts(), ledger))
        perf[-1]["ranks"] = engine.rank_seconds() if not spec.get("stock") else []
    result = {
        "outputs": [r.token_ids for r in results],
        "preemptions": [r.preemptions for r in results],
        "cached_tokens": [r.cached_tokens for r in results],  # found in vLLM's prefix cache (or a shared context)
        "top_logprobs": [r.top_logprobs if top_logprobs else None for r in results],
        "token_logprobs": [r.token_logprobs for r in results],
        "token_ranks": [r.token_ranks for r in results],
        "free_blocks_before": free_before,
        "free_blocks_after": engine.free_blocks(),
        "ledger": ledger,
        "request_counters": [counters.get(r.request_id) for r in results],
        "pool_blocks": engine.facts()["kv_pool_blocks"],
        "kv_cache_groups": engine.kv_cache_groups(),
        "eviction_status": engine.eviction_status() if eviction is not None else None,
        "perf": perf,
        "cached_blocks": compare_cached_blocks(snapshot, cached_blocks(engine)) if snapshot is not None else None,
    }
    if spec.get("conversations"):
        result["conversations"] = run_conversations(engine, spec["conversations"], spec.get("ignore_eos", True),
                                                    top_logprobs, in_process=settings.in_process)
    return result


def run_conversations(engine, conversations: list[dict], ignore_eos: bool, top_logprobs: int, in_process: bool) -> dict:
    """Multi-turn conversations on ``engine``, turn by turn (see the module's ``conversations``)."""
    from harness.eviction.settings import CONFIG_KEY

    engine.ledger(reset=True)
    turns = 1 + max(len(c["messages"]) for c in conversations)
    prompts = [list(c["prompt"]) for c in conversations]
    boundaries = [c["context_tokens"] for c in conversations]
    record = {key: [[] for _ in conversations] for key in ("prompts", "boundaries", "outputs", "top_logprobs",
                                                           "request_counters")}
    snapshots = []
    for turn in range(turns):
        live = [i for i, c in enumerate(conversations) if turn <= len(c["messages"])]
        settings = [{CONFIG_KEY: {**conversations[i]["eviction"], "context_tokens": boundaries[i]}} for i in live]
        results = engine.generate([prompts[i] for i in live], [conversations[i]["max_new_tokens"] for i in live],
                                  settings=settings, ignore_eos=ignore_eos, top_logprobs=top_logprobs, progress=False)
        counters = engine.request_counters([r.request_id for r in results])
        for i, r in zip(live, results):
            for key, value in (("prompts", prompts[i]), ("boundaries", boundaries[i]), ("outputs", r.token_ids),
                               ("top_logprobs", r.top_logprobs if top_logprobs else None),
                               ("request_counters", counters.get(r.request_id))):
                record[key][i].append(value)
            if turn < len(conversations[i]["messages"]):
                boundaries[i] = len(prompts[i]) + len(r.token_ids)
                prompts[i] = prompts[i] + list(r.token_ids) + list(conversations[i]["messages"][turn])
        if in_process:
            snapshots.append(chain_blocks(engine))
    return {**record, "ledger": engine.ledger(), "free_blocks_after": engine.free_blocks(),
            "chain_blocks": compare_chain_blocks(snapshots, chain_blocks(engine)) if in_process else None}


def chain_blocks(engine) -> dict[int, tuple[frozenset, list]]:
    """Every block a chain entry holds (``harness.engine.shared_contexts``): block id -> (the keys
    of the chain entries holding it, its K/V in every layer of every rank). A chain entry's owner has
    finished: no slot of its blocks may change while the entry stands."""
    contexts = engine.llm.llm_engine.engine_core.engine_core.scheduler.kv_contexts
    holders: dict[int, set] = {}
    for entry in contexts.entries.values() if contexts is not None else ():
        if entry.chain:
            for block in entry.all_blocks():
                holders.setdefault(block.block_id, set()).add(entry.key)
    ids = sorted(holders)

    def read(worker):
        return [layer[ids].clone() for layer in worker.model_runner.kv_caches]

    layers = [layer for rank in engine.llm.collective_rpc(read) for layer in rank] if ids else []
    return {block_id: (frozenset(holders[block_id]), [layer[i] for layer in layers]) for i, block_id in enumerate(ids)}


def compare_chain_blocks(snapshots: list[dict], final: dict) -> dict:
    """How many (snapshot, block) pairs still held by the same chain entry at the end were
    compared, and how many of them changed (a kept block written)."""
    import torch

    checked = changed = 0
    for snapshot in snapshots:
        for block_id, (keys, before) in snapshot.items():
            if block_id in final and keys & final[block_id][0]:
                checked += 1
                changed += not all(torch.equal(x, y) for x, y in zip(before, final[block_id][1]))
    return {"entries": len({key for _, (keys, _) in final.items() for key in keys}), "checked": checked,
            "changed": changed}


def cached_blocks(engine) -> dict[int, tuple]:
    """Every block registered in the prefix cache: block id -> (its hash, its K/V in every layer of
    every rank). Needs the engine core in this process (``in_process``)."""
    scheduler = engine.llm.llm_engine.engine_core.engine_core.scheduler
    registered = {block.block_id: block.block_hash for block in scheduler.kv_cache_manager.block_pool.blocks
                  if block.block_hash is not None and not block.is_null}
    ids = sorted(registered)

    def read(worker):
        return [layer[ids].clone() for layer in worker.model_runner.kv_caches]

    layers = [layer for rank in engine.llm.collective_rpc(read) for layer in rank]
    return {block_id: (registered[block_id], [layer[i] for layer in layers]) for i, block_id in enumerate(ids)}


def compare_cached_blocks(before: dict, after: dict) -> dict:
    """How many blocks registered before are still registered under the same hash, and how many
    of those hold different K/V (a cached block was written)."""
    import torch

    same = [b for b, (block_hash, _) in before.items() if b in after and after[b][0] == block_hash]
    changed = [b for b in same if not all(torch.equal(x, y) for x, y in zip(before[b][1], after[b][1]))]
    return {"registered_before": len(before), "still_registered": len(same), "changed": len(changed)}


def run_in_subprocess(spec: dict, workdir: Path, timeout_s: float = 3 * 3600) -> dict:
    """Run ``spec`` in a fresh Python process; its stderr tail is the error if it fails."""
    import subprocess
    import tempfile

    check_spec(spec)  # refused here, before a process starts
    workdir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=workdir) as scratch:
        spec_file, out_file = Path(scratch) / "spec.json", Path(scratch) / "out.json"
        spec_file.write_text(json.dumps(spec))
        done = subprocess.run(
            [sys.executable, "-m", "harness.engine.batch_run", str(spec_file), str(out_file)],
            capture_output=True, text=True, timeout=timeout_s, cwd=Path(__file__).resolve().parents[2],
        )
        if done.returncode != 0:
            raise RuntimeError(f"engine process failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
        return json.loads(out_file.read_text())


def main(argv: list[str]) -> int:
    spec_path, out_path = map(Path, argv)
    result = run(json.loads(spec_path.read_text()))
    tmp = out_path.with_name(out_path.name + ".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, out_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
