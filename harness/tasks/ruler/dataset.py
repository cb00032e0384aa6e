"""RULER (Hsieh et al., arXiv 2404.06654), generated here: synthetic long-context tasks at a length
in tokens of the evaluated model's tokenizer, scored by string match.

RULER is a generator, not a dataset. Its task texts (templates, answer prefixes, needle sentence,
noise sentence) are the authors' data, kept in ``templates.json`` with their attribution;
the generator is written here from the rules in ``design/RULER.md``:

* NIAH: needle sentences "One of the special magic {numbers} for {key} is: {value}." in a haystack
  of the noise sentences, of generated prose (standing in for the Paul Graham essays, which
  cannot be downloaded here: those tasks are named ``*_generated``), or of other needles. Keys are
  adjective-noun words, 7-digit numbers or UUIDs; values 7-digit numbers or UUIDs.
* ``vt``: one chain ``VAR A = 12345``, ``VAR B = VAR A``, ... of four hops in the noise haystack;
  the answer is every variable of the chain.
* ``cwe``: a numbered list in which 10 words occur 30 times and the others 3 (6 and 1 below 4k
  tokens), after one worked example; the answer is the 10 common words.
* ``fwe``: coded six-letter words drawn from a Zipf law (alpha 2); the answer is the three most
  frequent after the first, which stands for noise (``...``).
* ``qa_generated``: the embedded suite's generated passages (``harness.tasks.embedded.dataset``) in
  place of SQuAD/HotpotQA documents: one passage answers the question, the others distract.

Each sample is sized so that its prompt (template, context, answer prefix; not the chat
template's few tokens) plus the task's tokens to generate fits the target length: the haystack's
size is searched with the tokenizer, as the authors' scripts do. Where a single needle goes is
stratified, not drawn: sample i at a length takes the depth ``DEPTHS[order[i]]`` (40 evenly spaced
depths 0..100%, visited in a golden-ratio order so that any ``data.limit`` spreads over them), and
``meta["depth"]`` records it, for the depth x length heatmap. Multi-needle tasks draw their depths
from the same 40 without replacement, as RULER does. Scoring: ``string_match_all`` (the share of
the references found in the prediction, case-insensitive) and ``string_match_part`` (1 if any is).

Where a prompt's context ends (``compress=context``): as kvpress splits a RULER prompt, the question
(``What are all the special magic ...``, ``Question: ...``) and the answer prefix are not context;
the preamble, the instruction before the haystack and the haystack are
(``harness.tasks.prompts.build_prompt``).
"""
from __future__ import annotations

import json
import math
import random
import string
import uuid
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from harness.tasks.sample import DataError, Sample
from harness.tasks.spec import TaskSpec

LENGTHS = (1024, 2048, 4096, 8192)  # tokens; SmolLM2's context is 8k (any length on a larger model)
SAMPLES_PER_LENGTH = 40
DEPTHS = tuple(round(100 * i / 39, 2) for i in range(40))  # percent, as RULER's np.linspace(0, 100, 40)
GOLDEN = (math.sqrt(5) - 1) / 2

ADJECTIVES = ("amber bold brisk calm clever cosmic crimson curious daring dusty eager elegant faint fierce "
              "gentle giant golden hollow humble icy jolly keen lively lucky mellow mighty misty noble odd "
              "pale plucky proud quick quiet rapid rosy rustic shiny silent silver sleepy sly smooth solid "
              "stormy sturdy sunny swift tame tidy vivid wary wild witty young zesty").split()
NOUNS = ("anchor badger beacon canyon castle cedar cobra comet coral crane delta ember falcon fern fjord "
         "forest garnet glacier harbor hazel heron island jaguar lagoon lantern lotus maple meadow meteor "
         "nebula oasis orchid otter panther pebble pepper prairie quartz raven reef river saddle sparrow "
         "summit thicket tiger tulip valley walrus willow wren yarrow zephyr").split()
SYLLABLES = ("ba be bi bo bu da de di do du fa fe fi fo ga ge go ka ke ki ko la le li lo lu ma me mi mo mu "
             "na ne ni no nu pa pe pi po ra re ri ro ru sa se si so ta te ti to va ve vi vo za zo").split()


@cache
def templates() -> dict:
    return json.loads(Path(__file__).with_name("templates.json").read_text())


