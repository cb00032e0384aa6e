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
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields, replace
import json
import math

from policies import REGISTRY, BudgetError, Policy, UnknownPolicyError, make_policy
from policies.budget_schedules import group_budgets

CONFIG_KEY = "kv_eviction"
PYRAMID_BETA = 20.0  # kvpress 0.5.5's PyramidKVPress default


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
    def parse(cls, raw, where: str) -> "Reconstruction | None":
        if raw is None or isinstance(raw, cls):
            return raw
        if not isinstance(raw, dict) or set(raw) != {"prefix_tokens", "first", "later", "suffix"}:
            raise ValueError(f"{where}: reconstruction must be a mapping of prefix_tokens, first, later and suffix "
                             f"(token ids), got {raw!r}")
        prefix = raw["prefix_tokens"]
        if isinstance(prefix, bool) or not isinstance(prefix, int) or prefix < 0:
            raise ValueError(f"{where}: reconstruction.prefix_tokens must be a number of tokens >= 0, got {prefix!r}")
        ids = {}
        for name in ("first", "later", "suffix"):
            value = raw[name]
            if not isinstance(value, (list, tuple)) or not all(
                    isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value):
                raise ValueError(f"{where}: reconstruction.{name} must be a list of token ids, got {value!r}")
            ids[name] = tuple(value)
        if not ids["first"] or not ids["later"]:
            raise ValueError(f"{where}: reconstruction.first and .later are the repeat prompts: they cannot be empty")
        return cls(prefix, ids["first"], ids["later"], ids["suffix"])


