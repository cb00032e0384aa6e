"""A serving sweep's summaries: per configuration and request rate, its figures over trials and its
ratio to full cache in the same trial and rate (geometric mean with a 95% t-interval over trials,
``harness.analysis.stats.ratio_interval``); its accuracy over the same served requests (95% intervals
over whole contexts, ``harness.analysis.stats.cell_interval``: a context's requests are resampled
together); where the runs kept the eviction scheduler's ledger, where a step's time goes at the
highest rate (``time_split``); and the latency-throughput plot."""
from __future__ import annotations

import math
import statistics

# Stated before any run (issue 64): a compressing configuration's accuracy counts as acceptable when
# it is non-inferior to full cache's within this many points (0-100), and its gain counts when its
# goodput at the highest rate reaches TARGET x full cache's.
ACCURACY_MARGIN = 5.0
TARGET = 1.3

# ratio to full cache of these run figures (higher is better for the first two, lower for the others)
RATIOS = (("output_tok_s", "output tok/s"), ("request_goodput", "goodput"), ("median_ttft_ms", "median TTFT"),
          ("median_tpot_ms", "median TPOT"))


# the figures the plot draws, each with its 95% t-interval over trials (error bars)
PLOTTED = ("output_tok_s", "request_goodput", "median_ttft_ms", "median_e2el_ms")


def half_width(values: list[float]) -> float | None:
    """Half the 95% t-interval of the mean of ``values`` (one per trial; None with fewer than two)."""
    from harness.analysis.stats import t_975

    if len(values) < 2:
        return None
    return t_975(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))


def ratio_cell(values: list[float]) -> dict:
    """Per-trial ratios -> estimate and 95% interval (None bounds with one trial; a zero or missing
    ratio in any trial leaves it undecided: no log of 0)."""
    from harness.analysis.stats import ratio_interval

    if not values or any(v is None or not v > 0 or math.isinf(v) for v in values):
        return {"estimate": None, "low": None, "high": None, "trials": len(values)}
    if len(values) == 1:
        return {"estimate": values[0], "low": None, "high": None, "trials": 1}
    interval = ratio_interval(values)
    return {"estimate": interval.estimate, "low": interval.low, "high": interval.high, "trials": len(values)}


def divide(a, b) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def rate_table(rows: list[dict]) -> list[dict]:
    """One line per configuration and rate: figures averaged over trials, and each of ``RATIOS``
    against full cache of the same trial and rate."""
    by = {(r["configuration"], r["rate"], r["trial"]): r for r in rows}
    configurations = list(dict.fromkeys(r["configuration"] for r in rows))
    table = []
    for rate in sorted({r["rate"] for r in rows}):
        for name in configurations:
            mine = [r for r in rows if r["configuration"] == name and r["rate"] == rate]
            line = {"configuration": name, "rate": rate, "trials": len(mine),
                    "completed": sum(r["completed"] for r in mine), "failed": sum(r["failed"] for r in mine)}
            for key in ("output_tok_s", "request_goodput", "median_ttft_ms", "median_tpot_ms", "median_e2el_ms",
                        "kv_usage_mean", "kv_usage_peak", "accuracy"):
                values = [r[key] for r in mine if r.get(key) is not None]
                line[key] = statistics.fmean(values) if values else None
                if key in PLOTTED:
                    line[f"{key}_half"] = half_width(values)
            if name != "full":
                for key, _ in RATIOS:
                    cell = ratio_cell([divide(r[key], by.get(("full", rate, r["trial"]), {}).get(key)) for r in mine])
                    line.update({f"{key}_ratio": cell["estimate"], f"{key}_low": cell["low"], f"{key}_high": cell["high"]})
            table.append(line)
    return table


