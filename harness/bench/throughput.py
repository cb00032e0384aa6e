"""The throughput benchmark: one workload, several engine configurations, ratios side by side.

A *setting* is a workload (requests x prompt tokens x output tokens, all arriving at once, greedy,
no early stop) and a list of *cells*: a policy and budget on a KV pool that is either *fixed*
(smaller than the requests need at full length, so full cache is memory-bound: sized either in
full-length requests or as every request's working set at one budget) or *unlimited* (every
request fits at full length: the ceiling concurrency alone can reach). Each cell runs in
a process of its own (``harness.engine.batch_run``) so no engine inherits another's memory or
threads, and its result is written atomically to ``<out>/cells/<cell>.json``: an interrupted
benchmark resumes with the cells it has not finished, a finished cell is never rerun by accident.

Throughput counts output tokens over the wall time of the whole batch (engine start excluded).
Memory comes from the scheduler's ledger: blocks really taken from and returned to vLLM's pool.
"""
from __future__ import annotations

import json
import math
import statistics
from collections import Counter
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import pandas as pd

from harness.analysis.studies import THROUGHPUT_MARGIN
from harness.analysis.verdicts import NO_VERDICT, ratio_word
from harness.config.models import KVCacheGroup, ModelShape
from harness.records.results import atomic_write_text


@dataclass(frozen=True)
class Workload:
    requests: int
    prompt_tokens: int
    output_tokens: int
    model: str = "embedded:smollm2-135m-instruct"
    block_size: int = 32
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    shared_prefix_tokens: int = 0  # a prefix (a system prompt) every request's prompt starts with

    @property
    def max_model_len(self) -> int:
        return self.shared_prefix_tokens + self.prompt_tokens + self.output_tokens

    @property
    def blocks_per_request(self) -> int:
        """Blocks one request holds at full length with full cache."""
        return math.ceil(self.max_model_len / self.block_size)


@dataclass(frozen=True)
class Cell:
    policy: str = "full"        # a policies.REGISTRY name, or "full"
    budget: int | None = None
    pool: str = "fixed"         # "fixed" | "unlimited"
    stock: bool = False         # stock vLLM, this project's plugin not loaded
    repeats: int = 1            # the batch generated this many times on one engine; medians reported
    trial: int = 1              # which of several engine processes of the same configuration
    prefix_caching: bool = False  # vLLM's prefix cache on
    tensor_parallel_size: int = 1  # the model's heads split over this many workers
    # False: vLLM's compiled mode, the platform's default (vLLM-cpu: torch.compile, no graphs;
    # GPU: CUDA graphs too); the harness's engines default to eager, which attention capture needs.
    enforce_eager: bool = True
    layer_groups: int = 1       # the layers as this many KV cache groups (harness.engine.layer_groups)
    budget_schedule: str = "uniform"  # how the budget spreads over the groups (uniform, pyramid)
    # (policy, budget and budget_schedule are the cell's eviction settings, by the settings record's
    # own names: ``settings`` reads them through its one parse; a new setting a cell varies is a field
    # here by the record's name, and reaches the engine with them)

    @property
    def settings(self):
        """The cell's eviction settings (``harness.eviction.settings.EvictionSettings``) from its
        fields named as the record's, through the one parse that every path takes (``parse_settings``:
        ``ValueError`` in one line); None for full cache."""
        from harness.config import parse_settings

        return parse_settings({name: getattr(self, name) for name in cell_settings()}, f"cell {self.name}")

    @property
    def eviction(self) -> dict | None:
        """The engine's eviction settings for this cell in their wire form (``EvictionSettings.as_dict``)
        as far as a cell gives them: its own fields, each other setting at its default; None for full cache."""
        settings = self.settings
        return None if settings is None else {k: v for k, v in settings.as_dict().items() if k in cell_settings()}

    @property
    def name(self) -> str:
        what = "stock vLLM" if self.stock else self.policy if self.policy == "full" else f"{self.policy} b{self.budget}"
        what += " + prefix cache" if self.prefix_caching else ""
        what += " compiled" if not self.enforce_eager else ""
        what += f" TP={self.tensor_parallel_size}" if self.tensor_parallel_size > 1 else ""
        what += f" G={self.layer_groups}" if self.layer_groups > 1 else ""
        what += f" {self.budget_schedule}" if self.budget_schedule != "uniform" else ""
        return f"{what} / {self.pool} pool" + (f" #{self.trial}" if self.trial > 1 else "")

    @property
    def slug(self) -> str:
        return self.name.replace(" / ", "__").replace(" #", "__trial-").replace(" ", "-")


def cell_settings() -> tuple[str, ...]:
    """The ``Cell`` fields that are eviction settings: those named as the settings record's wire fields."""
    from harness.config import WIRE_FIELDS

    return tuple(f.name for f in fields(Cell) if f.name in WIRE_FIELDS)


