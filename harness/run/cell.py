"""A cell from settings to a published run directory: its prompts (``prepare_cell``), its record
(``record_cell``: predictions, scores, fidelity to full cache, perf; eviction checked) and its
publication (``publish``: writes only). The engine between them is ``harness.run.group``'s, for a
single cell too (a group of one)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from harness.config import ConfigError, RunSettings
from harness.tasks import load_samples, task_spec
from harness.tasks.prompts import build_prompt
from harness.records import interrupts
from harness.eviction.messages import EvictionNotActiveError
from harness.run.likelihood import answer_tokens
from harness.scoring.fidelity import fidelity
from harness.scoring.likelihood import reference_answer, summarize_likelihood
from harness.scoring.report import score_run
from harness.config.models import resolve_model_path
from harness.records.perf import summarize_perf
from harness.records.provenance import provenance
from harness.records.results import RunWriter, is_complete, read_jsonl
from harness.records.tables import scores_table



@dataclass
class CellWork:
    """A cell ready for an engine: its settings, where it goes, and its prompts."""

    run: RunSettings
    target: Path
    samples: list        # the samples that run (each with its prompt below)
    prompts: list        # harness.tasks.prompts.Prompt, one per sample
    skipped: list[dict]  # samples left out, with the reason
    specs: dict          # task -> TaskSpec
    answer_ids: list = field(default_factory=list)  # per sample, its reference answer's token ids

    @property
    def token_ids(self) -> list[list[int]]:
        return [prompt.token_ids for prompt in self.prompts]

    @property
    def context_tokens(self) -> list[int | None]:
        """Each prompt's context boundary (``harness.tasks.prompts.Prompt``)."""
        return [prompt.context_tokens for prompt in self.prompts]

    def eviction_for(self, index: int):
        """The eviction settings of prompt ``index``'s request: the cell's, with that prompt's
        context boundary where the cell compresses the context and its reconstruction ids where
        the policy reconstructs it (KVzip) (None: full cache)."""
        settings, prompt = self.run.eviction, self.prompts[index]
        return settings and settings.for_request(prompt.context_tokens, prompt.reconstruction)

    @property
    def eviction_settings(self) -> list:
        """Every prompt's request settings (``eviction_for``), in order."""
        return [self.eviction_for(index) for index in range(len(self.prompts))]

    @property
    def max_new_tokens(self) -> list[int]:
        return [self.specs[s.task].max_new_tokens for s in self.samples]

    @property
    def stops(self) -> list[tuple[str, ...]]:
        """Each prompt's stop strings (``Prompt.stop``, ``harness.tasks.prompts.answer_stops``): its
        task's, and the end of the line where a base model answers a one-line task."""
        return [tuple(prompt.stop) for prompt in self.prompts]


def prepare_cell(run: RunSettings, tokenizer=None) -> CellWork | None:
    """Build a cell's prompts; None when its run directory is already complete."""
    target = run.run_dir
    if is_complete(target) and not run.force:
        print(f"[skip] {target} is complete (force=true reruns it)")
        return None
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(run.model.path))
    samples = load_samples(run.data, tokenizer)
    specs = {s.task: task_spec(s.task) for s in samples}
    prompts, kept, skipped = [], [], []
    for sample in samples:
        spec = specs[sample.task]
        prompt = build_prompt(sample, spec, tokenizer, run.model.max_prompt_tokens)
        length = len(prompt.token_ids)
        if length + spec.max_new_tokens > run.model.max_model_len:
            # LongBench's truncation keeps prompts under the limit; a user's own limit may not.
            skipped.append({"task": sample.task, "id": sample.id, "reason": f"prompt of {length} tokens "
                            f"+ {spec.max_new_tokens} new exceeds max_model_len={run.model.max_model_len}"})
            continue
        prompts.append(prompt)
        kept.append(sample)
    if not kept:
        raise RuntimeError(f"every sample was skipped: {skipped[:3]}")
    if run.evicts and run.compress == "context":
        unmarked = [s.id for s, p in zip(kept, prompts) if not p.context_tokens]
        if unmarked:
            raise ConfigError(f"compress=context evicts at each prompt's context boundary, but {len(unmarked)} "
                              f"prompt(s) have none (e.g. {', '.join(unmarked[:3])}): their question could not be "
                              "found after truncation")
    answers = [answer_tokens(tokenizer, reference_answer(s.answers, specs[s.task].metric)) for s in kept]
    work = CellWork(run, target, kept, prompts, skipped, specs, answers)
    if run.evicts and run.eviction.reconstructs:
        check_reconstructions(work)
    return work


def check_reconstructions(work: CellWork) -> None:
    """A policy that reconstructs each prompt's context (KVzip) needs every request's
    reconstruction ids (``harness.tasks.prompts.reconstruction``) and something to reconstruct
    after the chat header: refused here, with one line, before an engine starts."""
    run = work.run
    missing = [s.id for s, p in zip(work.samples, work.prompts) if p.reconstruction is None]
    if missing:
        raise ConfigError(f"policy={run.policy} repeats each prompt's context after its chat header, but "
                          f"{len(missing)} prompt(s) have no header the prompt builder could find (e.g. "
                          f"{', '.join(missing[:3])}): "
                          "the model's chat template does not write the user message once and verbatim")
    for sample, prompt, settings in zip(work.samples, work.prompts, work.eviction_settings):
        try:
            settings.for_prompt(len(prompt.token_ids), run.block_size)
        except ValueError as error:
            raise ConfigError(f"policy={run.policy}, prompt {sample.id}: {error}") from None


