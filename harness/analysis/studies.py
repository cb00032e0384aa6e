"""The committed studies, one record each: what ``results/RESULTS.md`` gathers
(``harness.analysis.report``) and what ``experiments/regenerate.py`` remakes and verifies.

A study is an accuracy sweep (its cells made by ``conf/experiment/<experiment>.yaml`` and
summarised by ``harness.analysis.aggregate``), a throughput setting (``experiments/throughput.py
<setting>``) or a serving sweep (``experiments/serving.py``, its command in the record: ``vllm serve``
loaded by vLLM's own benchmark, ``results/serving/<sweep>``). Its record says where it lives, what it asks, the variant every other is compared
with, the signal its verdict rests on, and how long it takes to make on the 2-core CPU machine
(``measured``: as it took there; otherwise the estimate it is planned with). A view is a further
summary of another study's cells (RULER without variable tracking). A new study is one record here
and its sweep's config.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Study:
    folder: str                  # under results/
    title: str = ""
    focus: str = ""              # accuracy: the variant every other is compared with
    # The signal the verdict rests on (a ``Quantity.field``). Holm runs per table and per signal,
    # nothing adjusts across the four signals, so a claim that cites whichever signal decides has
    # four chances; the others are reported as secondary (issue 51, item 5). The task score for
    # every study here: each asks what eviction costs in answers; the signals that need no right
    # answer were added later to see where the score cannot.
    primary: str = "score"
    experiment: str | None = None  # accuracy: the conf/experiment sweep that makes its cells
    minutes: float | None = None   # to make it here (None: not part of the regeneration plan)
    measured: bool = False
    view_of: str | None = None     # a further summary of that study's cells ...
    view_options: tuple[str, ...] = ()  # ... with these aggregate options
    beside: tuple[str, ...] = ()   # other studies' folders whose cells its summaries show beside its own
    trials: int = 3                # throughput: interleaved trials of every configuration
    command: str | None = None     # the command RESULTS.md names for its cells, where not its sweep's
    # Non-inferiority and equivalence margin of the primary signal (points of score on the 0-100
    # scale): a comparison is equivalent when its 95% interval lies inside (-margin, +margin) (two
    # one-sided tests at 2.5% each), non-inferior when the bound on the worse side lies inside it
    # (one-sided at 2.5%). Throughput: the ratio's margin (``THROUGHPUT_MARGIN``). Issue 65, item 1:
    # set in this record, before a study (re)runs. The committed results predate it: for them the
    # margin was set after their numbers were seen, which FINDINGS says.
    margin: float = 5.0
    # The study whose cells and samples this one repeats on another model (issue 66): its summary
    # and this one's side by side (``harness.analysis.cross_model``) in ``<folder>/across_models``.
    across: str | None = None

    @property
    def throughput(self) -> bool:
        return self.folder.startswith("throughput/")

    @property
    def serving(self) -> bool:
        return self.folder.startswith("serving/")

    @property
    def name(self) -> str:
        return self.folder

    @property
    def made_by(self) -> str:
        """The command that makes its cells (and, for a view, the study it views)."""
        if self.command is not None:
            return self.command
        if self.view_of is not None or self.beside:
            return f"python experiments/regenerate.py --only {self.view_of or self.folder}"
        if self.throughput:
            return f"python experiments/throughput.py {self.folder.split('/', 1)[1]} --trials {self.trials}"
        return f"python run.py -m +experiment={self.experiment}"


def throughput(setting: str, minutes: float | None = None, trials: int = 3, measured: bool = False) -> Study:
    return Study(f"throughput/{setting}", minutes=minutes, trials=trials, measured=measured)


# Planned from a side-by-side timing: both suites at 2 samples per task (run.py -m
# +experiment=gemma3_cpu_accuracy data.limit=2, then +experiment=cpu_accuracy data.limit=2, back to
# back under the engine lock, nothing else running, 2026-11-30 at e7be620): Gemma 18.7 min, SmolLM2
# 4.2 min, 4.5x; so cpu_accuracy's 68.3 measured minutes give Gemma's suite about 300. (Its
# generation and two likelihood rounds took about the same time each: 6.1, 5.9 and 5.9 min. Gemma's
# 262,144-token output layer, 168M of its 268M weights, is in every decode step, and every returned
# logprob is a log-softmax over it.) RULER compressed before the question is as decode-heavy, so
# ruler_context's 160 min at the same 4.5x: about 720. A first try of the whole suite, beside the unit
# tests, reached 314 of its generation round's 2,960 requests in 21.4 min and was stopped. Both Gemma
# accuracy studies generate only (likelihood: false in their experiment files; the cross-model table
# compares the primary score): the generation round was 6.1 of the 18.7 minutes, so about a third of
# each, 300 -> 100 and 720 -> 240. Measured since (2026-11-30, alone under the lock): the suite's one
# engine group reached 2,482 of its 2,960 requests in 98 min and its last task (code completion, long
# answers) ran at about 8 requests a minute: about 160 min in all. Measured in its chunks of policies
# (2026-11-30, each alone under the lock at one code version, 84d023a8e4bc): full and PagedEviction 12,
# StreamingLLM 12, Knorm 12, SnapKV and H2O 84, KeyDiff and value norm 12, recency and the learned
# scorer 12, the hybrid 43, TOVA 12, LRU 43 (the unit tests ran beside it for its first 25 min):
# 242 min in all. RULER's answers are short, but its first chunk, full cache and PagedEviction (5
# cells x 144 samples), took 47 min (the unit tests beside it for about 20): at that pace its 17 cells
# without query capture take about 150, and if capture costs what it did in the suite (SnapKV and H2O,
# 6 cells, 84 min against 12 for 6 cells without), SnapKV, TOVA and H2O about 250 more, KVzip's
# passes on top: about 480 in all, planned. Either is more than a session holds beside a CI: run them in chunks of
# policies (run.py -m +experiment=... 'policy=full,paged,...': the command line's list replaces the
# experiment's), each an engine group that publishes its cells at its end (the suite's chunks above
# are such groups). Run the chunks with run.py, not regenerate.py: at a later code version regenerate deletes cells of another
# version that no --verify has replayed equal; the finished study is aggregated, then verified.
# Measured in its chunks (2026-11-30 to 2026-12-01, each under the lock from a detached worktree at
# e0a1124, code 84d023a8e4bc): full and PagedEviction 47 (the unit tests beside it for about 20),
# StreamingLLM 32, Knorm 41, KeyDiff 38 and SnapKV 53 (tests beside both), TOVA 18 + 18, H2O 18 + 19
# and KVzip 28 + 27 (two ratios a chunk, alone): 339 min in all, against the 480 planned.
# Measured: 126 minutes alone under the lock from a detached worktree at e0a1124 (code 84d023a8e4bc;
# one test file ran beside it for about 5); a quick look at one ratio had planned 100.
KVZIP_SCHEDULE_MINUTES = 126
GEMMA3_SUITE_MINUTES = 242
GEMMA3_RULER_MINUTES = 339
# Planned at 105: cpu's 42.4 min (measured) at about 2.5x, the same token counts with no logprobs asked
# (the suites' 4.5x above includes theirs). Measured: 82 min alone under the lock at 421395c
# (2026-12-02, --trials 3, 33 engine processes; 4940 s by its own count), 1.9x cpu's, about the two
# models' parameters, 268M / 135M.
GEMMA3_CPU_MINUTES = 82

# In RESULTS.md's order, which the regeneration also follows. Sample counts: the embedded suite and
# the ablation at 20 per task, as committed (results/*/sample_size.md say what deciding every
# headline comparison would take); RULER at kvpress's four compression ratios, 12 samples per task
# (6 per length), prompt-only compression (conf/experiment/ruler_ratios.yaml). Throughput:
# interleaved trials of every configuration. Outside the plan (no minutes): ``quick`` (a subset of
# ``cpu``) and ``cpu_tight`` (``cpu`` on a smaller pool), runnable but not remade; also the proxy
# study and the eviction-cost benchmark, which record no provenance yet, and the shared-context and
# multi-turn studies (experiments/shared_context.py, multi_turn.py), which record theirs
# (provenance.json, settings.json) but are remade by their own scripts.
STUDIES: tuple[Study, ...] = (
    Study("cpu_accuracy", "The policies on the embedded suite", "paged", experiment="cpu_accuracy",
          minutes=68.3, measured=True),
    Study("ruler", "RULER at kvpress's compression ratios (prompt only)", "paged[decode_eviction=False]",
          experiment="ruler_ratios", minutes=73.8, measured=True, command="python experiments/regenerate.py --only ruler"),
    # RULER's variable tracking scores 0 under full cache (its answers copy the filler) and rewards
    # evicting the filler: the table is also summarised without it.
    Study("ruler/without_vt", "The same RULER cells without variable tracking (full cache scores 0 on it)",
          "paged[decode_eviction=False]", view_of="ruler", view_options=("--drop-task", "vt", "--no-plots")),
    # Measured in two parts: its 29 cells 92.9 min (ed377cd), KVzip's 4 cells 67 min (355137d).
    # The same RULER samples compressed before the question is seen (the leaderboard's main loop),
    # summarised beside the query-aware cells above (its --compress_questions loop).
    Study("ruler_context", "RULER compressed before the question is seen (query-agnostic, kvpress's "
          "leaderboard loop) beside the whole prompt compressed (query-aware, its --compress_questions loop)",
          "paged[compress=context]", experiment="ruler_context", minutes=160, measured=True, beside=("results/ruler",)),
    Study("ruler_context/without_vt", view_of="ruler_context", view_options=("--drop-task", "vt", "--no-plots")),
    Study("ablation", "PagedEviction's score and granularity apart", "paged", experiment="ablation",
          minutes=69.1, measured=True),
    Study("layer_budgets", "Budgets per layer at equal total KV memory: three KV cache groups at the uniform, "
          "pyramid and attention schedules (RULER, prompt only)", "paged[decode_eviction=False, layer_groups=3]",
          experiment="layer_budgets", minutes=140, measured=True),  # 62 min, then the attention schedule's 4 cells 78 (486488c)
    Study("layer_budgets_suite", "Budgets per layer on the embedded suite: three KV cache groups at the "
          "uniform, pyramid and attention schedules", "paged[layer_groups=3]", experiment="layer_budgets_suite",
          minutes=40, measured=True),
    # KVzip's own allocation over three layer groups (its global threshold) beside the equal counts
    # of pair-uniform, RULER compressed before the question, with ruler_context's full cache beside
    Study("kvzip_schedule", "KVzip's allocation across layer groups (its global threshold) beside equal counts "
          "per layer and head (pair-uniform), RULER compressed before the question",
          "kvzip[compress=context, layer_groups=3]", experiment="kvzip_schedule", minutes=KVZIP_SCHEDULE_MINUTES,
          measured=True, beside=("results/ruler_context",)),
    # The second model (issue 66): the suite and RULER compressed before the question on Gemma 3 270M,
    # the SmolLM2 studies' cells (minutes: planned, from one cell of each timed beside SmolLM2's)
    Study("cpu_accuracy_gemma3", "The policies on the embedded suite, on Gemma 3 270M", "paged",
          experiment="gemma3_cpu_accuracy", minutes=GEMMA3_SUITE_MINUTES, measured=True,
          across="cpu_accuracy"),
    Study("ruler_context_gemma3", "RULER compressed before the question is seen, on Gemma 3 270M",
          "paged[compress=context]", experiment="gemma3_ruler_context", minutes=GEMMA3_RULER_MINUTES,
          measured=True, across="ruler_context"),
    throughput("quick"),
    throughput("cpu", 42.4, measured=True),
    throughput("cpu_tight"),
    throughput("cpu_gemma3", GEMMA3_CPU_MINUTES, measured=True),  # the second model (issue 66)
    throughput("attention", 33.1, measured=True),
    throughput("overhead", 13),
    throughput("latency", 10),
    throughput("shared_prefix", 10),
    throughput("tensor_parallel", 8.8, measured=True),
    throughput("layer_groups", 9),
    throughput("budget_schedules", 17, trials=5, measured=True),
    throughput("group_overhead", 10, trials=10, measured=True),
    # KVzip's reconstruction passes against a plain prefill (a prefill setting: its ratios are of
    # prefill seconds against full cache, not of output tok/s)
    throughput("reconstruction", 7, trials=4, measured=True),
    # Serving sweeps (RESULTS.md's Serving section reads their own summaries): the default sweep, and
    # KVzip beside PagedEviction at twice full cache's capacity
    Study("serving/shared_context_long", command="python experiments/serving.py", minutes=48, measured=True),
    Study("serving/shared_context_long_kvzip", command="python experiments/serving.py --configs 'full,paged context,kvzip "
          "context' --rates 0.257 --trials 3 --out results/serving/shared_context_long_kvzip", minutes=27, measured=True),
    # the default sweep on a pool where full cache does not queue (what it needs at once, 317 blocks, and one
    # more; 20 min alone here)
    Study("serving/shared_context_long_no_queue", command="python experiments/serving.py --pool-blocks 318 --out "
          "results/serving/shared_context_long_no_queue", minutes=20, measured=True),
    # the short-answer questions of results/shared_context served the same way (77 min alone here)
    Study("serving/shared_context", command="python experiments/serving.py --workload shared_context", minutes=77,
          measured=True),
    # vLLM's own synthetic (unscored), smaller than its defaults to fit a session (32 min alone here)
    Study("serving/prefix_repetition", command="python experiments/serving.py --workload prefix_repetition "
          "--num-requests 12 --num-prefixes 4 --output-len 128", minutes=32, measured=True),
    # conversations: full cache, recompressing each turn's history, and the chain (124 min alone here,
    # most of it the arrival spans of the two lowest rates)
    Study("serving/multi_turn", command="python experiments/serving.py --workload multi_turn --configs "
          "'full,paged context,paged context chained'", minutes=124, measured=True),
)


# Throughput: a configuration is non-inferior to its baseline when its ratio's 95% interval lies
# above 1 - THROUGHPUT_MARGIN (0.95x), equivalent when it lies inside (0.95x, 1/0.95x).
THROUGHPUT_MARGIN = 0.05
DEFAULT_MARGIN = 5.0  # points of score, for a summary outside the studies (results/runs/...)


def margin_for(out: Path | str) -> float:
    """The margin of the study whose folder ``out`` is (``results/<folder>``), else the default."""
    target = Path(out).resolve()
    for study in STUDIES:
        if (ROOT / "results" / study.folder).resolve() == target:
            return study.margin
    return DEFAULT_MARGIN


def accuracy_studies() -> tuple[Study, ...]:
    """What RESULTS.md gathers of accuracy: every study and view with a title."""
    return tuple(study for study in STUDIES if not study.throughput and study.title)


def throughput_settings() -> tuple[str, ...]:
    return tuple(study.folder.split("/", 1)[1] for study in STUDIES if study.throughput)


def planned() -> tuple[Study, ...]:
    """The studies the regeneration makes, in order (views ride with the study they view)."""
    return tuple(study for study in STUDIES if study.minutes is not None)


def views_of(study: Study) -> tuple[Study, ...]:
    return tuple(view for view in STUDIES if view.view_of == study.folder)


def refuse_uncommitted(out: Path | str, version: str | None) -> None:
    """A committed study's cells come from committed code only: writing into a study's folder
    (``results/<folder>``, its subfolders included) at a code version with uncommitted changes
    (``harness.records.provenance.code_version`` ending ``+dirty``) is refused with a ``ValueError``
    saying so, before any engine starts. Anywhere else (``results/runs``, a scratch folder) is free."""
    if not (version or "").endswith("+dirty"):
        return
    target = Path(out).resolve()
    for study in STUDIES:
        folder = (ROOT / "results" / study.folder).resolve()
        if target == folder or folder in target.parents:
            raise ValueError(
                f"results/{study.folder} holds a committed study (harness/analysis/studies.py): its cells are made "
                f"only from committed code, and this checkout's code has uncommitted changes (code version "
                f"{version}): commit them first, or write to another folder (run.py's output_dir=results/runs/..., "
                f"experiments' --out)")