def accuracy_table(requests: list[dict]) -> list[dict]:
    """Per configuration, over every rate and trial: each request's score averaged over its runs,
    then the mean over context kinds of the kinds' means (``cell_interval``, whole contexts
    resampled together), and its difference from full cache on the same requests."""
    import numpy as np

    from harness.analysis.stats import cell_interval, holm, sign_flip_test
    from harness.analysis.verdicts import verdict

    scored = [r for r in requests if r["score"] is not None]
    if not scored:
        return []
    per_request: dict[tuple, list[float]] = {}
    for r in scored:
        per_request.setdefault((r["configuration"], r["context"], r["question"]), []).append(r["score"])
    mean = {key: statistics.fmean(values) for key, values in per_request.items()}
    configurations = list(dict.fromkeys(r["configuration"] for r in scored))
    keys = sorted({(context, question) for _, context, question in mean})

    def strata(values: dict[tuple, float]):
        per_kind, clusters = {}, {}
        for (context, _), value in values.items():
            kind = context.split("-")[0]
            per_kind.setdefault(kind, []).append(value)
            clusters.setdefault(kind, []).append(context)
        return {k: np.array(v) for k, v in per_kind.items()}, {k: np.array(v) for k, v in clusters.items()}

    def interval(values: dict[tuple, float], bounds: tuple[float, float]):
        per_kind, clusters = strata(values)
        return cell_interval(per_kind, clusters=clusters, bounds=bounds)

    table = []
    for name in configurations:
        mine = {key: mean[(name, *key)] for key in keys if (name, *key) in mean}
        score = interval(mine, (0.0, 1.0))  # scores lie in [0, 1]
        line = {"configuration": name, "requests": len(mine), "score": score.estimate, "score_low": score.low,
                "score_high": score.high}
        if name != "full":
            paired = {key: value - mean[("full", *key)] for key, value in mine.items() if ("full", *key) in mean}
            difference = interval(paired, (-1.0, 1.0))  # ... and their differences in [-1, 1]
            per_kind, clusters = strata(paired)
            line.update(vs_full=difference.estimate, vs_full_low=difference.low, vs_full_high=difference.high,
                        p=sign_flip_test(per_kind, clusters=clusters).p,
                        contexts=len({context for context, _ in paired}),
                        contexts_to_show_non_inferior=contexts_for_non_inferiority(paired))
        table.append(line)
    # Holm over the table's family (every compressing configuration against full cache), then one word
    # each: better / worse, or non-inferior within ACCURACY_MARGIN points, or inconclusive
    # (harness.analysis.verdicts); a family whose smallest attainable p cannot reach 0.05 enters none.
    from harness.analysis.stats import can_decide

    compared = [line for line in table if "p" in line]
    decidable = can_decide([line["contexts"] for line in compared])
    for line, adjusted in zip(compared, holm([line["p"] for line in compared])):
        line["p_holm"] = adjusted
        line["verdict"] = verdict(line["vs_full"], line["vs_full_low"], line["vs_full_high"], adjusted,
                                  ACCURACY_MARGIN, decidable=decidable)
        # acceptable: the one-sided test at 2.5% rejects "worse by the margin or more" (a decided loss
        # smaller than the margin is "worse" and still acceptable)
        line["non_inferior"] = decidable and line["vs_full_low"] > -ACCURACY_MARGIN
    return table


def contexts_for_non_inferiority(paired: dict[tuple, float]) -> int | None:
    """The plan for a design that can show non-inferiority within ACCURACY_MARGIN points: contexts
    per context kind, from the spread of the observed per-context mean differences
    (``harness.analysis.sample_size.clusters_for_non_inferiority``, whole contexts as clusters)."""
    import numpy as np

    from harness.analysis.sample_size import clusters_for_non_inferiority

    per_context: dict[str, dict[str, list[float]]] = {}
    for (context, _), value in paired.items():
        per_context.setdefault(context.split("-")[0], {}).setdefault(context, []).append(value)
    means = {kind: np.array([statistics.fmean(v) for v in contexts.values()]) for kind, contexts in per_context.items()}
    return clusters_for_non_inferiority(means, ACCURACY_MARGIN)


