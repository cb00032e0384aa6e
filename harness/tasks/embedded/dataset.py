"""The embedded suite: long-context tasks generated from a seed, in LongBench's record format.

All text is made here from small word lists, so the suite needs no download and copies no corpus.
Each task tests one LongBench skill with a LongBench template, and a small instruct model can score
on it at full cache: the answer is stated verbatim somewhere in a long context full of distractors.
Contexts span about 1k to 7k tokens (``length`` is in words, as in LongBench).

Where the answer sits is stratified, not drawn: sample ``i`` puts it early, in the middle or late
in the context (``DEPTHS``, cycling), so any ``data.limit`` sees every depth. Random depths let a
small limit land every needle inside a recency policy's window.

``record_listing`` is the long-output task (answers of about 350-400 tokens, so decode eviction
happens mid-answer). It is opt-in, not in ``DEFAULT_TASKS``: ``data=synthetic_long`` or
``data.tasks=[record_listing]``. Every sample of it generates hundreds of tokens, and a run
directory is named by its config, in which ``tasks: null`` would not change if the default set
did: committed default-suite runs would then stand for a task set they never ran.
"""
from __future__ import annotations

import random

from harness.tasks.sample import Sample
from harness.tasks.longbench.tasks import longbench_templates
from harness.tasks.spec import TaskSpec

SAMPLES_PER_TASK = 24
# Context sizes in words (~1.3 tokens per word with SmolLM2's tokenizer): about 1k to 7k tokens.
CONTEXT_WORDS = (800, 1600, 3000, 5000)
# Where the answer goes, as a fraction of the context: early, middle, late (sample i takes
# DEPTHS[i % 3]; with four context sizes every size meets every depth within 12 samples).
DEPTHS = ((0.05, 0.3), (0.35, 0.65), (0.7, 0.95))

FIRST = "Ada Boris Cora Dmitri Elin Farid Greta Hugo Ines Jonas Kaia Lars Mira Nils Oona Pavel Rhea Soren Tilda Umar Vera Wim Yara Zeno".split()
LAST = "Abbot Brandt Castell Dorn Eskew Falk Grell Hollis Ivers Jarl Kestrel Lund Marrow Noll Orrin Pike Quill Rook Sallow Thorne Vance Wilde".split()
CITIES = "Arlen Brisk Calder Dunmore Elsby Fairholt Glenmoor Harrowgate Islay Jesmond Kelso Larkspur Melrose Norwick Ottery Penrith Quarley Rosslyn Selby Tarland".split()
JOBS = "baker carpenter chemist drummer engineer farmer geologist harpist illustrator jeweller librarian mason navigator optician potter".split()
NOUNS = "river market tower garden bridge harbour valley library orchard station meadow workshop lantern festival".split()
ADJECTIVES = "quiet old busy narrow bright distant famous small ancient windy green crowded".split()
VERBS = "opened closed grew changed moved flooded shone rested waited returned".split()
TIMES = "spring summer autumn winter morning evening night".split()


def filler_sentence(rng: random.Random) -> str:
    return (
        f"The {rng.choice(ADJECTIVES)} {rng.choice(NOUNS)} near {rng.choice(CITIES)} "
        f"{rng.choice(VERBS)} in the {rng.choice(TIMES)}."
    )


def filler(rng: random.Random, words: int) -> list[str]:
    sentences, count = [], 0
    while count < words:
        sentences.append(filler_sentence(rng))
        count += len(sentences[-1].split())
    return sentences


def insert_at_random(rng: random.Random, sentences: list[str], extra: list[str]) -> list[str]:
    out = list(sentences)
    for sentence in extra:
        out.insert(rng.randrange(len(out) + 1), sentence)
    return out


def at_depth(rng: random.Random, count: int, depth: tuple[float, float]) -> int:
    """A position among ``count`` inside the depth band (fractions of the context)."""
    low, high = depth
    return min(count - 1, int(rng.uniform(low, high) * count))


def insert_at_depth(rng: random.Random, sentences: list[str], needle: str, depth: tuple[float, float]) -> list[str]:
    out = list(sentences)
    out.insert(at_depth(rng, len(out) + 1, depth), needle)
    return out


def people(rng: random.Random, count: int) -> list[str]:
    names = [f"{first} {last}" for first in FIRST for last in LAST]
    return rng.sample(names, count)