@dataclass(frozen=True)
class EvictionSettings:
    """A request's eviction settings: the one record of them. It owns their forms: the dict that
    ``extra_args`` / ``additional_config`` carry (``as_dict``, read back by ``parse_settings``), the
    Hydra config a run gives (``from_run_config``), a label (``label``, ``describe``), a cell's name
    (``slug``, ``identity``) and a table's variant (``variant_marks``). A new setting is a field
    here, its check in ``parse_settings``, and the code that acts on it.

    ``policy`` "full" is a run that keeps its whole cache (its budget is then only checked); a
    request's settings are None for it (``parse_settings``)."""

    policy: str
    budget: int | None       # tokens kept per request; None with a budget_ratio until resolved
    options: dict = field(default_factory=dict)
    budget_ratio: float | None = None  # share of the prompt removed (kvpress's compression ratio)
    decode_eviction: bool = True       # False: compress the prompt only
    compress: str = "prompt"           # "context": evict at the request's context boundary
    context_tokens: int | None = None  # the request's context, in token ids (compress="context")
    budget_schedule: str = "uniform"   # how the budget is spread over the engine's layer groups
    pyramid_beta: float = PYRAMID_BETA  # the pyramid's slope (1 is flat)
    # compress=context: hand the compressed context to later requests asking about it (None: where
    # sharing is exact; True: that, or refuse the request; False: never; ``harness.engine.shared_contexts``)
    share_context: bool | None = None
    # compress=context: carry a finished turn's compressed cache into the next turn of its conversation
    # instead of compressing the pristine history again (``harness.engine.shared_contexts``, chain entries)
    chain: bool = False
    # budget_schedule=attention or kvzip: this request's group budgets, once measured from its prompt
    # (the engine's, never a user's: parse_settings does not take it)
    group_budgets: tuple[int, ...] | None = None
    # A reconstructing policy's (KVzip's) inputs for this request (``Reconstruction``); the request's own
    reconstruction: Reconstruction | None = None

    def __post_init__(self) -> None:
        # A reconstruction given as its wire form (a mapping) becomes its record.
        if isinstance(self.reconstruction, dict):
            object.__setattr__(self, "reconstruction", Reconstruction.parse(self.reconstruction, "settings"))

    def as_dict(self) -> dict:
        """The wire form: policy, budget and options, and every other setting away from its default."""
        raw = {"policy": self.policy, "budget": self.budget, "options": dict(self.options)}
        raw.update({name: getattr(self, name) for name in WIRE_FIELDS[3:] if getattr(self, name) != DEFAULTS[name]})
        if self.reconstruction is not None:
            raw["reconstruction"] = self.reconstruction.as_dict()
        return raw

    @classmethod
    def from_run_config(cls, resolved: dict) -> "EvictionSettings":
        """The settings a run's Hydra config gives (``conf/config.yaml`` and the command line; a
        committed cell's ``config.yaml``, which may predate a setting: then its default)."""
        policy = resolved.get("policy") or {}
        return cls(policy.get("name", "full"), resolved.get("budget"), dict(policy.get("options") or {}),
                   **{name: resolved.get(name, DEFAULTS[name]) for name in RUN_FIELDS})

    # --- names: every rule that turns settings into text lives here -------------------------------

    def size_text(self) -> str:
        return f"budget_ratio={self.budget_ratio:g}" if self.budget_ratio is not None else f"budget={self.budget}"

    def scope_text(self) -> str:
        """What is compressed, where it is not the whole cache at every step."""
        scope = "" if self.decode_eviction else " context only" if self.compress == "context" else " prompt only"
        return scope + (" chained" if self.chain else "")

    def label(self) -> str:
        """``budget=512``, ``budget_ratio=0.5 pyramid context only``: the budget and how it applies."""
        schedule = "" if self.budget_schedule == "uniform" else f" {self.budget_schedule}"
        beta = "" if self.pyramid_beta == PYRAMID_BETA else f" beta={self.pyramid_beta:g}"
        return self.size_text() + schedule + beta + self.scope_text()

    def describe(self) -> str:
        """``policy=paged budget=256``, ``policy=snapkv budget_ratio=0.5 context only``."""
        return f"policy={self.policy} {self.label()}"

    def slug(self) -> str:
        """The start of a cell's directory name: ``paged_b512``, ``snapkv_r0.5_context_pyramid``."""
        slug = f"{self.policy}_r{self.budget_ratio:g}" if self.budget_ratio is not None else f"{self.policy}_b{self.budget}"
        slug += "" if self.decode_eviction else "_context" if self.compress == "context" else "_prompt"
        slug += "" if self.budget_schedule == "uniform" else f"_{self.budget_schedule}"
        slug += "" if self.pyramid_beta == PYRAMID_BETA else f"_beta{self.pyramid_beta:g}"
        return slug + ("_chain" if self.chain else "")

    def identity(self) -> dict:
        """What names a cell beyond policy and budget: each setting away from its default (settings
        added after cells were committed are named only there, so earlier cells keep their names)."""
        return {name: getattr(self, name) for name in RUN_FIELDS if getattr(self, name) != DEFAULTS[name]}

    def variant_marks(self, layer_groups: int = 1) -> list[str]:
        """What a table's variant label adds for these settings (with the engine's layer groups,
        which a schedule spreads the budget over): ``compress=context``, ``layer_groups=3``, ..."""
        marks = []
        if self.compress == "context":
            marks.append("compress=context")  # the context compressed before the question (and only then)
        elif self.decode_eviction is False:
            marks.append("decode_eviction=False")  # the prompt compressed only
        if layer_groups != 1:
            marks.append(f"layer_groups={layer_groups}")  # the layers as G KV cache groups, each its own budget
        if self.budget_schedule != "uniform":
            marks.append(f"budget_schedule={self.budget_schedule}")
        if self.pyramid_beta != PYRAMID_BETA:
            marks.append(f"pyramid_beta={self.pyramid_beta:g}")
        if self.chain:
            marks.append("chain=true")  # each turn compresses the previous turn's compressed cache
        return marks

    def as_additional_config(self) -> dict:
        return {CONFIG_KEY: self.as_dict()}

    def as_extra_args(self) -> dict:
        """``SamplingParams.extra_args`` that give one request these settings."""
        return {CONFIG_KEY: self.as_dict()}

    @property
    def key(self) -> tuple:
        """Hashable identity of the policy these settings build (one per distinct key); a
        request's boundary is not part of it (the policy does not depend on it)."""
        return (self.policy, self.budget, json.dumps(self.options, sort_keys=True),  # options may nest (hybrid's weights)
                self.budget_ratio, self.decode_eviction, self.compress, self.budget_schedule, self.pyramid_beta,
                self.group_budgets, self.chain)

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


