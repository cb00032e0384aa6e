"""The serving benchmark's workloads, each one definition: a list of ``Item``s (a request's token ids,
where its context ends, its output length, its reference answer), turned into vLLM's own
``SampleRequest``s (``vllm/benchmarks/datasets/datasets.py:73-91``) for a configuration, and scored.

* ``shared_context``: ``experiments/shared_context.py``'s workload (its generator lives here:
  ``shared_contexts``, ``access_codes``, ``birthplaces``, ``prompts_of``): half the contexts a long
  text hiding one access code per person, half passages about people each born somewhere; each
  context asked one short question per person, with the embedded suite's templates and scoring.
* ``shared_context_long``: contexts of about 2,000 tokens each holding ``requests`` registers of
  ``ENTRIES`` lines; each request asks for one register back (its own question on the shared
  context): answers of about 160 tokens, scored by ROUGE-L against the register.
* ``multi_turn``: conversations about ``shared_context``'s contexts, one person per turn: turn 1 is
  the context's first question as ``shared_context`` asks it, each later turn the model's own answer
  (its token ids), then the next question in a new user message (the chat template's rendering,
  ``next_turn_tokens``). Later turns' prompts exist only once the turn before has returned, so a
  run sends them through ``harness.engine.bench_client.conversations`` (``next_request``).
* ``prefix_repetition``: vLLM's own standard synthetic (``PrefixRepetitionRandomDataset``,
  vllm/benchmarks/datasets/datasets.py:4181, through ``harness.engine.bench_client``): random-token
  prefixes each shared by ``num_requests / num_prefixes`` requests, sampled by vLLM's class, then
  sent as token ids with the context boundary at the tokens every request of a prefix shares (vLLM
  decodes the prompt to text; re-encoded, the junction of prefix and suffix may merge, so the shared
  part is measured, not assumed). Not scored (random tokens).

Every prompt is token ids (``SampleRequest.prompt`` may be ``list[int]``), so the boundary a request
states (``context_tokens``) is exactly where its context ends. A configuration is a per-request
``vllm_xargs`` setting (``request_overrides``, merged into each request's body on top of the
bench's ``extra_body``: vllm/benchmarks/serve.py:69-73 and :1048), so one server runs them all.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

from harness.tasks.embedded.dataset import CITIES, JOBS, filler, people

WORKLOADS = ("shared_context", "shared_context_long", "multi_turn", "prefix_repetition")
QUESTIONS = 6
WORDS = 1400          # about 2,000 of SmolLM2's tokens per context


# ----------------------------------------------------------------------------------- shared contexts
@dataclass(frozen=True)
class Shared:
    """A context and its questions (``input``, answers), in the suite's record format; ``people``:
    each person of the context with their access code or birthplace, in the context's order."""

    task: str
    id: str
    context: str
    questions: tuple[tuple[str, tuple[str, ...]], ...]
    people: tuple[tuple[str, str], ...] = ()


def access_codes(rng: random.Random, index: int, questions: int = QUESTIONS) -> Shared:
    """A long text with one access code per person, spread from 10% to 90% of its depth."""
    names = people(rng, questions)
    codes = [str(code) for code in rng.sample(range(10000, 100000), questions)]
    sentences = filler(rng, WORDS)
    for k, (name, code) in reversed(list(enumerate(zip(names, codes)))):
        depth = 0.1 + 0.8 * k / (questions - 1)
        sentences.insert(round(depth * len(sentences)), f"The access code of {name} is {code}. Remember it: {code}.")
    asked = tuple((f"What is the access code of {name}? Answer with the number only.", (code,))
                  for name, code in zip(names, codes))
    return Shared("key_retrieval", f"codes-{index}", " ".join(sentences), asked, tuple(zip(names, codes)))