def headline(table: list[dict], accuracy: list[dict], unit: str = "req/s") -> list[str]:
    """The verdict in a few lines: per compressing configuration, its goodput and output tok/s
    against full cache's at each rate, beside its accuracy verdict; whether a configuration whose
    accuracy is non-inferior to full cache's reaches TARGET x full cache's goodput at some rate
    (the interval's lower bound)."""
    if not table:
        return []
    words = {line["configuration"]: line.get("verdict") for line in accuracy}
    acceptable = {line["configuration"]: line.get("non_inferior", False) for line in accuracy}
    lines = ["## Verdict", "",
             "Against full cache with prefix caching in the same trial and rate; accuracy non-inferior means within "
             f"{ACCURACY_MARGIN:g} points (0-100) of full cache's, and the target is {TARGET:g}x full cache's goodput "
             "at such an accuracy, both stated before the run. " + ratio_design(accuracy), ""]
    reached = []
    for name in dict.fromkeys(line["configuration"] for line in table if line["configuration"] != "full"):
        word = words.get(name)
        ok = acceptable.get(name, False)
        if word is not None and word != "no verdict":
            word += f" ({'within' if ok else 'not shown within'} the {ACCURACY_MARGIN:g}-point margin)"
        lines.append(f"* {name}: accuracy {word or 'not scored'}; goodput and output tok/s against full cache's "
                     "at " + "; ".join(f"{line['rate']:g} {unit} {judged(line, 'request_goodput')} and "
                                      f"{judged(line, 'output_tok_s')}"
                                      for line in table if line["configuration"] == name) + ".")
        hits = [line["rate"] for line in table if line["configuration"] == name
                and line.get("request_goodput_low") is not None and line["request_goodput_low"] >= TARGET]
        if ok and hits:
            reached.append(f"{name} (at {', '.join(f'{r:g}' for r in hits)} {unit})")
    if any(words.values()):
        lines += ["", (f"Reached by: {'; '.join(reached)}: the goodput interval's lower bound at or above {TARGET:g}x."
                       if reached else f"No configuration reaches {TARGET:g}x full cache's goodput (the interval's "
                       "lower bound) at an accuracy non-inferior to full cache's.")]
    return lines + [""]


# The parts of a run's wall time, from its ledger (harness.engine.scheduler.Ledger: model_s holds
# capture_s, evict_s holds reconstruct_s), each without what it holds, and the rest of the wall time.
PARTS = (("model", "model"), ("capture", "attention (query capture)"), ("eviction", "eviction"),
         ("reconstruction", "reconstruction"), ("other", "scheduling and other"))
EVICTION_PARTS = ("capture", "eviction", "reconstruction")  # the eviction's own work


def run_parts(row: dict) -> dict | None:
    """One run's seconds per part (``PARTS``), or None where its worker timed no step (no request of
    the run evicts: the worker times only steps that run an evicting request)."""
    model, capture, evict = row["ledger_model_s"], row["ledger_capture_s"], row["ledger_evict_s"]
    if not model:
        return None
    reconstruct = row.get("ledger_reconstruct_s") or 0.0
    return {"model": model - capture, "capture": capture, "eviction": evict - reconstruct,
            "reconstruction": reconstruct, "other": row["duration_s"] - model - evict}


def time_split(rows: list[dict]) -> list[dict]:
    """Where a step's time goes at the highest rate, one line per configuration whose runs kept
    their ledger: steps and wall ms per step, and per part (``PARTS``) its ms per step and share of
    the wall time, means over trials with the 95% t-interval's half-width over trials; a
    configuration whose worker timed no step (full cache) has steps and wall time only."""
    kept = [r for r in rows if r.get("ledger_steps")]
    if not kept:
        return []
    top = max(r["rate"] for r in kept)
    split = []
    for name in dict.fromkeys(r["configuration"] for r in kept):
        mine = [r for r in kept if r["configuration"] == name and r["rate"] == top]
        if not mine:
            continue
        walls = [r["duration_s"] * 1000 / r["ledger_steps"] for r in mine]
        line = {"configuration": name, "rate": top, "trials": len(mine),
                "steps": statistics.fmean(r["ledger_steps"] for r in mine), "wall_ms_per_step": statistics.fmean(walls),
                "wall_ms_per_step_half": half_width(walls),
                "reconstructs": any(r.get("ledger_reconstruct_s") is not None for r in mine)}
        parts = [run_parts(r) for r in mine]
        line["timed"] = None not in parts
        if line["timed"]:
            for key, _ in PARTS:
                shares = [p[key] / r["duration_s"] for p, r in zip(parts, mine)]
                line[f"{key}_ms_per_step"] = statistics.fmean(p[key] * 1000 / r["ledger_steps"] for p, r in zip(parts, mine))
                line[f"{key}_share"], line[f"{key}_share_half"] = statistics.fmean(shares), half_width(shares)
            own = [sum(p[key] for key in EVICTION_PARTS) / r["duration_s"] for p, r in zip(parts, mine)]
            line["eviction_work_share"], line["eviction_work_share_half"] = statistics.fmean(own), half_width(own)
        split.append(line)
    return split