@dataclass(frozen=True)
class Niah:
    haystack: str        # "noise" | "prose" | "needle"
    key: str = "words"   # "words" | "numbers" | "uuids"
    value: str = "numbers"
    keys: int = 1
    values: int = 1
    queries: int = 1


# name -> the task's configuration (RULER's scripts/synthetic.yaml, prose for the essays).
NIAH_TASKS = {
    "niah_single_1": Niah("noise"),
    "niah_single_2_generated": Niah("prose"),
    "niah_single_3_generated": Niah("prose", value="uuids"),
    "niah_multikey_1_generated": Niah("prose", keys=4),
    "niah_multikey_2": Niah("needle"),
    "niah_multikey_3": Niah("needle", key="uuids", value="uuids"),
    "niah_multivalue_generated": Niah("prose", values=4),
    "niah_multiquery_generated": Niah("prose", keys=4, queries=4),
}
TASK_FAMILIES = {**{name: "niah" for name in NIAH_TASKS}, "vt": "variable_tracking",
                 "cwe": "common_words_extraction", "fwe": "freq_words_extraction", "qa_generated": "qa"}
TASKS = tuple(TASK_FAMILIES)
METRICS = {"qa": "string_match_part"}  # every other family: string_match_all


def needle_noun(task: str) -> str | None:
    """What a NIAH task's needles hold, as its texts say it ("number" when one value is asked)."""
    config = NIAH_TASKS.get(task)
    if config is None:
        return None
    return config.value if config.values * config.queries > 1 else config.value[:-1]


def singular(text: str, noun: str | None) -> str:
    """RULER's wording when one value is asked: "A special magic number ... is"."""
    if noun is None or noun.endswith("s"):
        return text
    return text.replace("Some", "A").replace("are all", "is").replace("are", "is").replace("answers", "answer")


def task_spec(task: str) -> TaskSpec:
    family = TASK_FAMILIES[task]
    text = templates()["tasks"][family]
    noun = needle_noun(task)
    template = singular(text["template"], noun).replace("{type_needle_v}", noun or "")
    return TaskSpec(name=task, template=template, max_new_tokens=text["tokens_to_generate"],
                    metric=METRICS.get(family, "string_match_all"))


def answer_prefix(task: str, query: str, count: int | str = "") -> str:
    text = templates()["tasks"][TASK_FAMILIES[task]]["answer_prefix"]
    noun = needle_noun(task)
    return singular(text, noun).format(type_needle_v=noun or "", query=query, num_v=count)


# ---------------------------------------------------------------- needles and haystacks


def random_item(rng: random.Random, kind: str) -> str:
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "words":
        return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(kind)


def prose_sentence(rng: random.Random) -> str:
    from harness.tasks.embedded.dataset import filler_sentence

    return filler_sentence(rng)


def place(sentences: list[str], needles: list[str], depths: list[float], joiner: str = " ") -> str:
    """The needles inserted among the sentences at the given depths (percent), in depth order; the
    noise and needle haystacks are one sentence group per line, prose runs on (as in RULER)."""
    out, last = [], 0
    positions = sorted(int(len(sentences) * depth / 100) for depth in depths)
    for needle, position in zip(needles, positions):
        out += sentences[last:position] + [needle]
        last = position
    return joiner.join(out + sentences[last:])


def niah(rng: random.Random, config: Niah, size: int, depths: list[float]) -> dict:
    kind = config.value
    needle = templates()["needle"]
    keys = []
    while len(keys) < max(config.keys, config.queries):
        key = random_item(rng, config.key)
        if key not in keys:
            keys.append(key)
    values = [[random_item(rng, kind) for _ in range(config.values)] for _ in keys]
    needles = [needle.format(type_needle_v=kind, key=k, value=v) for k, vs in zip(keys, values) for v in vs]
    rng.shuffle(needles)
    if config.haystack == "noise":
        haystack = [templates()["noise"]] * size
    elif config.haystack == "prose":
        haystack = [prose_sentence(rng) for _ in range(size)]
    else:  # other needles, none with a key the sample asks about (the answer stays unique)
        haystack = []
        while len(haystack) < size:
            key = random_item(rng, config.key)
            if key not in keys:
                haystack.append(needle.format(type_needle_v=kind, key=key, value=random_item(rng, kind)))
    asked = rng.sample(range(len(keys)), config.queries)
    queried = [keys[i] for i in asked]
    query = queried[0] if len(queried) == 1 else ", ".join(queried[:-1]) + ", and " + queried[-1]
    joiner = " " if config.haystack == "prose" else "\n"
    return {"context": place(haystack, needles, depths, joiner), "input": query,
            "answers": [v for i in asked for v in values[i]]}


