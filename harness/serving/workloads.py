"""The serving benchmark's workloads, each one definition: a list of ``Item``s (a request's token ids,
where its context ends, its output length, its reference answer), turned into vLLM's own
``SampleRequest``s (``vllm/benchmarks/datasets/datasets.py:73-91``) for a configuration, and scored.

* ``shared_context``: ``experiments/shared_context.py``'s workload (its generator lives here:
  ``shared_contexts``, ``access_codes``, ``birthplaces``, ``prompts_of``): half the contexts a long
  text hiding one access code per person, half passages about people each born somewhere; each
  context asked one short question per person, with the embedded suite's templates and scoring.
* ``shared_context_long``: the same kind of contexts, each asked ``requests`` times to list every
  person with their access code or birthplace (one line each, in an order that differs per request,
  so each request has its own question on the shared context): answers of 128 tokens and more,
  scored by F1 of the (person, value) pairs the answer states (``pair_score``).
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
import re
from dataclasses import dataclass, field

from harness.tasks.embedded.dataset import CITIES, FIRST, JOBS, LAST, filler, people

WORKLOADS = ("shared_context", "shared_context_long", "prefix_repetition")
QUESTIONS = 6
WORDS = 1400          # about 2,000 of SmolLM2's tokens per context
LISTED = 16           # people per context in the long-answer workload (answers of about 130-200 tokens)
LONG_TOKENS = 256     # its answers' limit


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
    from harness.tasks.sample import Sample

    spec = task_spec(shared.task)
    return _same_context(shared.id, [_prompt(Sample(shared.task, f"{shared.id}-q{q}", shared.context, text,
                                                    list(answers)), spec, tokenizer, max_prompt_tokens)
                                     for q, (text, answers) in enumerate(shared.questions)])


def _prompt(sample, spec, tokenizer, max_prompt_tokens: int):
    from harness.tasks.prompts import build_prompt

    return build_prompt(sample, spec, tokenizer, max_prompt_tokens)


def _same_context(name: str, prompts: list) -> list:
    first = prompts[0]
    if any(not p.context_tokens or p.token_ids[:p.context_tokens] != first.token_ids[:first.context_tokens]
           for p in prompts):
        raise RuntimeError(f"{name}: the questions' prompts do not share one context")
    return prompts


# ----------------------------------------------------------------------------- long answers: listings
LISTING_TEMPLATE = "Read the text below, then do what is asked after it.\n\n{context}\n\nNow, {input}"
LISTING_TASK = "pairs"   # the scoring rule's name in an Item (``pair_score``)


def listing_request(shared: Shared, order: list[int]) -> str:
    """The request asking for every person of ``shared`` with their value, in ``order``."""
    names = ", ".join(shared.people[k][0] for k in order)
    what = "access code" if shared.task == "key_retrieval" else "city of birth"
    return (f"write the {what} of each of these {len(order)} people, one per line as 'Name: {what}', in this "
            f"order: {names}.")


def listing_orders(people_count: int, requests: int) -> list[list[int]]:
    """Request r lists the people starting from person ``r * people_count // requests`` (each its own
    question on the shared context, every one asking for all the people)."""
    return [[(start + k) % people_count for k in range(people_count)]
            for start in (r * people_count // requests for r in range(requests))]


def listing_prompts(shared: Shared, requests: int, tokenizer, max_prompt_tokens: int) -> list:
    from harness.tasks.sample import Sample
    from harness.tasks.spec import TaskSpec

    spec = TaskSpec(name=LISTING_TASK, template=LISTING_TEMPLATE, max_new_tokens=LONG_TOKENS, metric=LISTING_TASK)
    return _same_context(shared.id, [_prompt(Sample(LISTING_TASK, f"{shared.id}-list{r}", shared.context,
                                                    listing_request(shared, order), []), spec, tokenizer,
                                             max_prompt_tokens)
                                     for r, order in enumerate(listing_orders(len(shared.people), requests))])


NAME = re.compile(r"\b(" + "|".join(FIRST) + r")\s+(" + "|".join(LAST) + r")\b")
CODE = re.compile(r"\b\d{5}\b")
CITY = re.compile(r"\b(" + "|".join(CITIES) + r")\b")


def stated_pairs(text: str) -> dict[str, str]:
    """The (person, value) pairs an answer states: on each line, every full name of the suite's
    vocabulary and the first five-digit code or city after it (before the next name). A person
    named again later keeps the first value stated (repeating a line gains nothing)."""
    stated: dict[str, str] = {}
    for line in text.splitlines():
        names = list(NAME.finditer(line))
        for index, match in enumerate(names):
            end = names[index + 1].start() if index + 1 < len(names) else len(line)
            rest = line[match.end():end]
            value = CODE.search(rest) or CITY.search(rest)
            name = f"{match.group(1)} {match.group(2)}"
            if value is not None and name not in stated:
                stated[name] = value.group(0)
    return stated


def pair_score(text: str, answers: list[str] | tuple[str, ...]) -> float:
    """F1 (0-1) of the pairs ``text`` states against ``answers`` ("name\\tvalue" each): precision over
    the people it gives a value for (a person not in the context counts against it), recall over
    the context's people."""
    truth = dict(answer.split("\t", 1) for answer in answers)
    stated = stated_pairs(text)
    correct = sum(truth.get(name) == value for name, value in stated.items())
    if not correct:
        return 0.0
    precision, recall = correct / len(stated), correct / len(truth)
    return 2 * precision * recall / (precision + recall)


