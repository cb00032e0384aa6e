"""What evictions did, counted once: ``EvictionCounters``, the one record of it.

The scheduler keeps one per request (``RequestCounters``, under the settings the request evicted
with) and their sum over the engine's requests (its ledger's ``totals``,
``harness.engine.scheduler.Ledger``); a cell sharing an engine with other cells sums its own
requests' (``harness.run.group.cell_kv``). With the layers as G KV cache groups
(``engine.layer_groups``) each group's eviction counts on its own: G evictions a step, tokens and
blocks of 1/G of the layers each. A record knows its fields, how two of them add up
(``+``, ``total``, ``over``) and how ``perf.json``'s ``kv`` record writes it (``counts``, in field
order) and reads it back (``of``); nothing else names the fields."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Iterable

from harness.eviction.evictor import Eviction

PHASES = ("prefill", "decode")


def by_phase() -> dict[str, int]:
    return {phase: 0 for phase in PHASES}


@dataclass(kw_only=True)
class EvictionCounters:
    # In the order perf.json's ``kv`` record writes them (``harness.engine.scheduler.Ledger.snapshot``).
    preempted_after_eviction: int = 0  # preemptions that dropped a request's eviction state
    evictions: dict[str, int] = field(default_factory=by_phase)  # evictions that freed tokens, per phase
    freed_blocks: int = 0            # blocks returned to vLLM's pool (net of copy targets)
    evicted_tokens: int = 0
    copied_tokens: dict[str, int] = field(default_factory=by_phase)  # token slots compaction rewrote
    copy_target_blocks: int = 0      # blocks allocated so that compaction did not write cached ones
    evict_s: float = 0.0             # wall time of the evictions themselves

    @staticmethod
    def names() -> tuple[str, ...]:
        """The counters' names, in the order ``counts`` writes them."""
        return tuple(f.name for f in fields(EvictionCounters))

    def record(self, eviction: Eviction, released_blocks: int, copy_target_blocks: int) -> None:
        """One eviction the scheduler applied: ``released_blocks`` went back to the pool, of which
        ``copy_target_blocks`` had been allocated for it this step."""
        self.copy_target_blocks += copy_target_blocks
        self.evict_s += eviction.seconds
        if not eviction.evicted_tokens:
            return
        self.evictions[eviction.phase] += 1
        self.freed_blocks += released_blocks - copy_target_blocks
        self.evicted_tokens += eviction.evicted_tokens
        self.copied_tokens[eviction.phase] += eviction.copied_tokens

    def __add__(self, other: "EvictionCounters") -> "EvictionCounters":
        """Counter by counter (a per-phase count phase by phase); a ``RequestCounters`` adds as its
        counters alone."""
        if not isinstance(other, EvictionCounters):
            return NotImplemented
        return EvictionCounters(**{name: _add(getattr(self, name), getattr(other, name)) for name in self.names()})

    def counts(self) -> dict:
        """The counters alone, as plain data: how ``perf.json``'s ``kv`` record writes them."""
        return {name: _plain(getattr(self, name)) for name in self.names()}

    @classmethod
    def of(cls, record: dict) -> "EvictionCounters":
        """The counters of a record read back as plain data (other keys ignored)."""
        names = EvictionCounters.names()
        return EvictionCounters(**{key: _plain(value) for key, value in record.items() if key in names})

    @classmethod
    def total(cls, records: Iterable["EvictionCounters"]) -> "EvictionCounters":
        return sum(records, EvictionCounters())

    @classmethod
    def over(cls, records: Iterable[dict | None]) -> "EvictionCounters":
        """The sum of requests' records as the scheduler hands them over (plain data; None, a
        request with no record, counts nothing)."""
        return cls.total(cls.of(record) for record in records if record is not None)


def _add(a, b):
    return {phase: a[phase] + b[phase] for phase in PHASES} if isinstance(a, dict) else a + b


def _plain(value):
    return dict(value) if isinstance(value, dict) else value


@dataclass(kw_only=True)
class RequestCounters(EvictionCounters):
    """One request's record, under the settings it evicted with (kept after it finishes until the
    harness reads it)."""

    policy: str
    budget: int
    group_budgets: list[int] | None = None  # budget_schedule=attention or kvzip: each layer group's, as measured
    failure: str | None = None              # its policy failed: the request ended with this error
    # compress=context with sharing (harness.engine.shared_contexts): "shared" (it took a context
    # another request compressed) or "compressed" (it compressed one and kept it for others)
    context: str | None = None
    context_wait_steps: int = 0             # steps it waited for another request compressing its context
    # chain=true: how often it took the previous turn's compressed cache (a replay after preemption takes
    # it again), and the logical tokens that cache stood for, which it did not compute
    chain_hits: int = 0
    chain_reused_tokens: int = 0
    chain_misses: int = 0  # scheduled without a chain entry: a first turn, or one whose entry was reclaimed

    def as_dict(self) -> dict:
        record = asdict(self)
        # only where they say something, so that other records keep their keys
        for name, unset in (("group_budgets", None), ("failure", None), ("context", None), ("context_wait_steps", 0),
                            ("chain_hits", 0), ("chain_reused_tokens", 0), ("chain_misses", 0)):
            if record[name] == unset:
                del record[name]
        return record