def variable_tracking(rng: random.Random, size: int, depths: list[float]) -> dict:
    names = set()
    while len(names) < 5:
        names.add("".join(rng.choices(string.ascii_uppercase, k=5)))
    chain = sorted(names)  # a set's order depends on the process's hash seed; the shuffle must not
    rng.shuffle(chain)
    value = str(rng.randint(10000, 99999))
    statements = [f"VAR {chain[0]} = {value}"] + [f"VAR {b} = VAR {a} " for a, b in zip(chain, chain[1:])]
    haystack = [templates()["noise"]] * size
    return {"context": place(haystack, statements, depths, "\n"), "input": value, "answers": chain,
            "count": len(chain)}


def pseudo_words(rng: random.Random, count: int) -> list[str]:
    words: set[str] = set()
    while len(words) < count:
        words.add("".join(rng.choices(SYLLABLES, k=rng.randint(2, 4))))
    return sorted(words)


def common_words(rng: random.Random, size: int, short: bool) -> dict:
    def example(words: int, common: int, uncommon: int) -> tuple[str, list[str]]:
        chosen = rng.sample(vocabulary, words)
        listed = chosen[:10] * common + chosen[10:] * uncommon
        rng.shuffle(listed)
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(listed)), chosen[:10]

    vocabulary = pseudo_words(rng, max(size, 40) + 10)
    shot_context, shot_answer = example(20, 3, 1) if short else example(40, 10, 3)
    shot = (task_spec("cwe").template.format(context=shot_context, input="") + answer_prefix("cwe", "") + " "
            + " ".join(f"{i + 1}. {w}" for i, w in enumerate(shot_answer)))
    context, answer = example(size, 6, 1) if short else example(size, 30, 3)
    return {"context": context, "input": "", "answers": answer, "preamble": shot + "\n"}


def frequent_words(rng: random.Random, size: int, vocabulary_size: int) -> dict:
    vocabulary = set()
    while len(vocabulary) < vocabulary_size:
        vocabulary.add("".join(rng.choices(string.ascii_lowercase, k=6)))
    ranked = sorted(vocabulary)
    rng.shuffle(ranked)
    ranked[0] = "..."  # the most frequent stands for noise
    zeta = math.pi ** 2 / 6
    words = [w for k, w in enumerate(ranked, start=1) for _ in range(int(size * k ** -2.0 / zeta))]
    rng.shuffle(words)
    return {"context": " ".join(words), "input": "", "answers": ranked[1:4]}


def qa_passages(rng: random.Random, size: int, depths: list[float]) -> dict:
    from harness.tasks.embedded.dataset import CITIES, JOBS, filler, people

    names = people(rng, max(size, 2))
    facts = [(name, rng.choice(CITIES), rng.choice(JOBS)) for name in names]
    passages = [f"Document {i + 1}:\n{name} was born in {city} and worked as a {job}. "
                + " ".join(filler(rng, 40)) for i, (name, city, job) in enumerate(facts)]
    asked = min(len(facts) - 1, int(len(facts) * depths[0] / 100))
    name, city, _ = facts[asked]
    return {"context": "\n\n".join(passages), "input": f"In which city was {name} born?", "answers": [city]}


# ---------------------------------------------------------------- samples at a length


