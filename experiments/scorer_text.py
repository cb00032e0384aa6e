"""The learned scorer's training text: a generator of its own, and the check that no evaluation uses it.

The scorer (``policies/learned.py``) learns how attention falls over a long prompt from K/V norms,
so its training prompts need the shape of the evaluated ones (a long context, the question at the
end, 1.1k-7.5k tokens of SmolLM2 with its chat template) but none of their text. This module writes
such prompts from its own sentence templates and its own word lists, which share no word with the
evaluation generators' lists (``harness/tasks/embedded/dataset.py``, ``harness/tasks/ruler/``):

* ``village_notes``: pages of a village record book, one sentence of which says who keeps a key
  (the asked one at an early, middle or late depth, others' keys elsewhere);
* ``letters``: numbered letters, each naming a cousin and the trade the cousin went to learn; the
  question asks one cousin's trade (the letter at the depth);
* ``workshop_diary``: a long diary with a six-digit serial number stamped on one person's object,
  three other serials elsewhere;
* ``storeroom_account``: prose with a contiguous list of twelve shelf lines somewhere in it; the
  question asks who checked one shelf;
* ``stock_module``: a Python file of stock-keeping functions; the answer is the next line (fed
  without the chat template, as LongBench feeds code).

Numbers are six digits (serials) or four (years), so none equals the evaluation's five-digit codes
and values or RULER's seven-digit ones. Same seed, same prompts, byte for byte.

The check (``overlap``): every text is cut into sentences on ``.``, ``?``, ``!`` and line breaks;
each is lowercased and every run of characters other than letters and digits becomes one space
(punctuation, underscores and spacing cannot hide a shared sentence); fragments of fewer than
``MIN_WORDS`` (4) words are ignored: "Passage 3", "Answer:", "1. bafe", a name or a number are
not sentences of a text, any two texts share such pieces, and what they could carry (names,
places, answers) is checked otherwise (answers exactly, words by ``vocabulary_check``). A training
prompt's sentences are those of its whole text before the chat template (the model's, the same for
every prompt): instructions, context, question; and an evaluation prompt's the same (with RULER's
worked example and answer prefix). Training answers must equal no evaluation answer (normalised
alike). The evaluation side (``evaluation_corpora``) is every family the harness has, at every
seed and size a committed config or script uses, and more (``EVALUATION`` lists it).
"""
from __future__ import annotations

import random
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

# This checkout's code, not whichever one the venv's editable install points at.
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from harness.tasks.embedded.dataset import at_depth, insert_at_depth, insert_at_random  # noqa: E402
from harness.tasks.sample import DataError, Sample  # noqa: E402
from harness.tasks.spec import TaskSpec  # noqa: E402

SEED = 20240611          # the training text's seed (no evaluation generator is involved at all)
PER_SHAPE = 6            # prompts per shape the script generates by default
# Context sizes in words, cycling as the embedded suite's do; the names here take more tokens per
# word than the suite's, so these land on its range of about 1.1k-7.5k tokens with SmolLM2.
CONTEXT_WORDS = (700, 1400, 2600, 4400)
DEPTHS = ((0.05, 0.3), (0.35, 0.65), (0.7, 0.95))  # early, middle, late, cycling with the index
MIN_WORDS = 4

# ------------------------------------------------------------------ the generator's own words

GIVEN = ("Anselm Beatrix Caspar Delphine Emrys Fenella Gideon Hesper Isidore Juniper Lorcan Maudie Nerys "
         "Osric Perpetua Quillon Rosalind Severin Tamsin Ulric Verity Wystan Xanthe Yestin Zillah").split()
FAMILY = ("Ashdown Blackwood Carrow Dunleavy Everard Fairweather Goodbody Hartnell Inchbald Jellicoe "
          "Kettering Lockwood Merriman Netherby Ormsby Pennington Quartermain Redfern Stainforth "
          "Tregarthen Underhill Wakefield Yelverton").split()
PLACES = ("Ambleford Brackenhurst Coldharbour Drumlanrig Eskdale Foxcombe Gorsley Hatherleigh Ingleby "
          "Lydbrook Mortehoe Nettlecombe Oakhanger Pitlochry Quenington Ravenglass Slindon Tintagel "
          "Uffington Wetheral Yarcombe Zennor").split()