def split_reading(line: dict, rate_line: dict | None, accuracy_line: dict | None) -> str:
    """What a compressing configuration's split says about the target, from its numbers only:
    the wall time its output tok/s needs to lose to reach TARGET x full cache's at the same output
    tokens, against its eviction's own share; its goodput ratio; its accuracy."""
    e, m, other = line["eviction_work_share"], line["model_share"], line["other_share"]
    text = (f"* {line['configuration']}: the eviction's own work (query capture, eviction"
            f"{', reconstruction' if line['reconstructs'] else ''}) takes {e:.0%} of the wall time, the model "
            f"{m:.0%}, scheduling and other {other:.0%}.")
    ratio = rate_line.get("output_tok_s_ratio") if rate_line else None
    if ratio is None:
        text += " Its output tok/s against full cache's is undecided."
    elif ratio < TARGET:
        need = 1 - ratio / TARGET
        text += (f" Its output tok/s is {ratio_text(rate_line, 'output_tok_s')} full cache's: {TARGET:g}x at the "
                 f"same output tokens needs the run {need:.0%} shorter, "
                 + (f"which its eviction's own {e:.0%} would cover were it free." if e >= need else
                    f"more than its eviction's own {e:.0%}: the rest would have to come off the model's {m:.0%} "
                    f"or the other {other:.0%}."))
    else:
        text += (f" Its output tok/s is already {ratio_text(rate_line, 'output_tok_s')} full cache's; goodput "
                 "counts only the requests within the SLOs, which this split of the steps does not apportion.")
    goodput = rate_line.get("request_goodput_ratio") if rate_line else None
    text += (" Its goodput against full cache's is " + (ratio_text(rate_line, "request_goodput") if goodput is not None
                                                        else "undecided (0 in a trial)") + ".") if rate_line else ""
    if accuracy_line is not None and "non_inferior" in accuracy_line and not accuracy_line["non_inferior"]:
        text += (f" Its accuracy is not shown within the {ACCURACY_MARGIN:g}-point margin "
                 f"({accuracy_line.get('verdict')}), which no time saved changes.")
    return text


def split_section(split: list[dict], table: list[dict], accuracy: list[dict], unit: str = "req/s") -> list[str]:
    """``summary.md``'s "Where a step's time goes" (empty where no run kept its ledger)."""
    if not split:
        return []
    top = split[0]["rate"]
    parts = [(key, label) for key, label in PARTS if key != "reconstruction" or any(l["reconstructs"] for l in split)]
    lines = ["## Where a step's time goes", "",
             f"At the highest rate ({top:g} {unit}), from the eviction scheduler's ledger (`GET /kv_eviction/state`, "
             "reset before each run and read after it: `runs/*.ledger.json`): the worker's seconds over the steps "
             "that ran an evicting request, split into the model (its forward and sampling, less the query capture "
             "inside it), the query capture attention-aware policies read, the eviction (less the reconstruction "
             "inside it), KVzip's reconstruction passes, and the rest of the run's wall time (vLLM's benchmark's "
             "duration): the scheduler, the server and the client, and waiting for arrivals. Each part in ms per "
             "step (steps that scheduled tokens) and as a share of the wall time, means over trials "
             "(± the 95% t-interval's half-width over trials). The worker times no step of a run where no request "
             "evicts (full cache): its steps and wall time per step only.", "",
             "| configuration | trials | steps | wall ms/step | " + " | ".join(label for _, label in parts) + " |",
             "|---|---|---|---|" + "---|" * len(parts)]
    for line in split:
        cells = [f"{line[f'{key}_ms_per_step']:.1f} ({share_text(line[f'{key}_share'], line[f'{key}_share_half'])})"
                 if line["timed"] else "not timed" for key, _ in parts]
        wall = number(line["wall_ms_per_step"], 1) + ("" if line["wall_ms_per_step_half"] is None
                                                       else f" ± {line['wall_ms_per_step_half']:.1f}")
        lines.append(f"| {line['configuration']} | {line['trials']} | {line['steps']:.0f} | {wall} | "
                     + " | ".join(cells) + " |")
    rates = {line["configuration"]: line for line in table if line["rate"] == top}
    scores = {line["configuration"]: line for line in accuracy}
    readings = [split_reading(line, rates.get(line["configuration"]), scores.get(line["configuration"]))
                for line in split if line["timed"] and line["configuration"] != "full"]
    if readings:
        lines += ["", f"What the split says of the target ({TARGET:g}x full cache's goodput at an accuracy within "
                  f"{ACCURACY_MARGIN:g} points):", ""] + readings
    return lines + [""]


def share_text(share: float, half: float | None) -> str:
    return f"{100 * share:.0f}%" + ("" if half is None else f" ± {100 * half:.0f}")


def number(value, digits: int = 2, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.{digits}f}{suffix}"