def single_doc_qa(rng: random.Random, words: int, depth: tuple[float, float]) -> dict:
    """One long text about several towns; a single sentence names the asked town's mayor, others
    give other people's jobs in other towns (multifieldqa: find the one relevant field)."""
    names = people(rng, 6)
    towns = rng.sample(CITIES, len(names))
    distractors = [f"{name} works as a {rng.choice(JOBS)} in {town}." for name, town in zip(names[1:], towns[1:])]
    text = insert_at_depth(rng, filler(rng, words), f"The mayor of {towns[0]} is {names[0]}.", depth)
    context = " ".join(insert_at_random(rng, text, distractors))
    return {"context": context, "input": f"Who is the mayor of {towns[0]}? Answer with the name only.",
            "answers": [names[0]]}


def multi_doc_qa(rng: random.Random, words: int, depth: tuple[float, float]) -> dict:
    """Passages about different people; the question is answered by one passage (hotpotqa)."""
    count = max(4, words // 150)
    names = people(rng, count)
    passages = []
    for i, name in enumerate(names, start=1):
        city, job = rng.choice(CITIES), rng.choice(JOBS)
        body = filler(rng, words // count - 20)
        body.insert(rng.randrange(len(body) + 1), f"{name} was born in {city} and worked as a {job}.")
        passages.append((name, city, f"Passage {i}:\n{name}\n{' '.join(body)}"))
    name, city, _ = passages[at_depth(rng, count, depth)]
    return {"context": "\n".join(p for *_, p in passages), "input": f"In which city was {name} born?", "answers": [city]}


def key_retrieval(rng: random.Random, words: int, depth: tuple[float, float]) -> dict:
    """A five-digit access code hidden once in a long text (a needle in a haystack, passkey style)."""
    name = people(rng, 1)[0]
    code = str(rng.randrange(10000, 100000))
    needle = f"The access code of {name} is {code}. Remember it: {code}."
    context = " ".join(insert_at_depth(rng, filler(rng, words), needle, depth))
    return {"context": context, "input": f"What is the access code of {name}? Answer with the number only.",
            "answers": [code]}


def code_completion(rng: random.Random, words: int, depth: tuple[float, float]) -> dict:
    """A long Python class of accessor methods; the next line follows the pattern (lcc)."""
    fields = [f"{rng.choice(ADJECTIVES)}_{rng.choice(NOUNS)}_{i}" for i in range(max(6, words // 12))]
    lines = ["class Registry:", "    def __init__(self):"]
    lines += [f"        self._{f} = None" for f in fields]
    for f in fields[:-1]:
        lines += ["", f"    def get_{f}(self):", f"        return self._{f}"]
    lines += ["", f"    def get_{fields[-1]}(self):"]
    return {"context": "\n".join(lines) + "\n", "input": "", "answers": [f"        return self._{fields[-1]}"]}


# The long-output task: a register of entries kept somewhere in a long text, copied back in full.
# 16 entries of about 21 tokens each (SmolLM2's tokenizer writes a five-digit code as five tokens)
# make a reference of 350-400 tokens: past every budget's last block, so decode eviction happens
# while the answer is being written, and what is left to copy sits in the evictable prompt.
RECORDS_PER_LISTING = 16
LISTING_TEMPLATE = (
    "Read the following text. Somewhere in it is a register of entries, one per line, each "
    "starting with \"Entry\".\n\n{context}\n\nNow, {input}"
)
# Written after the assistant's header (as RULER's answer prefixes are): the register's own
# heading, so the answer starts where the copy starts; the reference is what follows it.
LISTING_ANSWER_PREFIX = "Register:\n"


def record_listing(rng: random.Random, words: int, depth: tuple[float, float]) -> dict:
    """A register of ``RECORDS_PER_LISTING`` numbered entries in one place of a long filler text,
    at a depth in the ``depth`` band; the answer is the register, line by line (a long structured
    output, scored with ROUGE-L as LongBench scores gov_report).

    The entries are together rather than scattered: SmolLM2-135M copies a contiguous list, but
    cannot gather 16 lines from across a long text (at full cache it repeats one line). Each entry
    carries a distinct code, so a skipped or invented entry changes the words ROUGE-L counts (it
    counts distinct words, and names, jobs and towns repeat); bare "Entry k:" lines keep the
    numbering's words and score about 35. ``meta["depth"]`` (percent) is where the register starts.

    Measured with ``run.py -m policy=full,paged budget=256 data.tasks=[record_listing]
    data.limit=4``: full cache 66.4 (BCa 95% 44.5-78.4), answers of 367-405 tokens where it copies;
    PagedEviction at 256 12.1 (2.2-22.0), 6-16 decode evictions per answer.
    """
    count = RECORDS_PER_LISTING
    names = people(rng, count)
    codes = rng.sample(range(10000, 100000), count)
    records = [
        f"Entry {k}: {name}, {rng.choice(JOBS)}, {rng.choice(CITIES)}, code {code}."
        for k, (name, code) in enumerate(zip(names, codes), start=1)
    ]
    register = "\n" + LISTING_ANSWER_PREFIX + "\n".join(records) + "\n"
    sentences = filler(rng, max(words - 8 * count, count))
    position = at_depth(rng, len(sentences) + 1, depth)
    context = " ".join(sentences[:position]) + register + " ".join(sentences[position:])
    return {"context": context,
            "input": f"copy the register: its {count} entries in order, one per line, exactly as written.",
            "answers": ["\n".join(records)],
            "meta": {"answer_prefix": LISTING_ANSWER_PREFIX, "depth": round(100 * position / (len(sentences) + 1), 2)}}


def _spec(name: str, longbench_task: str, metric: str, max_new_tokens: int, chat: bool = True) -> TaskSpec:
    return TaskSpec(
        name=name,
        template=longbench_templates()[longbench_task]["prompt"],
        max_new_tokens=max_new_tokens,
        metric=metric,
        chat=chat,
    )


# name -> (generator, task spec). Templates are LongBench's for the same skill, and so are the
# metrics, except where LongBench's would not score what the task asks (key_retrieval).
TASKS = {
    "single_doc_qa": (single_doc_qa, _spec("single_doc_qa", "multifieldqa_en", "qa_f1", 16)),
    "multi_doc_qa": (multi_doc_qa, _spec("multi_doc_qa", "hotpotqa", "qa_f1", 16)),
    # The task asks for the code, and a sentence that states it answers: scored as RULER scores its
    # needles (string_match_all: the code occurs in the answer), not by token F1, which gives
    # "The access code of Ada Brandt is 23205." 0.25 for the right code.
    "key_retrieval": (key_retrieval, _spec("key_retrieval", "multifieldqa_en", "string_match_all", 16)),
    # No counting or few-shot labelling task: SmolLM2-135M scores 0 on passage counting and chance on
    # a trec-style lookup at full cache, and a task no policy can score on says nothing about eviction.
    # LongBench's own lcc length: 64 tokens (two blocks and more), so every policy also evicts while
    # generating it; the QA answers above end within a few tokens.
    "code_completion": (code_completion, _spec("code_completion", "lcc", "code_sim", 64, chat=False)),
    "record_listing": (record_listing, TaskSpec(name="record_listing", template=LISTING_TEMPLATE,
                                                max_new_tokens=512, metric="rouge",
                                                # the register has 16 entries: a 17th is invented
                                                stop=(f"Entry {RECORDS_PER_LISTING + 1}:",))),
}


# What ``data.tasks: null`` runs: every task but the long-output one (see the module's docstring).
DEFAULT_TASKS = ("single_doc_qa", "multi_doc_qa", "key_retrieval", "code_completion")


def generate(seed: int = 0, tasks: list[str] | None = None, samples_per_task: int = SAMPLES_PER_TASK,
             context_words: tuple[int, ...] = CONTEXT_WORDS) -> list[Sample]:
    """The suite for a seed: same seed, same samples, byte for byte. Sample ``i`` of a task has a
    context of about ``context_words[i % len(context_words)]`` words and its answer at depth
    ``DEPTHS[i % 3]``. ``tasks`` None: ``DEFAULT_TASKS``."""
    samples = []
    for name in tasks or DEFAULT_TASKS:
        make, _ = TASKS[name]
        for index in range(samples_per_task):
            rng = random.Random(f"{seed}/{name}/{index}")
            words = context_words[index % len(context_words)]
            record = make(rng, words, DEPTHS[index % len(DEPTHS)])
            samples.append(
                Sample(
                    task=name,
                    id=f"{name}-{seed}-{index}",
                    context=record["context"],
                    input=record["input"],
                    answers=record["answers"],
                    length=len(record["context"].split()),
                    meta=record.get("meta", {}),
                )
            )
    return samples