OBJECTS = ("kettle compass barometer teapot chisel saddlebag telescope birdcage hourglass inkwell "
           "gramophone typewriter weathervane sundial thimble cartwheel bellows fiddle hamper padlock "
           "quilt satchel tinderbox wheelbarrow").split()
MATERIALS = "brass pewter walnut copper tin wicker linen slate cork enamel".split()
TRADES = ("cooper wheelwright glazier thatcher saddler cobbler tanner farrier chandler ropemaker "
          "bookbinder clockmaker").split()
COLOURS = "ochre teal maroon indigo russet mauve".split()
# (no May: "may" is a word of LongBench's passage_count instructions)
MONTHS = "January February March April June July August September October November December".split()
BUILDINGS = "pumphouse tithebarn belfry granary smithy dovecote".split()
GROUPS = ("bellringers", "allotment society", "choral society", "rowing club", "parish council", "quilting circle")
SMELLS = "tar beeswax woodsmoke camphor linseed vinegar".split()
# Every word the lists above can put in a text: none may occur anywhere in the evaluation texts
# (``vocabulary_check``), and every training sentence carries at least one of the markers.
VOCABULARY = frozenset(w.lower() for words in (GIVEN, FAMILY, PLACES, OBJECTS, MATERIALS, TRADES, COLOURS,
                                                MONTHS, BUILDINGS, SMELLS, GROUPS) for item in words for w in item.split())
MARKERS = frozenset(w.lower() for words in (GIVEN, FAMILY, PLACES, OBJECTS, TRADES, BUILDINGS) for w in words)

# Prose: every template names at least one person, place, object, trade or building of the lists.
PROSE = (
    "{person} kept the {material} {object} on a shelf above the door in {place}.",
    "Every {month} the {group} of {place} met to repair the {object}.",
    "{person}, a {trade} from {place}, sold a {object} for {small} shillings.",
    "The road from {place} to {place2} was closed for {small} days after the storm in {month}.",
    "Nobody in {place} could explain why the {object} had been painted {colour}.",
    "{person} borrowed a {object} from {person2} and returned it with a note.",
    "In {month}, {person} counted {small} of them in the storeroom at {place}.",
    "The {trade} at {place} charged extra for mending a {material} {object}.",
    "{person} wrote that the {object} at {place} had stopped working again.",
    "A {colour} {object} turned up behind the chapel in {place} after the fair.",
    "{person} taught {person2} how to oil a {object} without spoiling the {material}.",
    "According to the parish records, {place} had {small} households in {year}.",
    "The {object} that {person} inherited was older than the {building} at {place}.",
    "{person} and {person2} argued for an hour over the price of the {object}.",
    "Visitors to {place} often asked about the {material} {object} in the hall.",
    "The {group} in {place} voted to buy a new {object} before {month}.",
    "When the {object} broke, {person} walked to {place} to find a {trade}.",
    "{person} said the {object} smelled of {smell} and {smell2}.",
    "Rain kept the {trade} of {place} indoors for most of {month}.",
    "In {year} the {building} at {place} was whitewashed by {person}.",
    "Was the {object} in {place} really bought by {person} in {year}?",
    "What a clatter the {object} made when {person} dropped it on the stairs!",
    "{person} never trusted the {object} that hung in the {place} inn.",
    "A letter from {place} asked {person} to bring the {object} back by {month}.",
    "\"Leave the {object} by the {building},\" {person} told the {trade}.",
    "The {trade} who lived past the {building} in {place} kept bees and a {object}.",
    "On market days {person} set out a {colour} cloth and a row of {material} goods at {place}.",
    "Children from {place} were not allowed near the {building} after dark.",
)


def person(rng: random.Random) -> str:
    return f"{rng.choice(GIVEN)} {rng.choice(FAMILY)}"


def people(rng: random.Random, count: int) -> list[str]:
    return rng.sample([f"{g} {f}" for g in GIVEN for f in FAMILY], count)


def prose_sentence(rng: random.Random) -> str:
    two = rng.sample(PLACES, 2)
    smells = rng.sample(SMELLS, 2)
    return rng.choice(PROSE).format(
        person=person(rng), person2=person(rng), place=two[0], place2=two[1], object=rng.choice(OBJECTS),
        material=rng.choice(MATERIALS), trade=rng.choice(TRADES), colour=rng.choice(COLOURS),
        month=rng.choice(MONTHS), group=rng.choice(GROUPS), building=rng.choice(BUILDINGS),
        smell=smells[0], smell2=smells[1], small=rng.randint(2, 60), year=rng.randint(1700, 1899))