def birthplaces(rng: random.Random, index: int, questions: int = QUESTIONS) -> Shared:
    """Passages about ``questions`` people, each born in a different city."""
    names, cities = people(rng, questions), rng.sample(CITIES, questions)
    passages = []
    for k, (name, city) in enumerate(zip(names, cities), start=1):
        body = filler(rng, WORDS // questions - 20)
        body.insert(rng.randrange(len(body) + 1), f"{name} was born in {city} and worked as a {rng.choice(JOBS)}.")
        passages.append(f"Passage {k}:\n{name}\n{' '.join(body)}")
    asked = tuple((f"In which city was {name} born?", (city,)) for name, city in zip(names, cities))
    return Shared("multi_doc_qa", f"births-{index}", "\n".join(passages), asked, tuple(zip(names, cities)))


def shared_contexts(contexts: int, seed: int = 0, questions: int = QUESTIONS) -> list[Shared]:
    """``contexts`` contexts, alternately access codes and birthplaces, each with ``questions`` people
    (the same draws as ``experiments/shared_context.py``'s ``workload`` always made)."""
    rng = random.Random(seed)
    return [(access_codes if index % 2 == 0 else birthplaces)(rng, index, questions) for index in range(contexts)]


def prompts_of(shared: Shared, tokenizer, max_prompt_tokens: int) -> list:
    """Each question's prompt (``harness.tasks.prompts.Prompt``: token ids and context boundary)."""
    from harness.tasks import task_spec
    from harness.tasks.prompts import build_prompt
    from harness.tasks.sample import Sample

    spec = task_spec(shared.task)
    return _same_context(shared.id, [build_prompt(Sample(shared.task, f"{shared.id}-q{q}", shared.context, text,
                                                         list(answers)), spec, tokenizer, max_prompt_tokens)
                                     for q, (text, answers) in enumerate(shared.questions)])


def _same_context(name: str, prompts: list) -> list:
    first = prompts[0]
    if any(not p.context_tokens or p.token_ids[:p.context_tokens] != first.token_ids[:first.context_tokens]
           for p in prompts):
        raise RuntimeError(f"{name}: the questions' prompts do not share one context")
    return prompts


# --------------------------------------------------------------------------------- conversations' turns
def footer_tokens(tokenizer, prompts: list) -> int:
    """How many closing tokens the chat template writes after every question (end of turn,
    assistant header): its footer, tokenized on its own (special tokens tokenize alone), which
    each prompt must end with."""
    from harness.tasks.prompts import chat_footer

    footer = chat_footer(tokenizer) if getattr(tokenizer, "chat_template", None) else ""
    ids = tokenizer(footer, add_special_tokens=False)["input_ids"] if footer else []
    if any(p.token_ids[len(p.token_ids) - len(ids):] != ids for p in prompts):
        raise RuntimeError("a prompt does not end with the chat template's footer")
    return len(ids)


def question_texts(prompts: list, tokenizer, footer: int) -> list[str]:
    """Each question's own part of its single-turn prompt (the suite's template after the context,
    without the chat template's footer), as text for a later user message."""
    return [tokenizer.decode(p.token_ids[p.context_tokens:len(p.token_ids) - footer]).strip() for p in prompts]


def next_turn_tokens(tokenizer, question_text: str, answer_ids: list[int]) -> list[int]:
    """What follows the model's answer ``answer_ids`` in the next turn's prompt: the end of the
    assistant's turn (unless the answer already ends with it), the user's header, ``question_text``,
    the end of the user's turn and the assistant's header, as the chat template renders a
    conversation (its rendering around a marker answer, tokenized alone: special tokens tokenize
    alone)."""
    marker = "\x00answer\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": "x"}, {"role": "assistant", "content": marker},
                                          {"role": "user", "content": question_text}], tokenize=False,
                                         add_generation_prompt=True)
    if text.count(marker) != 1:
        raise RuntimeError("the chat template does not write the answer once and verbatim")
    glue = tokenizer(text.split(marker)[1], add_special_tokens=False)["input_ids"]
    if answer_ids and glue and answer_ids[-1] == glue[0] == tokenizer.eos_token_id:
        glue = glue[1:]  # the answer ended with the end-of-turn token itself
    return glue


