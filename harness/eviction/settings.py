"""Eviction settings as vLLM carries them, engine-wide and per request.

Engine-wide (the default of every request): ``additional_config={"kv_eviction": {...}}``, from
Python (``LLM(additional_config=...)``) or the command line (``vllm serve MODEL --additional-config
'{"kv_eviction": {"policy": "paged", "budget": 512}}'``); every vLLM process reads it from its own
``vllm_config``.

Per request: the same dict under ``SamplingParams.extra_args["kv_eviction"]`` (offline), or as a
JSON string under ``vllm_xargs`` in an OpenAI request (vLLM copies ``vllm_xargs`` into
``extra_args``; its values may only be strings and numbers: ``entrypoints/openai/completion/
protocol.py:250,379``). ``{"policy": "full"}`` turns eviction off for that request.

A budget is a token count (``budget``) or a compression ratio (``budget_ratio`` r, as kvpress and
its leaderboard give it): each request then keeps (1 - r) x its prompt length, rounded to whole
blocks (at least two), resolved when the request arrives (``for_prompt``). ``decode_eviction:
false`` compresses the prompt only (prefill eviction), as kvpress's presses do; the cache then
grows while the answer is generated.

Where the prefill eviction runs (``compress``): ``prompt`` (the default) evicts once the whole
prompt, question included, is computed (query-aware: an attention-aware policy's window sits on the
question; kvpress's ``--compress_questions``); ``context`` evicts when the prefill reaches the end
of the request's context, its first ``context_tokens`` token ids, before any question token is
computed, and the question is prefilled on top of the compressed cache (query-agnostic: kvpress's
``pipeline(context, question=...)``, its leaderboard's main loop). A ratio then applies to the
context's tokens. The boundary is the request's own (the data families mark it,
``harness.tasks.prompts``); an engine-wide ``compress: context`` needs every request to bring one.
Context compression evicts once: it needs ``decode_eviction: false`` (a decode eviction after it
would also drop question tokens, which is query-aware again). It keeps exactly the budget, whole
blocks, at every granularity (``Policy.whole_blocks``): a block policy (PagedEviction) keeps its
prompt's ``L mod B`` tokens beside the budget only where it compresses the whole prompt.

Multi-turn conversations (``chain``, ``compress=context`` only, off by default): a request that
compressed its context leaves, when it finishes, its whole kept cache (kept context, question and
answer) to the next turn, whose prompt starts with its prompt and answer: that turn prefills only its
new tokens up to its own context boundary, on top of it, and compresses the already-compressed history
and those tokens at the boundary (``harness.engine.shared_contexts``). Its budget is the one the turn
would have recompressing: a ratio applies to the turn's whole logical history (its context boundary),
so chain and recompression hold the same number of tokens at every turn and differ only in which:
what one turn dropped, no later turn can keep.

How the budget is spread over the layers (``budget_schedule``, on an engine whose layers run as G
KV cache groups, ``engine.layer_groups``): ``uniform`` (every group the request's budget),
``pyramid`` (PyramidKV's linear schedule, more in the lower layers; ``pyramid_beta`` its slope, 20 as
kvpress's ``PyramidKVPress``), ``attention`` (CAKE's layer preferences, measured per request from its
prompt's last 32 queries when the prefill reaches the eviction point: ``harness.eviction.layer_budgets``),
``kvzip`` (KVzip's own allocation, for ``policy=kvzip`` at ``compress=context`` only: one threshold
over every layer's and head's reconstruction scores, each group its layers' entries above it,
measured from the scores the passes leave in the same step). The budget stays the total: the groups'
budgets, in whole blocks, sum to G x the budget (``policies.budget_schedules.group_budgets``). An
``attention`` or ``kvzip`` request's budgets are its own (``group_budgets``, fixed once measured);
until then its groups run the uniform budgets, which no eviction reads (the first one follows the
measurement).

The record's fields are declared once (``EvictionSettings``, each with ``setting(...)``): its check
(``harness.eviction.checks``), whether a user gives it (the wire form: ``WIRE_FIELDS``,
``as_dict``), whether a run's Hydra config gives it and names its cell by it (``RUN_FIELDS``,
``identity``), whether it decides what the policy keeps (``key``), the ``Policy`` field it sets
(``policy_fields``), and how it shows in a cell's name, a label and a table's variant (``Names``).
Every form derives from that declaration, and every path reads settings through the one parse of it
(``read_settings``: ``parse_settings`` for requests and engines, ``from_run_config`` for runs).
What the settings need of an engine is ``harness.eviction.admission``'s (``admit``).
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Callable
import json
import math

from policies import REGISTRY, BudgetError, UnknownPolicyError
from policies.budget_schedules import group_budgets

from harness.eviction import checks
# The admission and the field checks, asked here by many importers (the engine, the config, tests).
from harness.eviction.admission import (PROBE_BLOCKS, admit, build_policy, check_chain_policy,  # noqa: F401
                                        check_grouped, check_layer_groups, check_policy_runs, check_reconstructing_policy,
                                        check_reconstruction, check_schedule_runs, group_policies, least_blocks,
                                        needs_sync, scheduling_is_async, try_score)
from harness.eviction.checks import (COMPRESS, ENGINE_SCHEDULES, MEASURED_SCHEDULES, PYRAMID_BETA,  # noqa: F401
                                     check_ratio, unshareable)

CONFIG_KEY = "kv_eviction"


@dataclass(frozen=True)
class Reconstruction:
    """A request's reconstruction inputs, for a policy that reconstructs its context (KVzip,
    ``policies.kvzip``): token ids its tokenizer made, which the engine's core and workers cannot
    make (they hold no tokenizer). ``prefix_tokens``: the context's leading tokens that are never
    reconstructed (its chat header, kvpress's ``prefix_length``); ``first``: the repeat prompt of
    the first chunk; ``later``: that of every later chunk (the previous chunk's last ids follow it);
    ``suffix``: the chat footer that ends the user turn and opens the assistant's. The request's own,
    like ``context_tokens``: not part of the policy's key."""

    prefix_tokens: int
    first: tuple[int, ...]
    later: tuple[int, ...]
    suffix: tuple[int, ...]

    def as_dict(self) -> dict:
        return {"prefix_tokens": self.prefix_tokens, "first": list(self.first), "later": list(self.later),
                "suffix": list(self.suffix)}

    @classmethod
    def parse(cls, raw, where: str | None) -> "Reconstruction | None":
        if raw is None or isinstance(raw, cls):
            return raw
        at = f"{where}: " if where else ""
        if not isinstance(raw, dict) or set(raw) != {"prefix_tokens", "first", "later", "suffix"}:
            raise ValueError(f"{at}reconstruction must be a mapping of prefix_tokens, first, later and suffix "
                             f"(token ids), got {raw!r}")
        prefix = raw["prefix_tokens"]
        if isinstance(prefix, bool) or not isinstance(prefix, int) or prefix < 0:
            raise ValueError(f"{at}reconstruction.prefix_tokens must be a number of tokens >= 0, got {prefix!r}")
        ids = {}
        for name in ("first", "later", "suffix"):
            value = raw[name]
            if not isinstance(value, (list, tuple)) or not all(
                    isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value):
                raise ValueError(f"{at}reconstruction.{name} must be a list of token ids, got {value!r}")
            ids[name] = tuple(value)
        if not ids["first"] or not ids["later"]:
            raise ValueError(f"{at}reconstruction.first and .later are the repeat prompts: they cannot be empty")
        return cls(prefix, ids["first"], ids["later"], ids["suffix"])


def check_reconstruction_ids(raw, given: dict) -> Reconstruction | None:
    """The ``reconstruction`` field's check: its wire form (a mapping of ids) as its record."""
    return Reconstruction.parse(raw, None)


# --- the declaration: what each field of the record is, given once ----------------------------------

@dataclass(frozen=True)
class Names:
    """How a field shows where it is away from its default (a field without a default: always),
    each a function of the settings giving its text ('' for none): in a cell's directory name
    (``slug``, in field order), a label (``label``: the budget, then how it spreads over the layer
    groups, then what is compressed; by ``aspect``: "size", "spread" or "scope") and a table's
    variant (``mark``, in field order, the engine's layer groups before the first "spread" field)."""

    slug: Callable | None = None
    label: Callable | None = None
    mark: Callable | None = None
    aspect: str = "scope"


@dataclass(frozen=True)
class Declared:
    """One field's roles (``setting``)."""

    check: Callable | None    # (value, settings checked before it) -> the value held; ValueError says why not
    wire: bool | str          # given by users (the wire form); "always": in every wire form, at any value
    run: bool                 # a run's Hydra config gives it by its name; the cell is named by it off its default
    key: bool                 # it decides what the policy keeps (the policy's key)
    names: Names | None
    policy_field: str | None  # the Policy field it sets (``policies.base.Policy``: not a policy option) ...
    policy_value: Callable    # ... to this function of its value


def setting(default=MISSING, *, factory=MISSING, check=None, wire: bool | str = True, run: bool = False,
            key: bool = True, names: Names | None = None, policy_field: str | None = None,
            policy_value: Callable = lambda value: value):
    """A field of ``EvictionSettings`` with its roles (``Declared``)."""
    return field(default=default, default_factory=factory, metadata={
        "setting": Declared(check, wire, run, key, names, policy_field, policy_value)})


@dataclass(frozen=True)
class EvictionSettings:
    """A request's eviction settings: the one record of them. It owns their forms: the dict that
    ``extra_args`` / ``additional_config`` carry (``as_dict``, read back by ``parse_settings``), the
    Hydra config a run gives (``from_run_config``), a label (``label``, ``describe``), a cell's name
    (``slug``, ``identity``) and a table's variant (``variant_marks``), each derived from the fields'
    declarations below. A new setting is a field here (its check in ``harness.eviction.checks``,
    its roles in ``setting``) and the code that acts on it (docs/extending.md, "Adding a setting").

    ``policy`` "full" is a run that keeps its whole cache (its budget is then only checked); a
    request's settings are None for it (``parse_settings``)."""

    policy: str = setting(check=checks.check_policy, wire="always", names=Names(slug=lambda s: s.policy))
    # tokens kept per request; None with a budget_ratio until resolved
    budget: int | None = setting(check=checks.check_budget, wire="always", names=Names(
        slug=lambda s: "" if s.budget_ratio is not None else f"_b{s.budget}",
        label=lambda s: "" if s.budget_ratio is not None else f"budget={s.budget}", aspect="size"))
    options: dict = setting(factory=dict, check=checks.check_options, wire="always")
    # share of the prompt removed (kvpress's compression ratio)
    budget_ratio: float | None = setting(None, check=checks.check_budget_ratio, run=True, names=Names(
        slug=lambda s: f"_r{s.budget_ratio:g}", label=lambda s: f"budget_ratio={s.budget_ratio:g}", aspect="size"))
    # False: compress the prompt only
    decode_eviction: bool = setting(True, check=checks.check_decode_eviction, run=True, policy_field="decode_eviction",
                                    names=Names(slug=lambda s: "_context" if s.compress == "context" else "_prompt",
                                                label=lambda s: "context only" if s.compress == "context" else "prompt only",
                                                mark=lambda s: "" if s.compress == "context" else "decode_eviction=False"))
    # "context": evict at the request's context boundary. The context compressed alone keeps whole
    # blocks (a block rule's L mod B more would end it in a partial block, which every request sharing
    # it copies; no decode eviction follows it to need them).
    compress: str = setting("prompt", check=checks.check_compress, run=True, policy_field="whole_blocks",
                            policy_value=lambda compress: compress == "context",
                            names=Names(mark=lambda s: "compress=context"))  # before the question (and only then)
    # the request's context, in token ids (compress="context"); the request's own, never a run's
    context_tokens: int | None = setting(None, check=checks.check_context_tokens, key=False)
    # how the budget is spread over the engine's layer groups
    budget_schedule: str = setting("uniform", check=checks.check_budget_schedule, run=True, names=Names(
        slug=lambda s: f"_{s.budget_schedule}", label=lambda s: s.budget_schedule,
        mark=lambda s: f"budget_schedule={s.budget_schedule}", aspect="spread"))
    # the pyramid's slope (1 is flat)
    pyramid_beta: float = setting(PYRAMID_BETA, check=checks.check_pyramid_beta, run=True, names=Names(
        slug=lambda s: f"_beta{s.pyramid_beta:g}", label=lambda s: f"beta={s.pyramid_beta:g}",
        mark=lambda s: f"pyramid_beta={s.pyramid_beta:g}", aspect="spread"))
    # compress=context: hand the compressed context to later requests asking about it (None: where
    # sharing is exact; True: that, or refuse the request; False: never; ``harness.engine.shared_contexts``)
    share_context: bool | None = setting(None, check=checks.check_share_context, run=True, key=False)
    # compress=context: carry a finished turn's compressed cache into the next turn of its conversation
    # instead of compressing the pristine history again (``harness.engine.shared_contexts``, chain entries)
    chain: bool = setting(False, check=checks.check_chain, run=True, names=Names(
        slug=lambda s: "_chain", label=lambda s: "chained",
        mark=lambda s: "chain=true"))  # each turn compresses the previous turn's compressed cache
    # the request's first N tokens never evicted, by any policy, in prefill or decode (a system prompt
    # it must keep); they count inside the budget (``policies.base.Policy.protect_prefix``)
    protect_prefix: int = setting(0, check=checks.check_protect_prefix, run=True, policy_field="protect_prefix",
                                  names=Names(slug=lambda s: f"_prefix{s.protect_prefix}",
                                              label=lambda s: f"protect_prefix={s.protect_prefix}",
                                              mark=lambda s: f"protect_prefix={s.protect_prefix}"))
    # budget_schedule=attention or kvzip: this request's group budgets, once measured from its prompt
    # (the engine's, never a user's: not in the wire form)
    group_budgets: tuple[int, ...] | None = setting(None, wire=False)
    # A reconstructing policy's (KVzip's) inputs for this request (``Reconstruction``); the request's own
    reconstruction: Reconstruction | None = setting(None, check=check_reconstruction_ids, key=False)

    def __post_init__(self) -> None:
        # A reconstruction given as its wire form (a mapping) becomes its record.
        if isinstance(self.reconstruction, dict):
            object.__setattr__(self, "reconstruction", Reconstruction.parse(self.reconstruction, "settings"))

    def away(self, name: str) -> bool:
        """Whether field ``name`` is away from its default (a field without one always is)."""
        return name not in DEFAULTS or getattr(self, name) != DEFAULTS[name]

    def as_dict(self) -> dict:
        """The wire form: policy, budget and options, and every other setting away from its default."""
        return {name: wire_value(getattr(self, name)) for name in WIRE_FIELDS
                if DECLARED[name].wire == "always" or self.away(name)}

    @classmethod
    def from_run_config(cls, resolved: dict, where: str = "the run") -> "EvictionSettings":
        """The settings a run's Hydra config gives (``conf/config.yaml`` and the command line; a
        committed cell's ``config.yaml``, which may predate a setting: then its default), read by the
        one parse (``read_settings``); ``ValueError`` says what is wrong. A run's budget against its
        block size and model is the config's check (``harness.config.check``)."""
        policy = resolved.get("policy") or {}
        raw = {"policy": policy.get("name", "full"), "budget": resolved.get("budget"), "options": policy.get("options"),
               **{name: resolved[name] for name in RUN_FIELDS if name in resolved}}
        return read_settings(raw, where, run=True)

    # --- names: every rule that turns settings into text, from the fields' ``Names`` ---------------

    def _texts(self, form: str, aspect: str | None = None) -> list[str]:
        """The ``form`` texts ("slug", "label" or "mark") of the named fields away from their
        defaults, in field order (those of ``aspect`` only, where given); none empty."""
        texts = []
        for name in NAMED_FIELDS:
            names = DECLARED[name].names
            write = getattr(names, form)
            if write is not None and aspect in (None, names.aspect) and self.away(name) and write(self):
                texts.append(write(self))
        return texts

    def size_text(self) -> str:
        return "".join(self._texts("label", "size"))

    def scope_text(self) -> str:
        """What is compressed, where it is not the whole cache at every step."""
        return "".join(" " + text for text in self._texts("label", "scope"))

    def label(self) -> str:
        """``budget=512``, ``budget_ratio=0.5 pyramid context only``: the budget and how it applies."""
        return " ".join([self.size_text(), *self._texts("label", "spread")]) + self.scope_text()

    def describe(self) -> str:
        """``policy=paged budget=256``, ``policy=snapkv budget_ratio=0.5 context only``."""
        return f"policy={self.policy} {self.label()}"

    def slug(self) -> str:
        """The start of a cell's directory name: ``paged_b512``, ``snapkv_r0.5_context_pyramid``."""
        return "".join(self._texts("slug"))

    def identity(self) -> dict:
        """What names a cell beyond policy and budget: each setting away from its default (settings
        added after cells were committed are named only there, so earlier cells keep their names)."""
        return {name: getattr(self, name) for name in RUN_FIELDS if self.away(name)}

    def variant_marks(self, layer_groups: int = 1) -> list[str]:
        """What a table's variant label adds for these settings (with the engine's layer groups,
        which a schedule spreads the budget over): ``compress=context``, ``layer_groups=3``, ..."""
        marks, groups = [], [f"layer_groups={layer_groups}"] if layer_groups != 1 else []
        for name in NAMED_FIELDS:
            names = DECLARED[name].names
            if names.aspect == "spread":  # the layers as G KV cache groups, each its own budget: then how
                marks, groups = marks + groups, []  # the budget spreads over them
            if names.mark is not None and self.away(name) and names.mark(self):
                marks.append(names.mark(self))
        return marks + groups

    def as_additional_config(self) -> dict:
        return {CONFIG_KEY: self.as_dict()}

    def as_extra_args(self) -> dict:
        """``SamplingParams.extra_args`` that give one request these settings."""
        return {CONFIG_KEY: self.as_dict()}

    @property
    def key(self) -> tuple:
        """Hashable identity of the policy these settings build (one per distinct key): the fields
        declared ``key`` (a request's boundary is not one: the policy does not depend on it)."""
        return tuple(json.dumps(value, sort_keys=True) if isinstance(value, dict) else value  # options may nest
                     for value in (getattr(self, name) for name in KEY_FIELDS))

    def policy_fields(self) -> dict:
        """The ``Policy`` fields these settings set on the policy they build (``build_policy``)."""
        return {declared.policy_field: declared.policy_value(getattr(self, name))
                for name, declared in DECLARED.items() if declared.policy_field}

    @property
    def chain_key(self) -> tuple:
        """What a chain entry is kept under beside its logical tokens: the settings' key with a
        ratio's budget left unresolved (each turn resolves it against its own, longer, history)."""
        return replace(self, budget=None).key if self.budget_ratio is not None else self.key

    @property
    def measuring(self) -> bool:
        """A measured schedule (``attention``, ``kvzip``) whose group budgets are not measured yet."""
        return self.budget_schedule in MEASURED_SCHEDULES and self.group_budgets is None

    def with_preferences(self, preferences, block_size: int, num_layers: int, groups: int) -> "EvictionSettings":
        """These settings with the attention schedule's group budgets, from each layer's measured
        preference (``policies.budget_schedules.preference``)."""
        budgets = group_budgets("attention", self.budget, num_layers, groups, block_size, preferences=list(preferences),
                                min_blocks=least_blocks(self, block_size))
        return replace(self, group_budgets=budgets)

    def with_kept_counts(self, counts, block_size: int, num_layers: int, groups: int, context: int
                         ) -> "EvictionSettings":
        """These settings with the kvzip schedule's group budgets, from each layer's count of
        entries above KVzip's global threshold (``policies.budget_schedules.kvzip_layer_counts``),
        none past the ``context`` it compresses (a block more than the context would hold nothing:
        its surplus goes to the other groups)."""
        budgets = group_budgets("kvzip", self.budget, num_layers, groups, block_size, counts=list(counts),
                                min_blocks=least_blocks(self, block_size), cap_tokens=context)
        return replace(self, group_budgets=budgets)

    def at_context(self, context_tokens: int | None) -> "EvictionSettings":
        """One request's settings: its context boundary, where ``compress`` is ``context``."""
        return replace(self, context_tokens=context_tokens) if self.compress == "context" else self

    @property
    def reconstructs(self) -> bool:
        """Whether the policy scores by reconstructing the request's context (KVzip): its requests
        need their ``reconstruction`` ids."""
        entry = REGISTRY.get(self.policy)
        return entry is not None and entry.reconstructs

    def for_request(self, context_tokens: int | None, reconstruction: dict | Reconstruction | None
                    ) -> "EvictionSettings":
        """One request's settings from what its prompt builder found (``harness.tasks.prompts.Prompt``):
        its context boundary (``at_context``) and, for a policy that reconstructs the context, its
        reconstruction ids (other policies refuse them, so they are not given)."""
        settings = self.at_context(context_tokens)
        if self.reconstructs and reconstruction is not None:
            settings = replace(settings, reconstruction=Reconstruction.parse(reconstruction, "the prompt builder"))
        return settings

    def eviction_point(self, prompt_tokens: int) -> int:
        """The logical length at which the prefill eviction runs: the prompt's end, or the end of
        the request's context."""
        return self.context_tokens if self.compress == "context" else prompt_tokens

    def for_prompt(self, prompt_tokens: int, block_size: int) -> "EvictionSettings":
        """These settings for a request of ``prompt_tokens``: its boundary checked against the
        prompt, and a ratio made its token budget (of the context, when that is what is compressed)."""
        if self.compress == "context":
            if self.context_tokens is None:
                raise ValueError("compress=context evicts at the request's context boundary: the request must give "
                                 "its context_tokens (how many leading prompt tokens are context)")
            if self.context_tokens > prompt_tokens:
                raise ValueError(f"context_tokens={self.context_tokens} is beyond the prompt's {prompt_tokens} tokens")
        check_reconstruction(self, build_policy(self, block_size), self.eviction_point(prompt_tokens))
        if self.budget_ratio is None:
            return self
        budget = budget_for_ratio(self.budget_ratio, self.eviction_point(prompt_tokens), block_size)
        # A short prompt's ratio budget can be below what the policy needs (SnapKV's window must
        # fit inside its budget): then the smallest budget the policy accepts.
        resolved = replace(self, budget=max(budget, build_policy(self, block_size).min_budget()))
        build_policy(resolved, block_size)
        return resolved


# What the declaration gives: each field's roles, the wire form's fields (what a user may give, in
# order), those a run's Hydra config gives beside policy, budget and options (a request's context
# boundary and reconstruction ids are its own, never a run's), the policy's key, the named fields,
# and each field's default.
DECLARED: dict[str, Declared] = {f.name: f.metadata["setting"] for f in fields(EvictionSettings)}
WIRE_FIELDS = tuple(name for name, declared in DECLARED.items() if declared.wire)
RUN_FIELDS = tuple(name for name, declared in DECLARED.items() if declared.run)
KEY_FIELDS = tuple(name for name, declared in DECLARED.items() if declared.key)
NAMED_FIELDS = tuple(name for name, declared in DECLARED.items() if declared.names is not None)
DEFAULTS = {f.name: f.default if f.default is not MISSING else f.default_factory()
            for f in fields(EvictionSettings) if f.default is not MISSING or f.default_factory is not MISSING}
# What the wire form reads where a field is not given (no policy: full cache; no budget: a ratio's).
WIRE_DEFAULTS = {"policy": "full", "budget": None, **DEFAULTS}


def wire_value(value):
    """A field's value in the wire form (a record, such as ``Reconstruction``, as its mapping)."""
    return value.as_dict() if hasattr(value, "as_dict") else dict(value) if isinstance(value, dict) else value


def budget_for_ratio(ratio: float, prompt_tokens: int, block_size: int) -> int:
    """(1 - ratio) x the prompt, rounded to the nearest whole block, at least two blocks (a
    budget's minimum: a first block and a recent one); ratio 0 keeps the whole prompt (rounded up,
    so nothing of it is evicted)."""
    if ratio == 0:
        return max(2, math.ceil(prompt_tokens / block_size)) * block_size
    blocks = math.floor((1 - ratio) * prompt_tokens / block_size + 0.5)
    return max(2, blocks) * block_size


# The settings of a request that keeps its whole cache, whatever the engine's default.
NO_EVICTION = {"policy": "full"}


def read_settings(raw, where: str, *, run: bool = False) -> EvictionSettings:
    """The one parse of eviction settings: ``{policy, budget, options, ...}`` (or its JSON text) as
    the record, each field (or its default) through its declared check, in field order, full cache
    included; ``ValueError`` in one line, naming ``where`` the settings came from. An evicting
    request needs a budget or a ratio; a run's budget (which full cache's too must give) is the
    run's own check (``harness.config.check``: ``run``)."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where} is not valid JSON ({error.msg}): {raw!r}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{where} must be a mapping with policy, budget and options; got {raw!r}")
    unknown = set(raw) - set(WIRE_FIELDS)
    if unknown:
        raise ValueError(f"{where} has unknown key(s) {sorted(unknown)}; valid: {', '.join(WIRE_FIELDS)}")
    given = {}
    for name in WIRE_FIELDS:
        value = raw.get(name, WIRE_DEFAULTS[name])
        check = DECLARED[name].check
        try:
            given[name] = check(value, given) if check is not None else value
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None
    if not run and given["policy"] != "full" and given["budget"] is None and given["budget_ratio"] is None:
        raise ValueError(f"{where} needs a 'budget' (KV tokens kept per request) or a 'budget_ratio' (share of "
                         "the prompt removed), exactly one of them")
    return EvictionSettings(**given)


def parse_settings(raw, where: str) -> EvictionSettings | None:
    """A request's or an engine's settings (``read_settings``); None for ``policy: full``."""
    settings = read_settings(raw, where)
    return None if settings.policy == "full" else settings


def settings_from(vllm_config) -> EvictionSettings | None:
    """The engine's default eviction settings, or None when eviction is off by default."""
    raw = (getattr(vllm_config, "additional_config", None) or {}).get(CONFIG_KEY)
    if not raw:
        return None
    return parse_settings(raw, CONFIG_KEY)


def request_settings(extra_args: dict | None, default: EvictionSettings | None, block_size: int
                     ) -> EvictionSettings | None:
    """One request's eviction settings: its own ``extra_args["kv_eviction"]`` or the engine default.

    Raises ``ValueError`` naming what is wrong and what is allowed (unknown policy or option,
    budget not a block multiple): the request is refused at admission."""
    if not extra_args or CONFIG_KEY not in extra_args:
        return default
    settings = parse_settings(extra_args[CONFIG_KEY], f"request {CONFIG_KEY}")
    if settings is not None:
        try:
            build_policy(settings, block_size)
        except (BudgetError, UnknownPolicyError, TypeError, ValueError) as error:
            raise ValueError(f"request {CONFIG_KEY}: {error}") from None
    return settings