@dataclass(frozen=True)
class Setting:
    name: str
    purpose: str
    workload: Workload
    cells: tuple[Cell, ...]
    fixed_pool_requests: int | None = None  # the fixed pool holds this many requests at full length,
    fixed_pool_budget: int | None = None    # or every request at this budget (budget blocks + the one filling)
    baseline: Cell | None = None            # ratios are against this cell ...
    ceiling: Cell | None = None             # ... and this one
    gpu_memory_utilization: float | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)

    def pool_blocks(self, cell: Cell) -> int | None:
        """Usable blocks of the cell's pool; None lets vLLM size it (GPU memory utilisation). A
        request holds blocks in every KV cache group of the cell's engine (``request_blocks``): one
        group of every layer, G groups of 1/G of them each (the same memory, G times the blocks), or a
        hybrid model's full-attention and sliding-window groups over the one pool."""
        workload = self.workload
        if cell.pool == "unlimited":
            return workload.requests * self.request_blocks(cell).total
        if self.fixed_pool_budget is not None:
            return workload.requests * self.request_blocks(cell, budget=self.fixed_pool_budget).total
        if self.fixed_pool_requests is not None:
            return self.fixed_pool_requests * self.request_blocks(cell).total
        return None

    def request_blocks(self, cell: Cell, budget: int | None = None, generating: bool = False) -> RequestBlocks:
        """The blocks one request of the workload holds in each KV cache group of the cell's engine.

        Full-attention groups: every token's blocks at full length, or at ``budget`` the budget and the
        block decode fills (budget // block + 1: what eviction keeps a request to). Sliding-window
        groups, which eviction leaves to vLLM's sliding-window manager: at full length what vLLM counts
        for one request when it sizes and checks its pool and caps its admission (the window less one
        token plus the tokens in flight, ``KVCacheGroup.request_blocks``, with the engine's in-flight
        tokens: ``max_num_batched_tokens`` per batch in flight, ``harness.config.in_flight_tokens``,
        vllm/config/vllm.py:589-598); while generating (``generating``, and at any ``budget``) what it
        holds then, the window and the newest token: ``SlidingWindowManager`` frees every block before
        the last ``W - 1`` computed tokens (``get_num_skipped_tokens``,
        vllm/v1/core/single_type_kv_cache_manager.py:1135-1170), and each batch in flight adds its one
        token (``max_concurrent_batches``, vllm/config/vllm.py:576-587)."""
        from harness.config import in_flight_tokens

        block, length = self.workload.block_size, self.workload.max_model_len
        engine = unsized_engine(self, cell)
        tokens = in_flight_tokens(engine)
        if generating or budget is not None:
            tokens //= engine.max_num_batched_tokens  # one token per batch in flight
        full, sliding = [], []
        for group in self.kv_groups(cell):
            if group.sliding_window is not None:
                sliding.append(group.request_blocks(block, length, tokens))
            else:
                full.append(budget // block + 1 if budget is not None else group.request_blocks(block, length, tokens))
        return RequestBlocks(tuple(full), tuple(sliding))

    def kv_groups(self, cell: Cell) -> tuple[KVCacheGroup, ...]:
        """The KV cache groups vLLM makes of the model's layers on the cell's engine, from its
        config.json (``harness.config.models.kv_cache_groups``, checked against vLLM by
        tests/unit/test_hybrid_memory.py). A model the harness cannot read here (a hub id: a GPU
        setting's model) is taken to be what every model the bench ran before was: ``layer_groups``
        full-attention groups."""
        from harness.config.models import ModelNotFoundError, kv_cache_groups, model_shape, resolve_model_path

        workload = self.workload
        try:
            model_dir = resolve_model_path(workload.model, prepare=False)
        except ModelNotFoundError as error:
            # An embedded model not prepared yet (or a local directory not there) is not sized at all:
            # nothing in the harness knows its layers before its config.json exists (the config checks
            # skip the pool check until then, harness.config.check_kv_pool), and counting it as one
            # group of every layer would size a hybrid model's pool silently wrong (Gemma 3 270M: six
            # groups, a request holding blocks in every one). run_setting prepares the model first.
            raise ValueError(f"{self.name}: the KV pool of {workload.model} is counted from its config.json: "
                             f"{error}") from None
        shape = model_shape(model_dir, workload.dtype)
        if shape is None:
            return (KVCacheGroup((), None),) * cell.layer_groups
        try:
            return kv_cache_groups(shape, cell.layer_groups)
        except ValueError as error:  # layer groups asked of a model with sliding-window layers
            raise ValueError(f"{self.name}: {cell.name}: {error}") from None

    def fixed_pool_text(self) -> str | None:
        """How the fixed pool was sized, for reports and plot titles."""
        cell = Cell(pool="fixed")
        blocks = self.pool_blocks(cell)
        if blocks is None:
            return None
        counted = self.request_blocks(cell)
        full_length = blocks / counted.total
        if counted.sliding:  # a hybrid model: vLLM's count of a full-length request is not what one holds
            held = f", {blocks / self.request_blocks(cell, generating=True).total:.1f} with full cache while generating"
            counting = " as vLLM counts a request"
        else:
            held = counting = ""
        if self.fixed_pool_budget is not None:
            return (f"{blocks} blocks: every request at budget {self.fixed_pool_budget} "
                    f"({blocks // self.workload.requests} blocks each), {full_length:.1f} at full length{counting}{held}")
        return f"{blocks} blocks: {full_length:.0f} requests at full length{counting}{held}"

    def pool_split_text(self) -> str | None:
        """For a model with sliding-window layers: how a request's blocks split over its KV cache
        groups at full length, with full cache while generating and at each budget of the setting,
        which says why eviction (which acts on the full-attention groups only) frees less of the
        pool than on a model without windows. None for a model without them (one kind of group:
        the blocks per request say it all)."""
        cell = Cell(pool="fixed")
        counted = self.request_blocks(cell)
        if not counted.sliding:
            return None
        from harness.config import in_flight_tokens

        generating = self.request_blocks(cell, generating=True)
        workload, engine = self.workload, unsized_engine(self, cell)
        text = (f"KV cache groups: {counted.groups_text()} over one block pool, a request holding blocks in each; "
                f"blocks per request ({counted.legend()}): at full length as vLLM counts one when it sizes and "
                f"checks its pool (a sliding-window group's window plus the {in_flight_tokens(engine)} tokens a step "
                f"may schedule, at most the request's {workload.max_model_len}) {counted.text()} = {counted.total}; "
                f"with full cache while generating (a sliding-window group's window and newest token) "
                f"{generating.text()} = {generating.total}")
        budgets = sorted({c.budget for c in self.cells if c.budget is not None}
                         | ({self.fixed_pool_budget} if self.fixed_pool_budget is not None else set()))
        for budget in budgets:
            evicting = self.request_blocks(cell, budget=budget)
            text += (f"; at budget {budget} {evicting.text()} = {evicting.total} "
                     f"({100 * (1 - evicting.total / generating.total):.0f}% fewer than full cache)")
        return text + ". Eviction shrinks the full-attention groups only."


@dataclass(frozen=True)
class RequestBlocks:
    """One request's blocks in each KV cache group, by the group's kind: full-attention groups
    (eviction acts on them) and sliding-window groups (vLLM's sliding-window manager keeps them)."""

    full: tuple[int, ...]
    sliding: tuple[int, ...] = ()

    @property
    def total(self) -> int:
        return sum(self.full) + sum(self.sliding)

    def kinds(self):
        return [(counts, kind) for counts, kind in ((self.full, "full-attention"), (self.sliding, "sliding-window"))
                if counts]

    def groups_text(self) -> str:
        """'1 full-attention and 5 sliding-window'."""
        return " and ".join(f"{len(counts)} {kind}" for counts, kind in self.kinds())

    def legend(self) -> str:
        """What the terms of ``text`` are: 'full-attention + sliding-window groups'."""
        return " + ".join(kind for _, kind in self.kinds()) + " groups"

    def text(self) -> str:
        """The blocks per kind of group: '36 + 5 x 37' (one group of 36, five of 37)."""
        def term(counts):
            if len(set(counts)) > 1:
                return " + ".join(map(str, counts))
            return str(counts[0]) if len(counts) == 1 else f"{len(counts)} x {counts[0]}"

        return " + ".join(term(counts) for counts, _ in self.kinds())


def cell_engine(setting: Setting, cell: Cell):
    """The cell's engine (``harness.config.EngineSettings``): the device's defaults (``conf/engine/<device>.yaml``,
    ``harness.config.engine_settings``), changed only where the cell says otherwise, its pool sized
    by the setting (``Setting.pool_blocks``)."""
    engine = unsized_engine(setting, cell)
    blocks = setting.pool_blocks(cell)
    # vLLM keeps one null block out of the pool
    return engine if blocks is None else replace(engine, num_kv_blocks=blocks + 1)


def unsized_engine(setting: Setting, cell: Cell):
    """The cell's engine before its pool is sized (what sizing the pool reads: its block size,
    layer groups and the tokens it schedules per step)."""
    from harness.config import engine_settings

    workload = setting.workload
    changes = {
        "block_size": workload.block_size, "tensor_parallel_size": cell.tensor_parallel_size,
        "enforce_eager": cell.enforce_eager, "layer_groups": cell.layer_groups,
        "max_num_seqs": max(workload.requests, 1),  # every request may run at once: the pool decides
    }
    if workload.device == "cpu":
        # The memory vLLM-cpu may use for KV; the pool's size itself is set in blocks below. 4 GiB,
        # not cpu.yaml's 2.0: every committed CPU cell ran (and recorded as kv_pool_bytes) at 4, and
        # replaying one (harness.bench.replay) must start the same engine.
        changes["kv_cache_gib"] = 4.0
    if setting.gpu_memory_utilization is not None:
        changes["gpu_memory_utilization"] = setting.gpu_memory_utilization
    return engine_settings(workload.device, **changes)


def engine_spec(setting: Setting, cell: Cell, prompts: list[list[int]], model_path: str) -> dict:
    """The batch_run spec of one cell: its engine (``cell_engine``) and its eviction settings (``Cell.eviction``)."""
    workload = setting.workload
    spec = {
        "model_path": model_path, "prompts": prompts, "max_new_tokens": workload.output_tokens,
        "max_model_len": workload.max_model_len, "dtype": workload.dtype, "repeats": cell.repeats, "stock": cell.stock,
        "prefix_caching": cell.prefix_caching, "engine": asdict(cell_engine(setting, cell)),
    }
    eviction = cell.eviction
    if eviction is not None:
        spec["eviction"] = eviction
    return spec


def admit_cell(setting: Setting, cell: Cell) -> tuple | None:
    """The policy each layer group of the cell's engine runs, through the one admission every path
    takes (``harness.config.admit_on``: the settings' policy, options, budget and schedule,
    and what they need of that engine); ``ValueError`` in one line naming the cell; None for full cache."""
    from harness.config import admit_on
    from harness.config.models import ModelNotFoundError, model_shape, resolve_model_path

    try:
        settings = cell.settings
        if settings is None:
            return None
        engine = unsized_engine(setting, cell)  # (admission does not read the pool's size)
        try:
            shape = model_shape(resolve_model_path(setting.workload.model, prepare=False), setting.workload.dtype)
        except ModelNotFoundError:
            shape = None  # not prepared here (a GPU setting's model): admitted at one layer per group
        return admit_on(settings, engine, shape.layers if shape else engine.layer_groups)
    except (TypeError, ValueError) as error:  # (a TypeError: an option of the wrong type)
        raise ValueError(f"{setting.name}: {cell.name}: {error}") from None


def check_setting(setting: Setting) -> None:
    """Refuse a setting that cannot measure what it claims, before any engine starts."""
    workload = setting.workload
    if setting.fixed_pool_requests is not None and setting.fixed_pool_budget is not None:
        raise ValueError(f"{setting.name}: size the fixed pool by fixed_pool_requests or by fixed_pool_budget, not both")
    names = [cell.name for cell in setting.cells]
    if len(set(names)) != len(names):
        raise ValueError(f"{setting.name}: cells repeat ({names}); give repeated configurations distinct trials")
    for cell in setting.cells:
        if admit_cell(setting, cell) is not None:  # its settings, policy, budget and engine
            if cell.budget + workload.block_size >= workload.max_model_len:
                raise ValueError(
                    f"{setting.name}: {cell.name} never evicts (budget {cell.budget} + one block "
                    f">= {workload.max_model_len} tokens per request)"
                )
        blocks = setting.pool_blocks(cell)
        if blocks is None:
            continue
        one = setting.request_blocks(cell)  # at full length, as vLLM counts one when it checks its pool
        if blocks < one.total:
            split = f" ({one.text()}: {one.legend()})" if one.sliding else ""
            raise ValueError(f"{setting.name}: a {blocks}-block pool cannot hold one request of "
                             f"{one.total} blocks{split}")


def setting_prompts(setting: Setting, model_path: str) -> list[list[int]]:
    """The token ids of the setting's requests: ``prompt_tokens`` each (seeded), after a shared
    prefix of ``shared_prefix_tokens`` where the workload has one."""
    from harness.tasks.embedded.token_prompts import token_prompts

    workload = setting.workload
    prompts = token_prompts(model_path, [workload.prompt_tokens] * workload.requests, seed=workload.seed)
    if workload.shared_prefix_tokens:
        (prefix,) = token_prompts(model_path, [workload.shared_prefix_tokens], seed=workload.seed + 1)
        prompts = [prefix + own for own in prompts]
    return prompts


def run_setting(setting: Setting, out: Path, force: bool = False, progress=print) -> pd.DataFrame:
    """Run every cell not already on disk; returns the table of all cells."""
    from harness.engine.batch_run import run_in_subprocess
    from harness.config.models import resolve_model_path
    from harness.records.provenance import provenance

    workload = setting.workload
    # Prepared before the check: the pool is counted from the model's config.json (``Setting.kv_groups``).
    model_path = resolve_model_path(workload.model)
    check_setting(setting)
    prompts = setting_prompts(setting, model_path)
    cells_dir = out / "cells"
    cells_dir.mkdir(parents=True, exist_ok=True)
    results = {}
    for index, cell in enumerate(run_order(setting.cells), 1):
        path = cells_dir / f"{cell.slug}.json"
        stored = None if force else stored_cell(path, workload)
        if stored is not None:
            progress(f"[{index}/{len(setting.cells)}] {cell.name}: already measured ({path})")
            results[cell] = stored
            continue
        progress(f"[{index}/{len(setting.cells)}] {cell.name}: running {workload.requests} requests "
                 f"x {workload.prompt_tokens} in x {workload.output_tokens} out ...")
        run = run_in_subprocess(engine_spec(setting, cell, prompts, model_path), out / "scratch")
        stored = {"setting": setting.name, "cell": asdict(cell), "workload": asdict(workload), "provenance": provenance(),
                  "pool_blocks": run["pool_blocks"] - 1, "perf": run["perf"],  # minus vLLM's null block
                  "position": index}  # where it ran in the setting's run order (``run_order``): drift's clock
        atomic_write_text(path, json.dumps(stored, indent=1) + "\n")
        results[cell] = stored
        progress(f"    {median_of(run['perf'], 'output_tokens_per_s'):.1f} output tok/s, "
                 f"{median_of(run['perf'], 'wall_s'):.0f} s")
    return cell_table(setting, {cell: results[cell] for cell in setting.cells})  # the table in the setting's order


def run_order(cells: tuple[Cell, ...]) -> list[Cell]:
    """The order cells run in: trial by trial, each trial's configurations in the setting's order in
    odd trials and reversed in even ones. The machine's speed drifts over a run (issue 51: output
    tok/s of one configuration fell from 80.9 to 69.0 over ``layer_groups``' nine cells); with one
    fixed order, the configuration run last in every trial absorbs the drift as if it were its own
    cost. Reversing every other trial gives each configuration the same mean position over an even
    number of trials, and lets the time trend be told apart from the configurations
    (``drift_lines``)."""
    trials = sorted({cell.trial for cell in cells})
    ordered = []
    for number, trial in enumerate(trials):
        mine = [cell for cell in cells if cell.trial == trial]
        ordered += mine[::-1] if number % 2 else mine
    return ordered


def stored_cell(path: Path, workload: Workload) -> dict | None:
    """A cell's stored result, or None when it is not on disk or was measured on another workload."""
    if not path.exists():
        return None
    stored = json.loads(path.read_text())
    return stored if stored["workload"] == asdict(workload) else None


def summarize_setting(setting: Setting, out: Path) -> pd.DataFrame:
    """The table of every cell of ``setting`` from ``<out>/cells/*.json`` alone, no engine started:
    what rewrites ``summary.md`` after a change to the report code. Refuses when a cell of the
    setting is missing (or was measured on another workload) and when the folder holds cells the
    setting does not name (they ran with other trials: give the same ``--trials``), so that the
    summary is always of exactly the cells on disk."""
    check_setting(setting)
    results, problems = read_cells(setting.cells, out / "cells", lambda path: stored_cell(path, setting.workload),
                                   "this workload")
    if problems:
        raise ValueError(f"{setting.name}: " + "; ".join(problems))
    return cell_table(setting, results)


def read_cells(cells, cells_dir: Path, load, measured_on: str) -> tuple[dict, list[str]]:
    """Each cell's stored record (``load(path)``: None when absent or measured on something else),
    and what is wrong with the folder: cells missing, and cells it holds that none of ``cells`` names
    (they ran with other trials)."""
    results, missing = {}, []
    for cell in cells:
        stored = load(cells_dir / f"{cell.slug}.json")
        if stored is None:
            missing.append(cell.name)
        else:
            results[cell] = stored
    slugs = {cell.slug for cell in cells}
    extra = sorted(path.stem for path in cells_dir.glob("*.json") if path.stem not in slugs)
    problems = []
    if missing:
        problems.append(f"not measured on {measured_on} in {cells_dir}: {', '.join(missing)}")
    if extra:
        problems.append(f"{cells_dir} holds cells this setting does not name (run with other --trials?): "
                        f"{', '.join(extra)}")
    return results, problems


def median_of(perf: list[dict], key: str, sub: str | None = None):
    values = [p[key][sub] if sub else p[key] for p in perf]
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def cell_table(setting: Setting, results: dict) -> pd.DataFrame:
    rows = []
    # Cells measured before positions were stored ran in the setting's order (one fixed order per trial).
    fixed_order = {cell: index for index, cell in enumerate(setting.cells, 1)}
    for cell, stored in results.items():
        perf = stored["perf"]
        kv = perf[-1]["kv"] or {}
        rows.append({
            "cell": cell.name, "policy.name": "stock" if cell.stock else cell.policy, "budget": cell.budget,
            "pool": cell.pool, "trial": cell.trial, "pool_blocks": stored["pool_blocks"], "repeats": len(perf),
            "output_tok_s": median_of(perf, "output_tokens_per_s"), "wall_s": median_of(perf, "wall_s"),
            "tpot_p50_ms": 1000 * (median_of(perf, "tpot_s", "p50") or math.nan),
            "ttft_p50_s": median_of(perf, "ttft_s", "p50"), "latency_p90_s": median_of(perf, "latency_s", "p90"),
            "total_tok_s": median_of(perf, "total_tokens_per_s"),
            "copy_target_blocks": kv.get("copy_target_blocks", 0),
            "running_peak": kv.get("running_requests_peak"), "blocks_used_peak": kv.get("kv_blocks_used_peak"),
            "decode_blocks_peak": kv.get("decode_blocks_peak"), "preemptions": perf[-1]["preemptions"],
            "evictions": sum((kv.get("evictions") or {}).values()) or 0,
            "freed_blocks": kv.get("freed_blocks", 0),
            "copied_prefill": (kv.get("copied_tokens") or {}).get("prefill", 0),
            "copied_decode": (kv.get("copied_tokens") or {}).get("decode", 0),
            "evict_share": kv.get("evict_share_of_step"),
            "capture_share": kv.get("capture_share_of_step"),
            "tensor_parallel_size": cell.tensor_parallel_size, "enforce_eager": cell.enforce_eager,
            "layer_groups": cell.layer_groups, "budget_schedule": cell.budget_schedule,
            "evict_share_ranks": rank_shares(perf[-1].get("ranks") or []),
            "position": stored.get("position", fixed_order.get(cell)),
            "position_recorded": "position" in stored,
        })
    table = pd.DataFrame(rows)
    for label, cell in (("x_baseline", setting.baseline), ("x_ceiling", setting.ceiling)):
        if cell is not None and cell in results:
            # Against the reference of the same trial where there is one (trials run back to back).
            same_trial = {trial: replace(cell, trial=trial).name for trial in table["trial"]}
            by_name = table.set_index("cell")["output_tok_s"]
            reference = [by_name.get(same_trial[trial], by_name[cell.name]) for trial in table["trial"]]
            table[label] = table["output_tok_s"] / reference
    return table


def rank_shares(ranks: list[dict]) -> str | None:
    """Each rank's eviction seconds as a share of its own model time on evicting steps, "r0/r1"."""
    if len(ranks) < 2:
        return None
    return "/".join(f"{100 * r['evict_s'] / r['model_s']:.2f}" if r["model_s"] else "-"
                    for r in sorted(ranks, key=lambda r: r["rank"]))


def with_setup_defaults(table: pd.DataFrame) -> pd.DataFrame:
    """The table with the engine-setup columns a table of earlier cells may lack, at their defaults."""
    defaults = {"tensor_parallel_size": 1, "layer_groups": 1, "budget_schedule": "uniform"}
    return table.assign(**{column: value for column, value in defaults.items() if column not in table})


def same_configuration(table: pd.DataFrame, policy: str, budget, pool: str) -> pd.DataFrame:
    """The table's cells of this policy, budget (full cache: none) and pool, any trial or engine
    setup: what a cell run another way (two workers, G layer groups) is compared with."""
    same_budget = (table["budget"] == budget) | (pd.isna(budget) & table["budget"].isna())
    return table[(table["policy.name"] == policy) & (table["pool"] == pool) & same_budget]


def design_lines(direction: str) -> list[str]:
    """What a summary's verdict words rest on (issue 65, items 1-2): the test, the margin, and the
    smallest p the design can reach, so whether it can decide. ``direction``: which way each
    measure is better, for the words better and worse. Each point wrapped to read in a terminal
    (Markdown joins the lines)."""
    import textwrap

    floor, ceiling = 1 - THROUGHPUT_MARGIN, 1 / (1 - THROUGHPUT_MARGIN)
    points = [
        "Test: a ratio over trials is the geometric mean of its per-trial ratios (a trial's cells ran back to "
        "back) with a 95% t-interval on their logs (`harness.analysis.stats.ratio_interval`); a ratio with the trend "
        "taken out has the drift model's own 95% interval (`harness.analysis.stats.trend_ratios`), so its word can "
        "differ from the per-trial one.",
        f"Verdict after each ratio (`harness.analysis.verdicts.ratio_verdict`, as in RESULTS.md) at a margin of "
        f"{THROUGHPUT_MARGIN:.0%} (`harness.analysis.studies.THROUGHPUT_MARGIN`: stated before each run since issue "
        f"65; cells measured earlier were seen before it was set): `better`/`worse` where the interval excludes 1 "
        f"({direction}), `equivalent` where it lies inside ({floor:g}x, {ceiling:.3g}x), `non-inferior` where its "
        "worse-side bound does, else `inconclusive`; unadjusted over the setting's comparisons.",
        "Smallest p this design can reach: no floor above 0 (a t-test's p is continuous, not a count of sign "
        "patterns), so with 2 or more trials it can decide (the drift model also needs a residual degree of "
        f"freedom); a configuration measured in one trial has no interval and gets `{NO_VERDICT}`.",
    ]
    return ["Design:", ""] + [textwrap.fill(point, width=110, initial_indent="- ", subsequent_indent="  ",
                                            break_long_words=False, break_on_hyphens=False) for point in points]


def tensor_parallel_lines(table: pd.DataFrame) -> list[str]:
    """Each cell under tensor parallelism against the same cell on one worker, trial by trial (the
    two run back to back): the median ratio of output tok/s and its range over trials, and the 95%
    t-interval about their geometric mean (``ratio_interval``) with its verdict (``ratio_word``)."""
    from harness.analysis.stats import ratio_interval

    lines = []
    split = table[table["tensor_parallel_size"] > 1]
    for (policy, budget, pool, size), cells in split.groupby(["policy.name", "budget", "pool", "tensor_parallel_size"],
                                                             dropna=False):
        ones = same_configuration(table, policy, budget, pool)
        ones = ones[ones["tensor_parallel_size"] == 1].set_index("trial")
        trials = sorted(set(cells["trial"]) & set(ones.index))
        if not trials:
            continue
        by_trial = cells.set_index("trial")
        ratios = [by_trial.loc[t, "output_tok_s"] / ones.loc[t, "output_tok_s"] for t in trials]
        name = policy if policy in ("full", "stock") else f"{policy} b{int(budget)}"
        text = (f"{name} TP={size} vs TP=1: {statistics.median(ratios):.2f}x output tok/s (median of {len(trials)} "
                f"back-to-back trial{'s' if len(trials) > 1 else ''}")
        if len(trials) > 1:
            interval = ratio_interval(ratios)
            text += (f", range {min(ratios):.2f}-{max(ratios):.2f}; 95% interval {interval.low:.2f}-"
                     f"{interval.high:.2f} about the geometric mean {interval.estimate:.2f}x): {ratio_word(interval)}")
        else:
            text += f"): {NO_VERDICT}"
        shares = [s for s in by_trial["evict_share_ranks"] if isinstance(s, str)]
        if shares and policy not in ("full", "stock"):
            text += f"; eviction % of each rank's step: {', '.join(shares)} (TP=1: " + ", ".join(
                f"{100 * v:.2f}" for v in ones["evict_share"] if pd.notna(v)) + ")"
        lines.append(text)
    return lines


def layer_group_lines(table: pd.DataFrame) -> list[str]:
    """Each configuration with its layers as G > 1 KV cache groups against the same one with one
    group, trial by trial (each trial's cells ran back to back): output tok/s and time per output
    token as geometric means with 95% t-intervals over the trials (``ratio_interval``), or the one
    trial's ratio, each with its verdict (``ratio_word``; less time per output token is better)."""
    from harness.analysis.stats import ratio_interval

    lines = []
    table = with_setup_defaults(table)
    keys = ["policy.name", "budget", "pool", "tensor_parallel_size"]
    grouped = table[table["layer_groups"] > 1].groupby(keys + ["layer_groups", "budget_schedule"], dropna=False)
    for (policy, budget, pool, size, groups, schedule), cells in grouped:
        ones = same_configuration(table, policy, budget, pool)
        ones = ones[(ones["layer_groups"] == 1) & (ones["tensor_parallel_size"] == size)].set_index("trial")
        mine = cells.set_index("trial")
        trials = sorted(set(mine.index) & set(ones.index))
        if not trials:
            continue
        parts = []
        for column, label, higher_is_better in (("output_tok_s", "output tok/s", True),
                                                ("tpot_p50_ms", "time per output token", False)):
            ratios = [mine.loc[t, column] / ones.loc[t, column] for t in trials]
            if len(ratios) > 1:
                ratio = ratio_interval(ratios)
                parts.append(f"{ratio.estimate:.3f}x {label} (95% interval {ratio.low:.3f}-{ratio.high:.3f}): "
                             + ratio_word(ratio, higher_is_better))
            else:
                parts.append(f"{ratios[0]:.3f}x {label} (one trial): {NO_VERDICT}")
        name = policy if policy == "full" else f"{policy} b{int(budget)}"
        name += "" if schedule == "uniform" else f" at the {schedule} schedule"
        one = "one" if policy == "full" else "one (uniform)"  # one group's budget is the uniform one
        lines.append(f"{name} with G={int(groups)} layer groups vs {one}, over {len(trials)} back-to-back "
                     f"trial{'s' if len(trials) > 1 else ''}: " + "; ".join(parts))
    return lines


def trial_lines(setting: Setting, table: pd.DataFrame) -> list[str]:
    """For cells run in several trials (each trial: every cell once, in order, so a trial's cells
    ran close in time): each evicting cell's output tok/s against full cache and against
    PagedEviction of the same trial, and its eviction + capture share of step time, as geometric
    means with 95% t-intervals over the trials (``harness.analysis.stats.ratio_interval``), each
    ratio with its verdict (``ratio_word``)."""
    from harness.analysis.stats import T_975, ratio_interval

    lines = []
    # one worker, one layer group: the other setups are compared with these (tensor_parallel_lines, layer_group_lines)
    table = with_setup_defaults(table)
    table = table[(table["pool"] == "fixed") & (table["tensor_parallel_size"] == 1) & (table["layer_groups"] == 1)
                  & (table["policy.name"] != "stock")]

    def tok_s(policy, budget, trial):
        """The output tok/s of a cell of this trial (full cache: any budget), or None."""
        rows = table[(table["policy.name"] == policy) & (table["trial"] == trial)
                     & ((table["budget"] == budget) | (policy == "full"))]
        return rows["output_tok_s"].iloc[0] if len(rows) == 1 else None

    for (policy, budget), cells in table[table["policy.name"] != "full"].groupby(["policy.name", "budget"]):
        trials = sorted(cells["trial"])
        if len(trials) < 2:
            continue
        parts = []
        for reference, label in (("full", "full cache"), ("paged", "PagedEviction")):
            pairs = [(tok_s(policy, budget, t), tok_s(reference, budget, t)) for t in trials]
            pairs = [(ours, theirs) for ours, theirs in pairs if ours and theirs]
            if reference != policy and len(pairs) >= 2:
                ratio = ratio_interval([ours / theirs for ours, theirs in pairs])
                parts.append(f"{ratio.estimate:.2f}x {label} ({ratio.low:.2f}-{ratio.high:.2f}): {ratio_word(ratio)}")
            elif reference != policy and pairs:
                parts.append(f"{pairs[0][0] / pairs[0][1]:.2f}x {label} (one trial): {NO_VERDICT}")
        shares = [100 * (row["evict_share"] + (row["capture_share"] or 0))
                  for _, row in cells.iterrows() if pd.notna(row["evict_share"])]
        if len(shares) >= 2:
            mean = statistics.mean(shares)
            if len(shares) - 1 > len(T_975):
                raise ValueError(f"at most {len(T_975) + 1} trials")
            half = T_975[len(shares) - 2] * statistics.stdev(shares) / math.sqrt(len(shares))
            parts.append(f"eviction + capture {mean:.2f}% of model step time ({max(mean - half, 0):.2f}-{mean + half:.2f})")
        lines.append(f"{policy} b{int(budget)} over {len(trials)} trials: " + "; ".join(parts))
    return lines


# The paper's model, for the same arithmetic (Llama-3.1-8B's config and parameter count).
LLAMA_31_8B = (ModelShape(layers=32, kv_heads=8, query_heads=32, head_dim=128, dtype_bytes=2), 8.03e9)


def recompute_share(shape: ModelShape, parameters: float, window: int, cached: int, block: int) -> float:
    """What recomputing a window's attention costs against the model, in FLOPs: the window's
    ``window`` queries against ``cached`` keys in every layer (q.k products), once per eviction,
    over the ``block`` decode steps between two evictions, each about 2 x parameters plus its own
    attention over the cache (q.k and p.v). No implementation that recomputes that attention
    exactly can cost less than this share of the step time on a compute-bound machine."""
    per_layer = 2 * shape.query_heads * cached * shape.head_dim
    recompute = window * per_layer * shape.layers
    step = 2 * parameters + 2 * per_layer * shape.layers
    return recompute / (block * step)


def tensor_shapes(model_dir: str) -> dict[str, list[int]]:
    """Each tensor's shape in a local safetensors checkpoint, from the files' headers (empty: none there)."""
    from safetensors import safe_open

    shapes = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                shapes[name] = handle.get_slice(name).get_shape()
    return shapes


def parameter_count(model_dir: str) -> int | None:
    """Parameters of a local safetensors checkpoint, from the files' headers."""
    shapes = tensor_shapes(model_dir)
    return sum(math.prod(shape) for shape in shapes.values()) if shapes else None


@dataclass(frozen=True)
class OutputLayer:
    """A checkpoint's output layer (the vocabulary's logits) against the weights a decode step multiplies by."""

    shape: tuple[int, ...]   # vocabulary x hidden
    tied: bool               # the input embedding's matrix (the checkpoint stores no lm_head of its own)
    parameters: int          # the checkpoint's
    multiplied: int          # the weights one token's decode step multiplies its activations by

    @property
    def share(self) -> float:
        return math.prod(self.shape) / self.multiplied


def output_layer(model_dir: str) -> OutputLayer | None:
    """The output layer of a local safetensors checkpoint, from the files' headers: ``lm_head``, or
    the input embedding where the two are tied (the checkpoint then stores the embedding alone, as
    transformers saves it; vLLM's logits multiply by that matrix all the same). A decode step
    multiplies one token's activations by every weight once, the output layer's included, except an
    untied input embedding, which it only looks up: the output layer's share of ``multiplied`` is its
    share of the step's weight matmul FLOPs (2 per weight; attention over the cache aside). None
    when the checkpoint is not here or has no embedding or output layer by these names."""
    shapes = tensor_shapes(model_dir)
    embedding = [name for name in shapes if name.endswith("embed_tokens.weight")]
    head = [name for name in shapes if name.endswith("lm_head.weight")]
    if len(embedding) != 1 or len(head) > 1:
        return None
    parameters = sum(math.prod(shape) for shape in shapes.values())
    if head:
        return OutputLayer(tuple(shapes[head[0]]), False, parameters, parameters - math.prod(shapes[embedding[0]]))
    return OutputLayer(tuple(shapes[embedding[0]]), True, parameters, parameters)


def output_layer_line(setting: Setting) -> str | None:
    """The share of a decode step's weight matmul FLOPs the setting's model spends in its output layer
    (``output_layer``): what no eviction shortens, large on a small model with a large vocabulary
    (Gemma 3 270M's 262,144 x 640 tied embedding: 168M of its 268M parameters). None for a model
    not here to read (a hub id, or not prepared)."""
    from harness.config.models import ModelNotFoundError, resolve_model_path

    model = setting.workload.model
    try:
        layer = output_layer(resolve_model_path(model, prepare=False))
    except ModelNotFoundError:
        return None
    if layer is None:
        return None
    what = "the input embedding, tied" if layer.tied else "lm_head"
    multiplied = "its parameters" if layer.tied else "its parameters less the input embedding, a lookup"
    return (f"Output layer of {Path(model).name} ({what}, {' x '.join(map(str, layer.shape))}): "
            f"{math.prod(layer.shape) / 1e6:.1f}M of the {layer.multiplied / 1e6:.1f}M weights a decode step multiplies "
            f"by ({multiplied}), {100 * layer.share:.1f}% of the step's weight matmul FLOPs: the vocabulary's logits, "
            "whatever the cache holds.")


def recompute_lines(setting: Setting) -> list[str]:
    """For attention-aware cells: the FLOP floor of recomputing their window's attention, on this
    model and on Llama-3.1-8B at the same budget and block."""
    from harness.config.models import model_shape, resolve_model_path

    workload = setting.workload
    windows = {}
    for cell in setting.cells:
        policies = admit_cell(setting, cell)
        if policies is not None:
            window = policies[0].query_window
            if window:
                windows[(cell.policy, cell.budget)] = window
    if not windows:
        return []
    model_dir = resolve_model_path(workload.model)
    shape, parameters = model_shape(model_dir, workload.dtype), parameter_count(model_dir)
    if shape is None or not parameters:
        return []
    lines = []
    for window, budget in sorted(set((w, b) for (_, b), w in windows.items())):
        policies = ", ".join(p for (p, b), w in windows.items() if (w, b) == (window, budget))
        cached = budget + workload.block_size
        here = recompute_share(shape, parameters, window, cached, workload.block_size)
        paper = recompute_share(*LLAMA_31_8B, window, cached, workload.block_size)
        lines.append(f"{policies} at b{budget}: recomputing {window} queries' attention over {cached} cached tokens "
                     f"once per {workload.block_size} decode steps is {100 * here:.1f}% of those steps' FLOPs on "
                     f"{Path(workload.model).name} ({parameters / 1e6:.0f}M parameters), {100 * paper:.2f}% on "
                     "Llama-3.1-8B's shape: a floor for any exact recomputation, before capture and selection")
    return lines


def headline(setting: Setting, table: pd.DataFrame) -> list[str]:
    """The targets of the performance issue, stated with the measured figures."""
    lines = []
    by_cell = table.set_index("cell")
    base = setting.baseline.name if setting.baseline else None
    ceiling = setting.ceiling.name if setting.ceiling else None
    # A configuration run in several trials is stated once, over its trials (``trial_lines``): a
    # line per trial would repeat the table's tok/s and ratio columns.
    repeated = Counter(replace(cell, trial=1) for cell in setting.cells)
    for cell in setting.cells:
        if cell.policy == "full" or cell.pool != "fixed" or base not in by_cell.index or repeated[replace(cell, trial=1)] > 1:
            continue
        row = by_cell.loc[cell.name]
        text = f"{cell.name}: {row['output_tok_s']:.1f} tok/s = {row['x_baseline']:.2f}x {base}"
        if ceiling in by_cell.index:
            text += f", {row['x_ceiling']:.2f}x {ceiling}"
        lines.append(f"{text} (one trial): {NO_VERDICT}")
    evicting = table[~table["policy.name"].isin(["full", "stock"]) & table["evict_share"].notna()]
    for _, row in evicting.iterrows():
        text = f"{row['cell']}: eviction work {100 * row['evict_share']:.2f}% of model step time"
        if pd.notna(row.get("capture_share")) and row.get("capture_share") > 0:
            text += f", query capture {100 * row['capture_share']:.2f}%"
        lines.append(text + (" (target < 5%)" if row["policy.name"] == "paged" else ""))
    lines += overhead_lines(table)
    lines += tensor_parallel_lines(table)
    lines += trial_lines(setting, table)
    lines += layer_group_lines(table)
    lines += drift_lines(setting, table)
    lines += recompute_lines(setting)
    for cell in setting.cells:
        twin = replace(cell, prefix_caching=False)
        if cell.prefix_caching and {cell.name, twin.name} <= set(by_cell.index):
            on, off = by_cell.loc[cell.name], by_cell.loc[twin.name]
            lines.append(f"{cell.name}: {on['output_tok_s']:.1f} output tok/s vs {off['output_tok_s']:.1f} without the "
                         f"prefix cache ({on['output_tok_s'] / off['output_tok_s']:.2f}x), batch {on['wall_s']:.1f} s vs "
                         f"{off['wall_s']:.1f} s, TTFT p50 {on['ttft_p50_s']:.2f} s vs {off['ttft_p50_s']:.2f} s")
    # On a pool every request fits, eviction cannot buy concurrency: what it changes is the time
    # per output token (the paper's latency claim), against full cache on the same engine
    # configuration and trial.
    if setting.baseline is not None and setting.baseline.policy == "full" and base in by_cell.index:
        for cell in setting.cells:
            full = replace(cell, policy="full", budget=None, repeats=setting.baseline.repeats)
            if cell.policy != "full" and cell.pool == "unlimited" and full.name in by_cell.index:
                tpot, reference = by_cell.loc[cell.name, "tpot_p50_ms"], by_cell.loc[full.name, "tpot_p50_ms"]
                lines.append(f"{cell.name}: time per output token {tpot:.2f} ms vs full cache {reference:.2f} ms "
                             f"({100 * (tpot / reference - 1):+.1f}%; the paper reports -10 to -12%)")
    return lines


def overhead_lines(table: pd.DataFrame) -> list[str]:
    """Patched engine with eviction off against stock vLLM on the same pool, in eager mode (what the
    harness runs) and in compiled mode (the platform's default), and the patched engine in eager
    mode against stock vLLM at the platform's default: what running the harness costs against
    what a user of vLLM gets. Trials alternate the engines in time, so each trial's ratio compares
    processes that ran back to back; the median over trials is the estimate, their range shows how
    far one process pair can mislead, and a 95% t-interval over trials bounds the ratio and gives
    its verdict (``ratio_word``)."""
    table = table if "enforce_eager" in table else table.assign(enforce_eager=True)
    stock = table[table["policy.name"] == "stock"]
    off = table[(table["policy.name"] == "full") & table["pool"].isin(stock["pool"])]
    comparisons = [
        ("patched engine, eviction off, vs stock vLLM", off[off["enforce_eager"]], stock[stock["enforce_eager"]]),
        ("compiled mode: patched engine, eviction off, vs stock vLLM", off[~off["enforce_eager"]],
         stock[~stock["enforce_eager"]]),
        ("patched engine in eager mode (eviction off) vs stock vLLM at the platform's defaults (compiled)",
         off[off["enforce_eager"]], stock[~stock["enforce_eager"]]),
    ]
    lines = []
    for label, ours, theirs in comparisons:
        ours, theirs = ours.set_index("trial"), theirs.set_index("trial")
        trials = sorted(set(ours.index) & set(theirs.index))
        if not trials:
            continue
        ratios = [ours.loc[t, "output_tok_s"] / theirs.loc[t, "output_tok_s"] for t in trials]
        line = (f"{label}: {100 * (statistics.median(ratios) - 1):+.2f}% output tok/s "
                f"(median of {len(trials)} back-to-back trial{'s' if len(trials) > 1 else ''}")
        word = NO_VERDICT
        if len(trials) > 1:
            from harness.analysis.stats import ratio_interval

            interval = ratio_interval(ratios)
            line += (f"; trials range {100 * (min(ratios) - 1):+.2f}% to {100 * (max(ratios) - 1):+.2f}%; 95% interval "
                     f"{100 * (interval.low - 1):+.2f}% to {100 * (interval.high - 1):+.2f}%")
            word = ratio_word(interval)
        lines.append(line + ("; target within 2%)" if label.startswith("patched engine, eviction off") else ")")
                     + f": {word}")
    return lines


COLUMNS = {
    "cell": "cell", "pool_blocks": "pool blocks", "output_tok_s": "out tok/s", "x_baseline": "x baseline",
    "x_ceiling": "x ceiling", "tpot_p50_ms": "TPOT p50 ms", "ttft_p50_s": "TTFT p50 s", "wall_s": "wall s",
    "running_peak": "running peak", "blocks_used_peak": "blocks used peak", "preemptions": "preempt",
    "evictions": "evictions", "freed_blocks": "blocks freed", "copied_prefill": "copied (prefill)",
    "copied_decode": "copied (decode)", "copy_target_blocks": "copy-target blocks", "evict_share": "evict % of step",
    "capture_share": "capture % of step", "evict_share_ranks": "evict % of step per rank",
}


def markdown_table(table: pd.DataFrame) -> str:
    from tabulate import tabulate

    shown = table[[c for c in COLUMNS if c in table.columns]].copy()
    for share in ("evict_share", "capture_share"):
        if share in shown:
            shown[share] = 100 * shown[share]
    shown = shown.astype(object).where(shown.notna(), None)  # "-" for what a cell did not measure
    return tabulate(shown.rename(columns=COLUMNS), headers="keys", tablefmt="github", showindex=False,
                    floatfmt=".2f", missingval="-")


def throughput_plot(setting: Setting, table: pd.DataFrame, out: Path) -> list[Path]:
    """Output tok/s against the budget per policy on the fixed pool, full cache (fixed pool) dashed
    and the unlimited-pool ceiling dotted."""
    import matplotlib.pyplot as plt

    from harness.analysis.plots import _against_budget, _save

    fixed = table[(table["pool"] == "fixed") & (table["policy.name"] != "stock")]
    fig, ax = plt.subplots(figsize=(6, 4))
    _against_budget(ax, fixed, "output_tok_s", "output tokens / s")
    if setting.ceiling and setting.ceiling.name in set(table["cell"]):
        value = table.loc[table["cell"] == setting.ceiling.name, "output_tok_s"].iloc[0]
        ax.axhline(value, linestyle=":", color="grey", label="full cache, unlimited pool")
    ax.legend(fontsize=8)
    workload = setting.workload
    ax.set_title(f"{setting.name}: {workload.requests} x {workload.prompt_tokens} in x {workload.output_tokens} out, "
                 f"{Path(workload.model).name}\nfixed pool {setting.fixed_pool_text()}", fontsize=9)
    return _save(fig, out, "throughput")


def trials_text(table: pd.DataFrame) -> str:
    """How many trials (an engine process per cell) each configuration of the table ran in, and how
    many times each process generated the batch, read off the cells themselves (never the
    setting's description, which can say otherwise)."""
    configurations = table["cell"].str.replace(r" #\d+$", "", regex=True)
    trials = table.groupby(configurations, sort=False)["trial"].nunique()

    def ran(n: int) -> str:
        return "once" if n == 1 else f"in {n} trials"

    counts = sorted(set(trials), reverse=True)
    if len(counts) == 1:
        every = "the configuration" if len(trials) == 1 else f"each of the {len(trials)} configurations"
        text = f"Trials: {every} ran {ran(counts[0])}"
    else:
        text = "Trials: " + "; ".join(", ".join(trials.index[trials == n]) + f" ran {ran(n)}" for n in counts)
    text += f" ({len(table)} cells, an engine process each"
    if counts[0] > 1:
        text += f"; trial k ran its configurations once each, {order_text(table)}, after trial k - 1"
    repeats = sorted(set(table["repeats"])) if "repeats" in table else [1]
    if repeats != [1]:
        times = " or ".join("once" if r == 1 else "twice" if r == 2 else f"{r} times" for r in repeats)
        text += f"; each process generated the batch {times}, medians reported"
    return text + ")."


def order_text(table: pd.DataFrame) -> str:
    """In which order each trial ran its configurations, read off the cells' positions."""
    if "position" not in table or table["position"].isna().any():
        return "in the table's order"  # cells from before positions were recorded: the one order there was
    reversed_trials = []
    for trial, cells in table.groupby("trial"):
        ran = list(cells.sort_values("position")["cell"])
        if ran != list(cells["cell"]):
            if ran != list(cells["cell"])[::-1]:
                return "in the order of the column `position`"
            reversed_trials.append(int(trial))
    if not reversed_trials:
        return "in the table's order"
    return f"in the table's order (reversed in trial{'s' if len(reversed_trials) > 1 else ''} " + ", ".join(
        map(str, reversed_trials)) + ")"


def drift_lines(setting: Setting, table: pd.DataFrame) -> list[str]:
    """The time trend of the run and each configuration's ratio to the baseline with the trend
    taken out (``harness.analysis.stats.trend_ratios``: log output tok/s fitted as configuration
    plus a straight line in run position), beside the trial-by-trial ratios above, each with the
    verdict of the fit's own 95% interval (``ratio_word``). Only for settings whose every
    configuration ran in several trials."""
    from harness.analysis.stats import trend_ratios

    if setting.baseline is None or "position" not in table or table["position"].isna().any():
        return []
    configuration = table["cell"].str.replace(r" #\d+$", "", regex=True)
    if configuration.value_counts().min() < 2 or setting.baseline.name not in set(configuration):
        return []
    fit = trend_ratios(table["output_tok_s"].astype(float).tolist(), configuration.tolist(),
                       table["position"].astype(float).tolist(), setting.baseline.name)
    if fit is None:
        return []
    slope = fit["drift"]
    lines = [f"Drift: output tok/s changed by {100 * (slope.estimate - 1):+.2f}% per cell run (95% interval "
             f"{100 * (slope.low - 1):+.2f}% to {100 * (slope.high - 1):+.2f}%; log output tok/s fitted as configuration "
             f"plus a straight line in run order over {len(table)} cells, {fit['df']} residual degrees of freedom"
             + ("" if table.get("position_recorded", pd.Series([True])).all() else
                "; cells that recorded no position are taken to have run in the setting's order, as the code then "
                "ran them: a cell rerun later breaks that") + ")"]
    for name, ratio in fit["ratios"].items():
        lines.append(f"{name} vs {setting.baseline.name}, the trend taken out: {ratio.estimate:.3f}x output tok/s "
                     f"(95% interval {ratio.low:.3f}-{ratio.high:.3f}): {ratio_word(ratio)}")
    return lines


def write_report(setting: Setting, table: pd.DataFrame, out: Path, command: str) -> str:
    lines = [f"# Throughput: {setting.name}", "", setting.purpose, "", f"Command: `{command}`", ""]
    workload = setting.workload
    shared = f" (after a {workload.shared_prefix_tokens}-token prefix they all share)" if workload.shared_prefix_tokens else ""
    lines.append(f"Workload: {workload.requests} requests x {workload.prompt_tokens} prompt tokens{shared} x "
                 f"{workload.output_tokens} output tokens, {workload.model}, {workload.dtype}, block "
                 f"{workload.block_size}, {workload.device}.")
    if setting.fixed_pool_text():
        lines.append(f"Fixed pool: {setting.fixed_pool_text()}; unlimited pool: "
                     f"{setting.pool_blocks(Cell(pool='unlimited'))} blocks (every request at full length).")
        split = setting.pool_split_text()  # a hybrid model's blocks per request, group by group
        if split:
            lines.append(split)
    output = output_layer_line(setting)
    if output:
        lines.append(output)
    lines.append(trials_text(table))
    lines += ["", *design_lines("better: more output tok/s, less time per output token")]
    ratios = f"Ratios of output tok/s: x baseline = against {setting.baseline.name}" if setting.baseline else ""
    if setting.ceiling:
        ratios += f"; x ceiling = against {setting.ceiling.name}"
    lines += ["", ratios + ".", "", markdown_table(table), "", *[f"- {line}" for line in headline(setting, table)], ""]
    lines += [f"- {note}" for note in setting.notes]
    report = "\n".join(lines) + "\n"
    atomic_write_text(out / "summary.md", report)
    atomic_write_text(out / "summary.csv", table.to_csv(index=False))
    if len(table[table["pool"] == "fixed"]) > 1:
        throughput_plot(setting, table, out)
    return report