# ------------------------------------------------------------------------------- long answers: registers
# SmolLM2-135M copies a contiguous list after its heading, but cannot gather lines scattered through
# a text (asked for every person with their code or city it lists names and no values: F1 0 at full
# cache, measured with the serving sweep, 2 contexts x 3 requests). So the long answer is a copy:
# each context holds one register per request (REGISTERS), each request asks for one of them back
# by its heading (the answer started with it, as the suite's record_listing starts its answers),
# and the answer is scored by ROUGE-L against the register, as record_listing is (LongBench's
# gov_report metric). Measured at full cache (vllm LLM, 4 contexts x 3 registers of 2,000 tokens):
# 47.0 on average, 17-83 per request.
ENTRIES = 8           # lines per register: about 20 tokens each, answers of about 160 tokens
LONG_TOKENS = 200     # the long answers' limit: the longest register is about 170 tokens
# Words per context: about 1,150 of SmolLM2's tokens with two registers. On this CPU a prompt's
# prefill (about 140 tokens/s) is most of a request's time, so contexts half the short-answer
# workload's keep the default sweep (4 rates x 2 configurations x 3 trials) near an hour.
LONG_WORDS = 750
REGISTERS = "ABCDEFGHIJKLMNOP"
REGISTER_TASK = "register_copy"
REGISTER_TEMPLATE = ("Read the following text. In it are registers of entries, each under its heading, one entry "
                     "per line.\n\n{context}\n\nNow, {input}")


def register_context(rng: random.Random, registers: int, words: int = LONG_WORDS) -> tuple[str, list[list[str]]]:
    """A filler text of about ``words`` words with ``registers`` registers ("Register A:" and its
    ``ENTRIES`` lines, then "End of register A.") spread from 10% to 90% of its depth; the
    registers' entries, each a list of lines. Every entry has a code of its own, so a skipped or
    invented line changes the words ROUGE-L counts."""
    sentences = filler(rng, max(words - registers * ENTRIES * 8, 20 * registers))
    tables = []
    for label in REGISTERS[:registers]:
        names = people(rng, ENTRIES)
        codes = rng.sample(range(10000, 100000), ENTRIES)
        tables.append([f"{name}, {rng.choice(JOBS)}, {rng.choice(CITIES)}, code {code}."
                       for name, code in zip(names, codes)])
    for k in reversed(range(registers)):
        depth = 0.1 + 0.8 * k / max(registers - 1, 1)
        label = REGISTERS[k]
        sentences.insert(round(depth * len(sentences)),
                         f"\nRegister {label}:\n" + "\n".join(tables[k]) + f"\nEnd of register {label}.\n")
    return " ".join(sentences), tables


def register_prompts(context: str, name: str, registers: int, tokenizer, max_prompt_tokens: int) -> list:
    """Request r's prompt: copy register r, its answer started with the register's heading."""
    from harness.tasks.prompts import build_prompt
    from harness.tasks.sample import Sample
    from harness.tasks.spec import TaskSpec

    spec = TaskSpec(name=REGISTER_TASK, template=REGISTER_TEMPLATE, max_new_tokens=LONG_TOKENS, metric="rouge")
    return _same_context(name, [
        build_prompt(Sample(REGISTER_TASK, f"{name}-register{label}", context,
                            f"copy register {label}: its {ENTRIES} entries in order, one per line, exactly as written.",
                            [], meta={"answer_prefix": f"Register {label}:\n"}), spec, tokenizer, max_prompt_tokens)
        for label in REGISTERS[:registers]])


# ------------------------------------------------------------------------------------- items, requests
@dataclass(frozen=True)
class Item:
    """One request of a workload: its token ids, where its context ends (None: no shared context),
    its output limit and stop strings, and what scores it (``task``: a suite task, or
    "" for an unscored synthetic) against ``answers``; ``context``: the shared context it asks about
    (a cluster in the accuracy's intervals)."""

    context: str
    question: int
    task: str
    prompt: list[int]
    context_tokens: int | None
    max_tokens: int
    answers: tuple[str, ...] = ()
    stop: tuple[str, ...] = ()
    reconstruction: dict | None = field(default=None, compare=False)
    # a conversation's later turn: its question's text (the prompt is made when the turn before has
    # returned: ``next_request``) and the longest its prompt can be (every earlier answer at its limit)
    follow_up: str | None = None
    longest_prompt: int | None = None

    @property
    def prompt_bound(self) -> int:
        """The most prompt tokens the request can have (its prompt's, where it is known)."""
        return self.longest_prompt if self.longest_prompt is not None else len(self.prompt)


