"""What evictions did, counted once: the record the scheduler keeps per request, and the sums over
an engine's requests (its ledger, ``harness.engine.scheduler.Ledger``) and over one cell's requests
when cells share an engine (``harness.run.group.cell_kv``)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Iterable

from harness.eviction.evictor import Eviction

PHASES = ("prefill", "decode")


def by_phase() -> dict[str, int]:
    return {phase: 0 for phase in PHASES}


@dataclass(kw_only=True)
class EvictionCounters:
    evictions: dict[str, int] = field(default_factory=by_phase)  # evictions that freed tokens, per phase
    freed_blocks: int = 0            # blocks returned to vLLM's pool (net of copy targets)
    evicted_tokens: int = 0
    copied_tokens: dict[str, int] = field(default_factory=by_phase)  # token slots compaction rewrote
    copy_target_blocks: int = 0      # blocks allocated so that compaction did not write cached ones
    evict_s: float = 0.0             # wall time of the evictions themselves
    preempted_after_eviction: int = 0  # preemptions that dropped a request's eviction state

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

    def counts(self) -> dict:
        """The counters alone, as plain data."""
        return {f.name: getattr(self, f.name) for f in fields(EvictionCounters)} | {
            "evictions": dict(self.evictions), "copied_tokens": dict(self.copied_tokens)}

    @classmethod
    def of(cls, record: dict) -> "EvictionCounters":
        """The counters of a record read back as plain data (other keys ignored)."""
        names = {f.name for f in fields(EvictionCounters)}
        return EvictionCounters(**{k: (dict(v) if isinstance(v, dict) else v) for k, v in record.items() if k in names})

    @classmethod
    def total(cls, records: Iterable["EvictionCounters"]) -> "EvictionCounters":
        total = EvictionCounters()
        for record in records:
            for name in ("freed_blocks", "evicted_tokens", "copy_target_blocks", "evict_s", "preempted_after_eviction"):
                setattr(total, name, getattr(total, name) + getattr(record, name))
            for phase in PHASES:
                total.evictions[phase] += record.evictions[phase]
                total.copied_tokens[phase] += record.copied_tokens[phase]
        return total


@dataclass(kw_only=True)
class RequestCounters(EvictionCounters):
    """One request's record, under the settings it evicted with (kept after it finishes until the
    harness reads it)."""

    policy: str
    budget: int

    def as_dict(self) -> dict:
        return asdict(self)