# The record's fields in their wire form (what a user may give), and those a run's Hydra config
# gives beside policy, budget and options (a request's context boundary is its own, never a run's).
WIRE_FIELDS = ("policy", "budget", "options", "budget_ratio", "decode_eviction", "compress", "context_tokens",
               "budget_schedule", "pyramid_beta", "share_context", "chain", "reconstruction")
RUN_FIELDS = tuple(name for name in WIRE_FIELDS[3:] if name not in ("context_tokens", "reconstruction"))
DEFAULTS = {f.name: f.default for f in fields(EvictionSettings) if f.default is not MISSING}


def budget_for_ratio(ratio: float, prompt_tokens: int, block_size: int) -> int:
    """(1 - ratio) x the prompt, rounded to the nearest whole block, at least two blocks (a
    budget's minimum: a first block and a recent one); ratio 0 keeps the whole prompt (rounded up,
    so nothing of it is evicted)."""
    if ratio == 0:
        return max(2, math.ceil(prompt_tokens / block_size)) * block_size
    blocks = math.floor((1 - ratio) * prompt_tokens / block_size + 0.5)
    return max(2, blocks) * block_size


def check_ratio(ratio) -> float:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio < 1:
        raise ValueError(f"budget_ratio is the share of the prompt removed, a number in [0, 1); got {ratio!r}")
    return float(ratio)


# The settings of a request that keeps its whole cache, whatever the engine's default.
NO_EVICTION = {"policy": "full"}