@dataclass(frozen=True)
class Workload:
    name: str
    items: list[Item]
    ignore_eos: bool    # every request generates max_tokens (the synthetic), or stops where the model ends
    description: str
    options: dict = field(default_factory=dict, compare=False)  # every argument it was built with (``build``)
    turns: int = 1      # a conversation's turns (items: each conversation's turns in order, ``question`` the turn)

    @property
    def scored(self) -> bool:
        return any(item.task for item in self.items)


def shuffled(items: list[Item], seed: int) -> list[Item]:
    """The order requests arrive in: contexts interleaved as users would send them, the same order
    for every configuration (a seeded shuffle)."""
    items = list(items)
    random.Random(seed).shuffle(items)
    return items


def shared_context_workload(tokenizer, contexts: int = 8, questions: int = QUESTIONS, max_prompt_tokens: int = 7500,
                            seed: int = 0) -> Workload:
    from harness.tasks import task_spec

    items = []
    for shared in shared_contexts(contexts, seed, questions):
        spec = task_spec(shared.task)
        for q, prompt in enumerate(prompts_of(shared, tokenizer, max_prompt_tokens)):
            items.append(Item(shared.id, q, shared.task, list(prompt.token_ids), prompt.context_tokens,
                              spec.max_new_tokens, tuple(shared.questions[q][1]), tuple(spec.stop),
                              prompt.reconstruction))
    return Workload("shared_context", shuffled(items, seed), False,
                    f"{contexts} contexts (half access codes in a long text, half passages about people; about "
                    f"2,000 tokens each) x {questions} short questions, the embedded suite's scoring")


def shared_context_long_workload(tokenizer, contexts: int = 6, requests: int = 2, max_prompt_tokens: int = 7500,
                                 seed: int = 0) -> Workload:
    if not 1 <= requests <= len(REGISTERS):
        raise ValueError(f"shared_context_long: requests per context must be 1-{len(REGISTERS)}, got {requests}")
    rng = random.Random(seed)
    items = []
    for index in range(contexts):
        name = f"registers-{index}"
        context, tables = register_context(rng, requests)
        for r, prompt in enumerate(register_prompts(context, name, requests, tokenizer, max_prompt_tokens)):
            items.append(Item(name, r, REGISTER_TASK, list(prompt.token_ids), prompt.context_tokens, LONG_TOKENS,
                              ("\n".join(tables[r]),), (f"End of register {REGISTERS[r]}",), prompt.reconstruction))
    tokens = round(sum(item.context_tokens for item in items) / len(items), -1)
    return Workload("shared_context_long", shuffled(items, seed), False,
                    f"{contexts} contexts (about {tokens:,.0f} tokens of text holding {requests} registers of {ENTRIES} "
                    f"entries each) x {requests} requests, each copying one register back (about 160 tokens, up "
                    f"to {LONG_TOKENS}), scored by ROUGE-L against the register (the suite's record_listing rule)")


