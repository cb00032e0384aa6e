"""The teacher-forced passes behind ``harness.scoring.likelihood``, run on a cell's engine after its
generation (so timings and the eviction ledger stay the generation's own).

For the cells sharing one engine and one list of prompts, two rounds of requests, each prompt
prefilled once per round where the engine has prefix caching (``harness.engine.shared_prefill``):

1. every cell forces the sample's reference answer under its own eviction settings; if any cell
   evicts, one full-cache request per prompt regenerates full cache's greedy output with its
   ``AGREEMENT_TOP`` best log-probabilities per step (the distribution the others are compared to);
2. every evicting cell forces that output under its own settings.

Full cache against itself is agreement 1 and KL 0 by definition; it is not recomputed.
"""
from __future__ import annotations

from harness.eviction.settings import EvictionSettings
from harness.scoring.likelihood import AGREEMENT_TOP, agreement, mean_logprob


def answer_tokens(tokenizer, answer: str) -> tuple[int, ...]:
    """The reference answer as the model would write it right after the prompt (which ends where
    the answer begins: the chat template's assistant turn, or the text to continue)."""
    return tuple(tokenizer(answer, add_special_tokens=False)["input_ids"])


def cells_likelihood(engine, works: list, progress=None) -> list[list[dict]]:
    """``likelihood_passes`` for cells (``harness.run.cell.CellWork``) sharing one list of prompts."""
    first = works[0]
    per_prompt = [list(row) for row in zip(*(work.eviction_settings for work in works))]
    return likelihood_passes(engine, first.token_ids, first.answer_ids, [w.run.eviction for w in works],
                             first.max_new_tokens, first.stops, progress, per_prompt)


def likelihood_passes(engine, prompts: list[list[int]], answers: list[tuple[int, ...]],
                      settings: list[EvictionSettings | None], max_new_tokens: list[int],
                      stops: list[tuple[str, ...]], progress=None,
                      per_prompt: list[list[EvictionSettings | None]] | None = None) -> list[list[dict]]:
    """Per cell (``settings``: each cell's eviction, None for full cache; ``per_prompt``: for each
    prompt, each cell's request settings with what the prompt gives them, its context boundary and
    reconstruction ids, ``CellWork.eviction_for``; None: ``settings`` as they are), per prompt: the
    sample's ``answer_logprob`` (mean nats per answer token), ``answer_tokens``, ``top1_agreement``
    and ``kl_to_full`` along full cache's output, and ``agreement_steps`` (how many steps those average)."""
    from harness.engine.shared_prefill import CellRequest, generate_shared  # imports vLLM: only with an engine

    if not all(answers):
        raise ValueError("a sample's reference answer is empty: there is nothing to force")
    evicting = [index for index, s in enumerate(settings) if s is not None]
    per_prompt = per_prompt or [list(settings) for _ in prompts]
    first = []
    for prompt, answer, length, stop, own in zip(prompts, answers, max_new_tokens, stops, per_prompt):
        row = [CellRequest(s, len(answer), forced=answer, top_logprobs=1) for s in own]
        if evicting:
            row.append(CellRequest(None, length, stop, top_logprobs=AGREEMENT_TOP))
        first.append(row)
    forced_answers, _ = generate_shared(engine, prompts, first, progress=progress)
    full_outputs = [row[-1] for row in forced_answers] if evicting else []
    second = [[CellRequest(own[c], len(full.token_ids), forced=tuple(full.token_ids), top_logprobs=AGREEMENT_TOP)
               for c in evicting] for full, own in zip(full_outputs, per_prompt)]
    along_full, _ = generate_shared(engine, prompts, second, progress=progress) if evicting else ([], [])
    cells = []
    for c, cell_settings in enumerate(settings):
        rows = []
        for p, answer in enumerate(answers):
            forced = forced_answers[p][c]
            row = {"answer_logprob": mean_logprob(forced.token_logprobs), "answer_tokens": len(answer)}
            if cell_settings is None:
                row.update(top1_agreement=1.0, kl_to_full=0.0, agreement_steps=None)
            else:
                cell = along_full[p][evicting.index(c)]
                row.update(agreement(full_outputs[p].top_logprobs, cell.token_ranks, cell.top_logprobs))
                row["agreement_steps"] = len(cell.token_ranks)
            rows.append(row)
        cells.append(rows)
    return cells