def parse_settings(raw, where: str) -> EvictionSettings | None:
    """``{policy, budget, options}`` (or its JSON text) as settings; None for ``policy: full``."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where} is not valid JSON ({error.msg}): {raw!r}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{where} must be a mapping with policy, budget and options; got {raw!r}")
    allowed = WIRE_FIELDS
    unknown = set(raw) - set(allowed)
    if unknown:
        raise ValueError(f"{where} has unknown key(s) {sorted(unknown)}; valid: {', '.join(allowed)}")
    if raw.get("policy", "full") == "full":
        return None
    budget, ratio = raw.get("budget"), raw.get("budget_ratio")
    if (budget is None) == (ratio is None):
        raise ValueError(f"{where} needs a 'budget' (KV tokens kept per request) or a 'budget_ratio' (share of "
                         "the prompt removed), exactly one of them")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)
                               and not (isinstance(budget, str) and budget.isdigit())):
        raise ValueError(f"{where}: budget must be an integer number of tokens, got {budget!r}")
    if ratio is not None:
        try:
            ratio = check_ratio(ratio)
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None
    decode = raw.get("decode_eviction", True)
    if not isinstance(decode, bool):
        raise ValueError(f"{where}: decode_eviction must be true or false, got {decode!r}")
    options = raw.get("options") or {}
    if not isinstance(options, dict):
        raise ValueError(f"{where}: options must be a mapping, got {options!r}")
    compress, context, chain = check_scope(raw.get("compress", "prompt"), raw.get("context_tokens"), decode,
                                           raw.get("chain", False), raw.get("budget_schedule", "uniform"), where)
    schedule, beta = check_schedule(raw.get("budget_schedule", "uniform"), raw.get("pyramid_beta", PYRAMID_BETA), where)
    share = check_share(raw.get("share_context"), compress, schedule, where)
    reconstruction = Reconstruction.parse(raw.get("reconstruction"), where)
    return EvictionSettings(str(raw["policy"]), None if budget is None else int(budget), dict(options), ratio, decode,
                            compress, context, schedule, beta, share, chain=chain, reconstruction=reconstruction)



ENGINE_SCHEDULES = ("uniform", "pyramid", "attention", "kvzip")
# The schedules whose group budgets each request measures in its eviction step (``measuring``).
MEASURED_SCHEDULES = ("attention", "kvzip")


def needs_sync(schedule: str) -> str:
    """Why an asynchronous scheduler cannot run a measured schedule (the scheduler, the request check
    and the run's config check say it alike)."""
    source = {"attention": "attention", "kvzip": "reconstruction scores"}[schedule]
    return (f"budget_schedule={schedule} sets each layer group's budget from the {source} of the step that "
            "reaches the eviction point, and evicts in that step; an asynchronous scheduler plans the next step "
            "before that step's report, so it could not know what the eviction left: run with synchronous "
            "scheduling (engine.async_scheduling=false, vllm serve --no-async-scheduling)")


def check_schedule(schedule, beta, where: str) -> tuple[str, float]:
    if schedule not in ENGINE_SCHEDULES:
        raise ValueError(f"{where}: budget_schedule must be one of {', '.join(ENGINE_SCHEDULES)}, got {schedule!r}")
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not math.isfinite(beta) or beta < 1:
        raise ValueError(f"{where}: pyramid_beta is the pyramid's slope, a number >= 1 (1 is flat), got {beta!r}")
    if beta != PYRAMID_BETA and schedule != "pyramid":
        raise ValueError(f"{where}: pyramid_beta shapes budget_schedule=pyramid; this one is {schedule}")
    return schedule, float(beta)


COMPRESS = ("prompt", "context")


def unshareable(compress: str, schedule: str) -> str | None:
    """Why settings' compressed contexts cannot be shared exactly, or None where they can."""
    if compress != "context":
        return ("compress=prompt keeps what the question attends to (query-aware): the kept set is the "
                "request's own, so no other request can take it")
    if schedule in MEASURED_SCHEDULES:
        return (f"budget_schedule={schedule} measures each request's layer budgets from its own prompt "
                "(its eviction step's report), which a request taking a shared context would not have")
    return None


def check_share(share, compress: str, schedule: str, where: str) -> bool | None:
    if share is not None and not isinstance(share, bool):
        raise ValueError(f"{where}: share_context must be true, false or null (share where exact), got {share!r}")
    reason = unshareable(compress, schedule) if share else None
    if reason:
        raise ValueError(f"{where}: share_context=true, but {reason}")
    return share


def check_chain(chain, compress: str, schedule: str, where: str) -> bool:
    """``chain`` against the settings it carries a turn's state under (the policy's own limits:
    ``check_chain_policy``; the engine's: the scheduler and the frontend)."""
    if not isinstance(chain, bool):
        raise ValueError(f"{where}: chain must be true or false, got {chain!r}")
    if chain and compress != "context":
        raise ValueError(f"{where}: chain=true carries a turn's compressed context into the next turn; it needs "
                         "compress=context (the history compressed before each new message)")
    if chain and schedule == "attention":
        raise ValueError(f"{where}: chain=true, but budget_schedule=attention measures each request's layer budgets "
                         "from its own prompt's queries, which a turn continuing a compressed history does not have")
    return chain


def check_reconstructing_policy(settings: EvictionSettings, policy: Policy) -> None:
    """What a reconstructing policy (KVzip) needs of its settings: it compresses once, at the
    eviction point, from passes that repeat what came before it (``policies.kvzip``)."""
    if not policy.reconstructs:
        return
    if settings.decode_eviction:
        raise ValueError(f"{policy.name} scores the context by reconstructing it once, before the eviction; it has no "
                         "rule for generated tokens: pass decode_eviction=false (with compress=context or prompt)")
    if settings.chain:
        raise ValueError(f"chain=true, but {policy.name} reconstructs the pristine context; a chained turn holds the "
                         "previous turn's compressed cache: use chain=false")
    if settings.budget_schedule == "attention":
        raise ValueError(f"budget_schedule=attention measures layer budgets from the prompt's last queries; {policy.name}"
                         " evicts from its reconstruction passes in the same step, which that measurement does not "
                         "follow: use uniform, pyramid or kvzip")


def check_reconstruction(settings: EvictionSettings, policy: Policy, eviction_point: int) -> None:
    """A request's reconstruction inputs, against its policy and where it evicts."""
    if not policy.reconstructs:
        if settings.reconstruction is not None:
            raise ValueError(f"reconstruction gives the ids a reconstructing policy (kvzip) repeats the context with; "
                             f"{policy.name} does not reconstruct")
        return
    if settings.reconstruction is None:
        raise ValueError(f"{policy.name} reconstructs the request's context: the request must give its reconstruction "
                         "ids (reconstruction: prefix_tokens, first, later, suffix; harness.eviction.settings.Reconstruction)")
    if settings.reconstruction.prefix_tokens >= eviction_point:
        raise ValueError(f"reconstruction.prefix_tokens={settings.reconstruction.prefix_tokens} leaves nothing of the "
                         f"{eviction_point} tokens before the eviction point to reconstruct")


def check_chain_policy(policy: Policy) -> None:
    """What a chained turn cannot give a policy: the next request holds the previous turn's kept K/V,
    not its queries, so a rule reading a window of queries before the boundary (SnapKV, TOVA) or
    summing every query (H2O, LRU) would see only the new tokens' few."""
    if policy.query_window or policy.accumulates:
        raise ValueError(f"chain=true, but {policy.name} reads attention queries (a window before the boundary or "
                         "every query so far); a chained turn carries the previous turn's kept K/V, not its queries: "
                         "use an attention-free policy or chain=false")


def check_scope(compress, context_tokens, decode_eviction: bool, chain, schedule, where: str
                ) -> tuple[str, int | None, bool]:
    """What is compressed, where, and whether a conversation's turns carry it on: ``compress`` and a
    request's ``context_tokens`` against ``decode_eviction``, then ``chain`` against them and the
    schedule. The one check of these fields, for a request's settings (``parse_settings``) and a
    run's (``harness.config.check``, which gives no boundary: each request brings its own)."""
    compress, context_tokens = check_compress(compress, context_tokens, decode_eviction, where)
    return compress, context_tokens, check_chain(chain, compress, schedule, where)


def check_compress(compress, context_tokens, decode_eviction: bool, where: str) -> tuple[str, int | None]:
    """``compress`` and a request's ``context_tokens``, checked against each other."""
    if compress not in COMPRESS:
        raise ValueError(f"{where}: compress must be one of {', '.join(COMPRESS)} (where the prefill eviction runs: "
                         f"after the whole prompt, or at the end of the context), got {compress!r}")
    if compress == "context" and decode_eviction:
        raise ValueError(f"{where}: compress=context compresses the context once, before the question (kvpress's "
                         "query-agnostic setting); pass decode_eviction=false with it")
    if context_tokens is None:
        return compress, None
    if compress != "context":
        raise ValueError(f"{where}: context_tokens is the boundary compress=context evicts at; it needs compress=context")
    if isinstance(context_tokens, bool) or not isinstance(context_tokens, int) or context_tokens < 1:
        raise ValueError(f"{where}: context_tokens must be a positive number of tokens, got {context_tokens!r}")
    return compress, context_tokens


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


# The budget a ratio's settings are checked at before any prompt is seen (names and options).
PROBE_BLOCKS = 64


def build_policy(settings: EvictionSettings, block_size: int) -> Policy:
    """The policy these settings run. Settings with a ``budget_ratio`` not yet resolved against a
    prompt (``for_prompt``) are built at a probe budget: enough to check the name and options.
    Its score is tried once on a tiny input (``try_score``): a score that raises or returns the
    wrong shape is refused here, at admission, with its message."""
    budget = settings.budget if settings.budget is not None else PROBE_BLOCKS * block_size
    policy = make_policy(settings.policy, budget, block_size, **settings.options)
    policy.decode_eviction = settings.decode_eviction
    # The context compressed alone keeps whole blocks (a block rule's L mod B more would end it in a
    # partial block, which every request sharing it copies; no decode eviction follows it to need them).
    policy.whole_blocks = settings.compress == "context"
    try_score(policy, (settings.policy, json.dumps(settings.options, sort_keys=True), block_size))
    return policy


_TRIED_SCORES: set[tuple] = set()


def try_score(policy: Policy, key: tuple) -> None:
    """An attention-free score run once per policy and options on two blocks of random K/V (two
    heads): what a user's new score gets wrong most often (it raises, or returns other than
    ``[kv_heads, tokens]`` finite numbers) fails its request at admission, not in the engine.
    What depends on real input can still fail there: the engine then ends that request alone
    (``harness.eviction.evictor.PolicyFailure``). Attention scores need a query window and are
    the harness's own (their tests check them)."""
    if key in _TRIED_SCORES or not policy.needs_kv or policy.query_window or policy.reconstructs \
            or not hasattr(policy, "score"):
        return  # (a reconstructing score is not computed from K/V: its passes are the engine's)
    import torch

    from harness.eviction.evictor import PolicyFailure, as_failure, checked_scores

    generator = torch.Generator().manual_seed(0)
    keys, values = (torch.randn(2 * policy.block_size, 2, 8, generator=generator) for _ in range(2))
    try:
        checked_scores(policy, policy.layer_scores(keys, values), keys)
    except Exception as error:
        failure: PolicyFailure = as_failure(policy, error)
        raise ValueError(f"{failure} (tried at admission on {keys.shape[0]} tokens of random K/V)") from None
    _TRIED_SCORES.add(key)


def group_policies(settings: EvictionSettings, block_size: int, num_layers: int, groups: int) -> tuple[Policy, ...]:
    """The policy each of an engine's ``groups`` KV cache groups runs for these settings: the
    budget spread by the settings' schedule (whole blocks, at least two per group, summing to
    ``groups`` x the budget), group 0 holding the first layers. One group: the settings' policy.
    A schedule that leaves a group less than its policy needs (SnapKV's window) is refused."""
    whole = build_policy(settings, block_size)
    if groups > 1:
        check_grouped(whole, groups)
    if groups == 1 or settings.budget is None:
        if settings.budget_schedule != "uniform" and groups == 1:
            raise ValueError(f"budget_schedule={settings.budget_schedule} spreads the budget over the engine's layer "
                             "groups; this engine has one (set engine.layer_groups)")
        return (whole,) * groups
    if settings.budget_schedule in MEASURED_SCHEDULES:
        # measured: the request's own; not yet: the uniform ones, which only say what is the same in
        # every group (window, phases) until the measurement fixes them
        budgets = settings.group_budgets or (settings.budget,) * groups
        if len(budgets) != groups or sum(budgets) > groups * settings.budget:
            raise ValueError(f"group budgets {list(budgets)} for {groups} groups of budget {settings.budget}")
    else:
        budgets = group_budgets(settings.budget_schedule, settings.budget, num_layers, groups, block_size,
                                beta=settings.pyramid_beta, min_blocks=least_blocks(settings, block_size))
    try:
        return tuple(build_policy(replace(settings, budget=budget), block_size) for budget in budgets)
    except BudgetError as error:
        raise ValueError(f"budget_schedule={settings.budget_schedule} gives the layer groups budgets {list(budgets)}: "
                         f"{error}") from None


def check_layer_groups(groups: object, num_layers: int | None = None) -> int:
    """``engine.layer_groups`` itself: a positive integer dividing the model's layer count (equal
    groups: vLLM sizes a block by its largest group, so unequal ones waste memory, and tags of
    unequal sizes split into more groups than tags, vllm/v1/core/kv_cache_utils.py:1467-1501)."""
    if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1:
        raise ValueError(f"layer_groups must be a positive integer, got {groups!r}")
    if num_layers is not None and num_layers % groups:
        raise ValueError(f"layer_groups={groups} does not divide the model's {num_layers} attention layers "
                         f"into equal groups; choose a divisor of {num_layers}")
    return groups


_ADMITTED: dict[tuple, tuple[Policy, ...]] = {}


def admit(settings: EvictionSettings, block_size: int, num_layers: int, groups: int, *, enforce_eager: bool,
          async_scheduling: bool) -> tuple[Policy, ...]:
    """The one admission of eviction settings on an engine: what the engine needs of them (an
    attention schedule synchronous scheduling and eager mode, an attention-reading policy eager
    mode), their budget spread over the engine's ``groups`` KV cache groups, and the policy each
    group runs; ``ValueError`` says what cannot run and why. The run's config check, the frontend's
    request check, the scheduler, the worker and the memory predictions all ask here; the answer
    is cached per settings and engine."""
    key = (settings.key, block_size, num_layers, groups, bool(enforce_eager), bool(async_scheduling))
    policies = _ADMITTED.get(key)
    if policies is None:
        check_schedule_runs(settings, enforce_eager, async_scheduling)
        policies = group_policies(settings, block_size, num_layers, groups)
        for policy in {id(policy): policy for policy in policies}.values():
            check_policy_runs(policy, enforce_eager)
            check_reconstructing_policy(settings, policy)
            if settings.chain:
                check_chain_policy(policy)
        if len(_ADMITTED) >= 4096:  # ratio budgets differ per prompt length: bounded, not a leak
            _ADMITTED.clear()
        _ADMITTED[key] = policies
    return policies


def scheduling_is_async(async_scheduling: bool | None, device: str) -> bool:
    """Whether vLLM will schedule asynchronously: as asked, or by default where the platform has
    it: on a GPU, not on CPU (vllm/platforms/cpu.py:329-331)."""
    return async_scheduling if async_scheduling is not None else device == "cuda"


def least_blocks(settings: EvictionSettings, block_size: int) -> int:
    """The fewest blocks a group's budget may have: two (a first block and a recent one), or more
    where the policy needs them (SnapKV's window inside its budget); at most the whole budget."""
    return min(build_policy(settings, block_size).min_budget(), settings.budget) // block_size


def check_grouped(policy: Policy, groups: int) -> None:
    """What a policy cannot do on an engine of several layer groups (each group scores and evicts
    its own layers, ``harness.engine.worker_patch``)."""
    if getattr(policy, "score_layers", "all") != "all":
        raise ValueError(f"score_layers names one layer of the model; with layer_groups={groups} each group scores "
                         "its own layers")


def check_schedule_runs(settings: EvictionSettings, enforce_eager: bool, async_scheduling: bool) -> None:
    """What a measured schedule needs of the engine: it evicts in the step it measures in (so the
    scheduler learns the budgets from that step's report); the attention schedule reads the
    prompt's queries through the hooks compiled graphs skip; the kvzip schedule reads KVzip's
    reconstruction scores, so it needs that policy, and it is built for a context compressed alone."""
    if settings.budget_schedule == "kvzip":
        if not settings.reconstructs:
            raise ValueError(f"budget_schedule=kvzip sets the layer groups' budgets from KVzip's reconstruction "
                             f"scores; policy {settings.policy} computes none: use policy=kvzip (or another schedule)")
        if settings.compress != "context":
            raise ValueError("budget_schedule=kvzip is built for compress=context only (KVzip's query-agnostic "
                             "setting, the context compressed once before the question; compress=prompt is untested "
                             "with it): pass compress=context")
        if async_scheduling:
            raise ValueError(needs_sync("kvzip"))
        return
    if settings.budget_schedule != "attention":
        return
    if async_scheduling:
        raise ValueError(needs_sync("attention"))
    if not enforce_eager:
        raise ValueError("budget_schedule=attention reads the prompt's queries through hooks that compiled graphs "
                         "skip: run with enforce_eager (engine.enforce_eager=true, vllm serve --enforce-eager)")


def check_policy_runs(policy: Policy, enforce_eager: bool) -> None:
    """What a policy needs of the engine beyond eviction itself: an attention-aware policy's query
    window is copied by Python hooks on the attention layers, which compiled graphs skip."""
    if (policy.query_window or policy.reconstructs) and not enforce_eager:
        raise ValueError(
            f"{policy.name} reads attention queries through hooks that compiled graphs skip: "
            "run with enforce_eager (engine.enforce_eager=true, vllm serve --enforce-eager)")
