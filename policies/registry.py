"""The one list of policies; everything else (Hydra configs, option checks, test matrices, sweeps,
plot styles) is derived from it.

A policy is either a score with a default granularity (``register_score``: any score runs at
``granularity=token`` or ``block``, ``policies.selection``) or a rule that needs no score
(``register_policy``: full cache, StreamingLLM). An alias names a score at a fixed granularity
(``paged_token`` is ``paged`` with ``granularity=token``); old configs keep working through it.

Each module of this package registers itself when ``policies`` is imported, so adding a score is
one file (``policies/value_norm.py`` is the example).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from policies.base import Policy
from policies.score import Score, function_score
from policies.selection import ScoredBlockPolicy, ScoredTokenPolicy

SELECTIONS = {"token": ScoredTokenPolicy, "block": ScoredBlockPolicy}
# What a policy class's fields hold that are not its options: ``Policy``'s own fields (its budget and
# block size, and the run settings it carries, which the settings record sets: decode_eviction,
# whole_blocks; ``harness.eviction.settings.EvictionSettings.policy_fields``) and a selection's score.
# A field added to ``Policy`` is never an option: an option would enter every policy's default config
# and rename every committed cell.
NOT_OPTIONS = frozenset({f.name for f in dataclasses.fields(Policy)} | {"score"})


class UnknownPolicyError(ValueError):
    pass


@dataclass(frozen=True)
class Entry:
    """One registered name: a score at a granularity, or a rule of its own (``rule``)."""

    name: str
    summary: str
    score: type[Score] | None = None
    granularity: str = "none"
    fixed_granularity: bool = False   # an alias: its granularity is its name's
    rule: type[Policy] | None = None
    alias_of: str | None = None
    options: dict = field(default_factory=dict)  # the defaults a config starts from

    @property
    def evicts(self) -> bool:
        return self.granularity != "none"

    @property
    def reads_attention(self) -> bool:
        return self.score is not None and self.score().query_window > 0

    @property
    def reconstructs(self) -> bool:
        """Scored by reconstruction passes the engine runs before the prefill eviction (KVzip)."""
        return self.score is not None and self.score.reconstructs


REGISTRY: dict[str, Entry] = {}


def _field_defaults(cls, skip=NOT_OPTIONS) -> dict:
    return {f.name: f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
            for f in dataclasses.fields(cls) if f.name not in skip}


def _summary(obj) -> str:
    return (obj.__doc__ or "").strip().splitlines()[0] if obj.__doc__ else ""


def selection_options(score: type[Score], granularity: str) -> dict:
    """The selection options a policy with this score exposes at this granularity: those the
    score's rule does not fix (``share`` fixes ``per_head``, ``token_edges`` fixes ``protect_edges``)."""
    options = _field_defaults(SELECTIONS[granularity])
    if score.share is not None:
        options.pop("per_head")
    if score.token_edges is not Score.token_edges:
        options.pop("protect_edges", None)
    return options


def register_score(name: str, *, granularity: str, static: bool = False, aliases: dict[str, str] | None = None):
    """Register a score (a ``Score`` subclass, or an attention-free ``function(keys, values)``
    returning ``[heads, tokens]``) under ``name`` at its default ``granularity``; ``aliases`` names
    it at other granularities (``{"paged_token": "token"}``)."""

    def register(obj):
        score = obj if isinstance(obj, type) else function_score(name, obj, static)
        score_options = _field_defaults(score)
        _add(Entry(name, _summary(obj), score, granularity, options={
            "granularity": granularity, **score_options, **selection_options(score, granularity)}))
        for alias, alias_granularity in (aliases or {}).items():
            _add(Entry(alias, f"{name} at {alias_granularity} granularity", score, alias_granularity, True,
                       alias_of=name, options={**score_options, **selection_options(score, alias_granularity)}))
        return obj

    return register


def register_policy(name: str):
    """Register a policy class that decides without a score (its dataclass fields are its options)."""

    def register(cls: type[Policy]):
        cls.name = name
        _add(Entry(name, _summary(cls), granularity=cls.granularity, rule=cls, options=_field_defaults(cls)))
        return cls

    return register


def _add(entry: Entry) -> None:
    if entry.name in REGISTRY:
        raise ValueError(f"policy {entry.name!r} is registered twice")
    REGISTRY[entry.name] = entry


def default_options(name: str) -> dict:
    """The options a config of this policy starts from (what ``conf/policy/<name>`` would hold)."""
    return dict(REGISTRY[name].options)


def make_policy(name: str, budget: int, block_size: int, **options: Any) -> Policy:
    """Build a policy by its registered name; unknown names and options fail with the valid ones."""
    if name not in REGISTRY:
        raise UnknownPolicyError(f"unknown policy {name!r}; valid: {', '.join(REGISTRY)}")
    entry = REGISTRY[name]
    if entry.rule is not None:
        unknown = set(options) - set(entry.options)
        if unknown:
            raise UnknownPolicyError(
                f"policy {name!r} has no option {', '.join(sorted(unknown))}; valid: {', '.join(sorted(entry.options)) or 'none'}")
        policy = entry.rule(budget=budget, block_size=block_size, **options)
        policy.name = name
        return policy
    options = dict(options)
    granularity = options.pop("granularity", entry.granularity)
    if entry.fixed_granularity and granularity != entry.granularity:
        raise UnknownPolicyError(f"policy {name!r} is {entry.alias_of} at {entry.granularity} granularity; "
                                 f"for {granularity} use {entry.alias_of} with granularity={granularity}")
    if granularity not in SELECTIONS:
        raise UnknownPolicyError(f"granularity must be one of {', '.join(SELECTIONS)}, got {granularity!r}")
    score_fields = _field_defaults(entry.score)
    if granularity != entry.granularity:
        # A config that switched granularity still holds the default granularity's selection
        # defaults (``policy=paged policy.options.granularity=token``): those are not choices.
        base = selection_options(entry.score, entry.granularity)
        options = {key: value for key, value in options.items()
                   if key in score_fields or key not in base or value != base[key]}
    mine = selection_options(entry.score, granularity)
    valid = sorted({*score_fields, *mine} | (set() if entry.fixed_granularity else {"granularity"}))
    unknown = set(options) - set(valid)
    if unknown:
        raise UnknownPolicyError(f"policy {name!r} at granularity={granularity} has no option "
                                 f"{', '.join(sorted(unknown))}; valid: {', '.join(valid)}")
    score = entry.score(**{k: v for k, v in options.items() if k in score_fields})
    policy = SELECTIONS[granularity](budget=budget, block_size=block_size, score=score,
                                     **{k: v for k, v in options.items() if k in mine})
    policy.name = name
    return policy

