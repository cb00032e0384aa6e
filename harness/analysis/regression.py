"""Two runs of the same cells compared sample by sample, under the near-tie rule.

    python -m harness.analysis.regression results/ci_baseline results/ci_regression

Two greedy fp32 runs of one configuration may round the last bits of a logit differently (kernel
blocking depends on batch shape and CPU); where the two best tokens are closer than ``TIE_NATS``
either is a correct greedy choice and the continuations may part. Any other difference in any
sample's output tokens, even one token, is a regression: unlike a task mean, it cannot hide in a
cell at 0 or in sampling noise.
"""
from __future__ import annotations

import sys
from pathlib import Path

from harness.records.results import read_jsonl

TIE_NATS = 1e-3


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where ``a`` and ``b`` differ (or one ends); None if equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def parting(want: list[int], got: list[int], want_top: list, got_top: list, tie_nats: float = TIE_NATS) -> str | None:
    """Why two outputs of one prompt are not the same greedy decoding, or None if they are (equal,
    or parting at a position where each run's top tokens were within ``tie_nats`` of each other)."""
    at = first_difference(want, got)
    if at is None:
        return None
    if at >= min(len(want), len(got)):
        return f"outputs of different lengths {len(want)} / {len(got)} with a common prefix"
    for name, top, chosen, other in (("first", want_top, want[at], got[at]), ("second", got_top, got[at], want[at])):
        logprobs = dict((token, logprob) for token, logprob in top[at])
        gap = logprobs[chosen] - logprobs.get(other, float("-inf"))
        if gap > tie_nats:
            return (f"diverges at output token {at} ({want[at]} vs {got[at]}): the {name} run preferred its "
                    f"token by {gap:.2e} nats, more than a rounding tie ({tie_nats})")
    return None


def cells(root: Path) -> dict[str, Path]:
    """Complete run directories under ``root`` by ``model/data/cell`` name."""
    return {str(p.parent.relative_to(root)): p.parent for p in root.rglob("predictions.jsonl")
            if not p.parent.name.endswith(".partial")}


def compare(reference: Path, candidate: Path) -> list[str]:
    """Every sample whose output moved, as ``cell sample: why``; also cells missing on either side."""
    want, got = cells(reference), cells(candidate)
    problems = [f"{name}: missing from {candidate}" for name in sorted(set(want) - set(got))]
    problems += [f"{name}: not in the reference" for name in sorted(set(got) - set(want))]
    for name in sorted(set(want) & set(got)):
        expected = {row["id"]: row for row in read_jsonl(want[name] / "predictions.jsonl")}
        measured = {row["id"]: row for row in read_jsonl(got[name] / "predictions.jsonl")}
        if set(expected) != set(measured):
            problems.append(f"{name}: samples differ ({sorted(set(expected) ^ set(measured))[:5]})")
        for sample in sorted(set(expected) & set(measured)):
            a, b = expected[sample], measured[sample]
            why = parting(a["output_token_ids"], b["output_token_ids"], a["top_logprobs"], b["top_logprobs"])
            if why:
                problems.append(f"{name} {sample}: {why}")
    return problems


def main(argv: list[str]) -> int:
    reference, candidate = map(Path, argv)
    problems = compare(reference, candidate)
    total = sum(len(read_jsonl(p / "predictions.jsonl")) for p in cells(reference).values())
    for problem in problems:
        print(problem)
    print(f"{len(problems)} difference(s) over {total} reference samples in {len(cells(reference))} cells")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