# which way each ratio to full cache is better, for the words better and worse
HIGHER_IS_BETTER = {"output_tok_s": True, "request_goodput": True, "median_ttft_ms": False, "median_tpot_ms": False}


def ratio_word(line: dict, key: str) -> str:
    """A configuration's ratio to full cache in one word (issue 65): ``ratio_verdict`` at
    ``THROUGHPUT_MARGIN``, as every throughput summary and RESULTS.md give theirs, from its 95%
    t-interval over trials; no interval (one trial, or a 0 in a trial): no verdict."""
    from harness.analysis.studies import THROUGHPUT_MARGIN
    from harness.analysis.verdicts import NO_VERDICT, ratio_verdict

    estimate, low, high = line.get(f"{key}_ratio"), line.get(f"{key}_low"), line.get(f"{key}_high")
    if estimate is None or low is None or high is None:
        return NO_VERDICT
    return ratio_verdict(estimate, low, high, THROUGHPUT_MARGIN, HIGHER_IS_BETTER[key])


def judged(line: dict, key: str) -> str:
    """``ratio_text`` with its word after it (full cache, the reference, has none)."""
    text = ratio_text(line, key)
    return text if line["configuration"] == "full" else f"{text} {ratio_word(line, key)}"


def ratio_design(accuracy: list[dict]) -> str:
    """What the ratios' words rest on, and, for a workload whose answers are not scored, that it
    enters no accuracy verdict (issue 65: every summary states its smallest attainable p)."""
    from harness.analysis.studies import THROUGHPUT_MARGIN

    floor, ceiling = 1 - THROUGHPUT_MARGIN, 1 / (1 - THROUGHPUT_MARGIN)
    return ((f"Each ratio's word (`harness.analysis.verdicts.ratio_verdict`, as in every throughput summary) is at a "
             f"margin of {THROUGHPUT_MARGIN:.0%} (`harness.analysis.studies.THROUGHPUT_MARGIN`, stated before the run): "
             "`better`/`worse` where its 95% t-interval over trials excludes 1 (higher goodput and output tok/s, lower "
             f"TTFT and TPOT are better), `equivalent` inside ({floor:g}x, {ceiling:.3g}x), `non-inferior` where its "
             "worse-side bound is, else `inconclusive`; unadjusted over the table's ratios. The t-test's p has no floor "
             "above 0, so two or more trials can decide; one trial, or a 0 in a trial, gives `no verdict`.")
            + ("" if accuracy else " Accuracy: not scored (this workload's requests have no reference answers), so "
               "no accuracy verdict and no smallest p for one."))


def ratio_text(line: dict, key: str) -> str:
    estimate, low, high = line.get(f"{key}_ratio"), line.get(f"{key}_low"), line.get(f"{key}_high")
    if line["configuration"] == "full":
        return "1.00x"
    if estimate is None:
        return "undecided (0 in a trial)"
    return f"{estimate:.2f}x" + ("" if low is None else f" ({ratio_bound(low)}-{ratio_bound(high)})")


def ratio_bound(bound: float) -> str:
    """A ratio's bound in two decimals, or as many more as it takes to show its side of 1 (a bound of
    1.003 printed 1.00 would read as an interval touching 1 beside the word better)."""
    digits = 2
    while bound != 1 and round(bound, digits) == 1 and digits < 6:
        digits += 1
    return f"{bound:.{digits}f}"


def usable_blocks(settings: dict) -> int:
    """The pool's blocks requests can hold: ``pool_blocks`` is vLLM's ``num_gpu_blocks`` (the label
    ``Server.pool_blocks`` reads), which counts the null block vLLM takes out of the free queue when
    it builds the pool (vllm/v1/core/block_pool.py:187), as the eviction ledger's pool does not."""
    return settings["pool_blocks"] - 1


def pool_clause(settings: dict) -> str:
    """Whether full cache queues on the sweep's pool: what it needs to run every request (conversation)
    at once, ``workloads.blocks_at_once``, against the blocks requests can hold (empty for settings
    that do not say)."""
    needs = settings.get("full_cache_blocks")
    if needs is None:
        return ""
    return (f", {'where full cache queues' if usable_blocks(settings) < needs else 'where full cache does not queue'}: "
            f"with prefix caching it needs {needs} to run every "
            f"{'request' if settings.get('turns', 1) == 1 else 'conversation'} at once")