def make(task: str, rng: random.Random, size: int, depths: list[float], length: int) -> dict:
    family = TASK_FAMILIES[task]
    if family == "niah":
        record = niah(rng, NIAH_TASKS[task], size, depths)
    elif family == "variable_tracking":
        record = variable_tracking(rng, size, depths)
    elif family == "common_words_extraction":
        # RULER switches to its long setting (30 / 3 repeats, a 40-word example) at 4096 tokens of
        # real words; a numbered pseudo-word takes about twice the tokens, and at 4096 the long
        # setting cannot list even 10 common words: it starts at 8192 here.
        record = common_words(rng, size, short=length < 8192)
    elif family == "freq_words_extraction":
        record = frequent_words(rng, size, vocabulary_size=max(length // 50, 10))
    else:
        record = qa_passages(rng, size, depths)
    record["answer_prefix"] = answer_prefix(task, record["input"], record.get("count", ""))
    return record


def prompt_text(task: str, record: dict) -> str:
    """The prompt as RULER sizes it: preamble (worked example), template, answer prefix."""
    body = task_spec(task).template.format(context=record["context"], input=record["input"])
    return record.get("preamble", "") + body + record["answer_prefix"]


def template_tokens(tokenizer) -> int:
    """Tokens the chat template adds around a user message (0 without one)."""
    if not getattr(tokenizer, "chat_template", None):
        return 0
    text = tokenizer.apply_chat_template([{"role": "user", "content": ""}], tokenize=False, add_generation_prompt=True)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def fitted(task: str, seed: tuple, depths: list[float], length: int, tokenizer, overhead: int = 0) -> dict:
    """The largest haystack whose prompt (with ``overhead`` tokens of chat template) plus the task's
    new tokens fits ``length`` tokens (a binary search over the haystack's size; the same seed
    draws the same sample at each size)."""
    budget = length - task_spec(task).max_new_tokens - overhead

    def tokens(size: int) -> tuple[int, dict]:
        record = make(task, random.Random(repr(seed)), size, depths, length)
        return len(tokenizer(prompt_text(task, record), add_special_tokens=False)["input_ids"]), record

    # Sizes are counted in the task's units (sentences, list words, coded words, passages): none
    # takes fewer than two tokens, and QA's people are as many as the embedded suite can name.
    # cwe lists its 10 common words and at least one uncommon one, or the question has no answer.
    smallest = 11 if task == "cwe" else 1
    low, high, best = smallest, min(length // 2, 500) if task == "qa_generated" else length // 2, None
    while low <= high:
        middle = (low + high) // 2
        count, record = tokens(middle)
        if count <= budget:
            best, low = record, middle + 1
        else:
            high = middle - 1
    if best is None:
        raise DataError(f"RULER {task} cannot fit a sample in {length} tokens (it needs at least {smallest} "
                        "units of its haystack)")
    return best


def depth_order(seed: int) -> list[int]:
    """Indices into DEPTHS in a golden-ratio order from a seeded start: any prefix spreads evenly."""
    start = random.Random(seed).random()
    order: list[int] = []
    step = 0
    while len(order) < len(DEPTHS):
        index = int(((start + step * GOLDEN) % 1) * len(DEPTHS))
        if index not in order:
            order.append(index)
        step += 1
    return order


def needle_count(task: str) -> int:
    """How many sentences a sample places (needles, chain statements); 0: it places one passage."""
    if task in NIAH_TASKS:
        config = NIAH_TASKS[task]
        return max(config.keys, config.queries) * config.values
    return {"vt": 5}.get(task, 1 if task == "qa_generated" else 0)


def generate(tokenizer, seed: int = 0, tasks: list[str] | None = None, lengths: tuple[int, ...] = LENGTHS,
             samples_per_length: int = SAMPLES_PER_LENGTH) -> list[Sample]:
    """RULER samples: per task and length, ``samples_per_length`` of them, ids ``task-length-i``.
    A sample with one needle (or one answering passage) records its depth in ``meta["depth"]``."""
    unknown = [t for t in tasks or () if t not in TASK_FAMILIES]
    if unknown:
        raise DataError(f"unknown RULER task(s) {', '.join(unknown)}; valid: {', '.join(TASKS)}")
    order = depth_order(seed)
    overhead = template_tokens(tokenizer)
    samples = []
    for task in tasks or TASKS:
        count = needle_count(task)
        for length in lengths:
            for index in range(samples_per_length):
                draw = random.Random(repr((seed, task, length, index, "depths")))
                depths = [DEPTHS[order[index % len(DEPTHS)]]] if count == 1 else draw.sample(DEPTHS, count)
                record = fitted(task, (seed, task, length, index), depths, length, tokenizer, overhead)
                meta = {"length_tokens": length, "answer_prefix": record["answer_prefix"]}
                if count == 1:
                    meta["depth"] = depths[0]
                if record.get("preamble"):
                    meta["preamble"] = record["preamble"]
                samples.append(Sample(task=task, id=f"{task}-{length}-{index}", context=record["context"],
                                      input=record["input"], answers=list(record["answers"]), length=length,
                                      meta=meta))
    return samples