def multi_turn_workload(tokenizer, conversations: int = 8, turns: int = 4, max_prompt_tokens: int = 7500,
                        seed: int = 0) -> Workload:
    """``conversations`` conversations of ``turns`` turns, each about one of ``shared_contexts``'
    contexts (alternately access codes and birthplaces), one person per turn, the embedded suite's
    scoring per turn; the conversations in a seeded order."""
    from harness.tasks import task_spec

    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("multi_turn: the model has no chat template to write a conversation's later turns with")
    if turns < 2:
        raise ValueError(f"multi_turn: a conversation needs at least 2 turns, got {turns}")
    talks = []
    for shared in shared_contexts(conversations, seed, turns):
        spec = task_spec(shared.task)
        prompts = prompts_of(shared, tokenizer, max_prompt_tokens)
        texts = question_texts(prompts, tokenizer, footer_tokens(tokenizer, prompts))
        first, longest, talk = prompts[0], len(prompts[0].token_ids), []
        for turn in range(turns):
            if turn:  # the answer before it at its limit, then the longest glue (no end-of-turn shared)
                longest += spec.max_new_tokens + len(next_turn_tokens(tokenizer, texts[turn], []))
            talk.append(Item(shared.id, turn, shared.task, list(first.token_ids) if turn == 0 else [],
                             first.context_tokens if turn == 0 else None, spec.max_new_tokens,
                             tuple(shared.questions[turn][1]), tuple(spec.stop), None,
                             texts[turn] if turn else None, longest))
        talks.append(talk)
    random.Random(seed).shuffle(talks)
    history = round(sum(len(talk[0].prompt) for talk in talks) / len(talks), -1)
    return Workload("multi_turn", [item for talk in talks for item in talk], False,
                    f"{conversations} conversations x {turns} turns (half access codes in a long text, half passages "
                    f"about people; about {history:,.0f} tokens at turn 1), each turn a short question about the next "
                    "person after the model's own answer, the embedded suite's scoring", turns=turns)