def prose(rng: random.Random, words: int) -> list[str]:
    sentences, count = [], 0
    while count < words:
        sentences.append(prose_sentence(rng))
        count += len(sentences[-1].split())
    return sentences


def paragraphs(rng: random.Random, sentences: list[str]) -> str:
    """Sentences run on in paragraphs of 3 to 8, a blank line between paragraphs."""
    out, start = [], 0
    while start < len(sentences):
        size = rng.randint(3, 8)
        out.append(" ".join(sentences[start:start + size]))
        start += size
    return "\n\n".join(out)


# ------------------------------------------------------------------ the shapes


def village_notes(rng: random.Random, words: int, depth: tuple[float, float]) -> dict:
    names = people(rng, 5)
    places = rng.sample(PLACES, 5)
    buildings = [rng.choice(BUILDINGS) for _ in names]
    keys = [f"The key to the {b} at {p} is kept by {n}." for n, p, b in zip(names, places, buildings)]
    text = insert_at_random(rng, insert_at_depth(rng, prose(rng, words), keys[0], depth), keys[1:])
    return {"context": paragraphs(rng, text),
            "input": f"who keeps the key to the {buildings[0]} at {places[0]}? Reply with the full name and nothing else.",
            "answers": [names[0]]}


def letters(rng: random.Random, words: int, depth: tuple[float, float]) -> dict:
    count = max(4, words // 160)
    writers, cousins = people(rng, 2 * count)[:count], people(rng, 2 * count)[count:]
    trades = [rng.choice(TRADES) for _ in range(count)]
    parts = []
    for k, (writer, cousin, trade) in enumerate(zip(writers, cousins, trades), start=1):
        body = prose(rng, max(words // count - 25, 20))
        body.insert(rng.randrange(len(body) + 1),
                    f"My cousin {cousin} has gone to {rng.choice(PLACES)} to train as a {trade}.")
        parts.append(f"Letter {k}, from {writer}:\n{' '.join(body)}")
    asked = at_depth(rng, count, depth)
    return {"context": "\n\n".join(parts),
            "input": f"what trade did {cousins[asked]} go away to learn? Reply with one word.",
            "answers": [trades[asked]]}


def workshop_diary(rng: random.Random, words: int, depth: tuple[float, float]) -> dict:
    owners = people(rng, 4)
    objects = [rng.choice(OBJECTS) for _ in owners]
    serials = [str(s) for s in rng.sample(range(100000, 1000000), len(owners))]
    stamped = [f"Stamped under the {o} belonging to {n} is the serial number {s}, which {n.split()[0]} wrote in chalk."
               for n, o, s in zip(owners, objects, serials)]
    text = insert_at_random(rng, insert_at_depth(rng, prose(rng, words), stamped[0], depth), stamped[1:])
    return {"context": paragraphs(rng, text),
            "input": f"what serial number is stamped under the {objects[0]} belonging to {owners[0]}? "
                     "Reply with the six digits only.",
            "answers": [serials[0]]}


SHELVES = 12


def storeroom_account(rng: random.Random, words: int, depth: tuple[float, float]) -> dict:
    checkers = people(rng, SHELVES)
    lines = [f"Shelf {k}: a {rng.choice(MATERIALS)} {rng.choice(OBJECTS)} and {rng.randint(2, 60)} more like it, "
             f"checked by {name} in {rng.choice(MONTHS)}." for k, name in enumerate(checkers, start=1)]
    text = prose(rng, max(words - 14 * SHELVES, 40))
    position = at_depth(rng, len(text) + 1, depth)
    context = (" ".join(text[:position]) + "\n\nStoreroom shelves:\n" + "\n".join(lines) + "\n\n"
               + " ".join(text[position:]))
    shelf = rng.randrange(SHELVES)
    return {"context": context, "input": f"who checked shelf {shelf + 1}? Reply with the full name only.",
            "answers": [checkers[shelf]]}


def stock_module(rng: random.Random, words: int, depth: tuple[float, float]) -> dict:
    """Functions that add to, take from or count a stock entry; the next line follows from the
    last function's name (its body is the answer)."""
    place = rng.choice(PLACES)
    lines = [f'"""Stock records of the {place} storeroom, kept by {person(rng)}."""', "", "STOCK = {}", ""]

    def body(kind: str, item: str) -> str:
        if kind == "add":
            return f'    STOCK["{item}"] = STOCK.get("{item}", 0) + count'
        if kind == "take":
            return f'    STOCK["{item}"] = max(STOCK.get("{item}", 0) - count, 0)'
        return f'    return STOCK.get("{item}", 0)'

    # About 34 words of prose per function give the same tokens (a function is ~58 SmolLM2 tokens).
    for index in range(max(8, words // 34)):
        kind, item = rng.choice(("add", "take", "tally")), f"{rng.choice(MATERIALS)}_{rng.choice(OBJECTS)}_{index}"
        lines += ["", f"def {kind}_{item}({'' if kind == 'tally' else 'count'}):", body(kind, item)]
        if kind != "tally":
            lines.append(f'    return STOCK["{item}"]')
    index += 1
    kind, item = rng.choice(("add", "take", "tally")), f"{rng.choice(MATERIALS)}_{rng.choice(OBJECTS)}_{index}"
    lines += ["", f"def {kind}_{item}({'' if kind == 'tally' else 'count'}):"]
    return {"context": "\n".join(lines) + "\n", "input": "", "answers": [body(kind, item)]}


def _spec(name: str, template: str, max_new_tokens: int = 16, chat: bool = True) -> TaskSpec:
    return TaskSpec(name=name, template=template, max_new_tokens=max_new_tokens, metric="qa_f1", chat=chat)


# name -> (generator, rules). The instructions are worded here: no evaluation template's sentence.
SHAPES = {
    "village_notes": (village_notes, _spec("village_notes", (
        "The pages below are copied from a village record book. Read every page with care.\n\n"
        "{context}\n\nUsing only those pages, {input}"))),
    "letters": (letters, _spec("letters", (
        "Here is a bundle of old letters, each headed by its number and its writer.\n\n"
        "{context}\n\nFrom the letters above, {input}"))),
    "workshop_diary": (workshop_diary, _spec("workshop_diary", (
        "A long workshop diary follows. Somewhere in it serial numbers are written down.\n\n"
        "{context}\n\nQuestion about the diary: {input}"))),
    "storeroom_account": (storeroom_account, _spec("storeroom_account", (
        "This is a storekeeper's account, with a list of shelves somewhere inside it.\n\n"
        "{context}\n\nLooking back over the account, {input}"))),
    "stock_module": (stock_module, _spec("stock_module", "# Python source; the line that follows comes next.\n{context}",
                                         max_new_tokens=48, chat=False)),
}


def generate(seed: int = SEED, per_shape: int = PER_SHAPE, shapes: list[str] | None = None,
             context_words: tuple[int, ...] = CONTEXT_WORDS) -> list[Sample]:
    """Training prompts: per shape, ``per_shape`` samples; sample ``i`` has about
    ``context_words[i % len]`` words and its answer at depth ``DEPTHS[i % 3]``."""
    samples = []
    for name in shapes or SHAPES:
        make, _ = SHAPES[name]
        for index in range(per_shape):
            rng = random.Random(f"scorer-text/{seed}/{name}/{index}")
            record = make(rng, context_words[index % len(context_words)], DEPTHS[index % len(DEPTHS)])
            samples.append(Sample(task=name, id=f"{name}-{seed}-{index}", context=record["context"],
                                  input=record["input"], answers=record["answers"],
                                  length=len(record["context"].split())))
    return samples


def spec(task: str) -> TaskSpec:
    return SHAPES[task][1]


# ------------------------------------------------------------------ the check

_SPLIT = re.compile(r"[.?!\n]+")
_NON_WORD = re.compile(r"[^0-9a-z]+")


def normalise(text: str) -> str:
    return _NON_WORD.sub(" ", text.lower()).strip()


def sentences(text: str) -> set[str]:
    """The normalised sentences of ``text`` with at least ``MIN_WORDS`` words."""
    out = set()
    for piece in _SPLIT.split(text):
        piece = normalise(piece)
        if piece.count(" ") + 1 >= MIN_WORDS:
            out.add(piece)
    return out


def prompt_text(sample: Sample, template: str) -> str:
    """The prompt's whole text before any chat template: worked example, instructions, context,
    question, answer prefix (what ``harness.tasks.prompts.build_prompt`` wraps)."""
    return (sample.meta.get("preamble", "") + template.format(context=sample.context, input=sample.input)
            + sample.meta.get("answer_prefix", ""))


@dataclass
class Corpus:
    """The sentences and normalised answers of a set of prompts (or of bare templates)."""

    name: str
    sentences: set[str] = field(default_factory=set)
    answers: set[str] = field(default_factory=set)
    words: set[str] = field(default_factory=set)
    prompts: int = 0

    def add(self, text: str, answers=()) -> None:
        self.sentences |= sentences(text)
        self.answers |= {normalise(a) for a in answers if normalise(a)}
        self.words |= set(normalise(text).split())
        self.prompts += 1


def corpus(name: str, samples: list[Sample], rules) -> Corpus:
    """``rules(task)`` gives a sample's ``TaskSpec``."""
    found = Corpus(name)
    for sample in samples:
        found.add(prompt_text(sample, rules(sample.task).template), sample.answers)
    return found


# What the evaluation side holds. Embedded: the suite at seed 0, 200 per
# task of all five tasks (cpu_accuracy and ablation use 20, data=synthetic 4, sample-size plans up
# to 192), the context sizes of ci_regression, quickstart and the cluster-launcher test, and seed 7
# (token_prompts: throughput and engine-test prompts). RULER: seed 0 at ruler_ratios' 1024 and
# 2048 tokens x 6 (kvpress parity's 1024 x 2 is inside), data=ruler's 4096 x 4, and 8192 x 1.
# LongBench: every task template of every family; records only from a local directory if given
# (none is committed here; the hub is not read).
EMBEDDED = (
    {"seed": 0, "per_task": 200, "context_words": None, "tasks": "all"},
    {"seed": 0, "per_task": 10, "context_words": (600, 900), "tasks": None},
    {"seed": 0, "per_task": 6, "context_words": (900, 1500), "tasks": None},
    {"seed": 0, "per_task": 2, "context_words": (600,), "tasks": None},
    {"seed": 7, "per_task": 24, "context_words": None, "tasks": ("multi_doc_qa", "single_doc_qa")},
)
RULER = ({"seed": 0, "lengths": (1024, 2048), "per_length": 6}, {"seed": 0, "lengths": (4096,), "per_length": 4},
         {"seed": 0, "lengths": (8192,), "per_length": 1})
EVALUATION = {"embedded": EMBEDDED, "ruler": RULER}


def evaluation_corpora(tokenizer, longbench_dir: Path | None = None) -> dict[str, Corpus]:
    """Every evaluation family's text, one ``Corpus`` per family (``EVALUATION``)."""
    from harness.tasks import families, task_spec
    from harness.tasks.embedded import dataset as embedded
    from harness.tasks.ruler import dataset as ruler

    found: dict[str, Corpus] = {}
    samples = []
    for each in EMBEDDED:
        tasks = list(embedded.TASKS) if each["tasks"] == "all" else each["tasks"]
        samples += embedded.generate(seed=each["seed"], tasks=list(tasks) if tasks else None,
                                     samples_per_task=each["per_task"],
                                     context_words=each["context_words"] or embedded.CONTEXT_WORDS)
    found["embedded"] = corpus("embedded", samples, task_spec)
    samples = []
    for each in RULER:
        samples += ruler.generate(tokenizer, seed=each["seed"], lengths=each["lengths"],
                                  samples_per_length=each["per_length"])
    found["ruler"] = corpus("ruler", samples, task_spec)
    # RULER's texts that a sample may not show at these sizes: needle and noise sentences.
    texts = ruler.templates()
    found["ruler"].add(texts["needle"] + "\n" + texts["noise"])
    # Every task template of every family, with an empty context (LongBench's 16 among them).
    templates = Corpus("templates")
    for family in families():
        for source in family.sources:
            if source in family.any_task:
                continue
            for task in family.tasks(source):
                rules = family.spec(task)
                if rules is not None:
                    templates.add(rules.template.format(context="\n", input="\n"))
    found["templates"] = templates
    # The evaluation generators' word lists themselves (words only: no sentence is made of them).
    lists = Corpus("word lists")
    lists.add(" ".join(word for words in (embedded.FIRST, embedded.LAST, embedded.CITIES, embedded.JOBS, embedded.NOUNS,
                                          embedded.ADJECTIVES, embedded.VERBS, embedded.TIMES, ruler.ADJECTIVES,
                                          ruler.NOUNS, ruler.SYLLABLES) for word in words))
    lists.sentences.clear()
    found["word lists"] = lists
    if longbench_dir is not None:
        from harness.tasks.longbench.dataset import read_jsonl

        def rules(task: str) -> TaskSpec:  # a record of a task with no template here: its text alone
            try:
                return task_spec(task)
            except DataError:
                return TaskSpec(name=task, template="{context}\n{input}", max_new_tokens=0, metric="")

        records = [s for path in sorted(Path(longbench_dir).glob("*.jsonl")) for s in read_jsonl(path)]
        found["longbench"] = corpus("longbench", records, rules)
    return found


@dataclass
class Overlap:
    training_sentences: int
    shared: dict[str, set[str]]          # family -> training sentences found in it
    shared_answers: dict[str, set[str]]  # family -> training answers equal to one of its answers

    @property
    def sentences(self) -> set[str]:
        return set().union(*self.shared.values()) if self.shared else set()

    @property
    def answers(self) -> set[str]:
        return set().union(*self.shared_answers.values()) if self.shared_answers else set()

    def __bool__(self) -> bool:
        return bool(self.sentences or self.answers)

    def describe(self) -> str:
        lines = [f"{len(self.sentences)} of {self.training_sentences} distinct training sentences "
                 f"({100 * len(self.sentences) / max(self.training_sentences, 1):.1f}%) and "
                 f"{len(self.answers)} training answer(s) occur in evaluation text"]
        for family in self.shared:
            if self.shared[family] or self.shared_answers[family]:
                example = sorted(self.shared[family])[:2] or sorted(self.shared_answers[family])[:2]
                lines.append(f"  {family}: {len(self.shared[family])} sentence(s), "
                             f"{len(self.shared_answers[family])} answer(s), e.g. {example}")
        return "\n".join(lines)


def overlap(training: Corpus, evaluation: dict[str, Corpus]) -> Overlap:
    return Overlap(len(training.sentences),
                   {name: training.sentences & each.sentences for name, each in evaluation.items()},
                   {name: training.answers & each.answers for name, each in evaluation.items()})


def vocabulary_check(training: Corpus, samples: list[Sample], evaluation: dict[str, Corpus]) -> list[str]:
    """What makes the check hold at any seed and size, not only the ones generated: the generator's
    words occur in no evaluation text and in none of the evaluation generators' word lists (every
    word those generators write comes from their lists and templates, or is a number or random
    string: a code, a UUID, a coded or pseudo word, none of which is a sentence of 4 words of its
    own), and every sentence of a training context names one of the ``MARKERS`` (a person, place,
    object, trade or building of the lists here), so no evaluation sentence can equal it.
    Returns what breaks either (empty: both hold)."""
    problems = [f"{family} text has the generator's word(s) {sorted(VOCABULARY & each.words)}"
                for family, each in evaluation.items() if VOCABULARY & each.words]
    for sample in samples:
        for sentence in sentences(sample.context):
            if not MARKERS & set(sentence.split()):
                problems.append(f"{sample.id}: {sentence!r} names none of the markers")
    return problems


def training_corpus(samples: list[Sample]) -> Corpus:
    return corpus("training", samples, spec)


def require_disjoint(samples: list[Sample], tokenizer, longbench_dir: Path | None = None, rules=None,
                     evaluation: dict[str, Corpus] | None = None) -> tuple[Overlap, dict[str, Corpus]]:
    """Raise ``SystemExit`` when a training sentence or answer is an evaluation one, or the
    vocabulary check fails; else the (empty) overlap and the evaluation corpora (``evaluation``:
    already built ones, else ``evaluation_corpora``). ``rules(task)``: the samples' task specs."""
    evaluation = evaluation if evaluation is not None else evaluation_corpora(tokenizer, longbench_dir)
    training = corpus("training", samples, rules or spec)
    found = overlap(training, evaluation)
    problems = vocabulary_check(training, samples, evaluation)
    if found or problems:
        raise SystemExit("training text shared with evaluation text:\n" + found.describe()
                         + "".join(f"\n  {p}" for p in problems[:10]))
    return found, evaluation
