"""How many samples per task the headline comparisons need, planned from committed per-sample scores.

    python -m harness.analysis.sample_size results/cpu_accuracy --focus paged
    python -m harness.analysis.sample_size results/ablation --focus paged --out results/ablation/sample_size.md

The headline family of a (model, data) table is the focus variant (``--focus``, PagedEviction by
default) against every other variant at the same budget label (token budget or compression ratio)
and against full cache at each budget: the subset of ``harness.analysis.aggregate.comparable_pairs`` that
involves the focus, oriented focus minus other. For each comparison, from the committed paired
per-sample score differences (stratified by task as the average is):

* the observed difference of the average, its standard error, the paired sign-flip p-value
  (``harness.analysis.stats.settled_p_values``: exact, or from random sign patterns until Holm's
  decision is settled) and whether Holm over the headline family decides it now; also whether Holm
  over the whole table (every comparison ``summary.md`` adjusts over) does;
* the samples per task for 80% power at Holm's strictest level alpha/m (m = headline family size),
  for a true difference of the observed size and of a stated minimal effect (``--effect``), and
  the samples per task that would show equivalence within +-effect (two one-sided tests at alpha/m)
  if the true difference were zero.

Planning uses the normal approximation on the stratified paired mean: with n samples in each of
T tasks and per-task variances s_t^2 of a sample's difference (the committed ones, ddof 1), the
average's standard error is S / sqrt(n), S^2 = sum_t s_t^2 / T^2, and a two-sided test at level a
has power Phi(|D| sqrt(n) / S - z_{1-a/2}) (+ the negligible opposite tail) against a true
difference D, so n = ((z_{1-a/2} + z_power) S / D)^2. alpha/m is the Bonferroni level, which Holm's
first step uses and every later step relaxes: the counts are what a comparison needs whatever the
others show. The committed variances stand in for the true ones (20 samples per task estimate them
loosely), and a difference observed at 20 samples overstates the true one when it was picked for
being large: the observed-size counts are planning figures, the minimal-effect counts the safer ones.
The normal approximation ignores that only differing samples carry evidence: an exact sign-flip test
cannot reach alpha/m with fewer than log2(2m/alpha) of them, so no count is below the n that brings
that many at the committed share of differing samples (``exact_floor``).

Cost starts from the cells' ``perf.json``: a sweep that shares prefill runs one engine for all its
cells (``shared_engine.group_wall_s`` for ``prompts`` prompts), isolated cells their own
(``wall_s``). That is the generation alone: the model under ``ENGINE_SECONDS`` adds each engine's
start-up and, where the cells record answer likelihood, the forced passes that follow the
generation on the same engine (``LIKELIHOOD_FACTOR``, calibrated on the committed sweeps). A sample
per task then costs the sweep's time over its samples per task, for every cell at once; the
extrapolation assumes time grows linearly in samples (the suite draws the same length distribution
at any ``data.limit``).

The recommendation is a ``data.limit`` in the data family's own unit (``LimitRule``): samples per
task for the embedded suite (a multiple of its context sizes x depths), LongBench and JSONL;
samples per task *and length* for RULER, so a need of n samples per task is ``data.limit``
ceil(n / lengths) there.

For a suite whose RULER counterpart has not run, ``--ruler-plan`` (on by default; the committed
plans pass ``--no-ruler-plan``, RULER having its own run in ``results/ruler``) transfers the per-task
variance seen here to RULER's task count (``conf/data/ruler.yaml``) at kvpress's four compression
ratios, says that this is an assumption, and sizes the pilot that would replace it.
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist

import numpy as np
import pandas as pd
import yaml

from harness.analysis.aggregate import SIGNIFICANCE, comparable_pairs, find_runs, paired, run_rows, sample_scores
from harness.analysis.labels import budget_label
from harness.records.results import atomic_write_text, read_json
from harness.analysis.stats import SCALE, holm, settled_p_values, standard_error

ALPHA = 0.05  # family-wise error the headline family is held to (aggregate.SIGNIFICANCE)
POWER = 0.8
EFFECT = 2.0  # points on the 0-100 scale: the smallest difference worth a claim
AFTERNOON_HOURS = 4.0
DECIDE_SHARES = (50, 75, 90)  # % of the headline comparisons
GRID = (20, 40, 60, 80, 100, 150, 200, 300, 500, 1000)  # samples per task tabulated

_Z = NormalDist()


# ---------------------------------------------------------------- the power formula
def unit_sd(per_task: dict[str, np.ndarray], scale: float = SCALE) -> float:
    """S: the standard deviation of the stratified mean difference times sqrt(n), for n samples in
    every task: sqrt(sum_t s_t^2) / T with s_t the task's per-sample standard deviation (ddof 1)
    x ``scale``. The standard error at n samples per task is S / sqrt(n)."""
    tasks = sorted(per_task)
    variances = [np.var(scale * np.asarray(per_task[t], float), ddof=1) for t in tasks if len(per_task[t]) > 1]
    return float(math.sqrt(sum(variances)) / len(tasks))


def z_sum(alpha: float, power: float) -> float:
    """z_{1-alpha/2} + z_power: the standard errors a true difference must span to be found with
    ``power`` by a two-sided test at ``alpha``."""
    return _Z.inv_cdf(1 - alpha / 2) + _Z.inv_cdf(power)


def samples_needed(difference: float, sd: float, alpha: float, power: float = POWER) -> float:
    """Samples per task for a two-sided test at ``alpha`` to find a true ``difference`` with
    ``power``, when the average's standard error is ``sd`` / sqrt(n): ceil((z_sum x sd / D)^2).
    inf for a zero difference with spread; 0 when there is no spread at all (nothing to test)."""
    if sd == 0:
        return 0.0
    if difference == 0:
        return math.inf
    return float(math.ceil((z_sum(alpha, power) * sd / abs(difference)) ** 2 - 1e-9))


def power_at(difference: float, sd: float, n: float, alpha: float) -> float:
    """Power of a two-sided test at ``alpha`` against a true ``difference`` with n samples per task
    (both tails of the normal approximation)."""
    if sd == 0:
        return 0.0
    shift = abs(difference) * math.sqrt(n) / sd
    z = _Z.inv_cdf(1 - alpha / 2)
    return _Z.cdf(shift - z) + _Z.cdf(-shift - z)


def equivalence_samples(margin: float, sd: float, alpha: float, power: float = POWER) -> float:
    """Samples per task for two one-sided tests at ``alpha`` each to show |difference| < ``margin``
    with ``power`` when the true difference is zero: ((z_{1-alpha} + z_{1-(1-power)/2}) sd / margin)^2."""
    if sd == 0:
        return 0.0
    return float(math.ceil(((_Z.inv_cdf(1 - alpha) + _Z.inv_cdf(1 - (1 - power) / 2)) * sd / margin) ** 2 - 1e-9))


def fewest_differing(alpha: float) -> int:
    """The fewest differing samples (or clusters) with which the stratified sign-flip test
    (``harness.analysis.stats._Stratified``) can give p < ``alpha``: with k units its smallest
    p-value is 1 / (1 + 2^k) (``stats.smallest_p``), reached only when the observed statistic
    exceeds every flipped one, which samples that do not differ cannot help."""
    return max(1, math.ceil(math.log2(1 / alpha - 1) + 1e-12))


def clusters_for_non_inferiority(per_task: dict[str, np.ndarray], margin: float, scale: float = SCALE) -> int | None:
    """The plan for a design that can show non-inferiority: clusters per task (or per stratum) for
    the one-sided test at 2.5% to find the difference above -``margin`` points with ``POWER``, were
    the true difference zero, from the spread of the observed per-cluster mean differences
    (``per_task``: each task's clusters' mean differences, on the 0-1 scale x ``scale``; normal
    approximation), and never fewer than the exact test over whole clusters needs to reach 2.5% at
    all. None where a task has fewer than two clusters or none differs (no spread to plan from)."""
    if not per_task or any(len(values) < 2 for values in per_task.values()):
        return None
    spread = unit_sd(per_task, scale)
    if spread == 0:
        return None
    # one-sided at 2.5% is the two-sided test at 5%: ((z_0.975 + z_0.8) S / margin)^2 clusters per task
    return int(max(samples_needed(margin, spread, 0.05, POWER), fewest_differing(0.025)))


def exact_floor(differing: int, samples: int, alpha: float) -> float:
    """Samples per task below which the sign-flip test cannot reach ``alpha`` however large the
    difference: the normal approximation ignores that only differing samples carry evidence. At the
    committed rate (``differing`` of ``samples`` per task, summed over tasks) n samples per task bring
    n x differing / samples differing ones, which must reach ``fewest_differing``."""
    if differing == 0:
        return math.inf
    return float(math.ceil(fewest_differing(alpha) * samples / differing - 1e-9))


def equivalent(difference: float, se: float, margin: float, alpha: float) -> bool:
    """Two one-sided tests at ``alpha`` (normal approximation): the 1 - 2 alpha interval lies in
    (-margin, margin)."""
    return abs(difference) + _Z.inv_cdf(1 - alpha) * se < margin


# ---------------------------------------------------------------- the family
def runs_frame(root: Path) -> pd.DataFrame:
    """One row per complete run directory under ``root`` (``harness.analysis.aggregate.run_rows``' columns),
    indexed by run directory, with its budget label."""
    runs = find_runs([root])
    if not runs:
        raise SystemExit(f"no complete run directory under {root}")
    frame = pd.DataFrame([run_rows(run)[0] for run in runs]).set_index("run_dir")
    frame["budget_label"] = [budget_label(row) for _, row in frame.iterrows()]
    return frame


def headline_pairs(group: pd.DataFrame, focus: str) -> list[tuple[str, str]]:
    """The headline family of one (model, data) group: (focus run, other run) for every comparison
    of the table (``comparable_pairs``) that involves the focus variant, focus first."""
    pairs = []
    for run, other in comparable_pairs(group):
        if group.loc[run, "variant"] == focus:
            pairs.append((run, other))
        elif group.loc[other, "variant"] == focus:
            pairs.append((other, run))
    return pairs


@dataclass
class Comparison:
    budget: str
    other: str
    samples: int  # per task (the fewest over tasks)
    diff: float  # points, focus minus other
    se: float
    sd: float  # S: se x sqrt(n)
    differing: int  # samples whose scores differ
    tasks: int
    p: float
    p_holm: float = 1.0
    p_holm_table: float = 1.0

    def needed(self, difference: float, alpha: float, power: float = POWER) -> float:
        """Samples per task for ``power`` against a true ``difference`` at ``alpha``: the normal
        approximation's count, at least the sign-flip test's floor (``exact_floor``)."""
        if self.sd == 0:
            return 0.0
        return max(samples_needed(difference, self.sd, alpha, power), exact_floor(self.differing, self.samples, alpha))

    def power(self, difference: float, n: float, alpha: float) -> float:
        """Power at n samples per task (0 below the sign-flip test's floor)."""
        if n < exact_floor(self.differing, self.samples, alpha):
            return 0.0
        return power_at(difference, self.sd, n, alpha)


def differences(group: pd.DataFrame, pairs: list[tuple[str, str]]) -> dict[tuple[str, str], dict[str, np.ndarray]]:
    scores = {run: sample_scores(run) for run in {r for pair in pairs for r in pair}}
    return {(run, other): paired(scores[run], scores[other]) for run, other in pairs}


def headline(group: pd.DataFrame, focus: str, alpha: float = ALPHA) -> list[Comparison]:
    """Every headline comparison with its statistics, Holm-adjusted over the headline family (at
    ``alpha``) and over the whole table's family (as ``summary.md`` marks it)."""
    table_pairs = comparable_pairs(group)
    table_diffs = differences(group, table_pairs)
    tested = [pair for pair in table_pairs if table_diffs[pair]]
    # The table's p-values as summary.md has them: settled over the table's family at its level.
    table_p = dict(zip(tested, settled_p_values([table_diffs[pair] for pair in tested], SIGNIFICANCE)))
    table_holm = dict(zip(tested, holm([table_p[pair].p for pair in tested])))
    found, keys = [], []
    for run, other in headline_pairs(group, focus):
        forward = (run, other) in table_diffs
        key = (run, other) if forward else (other, run)
        d = table_diffs[key] if forward else {t: -v for t, v in table_diffs[key].items()}
        if not d:
            continue
        samples = min(len(v) for v in d.values())
        found.append(Comparison(
            budget=group.loc[run, "budget_label"], other=group.loc[other, "variant"], samples=samples,
            diff=float(SCALE * np.mean([v.mean() for v in d.values()])), se=standard_error(d), sd=unit_sd(d),
            differing=int(sum(np.count_nonzero(v) for v in d.values())), tasks=len(d),
            p=table_p[key].p, p_holm_table=table_holm[key]))
        keys.append(key)
    # Holm over the headline family at ``alpha`` may need more precise p-values than the table's:
    # each random one continues from the table's flips (same data, same draws), so it only sharpens.
    headline_p = settled_p_values([table_diffs[key] for key in keys], alpha,
                                  start=[table_p[key].flips for key in keys])
    for comparison, value, adjusted in zip(found, headline_p, holm([value.p for value in headline_p])):
        comparison.p, comparison.p_holm = value.p, adjusted
    return sorted(found, key=lambda c: (budget_order(c.budget), c.other != "full", c.other))


def budget_order(label: str) -> tuple:
    return (label.startswith("r"), float(label[1:]) if label.startswith("r") else int(label) if label.isdigit() else -1)


# ---------------------------------------------------------------- cost
# What a sweep costs, per engine (a shared-prefill group, or an isolated cell):
#
#     ENGINE_SECONDS + generation x (LIKELIHOOD_FACTOR if the cells record likelihood else 1)
#
# ``generation`` is the one time ``perf.json`` records: the wall time of the cells' own requests
# (``shared_engine.group_wall_s``, or an isolated cell's ``wall_s``). A cell costs more than that.
# With ``likelihood: true`` (the default, conf/config.yaml) the same engine then runs two more
# rounds of requests for every prompt (``harness.run.likelihood.likelihood_passes``: every cell
# forcing the reference answer while full cache generates again with its top logprobs, then every
# evicting cell forced along full cache's output), untimed; and every engine starts, loads the
# model, prepares its prompts and scores and writes its cells. Calibrated on the 2-core CPU
# machine at code version 114c4ea051a4 against what the committed cells show:
#
# * likelihood off, ``results/ci_baseline`` (24 isolated cells run one after another): each
#   cell's engine log starts 2.9-5.4 s (median 4.0) later than the previous cell's start plus its
#   generation wall time: ENGINE_SECONDS = 4;
# * likelihood on, ``results/ablation``: the second engine's log starts 2,406 s after the first
#   engine's, whose generation took 844 s: (2406 - 4) / 844 = 2.85 = LIKELIHOOD_FACTOR. The
#   regeneration's step times (experiments/regenerate.py: the sweep and its aggregate; commits
#   1e10133 and 918c1d0) agree: cpu_accuracy 68.3 min over 1,441 s of generation (2.84x),
#   ablation 69.1 min over 844 + 541 s (2.99x), RULER 73.8 min over 1,664 s (2.66x).
#
# The factor is a ratio of times on one machine and code: what it carries to another is the
# shape (about three rounds of requests where perf.json times one), not the seconds.
ENGINE_SECONDS = 4.0
LIKELIHOOD_FACTOR = 2.85


@dataclass
class Cost:
    seconds: float  # the whole sweep, every cell: generation as measured, the rest by the model above
    samples_per_task: int
    groups: list[str]  # how the time was measured, one line per engine
    commits: list[str]  # the code the cells ran
    fixed: float = 0.0  # of ``seconds``, what does not grow with samples (engine start-ups)
    generation: float = 0.0  # of ``seconds``, what perf.json measured

    @property
    def per_sample(self) -> float:
        """Seconds per added sample per task, all cells of the sweep together."""
        return (self.seconds - self.fixed) / self.samples_per_task

    def hours(self, samples_per_task: float) -> float:
        """The sweep's hours at ``samples_per_task``: start-ups once, the rest linear in samples."""
        return (self.fixed + samples_per_task * self.per_sample) / 3600

    def within(self, hours: float) -> int:
        """The most samples per task the sweep runs in ``hours``."""
        return max(int((hours * 3600 - self.fixed) // self.per_sample), 0)


def sweep_cost(group: pd.DataFrame) -> Cost:
    """Wall time of the group's sweep: each shared engine counted once (its cells share one
    ``group_wall_s``), each isolated cell by its own ``wall_s``, each with what perf.json does not
    time (``ENGINE_SECONDS``, ``LIKELIHOOD_FACTOR``)."""
    engines: dict[tuple, list[str]] = {}
    likelihood: dict[tuple, bool] = {}
    for run in group.index:
        perf = read_json(Path(run) / "perf.json")
        config = yaml.safe_load((Path(run) / "config.yaml").read_text())
        shared = perf.get("shared_engine")
        if shared:
            key = ("shared", shared["cells"], shared["prompts"], round(shared["group_wall_s"], 3))
        else:
            key = ("isolated", run, perf["requests"], round(perf["wall_s"], 3))
        engines.setdefault(key, []).append(run)
        # Configs older than the forced passes have no key: they ran none.
        likelihood[key] = likelihood.get(key, False) or bool(config.get("likelihood", False))
    samples = int(group["samples"].max())  # per task, as configured (data.limit)
    commits = sorted({(yaml.safe_load((Path(run) / "config.yaml").read_text()).get("provenance") or {})
                      .get("git_commit", "unknown")[:8] for run in group.index})
    lines = []
    seconds = generation = 0.0
    for key, runs in sorted(engines.items(), key=lambda item: -item[0][3]):
        kind, cells_or_run, prompts, wall = key
        factor = LIKELIHOOD_FACTOR if likelihood[key] else 1.0
        total = ENGINE_SECONDS + factor * wall
        seconds += total
        generation += wall
        what = (f"with the forced likelihood passes (x{LIKELIHOOD_FACTOR:g}) and start-up" if likelihood[key]
                else "with start-up")
        if kind == "shared":
            lines.append(f"one shared-prefill engine: {len(runs)} of its {cells_or_run} cells here, {prompts} prompts, "
                         f"generation {wall:,.0f} s ({wall / prompts:.1f} s per prompt for all its cells); {what} "
                         f"about {total:,.0f} s")
        else:
            lines.append(f"isolated cell {Path(cells_or_run).name}: {prompts} prompts, generation {wall:,.0f} s; "
                         f"{what} about {total:,.0f} s")
    return Cost(seconds, samples, lines, commits, fixed=ENGINE_SECONDS * len(engines), generation=generation)


# ---------------------------------------------------------------- the report
def fmt_n(n: float, cap: int = 100_000) -> str:
    if math.isinf(n):
        return "never (no difference)"
    return f">{cap:,}" if n > cap else f"{int(n):,}"


def decided_text(c: Comparison, alpha: float, effect: float, level: float) -> str:
    if c.p_holm < alpha:
        return "yes: " + ("higher" if c.diff > 0 else "lower")
    if equivalent(c.diff, c.se, effect, level):
        return f"equivalent within ±{effect:g}"
    return "no"


def share_deciding(comparisons: list[Comparison], share: float, alpha: float, power: float) -> float:
    """The fewest samples per task at which ``share`` % of the comparisons each reach ``power``
    against a true difference of their observed size (inf when fewer than that share can)."""
    # Cells identical on every sample (0 needed: no spread) have nothing to find: never decided.
    needed = sorted(math.inf if c.sd == 0 else c.needed(c.diff, alpha, power) for c in comparisons)
    return needed[max(math.ceil(share / 100 * len(needed)) - 1, 0)]


def report(root: Path, focus: str, effect: float, alpha: float, power: float, hours: float,
           shares: tuple[int, ...], ruler: tuple[int, tuple[int, ...]] | None, command: str) -> str:
    """The markdown report for every (model, data) group holding the focus; ``ruler`` (RULER's task
    count and lengths) adds the RULER planning section, None leaves it out."""
    frame = runs_frame(root)
    if focus not in set(frame["variant"]):
        raise SystemExit(f"--focus {focus}: no run of that variant under {root}; variants there: "
                         f"{', '.join(sorted(set(frame['variant'])))}")
    parts = [f"# Samples needed to decide the headline comparisons\n\nProduced by `{command}`\n"]
    for (model, data), group in frame.groupby(["model.name", "data.name"]):
        if focus not in set(group["variant"]):
            continue
        parts += group_report(group, model, data, focus, effect, alpha, power, hours, shares, ruler)
    return "\n".join(parts)


def group_report(group: pd.DataFrame, model: str, data: str, focus: str, effect: float, alpha: float,
                 power: float, hours: float, shares: tuple[int, ...],
                 ruler: tuple[int, tuple[int, ...]] | None) -> list[str]:
    comparisons = headline(group, focus, alpha)
    m = len(comparisons)
    m_table = len(comparable_pairs(group))
    level = alpha / m
    tasks = sorted(read_json(Path(group.index[0]) / "scores.json")["tasks"])
    n_now = min(c.samples for c in comparisons)
    cost = sweep_cost(group)
    afternoon = cost.within(hours)
    rule = limit_rule(group)
    lines = [
        f"## {model} on {data}: {focus} against each other variant",
        "",
        f"Headline family: `{focus}` against every other variant at the same budget and against full cache at "
        f"each budget, **m = {m} comparisons** (of the table's {m_table}, which `summary.md` adjusts over). "
        f"Differences are of the average score (points on the 0-100 scale, unweighted mean over the {len(tasks)} "
        f"tasks {', '.join(tasks)} of the per-task mean paired difference, {focus} minus the other, "
        f"{n_now} samples per task now). SE is the average's standard error from the per-task variances of the "
        f"differences (ddof 1). p is the paired sign-flip p-value (3 significant digits; exact, or from random sign "
        f"patterns until Holm's decision is settled); *decided* means Holm over the headline family "
        f"gives p < {alpha} (the sign says which way), or, failing that, two one-sided tests at {alpha}/{m} put "
        f"the difference within ±{effect:g} points (equivalent); *table Holm* is the same p adjusted over the "
        f"table's {m_table} comparisons, as `summary.md` marks it (`*`).",
        "",
        f"Samples per task are for {power:.0%} power at Holm's strictest level {alpha}/{m} = {level:.5f} "
        f"(two-sided), normal approximation on the stratified paired mean: n = ((z(1-a/2) + z(power)) S / D)^2 "
        f"with S = sqrt(sum_t s_t^2) / T from the committed variances, for a true difference D of the observed "
        f"size and of {effect:g} points; *equivalence* is n for two one-sided tests at {alpha}/{m} to show "
        f"|D| < {effect:g} with {power:.0%} power if the true difference were 0. The first two counts are at least "
        f"the sign-flip test's floor: the n at which the committed share of differing samples brings the "
        f"{fewest_differing(level)} differing samples it needs to reach {level:.5f} at all. 0 = the two cells "
        f"agree on every sample (no spread to plan from). Holm over the headline family alone is valid when that "
        f"family is declared as the primary one before the runs it is applied to (as here, for the next runs); "
        f"the table-wide Holm stays the secondary, stricter reading.",
        "",
        "| budget | vs | diff | SE | differing samples | p | Holm (headline) | table Holm | decided | "
        f"n/task, observed D | n/task, D = {effect:g} | n/task, equivalence ±{effect:g} |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in comparisons:
        lines.append(
            f"| {c.budget} | {c.other} | {c.diff:+.2f} | {c.se:.2f} | {c.differing}/{c.samples * len(tasks)} | "
            f"{c.p:.3g} | {c.p_holm:.4f} | {c.p_holm_table:.4f} | {decided_text(c, alpha, effect, level)} | "
            f"{fmt_n(c.needed(c.diff, level, power))} | {fmt_n(c.needed(effect, level, power))} | "
            f"{fmt_n(equivalence_samples(effect, c.sd, level, power))} |")
    decided = sum(c.p_holm < alpha for c in comparisons)
    equivalent_now = sum(c.p_holm >= alpha and equivalent(c.diff, c.se, effect, level) for c in comparisons)
    identical = sum(c.sd == 0 for c in comparisons)
    decided_table = sum(c.p_holm_table < alpha for c in comparisons)
    lines += [
        "",
        f"Decided now: {decided} of {m} by Holm over the headline family ({decided_table} by Holm over the whole "
        f"table), {equivalent_now} more shown equivalent within ±{effect:g} points; {identical} comparison(s) of "
        f"cells identical on every sample. An exact sign-flip test cannot reach {level:.5f} with fewer than "
        f"{fewest_differing(level)} differing samples (smallest p = 1 / (1 + 2^k)), whatever the sizes.",
        "",
    ]
    # Grid: what n buys.
    spread = [c for c in comparisons if c.sd > 0]
    lines += [
        f"What n samples per task buys (the {len(spread)} comparisons with spread; assuming each true difference "
        f"equals the observed one for the first two columns; time is the whole sweep's, every cell, extrapolated "
        f"from {cost.per_sample:.1f} s per sample per task, forced passes and start-ups included: see Cost):",
        "",
        f"| n/task | {power:.0%} power at observed D | expected share decided | median detectable D (points) | "
        f"{power:.0%} power at D = {effect:g} | sweep wall time (h) |",
        "|---|---|---|---|---|---|",
    ]
    grid = sorted(set(GRID) | {n_now, afternoon})
    for n in grid:
        powered = sum(c.power(c.diff, n, level) >= power for c in spread)
        expected = np.mean([c.power(c.diff, n, level) for c in spread] + [0.0] * (m - len(spread)))
        detectable = np.median([z_sum(level, power) * c.sd / math.sqrt(n) for c in spread])
        at_effect = sum(c.power(effect, n, level) >= power for c in spread)
        mark = " (now)" if n == n_now else " (one afternoon)" if n == afternoon else ""
        lines.append(f"| {n}{mark} | {powered}/{m} | {expected:.0%} | {detectable:.2f} | {at_effect}/{m} | "
                     f"{cost.hours(n):.1f} |")
    targets = {share: share_deciding(comparisons, share, level, power) for share in shares}
    lines += [
        "",
        "Samples per task at which the given share of the headline comparisons each have "
        f"{power:.0%} power against their observed difference (identical cells count as never decided): "
        + "; ".join(f"{share}%: {fmt_n(n)}" + (f" ({cost.hours(n):.1f} h)" if math.isfinite(n) else "")
                    for share, n in targets.items()) + ".",
        "",
        "### Cost",
        "",
        f"The cells' `perf.json` times their generation only ({cost.generation:,.0f} s). A sweep also starts "
        f"each engine (about {ENGINE_SECONDS:g} s) and, where the cells record answer likelihood, runs two more "
        f"rounds of forced requests on it: such an engine takes about {LIKELIHOOD_FACTOR:g} times its generation "
        f"time (`LIKELIHOOD_FACTOR` in `harness.analysis.sample_size`, calibrated on this machine's committed "
        f"sweeps). The sweep: about {cost.seconds:,.0f} s for {cost.samples_per_task} samples per task = "
        f"{cost.per_sample:.1f} s per sample per task, every cell:",
        "",
        *[f"- {line}" for line in cost.groups],
        "",
        f"One CPU afternoon ({hours:g} h) runs **{afternoon} samples per task**{rule.afternoon_text(afternoon)} "
        f"of this sweep (every cell; the "
        f"headline family needs all {group['variant'].nunique()} variants' cells, so running fewer cells saves "
        f"little). "
        f"Times are this machine's (2 cores, possibly shared with other work when measured) at the cells' commit "
        f"({', '.join(cost.commits)}; later eviction code may be faster or slower), linear in samples.",
        "",
    ]
    lines += recommendation(comparisons, group, n_now, afternoon, cost, effect, level, power, rule)
    if ruler:
        lines += ruler_plan(comparisons, tasks, cost, group, effect, alpha, power, hours, *ruler)
    return lines


@dataclass(frozen=True)
class LimitRule:
    """How ``data.limit`` turns into samples per task for a data family: RULER generates
    ``data.limit`` samples per task *and length* (``harness.tasks.ruler.dataset.generate``,
    ``samples_per_length``), so a limit gives one sample per task for each of the run's lengths;
    the embedded suite, LongBench and JSONL take ``data.limit`` samples per task."""
    source: str
    per_limit: int = 1  # samples per task per unit of data.limit (RULER: its number of lengths)
    multiple: int = 1  # data.limit a multiple of this
    lengths: tuple[int, ...] = ()

    def limit_for(self, samples_per_task: float) -> int:
        """The smallest allowed ``data.limit`` giving at least ``samples_per_task``."""
        return max(self.multiple * math.ceil(samples_per_task / (self.per_limit * self.multiple) - 1e-9), self.multiple)

    def limit_within(self, samples_per_task: float) -> int:
        """The largest allowed ``data.limit`` giving at most ``samples_per_task`` (at least one step)."""
        return max(self.multiple * int(samples_per_task // (self.per_limit * self.multiple)), self.multiple)

    def samples(self, limit: int) -> int:
        return limit * self.per_limit

    def counts(self) -> str:
        """What ``data.limit`` counts, in words."""
        if self.per_limit > 1:
            return (f"RULER's `data.limit` counts samples per task *and length*: at this sweep's {self.per_limit} "
                    f"lengths ({', '.join(map(str, self.lengths))} tokens) a limit of k gives {self.per_limit}k "
                    f"samples per task")
        family = "the embedded suite's" if self.source == "embedded" else f"`{self.source}`'s"
        text = f"{family} `data.limit` counts samples per task"
        if self.multiple > 1:
            text += f", in multiples of {self.multiple} so that every context size meets every depth"
        return text

    def afternoon_text(self, samples_per_task: int) -> str:
        """`` (data.limit: k per length)`` where the limit is not the per-task count itself."""
        if self.per_limit == 1:
            return ""
        return f" (`data.limit: {samples_per_task // self.per_limit}` per length)"


def limit_rule(group: pd.DataFrame) -> LimitRule:
    """The ``LimitRule`` of the group's data, from its first cell's config."""
    config = yaml.safe_load((Path(group.index[0]) / "config.yaml").read_text())
    data = config.get("data") or {}
    source = data.get("source") or "embedded"
    if source == "ruler":
        from harness.tasks.ruler.dataset import LENGTHS

        lengths = tuple(int(n) for n in (data.get("lengths") or LENGTHS))
        return LimitRule(source, per_limit=len(lengths), lengths=lengths)
    return LimitRule(source, multiple=limit_step(group))


def limit_step(group: pd.DataFrame) -> int:
    """What ``data.limit`` should be a multiple of: for the embedded suite, every context size meets
    every answer depth once in lcm(sizes, depths) samples (``harness.tasks.embedded.dataset``); else 1."""
    config = yaml.safe_load((Path(group.index[0]) / "config.yaml").read_text())
    if (config.get("data") or {}).get("source") != "embedded":
        return 1
    from harness.tasks.embedded import dataset as synthetic

    sizes = len((config.get("data") or {}).get("context_words") or synthetic.CONTEXT_WORDS)
    return math.lcm(sizes, len(synthetic.DEPTHS))


def samples_available(group: pd.DataFrame, limit: int) -> int | None:
    """Samples per task the data loader gives at ``data.limit`` = ``limit`` (the fewest over tasks),
    asked of the loader itself; None for a source that needs a tokenizer or files to answer."""
    config = yaml.safe_load((Path(group.index[0]) / "config.yaml").read_text())
    data = config.get("data") or {}
    if data.get("source") != "embedded":
        return None
    from collections import Counter

    from harness.config import DataSettings
    from harness.tasks import load_samples

    settings = DataSettings(name=data["name"], source="embedded", tasks=tuple(data["tasks"]) if data.get("tasks")
                            else None, limit=limit, seed=data.get("seed", 0),
                            context_words=tuple(data["context_words"]) if data.get("context_words") else None)
    return min(Counter(sample.task for sample in load_samples(settings)).values())


def recommendation(comparisons: list[Comparison], group: pd.DataFrame, n_now: int, afternoon: int, cost: Cost,
                   effect: float, level: float, power: float, rule: LimitRule | None = None) -> list[str]:
    """A ``data.limit``: the median comparison's count for the minimal effect, capped at one
    afternoon, turned into the data family's ``data.limit`` (``LimitRule``: per task, or per task
    and length for RULER, in whole steps); checked against what the loader gives."""
    spread = [c for c in comparisons if c.sd > 0]
    if not spread:
        return ["### Recommendation", "", "Every headline comparison is between identical cells: nothing to plan.", ""]
    rule = rule or limit_rule(group)
    at_effect = sorted(c.needed(effect, level, power) for c in spread)
    median_effect = float(np.median(at_effect))
    wanted_limit = rule.limit_for(median_effect)
    wanted = rule.samples(wanted_limit)
    fits = wanted <= afternoon
    limit = wanted_limit if fits else rule.limit_within(afternoon)
    chosen = rule.samples(limit)
    detectable_then = np.median([z_sum(level, power) * c.sd / math.sqrt(chosen) for c in spread])
    share_then = np.mean([c.power(c.diff, chosen, level) for c in spread] + [0.0] * (len(comparisons) - len(spread)))
    per_task = f"{chosen} samples per task, " if rule.per_limit > 1 else ""
    per_task_wanted = f"{wanted} samples per task, " if rule.per_limit > 1 else ""
    text = (f"For the median headline comparison to find a true {effect:g}-point difference with {power:.0%} power "
            f"after Holm needs {fmt_n(median_effect)} samples per task (range {fmt_n(at_effect[0])} to "
            f"{fmt_n(at_effect[-1])}); one afternoon allows {afternoon}. ")
    if fits:
        text += (f"Recommended `data.limit: {limit}` ({per_task}{cost.hours(chosen):.1f} h): the comparison of "
                 f"median spread then detects {effect:g} points.")
    else:
        text += (f"That does not fit: recommended `data.limit: {limit}` (the afternoon: {per_task}"
                 f"{cost.hours(chosen):.1f} h), at which the median comparison detects {detectable_then:.2f} points "
                 f"and an expected {share_then:.0%} of the headline comparisons are decided if the observed "
                 f"differences are the true ones; a {effect:g}-point claim for the median comparison needs "
                 f"`data.limit: {wanted_limit}` ({per_task_wanted}{cost.hours(wanted):.0f} h).")
    counts = rule.counts()
    text += f" ({counts[0].upper()}{counts[1:]}.)"
    now = (yaml.safe_load((Path(group.index[0]) / "config.yaml").read_text()).get("data") or {}).get("limit")
    lines = ["### Recommendation", "", text, "",
             f"(Now: {n_now} per task" + (f", `data.limit: {now}`" if now is not None else "") + ".)", ""]
    available = samples_available(group, limit)
    if available is not None and available < rule.samples(limit):
        lines += [f"**The data loader gives only {available} samples per task at `data.limit: {limit}`** (asked of "
                  f"`harness.tasks.load_samples` now): the limit above takes effect only once the loader generates "
                  f"as many as the limit asks.", ""]
    return lines


KVPRESS_RATIOS = (0.25, 0.5, 0.75, 0.875)  # the compression ratios NVIDIA kvpress's leaderboard reports


def ruler_plan(comparisons: list[Comparison], tasks: list[str], cost: Cost, group: pd.DataFrame, effect: float,
               alpha: float, power: float, hours: float, ruler_tasks: int, ruler_lengths: tuple[int, ...]) -> list[str]:
    """RULER has no committed run: transfer this suite's per-task variance of a sample's difference
    to RULER's task count, its family to kvpress's ratios, and its cost by cells and prompt length
    (each stated as an assumption)."""
    spread = [c for c in comparisons if c.sd > 0]
    if not spread:
        return []
    # A comparison's mean per-task variance of one sample's difference: S^2 T^2 / T = S^2 T.
    per_task_variance = float(np.median([c.sd ** 2 * c.tasks for c in spread]))
    ruler_sd = math.sqrt(per_task_variance / ruler_tasks)
    variants = group["variant"].nunique()
    family = (variants - 1) * len(KVPRESS_RATIOS)  # per ratio: the focus against the others and full cache
    cells = (variants - 1) * len(KVPRESS_RATIOS) + 1
    level = alpha / family
    n_effect = samples_needed(effect, ruler_sd, level, power)
    prompt_tokens = []
    for run in group.index:
        perf = read_json(Path(run) / "perf.json")
        prompt_tokens.append(perf["prompt_tokens"] / perf["requests"])
    suite_tokens = float(np.median(prompt_tokens))
    ruler_tokens = float(np.mean(ruler_lengths))  # a sample fills its length, answer included
    per_prompt = cost.per_sample / len(tasks)  # one prompt, every cell of the sweep, forced passes included
    per_sample = per_prompt * (cells / len(group)) * (ruler_tokens / suite_tokens) * ruler_tasks
    afternoon = int(hours * 3600 // per_sample)
    limit_effect = math.ceil(n_effect / len(ruler_lengths))
    limit_afternoon = afternoon // len(ruler_lengths)
    detectable = z_sum(level, power) * ruler_sd / math.sqrt(max(limit_afternoon * len(ruler_lengths), 1))
    pilot = 4
    pilot_hours = pilot * len(ruler_lengths) * per_sample / 3600
    return [
        "### RULER (no committed run: planning assumption)",
        "",
        f"Assumptions, not measurements: each of RULER's {ruler_tasks} tasks has this suite's median per-task "
        f"variance of a sample's paired difference ({per_task_variance:.0f} points^2, median over the "
        f"{len(spread)} comparisons with spread); the experiment runs kvpress's ratios "
        f"{', '.join(f'{r:g}' for r in KVPRESS_RATIOS)} with the same {variants} variants ({cells} cells, a "
        f"headline family of {family}, Holm's strictest level {alpha}/{family}); time per prompt grows with the "
        f"cells ({cells} against {len(group)}) and the prompt length (RULER lengths "
        f"{', '.join(map(str, ruler_lengths))} tokens, mean {ruler_tokens:.0f}, against this suite's median "
        f"{suite_tokens:.0f}; prompt-only compression, `decode_eviction=false`, evicts less and should cost less). "
        f"Then the average's S is {ruler_sd:.1f} points (12 tasks average more samples than 4), "
        f"{per_sample:.0f} s per sample per task, a {effect:g}-point difference needs {fmt_n(n_effect)} samples "
        f"per task with {power:.0%} power, i.e. `data.limit: {limit_effect}` (RULER's limit counts per task and "
        f"length, {len(ruler_lengths)} lengths; {limit_effect * len(ruler_lengths) * per_sample / 3600:.1f} h), and "
        f"one afternoon allows {afternoon} per task (`data.limit: {limit_afternoon}`, detecting {detectable:.1f} "
        f"points). RULER's string-match scores on a 135M model may be nearly all 0 or all 1 on a task, which "
        f"makes its variance smaller or larger than assumed; so before choosing, run the pilot: the same cells on "
        f"`data=ruler data.limit={pilot}` ({pilot * len(ruler_lengths)} samples per task, "
        f"{pilot * len(ruler_lengths) * ruler_tasks} prompts, about {pilot_hours:.1f} h by the same assumptions), "
        f"then this command on its results.",
        "",
    ]


def ruler_defaults() -> tuple[int, tuple[int, ...]]:
    """RULER's task count and lengths as ``conf/data/ruler.yaml`` sets them (null tasks = all)."""
    from harness.tasks.ruler.dataset import TASKS

    config = yaml.safe_load((Path(__file__).resolve().parents[2] / "conf" / "data" / "ruler.yaml").read_text())
    tasks = config.get("tasks") or TASKS
    return len(tasks), tuple(int(n) for n in config["lengths"])


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, help="a results directory of run directories (e.g. results/cpu_accuracy)")
    parser.add_argument("--focus", default="paged", help="the variant compared against every other (default paged)")
    parser.add_argument("--effect", type=float, default=EFFECT, help="minimal effect in points (default 2)")
    parser.add_argument("--alpha", type=float, default=ALPHA, help="family-wise error (default 0.05)")
    parser.add_argument("--power", type=float, default=POWER, help="power (default 0.8)")
    parser.add_argument("--hours", type=float, default=AFTERNOON_HOURS, help="a CPU afternoon in hours (default 4)")
    parser.add_argument("--decide", default=",".join(map(str, DECIDE_SHARES)),
                        help="shares (%%) of the headline comparisons to decide, comma-separated (default 50,75,90)")
    parser.add_argument("--out", type=Path, help="markdown file (default <root>/sample_size.md)")
    parser.add_argument("--ruler-plan", action=argparse.BooleanOptionalAction, default=True,
                        help="add the RULER planning section, transferred from these runs' variance (default on)")
    args = parser.parse_args(argv)
    problems = []
    if args.effect <= 0:
        problems.append(f"--effect {args.effect}: must be > 0 points")
    if not 0 < args.alpha < 1:
        problems.append(f"--alpha {args.alpha}: must be in (0, 1)")
    if not 0.5 <= args.power < 1:
        problems.append(f"--power {args.power}: must be in [0.5, 1)")
    if args.hours <= 0:
        problems.append(f"--hours {args.hours}: must be > 0")
    try:
        shares = tuple(int(s) for s in args.decide.split(","))
        if not all(0 < s <= 100 for s in shares):
            raise ValueError
    except ValueError:
        problems.append(f"--decide {args.decide}: comma-separated whole percentages in (0, 100]")
        shares = ()
    if not args.root.is_dir():
        problems.append(f"{args.root}: not a directory")
    if problems:
        parser.error("; ".join(problems))
    command = "python -m harness.analysis.sample_size " + " ".join(argv)
    text = report(args.root, args.focus, args.effect, args.alpha, args.power, args.hours, shares,
                  ruler_defaults() if args.ruler_plan else None, command)
    out = args.out or args.root / "sample_size.md"
    atomic_write_text(out, text)
    print(text)
    print(f"[sample_size] -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
