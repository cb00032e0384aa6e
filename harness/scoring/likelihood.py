"""Per-sample signals that do not need the model to be right, from teacher-forced decoding.

* ``answer_logprob``: the mean log-likelihood per token (nats) of the sample's reference answer,
  forced after the prompt under the cell's cache (eviction as in generation). Higher is better; it
  moves when eviction removes what the answer depends on even where the model's own answer is wrong
  under every policy (a task score of 0 everywhere says nothing).
* Along full cache's greedy output, forced under the cell's cache: ``top1_agreement``, the share of
  steps where the cell's first choice is full cache's token (its rank is 1), and ``kl_to_full``,
  the mean over steps of KL(full || cell) in nats, estimated from the ``AGREEMENT_TOP`` best
  log-probabilities of each: both distributions are coarsened to full cache's top tokens plus one
  bucket for the rest (a coarsening never increases KL), and a token missing from the cell's top
  list is given the cell's last listed log-probability (at least its true value), so the estimate
  is a lower bound up to that substitution. Full cache against itself: 1 and 0.
"""
from __future__ import annotations

import math
from statistics import fmean

AGREEMENT_TOP = 20  # log-probabilities per step kept for the KL estimate
FLOOR = 1e-12       # probability floor of the rest bucket (the cell's listed mass can reach 1)


def reference_answer(answers: list[str], metric: str) -> str:
    """The continuation whose likelihood is measured: the first accepted answer, or all of them in
    order where the task asks for every one (RULER's string_match_all)."""
    return ", ".join(answers) if metric == "string_match_all" else answers[0]


def mean_logprob(token_logprobs: list[float]) -> float | None:
    return fmean(token_logprobs) if token_logprobs else None


def step_kl(full_top: list[list], cell_top: list[list]) -> float:
    """KL(full || cell) at one step from each side's best ``[token, logprob]`` pairs."""
    cell = dict((int(token), logprob) for token, logprob in cell_top)
    floor = min(cell.values()) if cell else -math.inf
    kl, full_mass, cell_mass = 0.0, 0.0, 0.0
    for token, logprob in full_top:
        p, log_q = math.exp(logprob), cell.get(int(token), floor)
        kl += p * (logprob - log_q)
        full_mass += p
        cell_mass += math.exp(log_q)
    rest_p, rest_q = max(1.0 - full_mass, 0.0), max(1.0 - cell_mass, FLOOR)
    if rest_p > 0:
        kl += rest_p * math.log(max(rest_p, FLOOR) / rest_q)
    return max(kl, 0.0)


def agreement(full_top: list[list[list]], cell_ranks: list[int], cell_top: list[list[list]]) -> dict:
    """Top-1 agreement and mean KL along full cache's output (one entry per forced step)."""
    if not cell_ranks:
        return {"top1_agreement": None, "kl_to_full": None}
    return {
        "top1_agreement": fmean(rank == 1 for rank in cell_ranks),
        "kl_to_full": fmean(step_kl(full, cell) for full, cell in zip(full_top, cell_top)),
    }


MEASURES = ("answer_logprob", "top1_agreement", "kl_to_full")


def summarize_likelihood(rows: list[dict]) -> dict:
    """Per task and over tasks (unweighted, as the average score), the mean of each measure."""
    tasks: dict[str, dict[str, list[float]]] = {}
    for row in rows:
        for measure in MEASURES:
            if row.get(measure) is not None:
                tasks.setdefault(row["task"], {}).setdefault(measure, []).append(row[measure])
    per_task = {task: {m: fmean(v) for m, v in values.items()} for task, values in sorted(tasks.items())}
    overall = {m: fmean(t[m] for t in per_task.values() if m in t) for m in MEASURES
               if any(m in t for t in per_task.values())}
    return {"tasks": per_task, **overall}