@dataclass
class CellRecord:
    """Everything a cell publishes, computed before anything is written: its rows (one per sample),
    scores, perf and resolved config."""

    work: CellWork
    rows: list[dict]
    scores: dict
    perf: dict
    config: dict


def record_cell(work: CellWork, results: list, wall: float, facts: dict, ledger: dict | None, vllm_version: str,
                shared: dict | None = None, *, evictions: list[dict | None] | None = None,
                likelihood: list[dict] | None = None, full_rows: list[dict] | None = None) -> CellRecord:
    """Score a cell's generations, compare them with full cache and check that eviction ran.
    ``shared``: how the cell shared its engine with others (timings are then not isolated).
    ``evictions``: per sample, its request's evictions by phase; ``likelihood``: per sample, the
    teacher-forced measures (``harness.run.likelihood``); ``full_rows``: the full-cache cell's rows
    when it ran on the same engine (otherwise its published run is read, if there is one).
    Raises ``EvictionNotActiveError`` for an evicting cell whose long prompts were never pruned."""
    run = work.run
    rows = [
        {
            "task": sample.task,
            "id": sample.id,
            "prompt": prompt.text,
            "prediction": result.text,
            "answers": sample.answers,
            "all_classes": sample.all_classes,
            "length": sample.length,
            "depth": sample.meta.get("depth"),  # where a generated sample's one needle sits (percent)
            "prompt_tokens": result.prompt_tokens,
            "output_tokens": result.output_tokens,
            "finish_reason": result.finish_reason,
            "output_token_ids": result.token_ids,
            "top_logprobs": result.top_logprobs,
        }
        for sample, prompt, result in zip(work.samples, work.prompts, results)
    ]
    for index, row in enumerate(rows):
        if run.compress == "context":  # recorded only where it was used: earlier cells' rows stay as they were
            row["context_tokens"] = work.prompts[index].context_tokens
        if evictions is not None:
            row["evictions"] = evictions[index]  # this sample's {prefill, decode} eviction count
        if likelihood is not None:
            row.update(likelihood[index])
    scores = score_run(rows, work.skipped)
    if likelihood is not None:
        scores["likelihood"] = summarize_likelihood(rows)
    scores["fidelity"] = fidelity_to_full_cache(run, rows, full_rows)
    check_evictions_happened(run, rows, ledger, work.eviction_settings if run.evicts else None)
    config = dict(run.resolved)
    config["provenance"] = provenance(vllm_version)
    return CellRecord(work, rows, scores, summarize_perf(results, wall, facts, ledger, shared), config)


def publish(record: CellRecord, writer: RunWriter) -> Path:
    """Write a recorded cell's run directory and publish it atomically; nothing is computed here."""
    writer.write_jsonl("predictions.jsonl", record.rows)
    writer.write_json("scores.json", record.scores)
    writer.write_json("perf.json", record.perf)
    writer.write_text("config.yaml", OmegaConf.to_yaml(OmegaConf.create(record.config)))
    interrupts.check()  # a Ctrl-C swallowed by a finalizer still stops the cell unpublished
    final = writer.commit()
    run = record.work.run
    print(scores_table(record.scores, title=f"{run.label} on {run.model.name} / {run.data.name}"))
    print(f"[done] {final}")
    return final


def check_evictions_happened(run: RunSettings, rows: list[dict], ledger: dict | None, requests: list | None) -> None:
    """An evicting run whose long prompts were never pruned ran stock vLLM: it is not a result.
    ``requests``: each row's request settings (``CellWork.eviction_settings``)."""
    if not run.evicts:
        return
    over = [row for row, settings in zip(rows, requests) if is_over_budget(settings, row, run.block_size)]
    recorded = ledger["evictions"]["prefill"] if ledger else None
    if over and not recorded:
        raise EvictionNotActiveError(
            f"{len(over)} prompt(s) are longer than {run.budget_text} + one block, yet the engine recorded "
            f"{'no ledger' if ledger is None else 'no prefill eviction'}: policy={run.policy} was not "
            "running; nothing was written"
        )


def is_over_budget(settings, row: dict, block_size: int) -> bool:
    """Whether a recorded sample's prompt (or context, where only that is compressed) is at least
    a block longer than its budget: its request (``settings``: its own, boundary included) must
    have evicted."""
    own = settings.for_prompt(row["prompt_tokens"], block_size)
    return own.eviction_point(row["prompt_tokens"]) >= own.budget + block_size


def fidelity_to_full_cache(run: RunSettings, rows: list[dict], full_rows: list[dict] | None = None) -> dict | None:
    """Agreement with the full-cache run of the same model and data: ``full_rows`` when full cache
    ran beside this cell, otherwise its published run, if it exists yet."""
    if not run.evicts:
        return None
    if full_rows is None:
        twin = run.full_cache_twin().run_dir
        if not is_complete(twin):
            return {"missing": f"no complete full-cache run at {twin}; run policy=full first"}
        full_rows = read_jsonl(twin / "predictions.jsonl")
    return fidelity(rows, full_rows)