# ------------------------------------------------------------------------------------- items, requests
@dataclass(frozen=True)
class Item:
    """One request of a workload: its token ids, where its context ends (None: no shared context),
    its output limit and stop strings, and what scores it (``task``: a suite task, ``pairs``, or
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


@dataclass(frozen=True)
class Workload:
    name: str
    items: list[Item]
    ignore_eos: bool    # every request generates max_tokens (the synthetic), or stops where the model ends
    description: str

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


def shared_context_long_workload(tokenizer, contexts: int = 8, requests: int = 4, max_prompt_tokens: int = 7500,
                                 seed: int = 0, listed: int = LISTED) -> Workload:
    items = []
    for shared in shared_contexts(contexts, seed, listed):
        answers = tuple(f"{name}\t{value}" for name, value in shared.people)
        for r, prompt in enumerate(listing_prompts(shared, requests, tokenizer, max_prompt_tokens)):
            items.append(Item(shared.id, r, LISTING_TASK, list(prompt.token_ids), prompt.context_tokens, LONG_TOKENS,
                              answers, (), prompt.reconstruction))
    return Workload("shared_context_long", shuffled(items, seed), False,
                    f"{contexts} contexts (half access codes, half birthplaces; {listed} people each, about 2,000 "
                    f"tokens) x {requests} requests each listing every person with their code or city (up to "
                    f"{LONG_TOKENS} tokens), scored by F1 of the (person, value) pairs stated")


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


def build(name: str, tokenizer, **options) -> Workload:
    """A workload by name, with its options (``contexts``, ``questions``/``requests``, ...)."""
    makers = {"shared_context": shared_context_workload, "shared_context_long": shared_context_long_workload,
              "prefix_repetition": prefix_repetition_workload}
    if name not in makers:
        raise ValueError(f"unknown workload {name!r}; the workloads are: {', '.join(WORKLOADS)}")
    return makers[name](tokenizer, **options)


# --------------------------------------------------------------------------------------- configurations
MODES = ("context", "context unshared", "prompt")


def parse_configuration(name: str) -> tuple[str | None, str]:
    """``full`` -> (None, "full"); ``<policy> <mode>`` -> (policy, mode), mode one of ``MODES``."""
    if name == "full":
        return None, "full"
    policy, _, mode = name.partition(" ")
    if mode not in MODES:
        raise ValueError(f"configuration {name!r}: 'full' or '<policy> <mode>' with mode one of {', '.join(MODES)}")
    return policy, mode


def check_configurations(names: list[str]) -> None:
    """One clear line for a configuration the server would refuse anyway (before any server starts)."""
    from policies import REGISTRY

    for name in names:
        policy, _ = parse_configuration(name)
        if policy is not None and policy not in REGISTRY:
            raise ValueError(f"configuration {name!r}: no policy {policy!r}; the policies are: {', '.join(REGISTRY)}")
    if "full" not in names:
        raise ValueError("the configurations must include 'full' (every ratio is against it)")


def settings_for(configuration: str, item: Item, ratio: float) -> dict:
    """The request's ``kv_eviction`` setting (docs/serving.md): ``full`` keeps the whole cache;
    ``<policy> context`` compresses the context (its first ``context_tokens`` prompt tokens) by
    ``ratio`` before the question is computed, one copy shared by the context's requests (prefix
    caching on); ``context unshared`` the same with each request compressing its own copy;
    ``prompt`` compresses context and question together (query-aware, no sharing)."""
    from policies import REGISTRY

    policy, mode = parse_configuration(configuration)
    if policy is None:
        return {"policy": "full"}
    settings = {"policy": policy, "budget_ratio": ratio, "decode_eviction": False}
    if mode in ("context", "context unshared"):
        if item.context_tokens is None:
            raise ValueError(f"{configuration}: request {item.context}/{item.question} has no context boundary")
        settings.update(compress="context", context_tokens=item.context_tokens)
    if mode == "context unshared":
        settings.update(share_context=False)
    if REGISTRY[policy].reconstructs:
        if item.reconstruction is None:
            raise ValueError(f"{configuration}: request {item.context}/{item.question} has no reconstruction ids")
        settings.update(reconstruction=item.reconstruction)
    return settings


def sample_requests(workload: Workload, configuration: str, ratio: float) -> list:
    """vLLM's ``SampleRequest``s of ``workload`` under ``configuration``: token-id prompts, each with
    its ``vllm_xargs`` eviction setting (a JSON string: vllm_xargs values may only be strings and
    numbers) and its stop strings as request overrides."""
    from harness.engine.bench_client import sample_request

    made = []
    for item in workload.items:
        overrides = {"vllm_xargs": {"kv_eviction": json.dumps(settings_for(configuration, item, ratio))}}
        if item.stop:
            overrides["stop"] = list(item.stop)
        made.append(sample_request(item.prompt, item.max_tokens, overrides))
    return made


def score(item: Item, text: str) -> float | None:
    """The request's score in [0, 1] (None for an unscored synthetic)."""
    if not item.task:
        return None
    if item.task == LISTING_TASK:
        return pair_score(text, item.answers)
    from harness.tasks.metrics import score_sample

    return score_sample(item.task, text, list(item.answers))