def markdown(table: list[dict], accuracy: list[dict], settings: dict, alone: list[dict] | None = None,
             split: list[dict] | None = None, rows: list[dict] | None = None) -> str:
    from harness.serving.workloads import rate_unit

    contexts = settings.get("contexts")
    turns = settings.get("turns", 1)
    unit = rate_unit(turns)
    lines = [f"# Serving benchmark: {settings['workload']}", "",
             f"Command: `{settings['command']}`"
             + (f" (commit {settings['provenance']['git_commit']}, code version "
                f"{settings['provenance']['code_version']})" if settings.get("provenance") else ""), "",
             f"{settings['description']}. One `vllm serve` ({settings['model']}, prefix caching on, the eviction "
             f"scheduler, a pool of {usable_blocks(settings)} blocks of {settings['block_size']} tokens (vLLM's "
             f"{settings['pool_blocks']} less its null block)"
             + pool_clause(settings) + "), every "
             "configuration a per-request `vllm_xargs` setting; "
             + ("vLLM's own `benchmark()` (`vllm/benchmarks/serve.py`) sends the requests as token ids with Poisson "
                "arrivals (burstiness 1.0) at each rate" if turns == 1 else
                "conversations arrive by vLLM's own arrival process (`get_request`, `vllm/benchmarks/serve.py`; "
                "Poisson, burstiness 1.0) at each rate in conversations per second, and each later turn goes out "
                "when the one before it returns (its prompt: the last prompt, the answer's token ids, the next "
                "question), every turn through vLLM's own request function, the figures by vLLM's "
                "`calculate_metrics` over every turn (`harness.engine.bench_client.conversations`)")
             + f", temperature 0, {'ignore_eos' if settings['ignore_eos'] else 'stopping where the model ends'}; "
             f"the prefix cache emptied before every run. Goodput SLOs (stated before the run): "
             + ", ".join(f"{k.upper()} <= {v:g} ms" for k, v in settings["goodput"].items()) + ". "
             f"Compression ratio {settings['ratio']:g} of what each configuration compresses. "
             f"{settings['trials']} trial(s), rates ascending and configurations in the listed order in odd trials, "
             "both reversed in even ones; within a trial and rate every configuration gets the same arrival times"
             + (". " if turns == 1 else " for its conversations' first turns (a later turn goes out as soon as the "
                "one before returns, with no time to think between them, which favours a chain's cached turns: an "
                "entry idle between turns could be reclaimed). ")
             + "Ratios: the configuration's figure over full cache's in the same trial and rate, geometric mean with a "
             "95% t-interval over trials (`harness.analysis.stats.ratio_interval`; one trial: no interval). KV usage: "
             "vLLM's `vllm:kv_cache_usage_perc` gauge sampled every 0.5 s beside the run (mean, peak).", ""]
    if settings.get("capacity") is not None:
        lines += [f"Rates: {', '.join(f'{r:g}' for r in settings['rates'])} {unit}, fractions "
                  f"{', '.join(f'{f:g}' for f in settings['fractions'])} of full cache's capacity "
                  f"({settings['capacity']:.3f} {unit} with every "
                  f"{'request' if turns == 1 else 'conversation'} sent at once).", ""]
    lines += headline(table, accuracy, unit)
    lines += split_section(split or [], table, accuracy, unit)
    lines += conversation_section(rows or [], unit)
    lines += ["## Every rate", "", f"| rate ({unit}) | configuration | completed/failed | output tok/s | vs full | goodput (req/s) | vs full | "
              "median TTFT ms | vs full | median TPOT ms | vs full | KV usage mean/peak | accuracy |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for line in table:
        lines.append(
            f"| {line['rate']:g} | {line['configuration']} | {line['completed']}/{line['failed']} | "
            f"{number(line['output_tok_s'], 1)} | {judged(line, 'output_tok_s')} | "
            f"{number(line['request_goodput'], 3)} | {judged(line, 'request_goodput')} | "
            f"{number(line['median_ttft_ms'], 0)} | {judged(line, 'median_ttft_ms')} | "
            f"{number(line['median_tpot_ms'], 1)} | {judged(line, 'median_tpot_ms')} | "
            f"{number(line['kv_usage_mean'])}/{number(line['kv_usage_peak'])} | {number(line['accuracy'], 1)} |")
    if accuracy:
        from harness.analysis.stats import smallest_p

        smallest = smallest_p(contexts) if contexts else None
        lines += ["", "## Accuracy of the served requests", "",
                  "Each request's score (0-100) averaged over every rate and trial it was served in; the mean over "
                  "context kinds of the kinds' means, 95% intervals over whole contexts (a context's requests "
                  "are resampled together, `harness.analysis.stats.cell_interval`); *vs full*: the same requests' "
                  "paired difference from full cache."
                  + (f" With {contexts} contexts the smallest two-sided p the test over whole contexts can "
                     f"reach is {smallest:.2g} (`harness.analysis.stats.smallest_p`)." if smallest else "")
                  + " p: the stratified sign-flip test over whole contexts, Holm-adjusted over the table's comparisons; "
                  f"verdict at a margin of {ACCURACY_MARGIN:g} points stated before the run "
                  "(`harness.analysis.verdicts`).", "",
                  "| configuration | requests | score (95%) | vs full (95%) | p (Holm) | verdict |",
                  "|---|---|---|---|---|---|"]
        for line in accuracy:
            versus = ("-" if "vs_full" not in line else
                      f"{line['vs_full']:+.2f} ({line['vs_full_low']:+.2f}, {line['vs_full_high']:+.2f})")
            p = "-" if "p" not in line else f"{line['p']:.4f} ({line['p_holm']:.4f})"
            lines.append(f"| {line['configuration']} | {line['requests']} | {line['score']:.1f} "
                         f"({line['score_low']:.1f}, {line['score_high']:.1f}) | {versus} | {p} | "
                         f"{line.get('verdict', '-')} |")
        planned = [line for line in accuracy if line.get("contexts_to_show_non_inferior")]
        if planned:
            lines += ["", f"Planning the next design (`contexts_for_non_inferiority`, `harness.analysis.sample_size`'s "
                      "normal approximation on the spread of these per-context differences): to show a configuration "
                      f"non-inferior within {ACCURACY_MARGIN:g} points with 80% power, were its true difference from "
                      "full cache zero, takes "
                      + "; ".join(f"{line['contexts_to_show_non_inferior']} contexts per kind for {line['configuration']}"
                                  f" (this run: {line['contexts']} in all)" for line in planned)
                      + ". A configuration whose true difference is below zero needs more."]
    if alone:
        lines += ["", "## Served under load against sent alone", "",
                  f"The first {len({(a['context'], a['question']) for a in alone})} requests of the workload, per "
                  "configuration, sent again one at a time after the sweep (vLLM's `max_concurrency` 1, prefix cache "
                  f"emptied), their texts against the same requests' in trial 1 at {alone[0]['rate']:g} {unit} "
                  "(`alone.json`; texts only: a difference is not checked for a near tie)."
                  + ("" if turns == 1 else " Conversations are replayed whole, one turn after another, each later "
                     "turn made from the answers it got alone: after a turn that parts, the later turns are no "
                     "longer the same requests.") + "", ""]
        for name in dict.fromkeys(a["configuration"] for a in alone):
            mine = [a for a in alone if a["configuration"] == name]
            parted = [f"{a['context']}/{a['question']} at character {a['parted_at_char']}" for a in mine if not a["equal"]]
            lines.append(f"* {name}: {sum(a['equal'] for a in mine)} of {len(mine)} equal"
                         + (f"; parted: {', '.join(parted)}" if parted else "") + ".")
    return "\n".join(lines) + "\n"


def conversation_section(rows: list[dict], unit: str) -> list[str]:
    """Conversations (runs whose rows carry the ledger's blocks, ``bench.run_row``): per rate and
    configuration, the prompt tokens a later turn computed (not found cached) and the KV blocks in
    use over the run's steps, each beside full cache's and a chained configuration's also beside its
    recompressing twin's (ratios of the same trial and rate, geometric mean and 95% t-interval over
    trials), and the chain's hits of the later turns served (``bench.chain_hits``)."""
    from harness.serving.workloads import twin_of

    rows = [r for r in rows if r.get("kv_blocks_mean") is not None]
    if not rows:
        return []
    by = {(r["configuration"], r["rate"], r["trial"]): r for r in rows}
    lines = ["## Conversations", "",
             "Per rate: the prompt tokens each later turn computed (its prompt less what vLLM found cached: "
             "`usage.prompt_tokens_details`), the KV blocks in use over the run's engine steps (the eviction "
             "scheduler's ledger: a block the prefix cache holds for no running request is free), each as a ratio to "
             "full cache's and, for a chained configuration, to its recompressing twin's in the same trial and rate "
             "(below 1: fewer); chain hits: later turns that took the turn before's compressed cache, of the later "
             "turns served (a miss recompresses the pristine history: its entry was reclaimed under pool "
             "pressure).", "",
             f"| rate ({unit}) | configuration | computed tokens per later turn | vs full | vs twin | KV blocks mean | "
             "vs full | vs twin | chain hits |", "|---|---|---|---|---|---|---|---|---|"]

    def ratio(mine: list[dict], other: str, key: str) -> str:
        cell = ratio_cell([divide(r[key], by.get((other, r["rate"], r["trial"]), {}).get(key)) for r in mine])
        return ratio_text({"configuration": "", "x_ratio": cell["estimate"], "x_low": cell["low"],
                           "x_high": cell["high"]}, "x")

    for rate in sorted({r["rate"] for r in rows}):
        for name in dict.fromkeys(r["configuration"] for r in rows):
            mine = [r for r in rows if r["configuration"] == name and r["rate"] == rate]
            if not mine:
                continue
            twin = twin_of(name) if name != "full" else None
            computed = [r["later_turn_computed"] for r in mine if r["later_turn_computed"] is not None]
            hits, asked = sum(r["chain_hits"] for r in mine), sum(r["later_turns"] for r in mine)
            lines.append(f"| {rate:g} | {name} | {number(statistics.fmean(computed) if computed else None, 0)} | "
                         f"{'-' if name == 'full' else ratio(mine, 'full', 'later_turn_computed')} | "
                         f"{ratio(mine, twin, 'later_turn_computed') if twin else '-'} | "
                         f"{number(statistics.fmean(r['kv_blocks_mean'] for r in mine), 1)} | "
                         f"{'-' if name == 'full' else ratio(mine, 'full', 'kv_blocks_mean')} | "
                         f"{ratio(mine, twin, 'kv_blocks_mean') if twin else '-'} | "
                         f"{f'{hits}/{asked}' if twin else '-'} |")
    return lines + [""]


def error_bars(values: list[float], halves: list) -> list | None:
    """Matplotlib's ``[lower arms, upper arms]`` for figures that cannot be negative (a latency, a
    throughput, a goodput): each half-width, its lower arm cut at zero where a wide interval over
    three trials would cross it; None (no bars) where a figure has no interval (one trial)."""
    if None in halves:
        return None
    return [[min(h, v) for v, h in zip(values, halves)], list(halves)]


def plot(table: list[dict], path, title: str, unit: str = "req/s") -> None:
    """Latency against throughput, one curve per configuration through its rates (means over
    trials, bars their 95% t-intervals over trials): median end-to-end latency and median TTFT
    against output tok/s, and goodput against the offered rate (a bar's lower arm cut at zero). The
    Pareto front of a configuration is its curve's lower right."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    for name in dict.fromkeys(line["configuration"] for line in table):
        mine = sorted((line for line in table if line["configuration"] == name), key=lambda line: line["rate"])
        throughput = [line["output_tok_s"] for line in mine]
        across = [line.get("output_tok_s_half") for line in mine]
        for axis, key, label in ((axes[0], "median_e2el_ms", "median end-to-end latency (s)"),
                                 (axes[1], "median_ttft_ms", "median TTFT (s)")):
            half = [line.get(f"{key}_half") for line in mine]
            seconds = [line[key] / 1000 for line in mine]
            axis.errorbar(throughput, seconds, marker="o", label=name, capsize=3, xerr=error_bars(throughput, across),
                          yerr=error_bars(seconds, [None if h is None else h / 1000 for h in half]))
            axis.set_xlabel("output tokens per second")
            axis.set_ylabel(label)
            for line in mine:
                axis.annotate(f"{line['rate']:g}", (line["output_tok_s"], line[key] / 1000), fontsize=7,
                              textcoords="offset points", xytext=(3, 3))
        goodput = [line["request_goodput"] for line in mine]
        axes[2].errorbar([line["rate"] for line in mine], goodput, marker="o", label=name, capsize=3,
                         yerr=error_bars(goodput, [line.get("request_goodput_half") for line in mine]))
    axes[2].set_xlabel(f"offered rate ({unit})" if unit != "req/s" else "offered request rate (req/s)")
    axes[2].set_ylabel("goodput (req/s within the SLOs)")
    axes[0].legend(fontsize=8)
    figure.suptitle(f"{title}: latency against throughput (points labelled by {'request ' if unit == 'req/s' else ''}"
                    "rate; bars: 95% over trials, cut at 0)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