def prefix_repetition_workload(tokenizer, num_requests: int = 40, prefix_len: int = 1024, suffix_len: int = 128,
                               num_prefixes: int = 8, output_len: int = 256, seed: int = 0) -> Workload:
    """vLLM's ``prefix_repetition`` dataset, sampled by its own class (the arguments of
    ``--prefix-repetition-*``), sent as token ids with the boundary at each prefix's shared tokens."""
    from harness.engine.bench_client import prefix_repetition

    prompts = prefix_repetition(tokenizer, num_requests, prefix_len, suffix_len, num_prefixes, output_len, seed)
    encoded = [list(tokenizer.encode(prompt, add_special_tokens=False)) for prompt in prompts]
    # a prefix's requests begin with the same tokens (random ones: half the prefix names the group)
    groups: dict[tuple, list[int]] = {}
    for index, ids in enumerate(encoded):
        groups.setdefault(tuple(ids[:prefix_len // 2]), []).append(index)
    items = [None] * len(encoded)
    for number, members in enumerate(groups.values()):
        shared = common_prefix([encoded[i] for i in members]) if len(members) > 1 else prefix_len
        for i in members:
            items[i] = Item(f"prefix-{number}", members.index(i), "", encoded[i], min(shared, len(encoded[i]) - 1),
                            output_len)
    return Workload("prefix_repetition", items, True,
                    f"vLLM's prefix_repetition: {num_requests} requests, {num_prefixes} random prefixes of {prefix_len} "
                    f"tokens, suffixes of {suffix_len}, {output_len} output tokens each (ignore_eos)")


def common_prefix(sequences: list[list[int]]) -> int:
    """How many leading tokens every sequence shares."""
    length = min(len(s) for s in sequences)
    for index in range(length):
        if any(s[index] != sequences[0][index] for s in sequences[1:]):
            return index
    return length


def blocks_at_once(workload: Workload, block_size: int) -> int:
    """The KV blocks full cache with prefix caching holds to run every request of ``workload`` at
    once: each context's full blocks once (its requests share them), and each request's own blocks
    after them, to its last output token. Conversations: each one's last turn at its longest (a
    conversation runs one turn at a time, each over the history the one before it cached)."""
    if workload.turns > 1:
        return sum(-(-(item.prompt_bound + item.max_tokens) // block_size) for item in workload.items
                   if item.question == workload.turns - 1)
    shared: dict[str, int] = {}
    own = 0
    for item in workload.items:
        common = item.context_tokens // block_size if item.context_tokens else 0
        shared[item.context] = max(shared.get(item.context, 0), common)
        own += -(-(len(item.prompt) + item.max_tokens) // block_size) - common
    return sum(shared.values()) + own


def build(name: str, tokenizer, **options) -> Workload:
    """A workload by name, with its options (``contexts``, ``questions``/``requests``, ...)."""
    makers = {"shared_context": shared_context_workload, "shared_context_long": shared_context_long_workload,
              "multi_turn": multi_turn_workload, "prefix_repetition": prefix_repetition_workload}
    if name not in makers:
        raise ValueError(f"unknown workload {name!r}; the workloads are: {', '.join(WORKLOADS)}")
    import inspect
    from dataclasses import replace

    # Its defaults too, recorded (settings.json): a later change of a default must not change what
    # the summaries rebuild from a committed sweep.
    parameters = inspect.signature(makers[name]).parameters
    effective = {key: p.default for key, p in parameters.items() if p.default is not inspect.Parameter.empty}
    return replace(makers[name](tokenizer, **options), options={**effective, **options})


# --------------------------------------------------------------------------------------- configurations
MODES = ("context", "context unshared", "context chained", "prompt")


def parse_configuration(name: str) -> tuple[str | None, str]:
    """``full`` -> (None, "full"); ``<policy> <mode>`` -> (policy, mode), mode one of ``MODES``."""
    if name == "full":
        return None, "full"
    policy, _, mode = name.partition(" ")
    if mode not in MODES:
        raise ValueError(f"configuration {name!r}: 'full' or '<policy> <mode>' with mode one of {', '.join(MODES)}")
    return policy, mode


def rate_unit(turns: int) -> str:
    """What a rate counts: requests, or conversations (a conversation's later turns follow its answers)."""
    return "conv/s" if turns > 1 else "req/s"


def twin_of(name: str) -> str | None:
    """A chained configuration's recompressing twin (``paged context chained`` -> ``paged context``)."""
    policy, mode = parse_configuration(name)
    return f"{policy} context" if mode == "context chained" else None


def check_configurations(names: list[str], workload: Workload | None = None) -> None:
    """One clear line for a configuration the server would refuse anyway, or one ``workload`` cannot
    run (before any server starts)."""
    from policies import REGISTRY, make_policy

    for name in names:
        policy, mode = parse_configuration(name)
        if policy is not None and policy not in REGISTRY:
            raise ValueError(f"configuration {name!r}: no policy {policy!r}; the policies are: {', '.join(REGISTRY)}")
        if workload is not None and workload.turns > 1 and policy is not None and REGISTRY[policy].reconstructs:
            raise ValueError(f"configuration {name!r}: {policy} reconstructs from ids each request brings, and a "
                             "conversation's later turns have none")
        if mode == "context chained":
            probe = make_policy(policy, 1024, 32)  # at its default options, as a configuration sends it
            if probe.query_window or probe.accumulates:  # what chain=true admits (admission.check_chain_policy)
                raise ValueError(f"configuration {name!r}: a chain carries kept keys and values, not the queries or "
                                 f"running totals {policy} scores by")
            if twin_of(name) not in names:
                raise ValueError(f"configuration {name!r}: list its recompressing twin {twin_of(name)!r} too (the "
                                 "summary sets each chain beside it)")
        if mode == "context chained" and workload is not None:
            if workload.turns < 2:
                raise ValueError(f"configuration {name!r}: a chain continues a conversation; {workload.name} has none")
            if any(item.stop for item in workload.items):
                # a stop string ends a request by an abort the frontend sends after the fact
                # (vllm/v1/engine/output_processor.py:768-820): the next turn's chain entry may not match
                raise ValueError(f"configuration {name!r}: a chain cannot follow answers cut by stop strings, and "
                                 f"{workload.name}'s tasks stop at {sorted({s for i in workload.items for s in i.stop})}")
    if "full" not in names:
        raise ValueError("the configurations must include 'full' (every ratio is against it)")


def settings_for(configuration: str, item: Item, ratio: float) -> dict:
    """The request's ``kv_eviction`` setting (docs/serving.md): ``full`` keeps the whole cache;
    ``<policy> context`` compresses the context (its first ``context_tokens`` prompt tokens) by
    ``ratio`` before the question is computed, one copy shared by the context's requests (prefix
    caching on); ``context unshared`` the same with each request compressing its own copy;
    ``context chained`` compresses a conversation's history as ``context`` does, each turn from the
    cache the turn before kept (``chain=true``: only the new tokens are computed);
    ``prompt`` compresses context and question together (query-aware, no sharing)."""
    from policies import REGISTRY

    policy, mode = parse_configuration(configuration)
    if policy is None:
        return {"policy": "full"}
    settings = {"policy": policy, "budget_ratio": ratio, "decode_eviction": False}
    if mode.startswith("context"):
        if item.context_tokens is None:
            raise ValueError(f"{configuration}: request {item.context}/{item.question} has no context boundary")
        settings.update(compress="context", context_tokens=item.context_tokens)
    if mode == "context unshared":
        settings.update(share_context=False)
    if mode == "context chained":
        settings.update(chain=True)
    if REGISTRY[policy].reconstructs:
        if item.reconstruction is None:
            raise ValueError(f"{configuration}: request {item.context}/{item.question} has no reconstruction ids")
        settings.update(reconstruction=item.reconstruction)
    return settings


def sample_requests(workload: Workload, configuration: str, ratio: float) -> list:
    """vLLM's ``SampleRequest``s of ``workload`` under ``configuration`` (a conversation's first turns
    only: the later ones are made as the conversation goes, ``next_request``)."""
    return [request_of(item, configuration, ratio) for item in workload.items if item.follow_up is None]


def request_of(item: Item, configuration: str, ratio: float):
    """vLLM's ``SampleRequest`` of ``item`` under ``configuration``: its token-id prompt, with its
    ``vllm_xargs`` eviction setting (a JSON string: vllm_xargs values may only be strings and numbers)
    and its stop strings as request overrides."""
    from harness.engine.bench_client import sample_request

    overrides = {"vllm_xargs": {"kv_eviction": json.dumps(settings_for(configuration, item, ratio))}}
    if item.stop:
        overrides["stop"] = list(item.stop)
    return sample_request(item.prompt, item.max_tokens, overrides)


def conversation_of(workload: Workload, c: int) -> list[Item]:
    """Conversation ``c``'s turns (in the order conversations arrive)."""
    return workload.items[c * workload.turns:(c + 1) * workload.turns]


def next_turn(tokenizer, item: Item, prompt: list[int], answer: list[int]) -> Item:
    """Turn ``item`` made concrete after the turn before it: that turn's ``prompt``, its ``answer``
    (token ids), then the glue and ``item``'s question (``next_turn_tokens``); its boundary (what
    ``context`` configurations compress) is the history, everything before the new question."""
    from dataclasses import replace

    return replace(item, prompt=prompt + answer + next_turn_tokens(tokenizer, item.follow_up, answer),
                   context_tokens=len(prompt) + len(answer))


def next_request(workload: Workload, tokenizer, configuration: str, ratio: float):
    """``harness.engine.bench_client.conversations``' ``follow``: conversation c's turn's request."""
    def follow(c: int, turn: int, prompt: list[int], answer: list[int]):
        return request_of(next_turn(tokenizer, conversation_of(workload, c)[turn], prompt, answer), configuration,
                          ratio)
    return follow


def turn_items(workload: Workload, tokenizer, answers: list[list[int]]) -> list[Item]:
    """Every turn of every conversation made concrete from the answers it was served (token ids, in
    the workload's order): what a run sent, rebuilt."""
    if workload.turns == 1:
        return list(workload.items)
    made = []
    for item, answer in zip(workload.items, answers):
        made.append(item if item.follow_up is None else next_turn(tokenizer, item, made[-1].prompt, previous))
        previous = answer
    return made


def score(item: Item, text: str) -> float | None:
    """The request's score in [0, 1] (None for an unscored synthetic)."""
    if not item.task:
        return None
    if item.task == REGISTER_TASK:
        from harness.tasks import metric

        return metric("rouge")(text, list(item.answers))
    from harness.tasks.metrics import score_sample

    return score_sample(item.task, text, list(item.answers))
