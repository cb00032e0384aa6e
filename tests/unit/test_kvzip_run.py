"""KVzip through run.py, without a model: the reconstruction ids the prompt builder makes (the chat
header's length, the repeat prompts, the footer) against kvpress 0.5.5's own derivation, rebuilt
here from its code; each request's settings carrying them (and only a reconstructing policy's);
the run's and a sweep's config checks, refusing with one line what still cannot run. The embedded
model's tokenizer only: no engine, no model."""
from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest
from hydra import compose, initialize_config_dir

from harness.config import ConfigError, run_settings
from harness.config.models import EMBEDDED_PREFIX, SMOLLM2, resolve_model_path
from harness.eviction.settings import CONFIG_KEY, admit, parse_settings
from harness.run.cell import CellWork, check_evictions_happened, check_reconstructions, prepare_cell
from harness.run.group import group_key
from harness.run.sweep import expand_sweep
from harness.tasks import task_spec
from harness.tasks.embedded import dataset as synthetic
from harness.tasks.prompts import build_prompt
from harness.tasks.sample import Sample
from harness.tasks.spec import TaskSpec
from hydra_plugins.kv_eviction_policies import sweep_policies
from tests.support import ROOT
from tests.unit.test_data import bos_writing_tokenizer

KVZIP = ("policy=kvzip", "compress=context", "budget_ratio=0.5")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path(EMBEDDED_PREFIX + SMOLLM2))


def kvpress_inputs(tokenizer) -> tuple[list[int], list[int], list[int], list[int]]:
    """The chat header's ids, the two repeat prompts and the suffix as kvpress 0.5.5's
    ``KVzipPress`` derives them (presses/kvzip_press.py:102-121 and 253-258), restated here."""
    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    if tokenizer.chat_template is None:
        prefix_text, suffix_text = "", "\n"
    else:
        dummy_context = "dummy context"
        separator = "\n" + "#" * len(dummy_context)
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": dummy_context + separator}],
                                                 add_generation_prompt=True, tokenize=False, enable_thinking=False)
        context, suffix_text = rendered.split(separator)
        prefix_text = context.split(dummy_context)[0]
    return (encode(prefix_text), encode("\n\nRepeat the previous context exactly."),
            encode("\n\nRepeat the part of the previous context exactly, starting with"), encode(suffix_text))


def compose_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def test_a_chat_prompt_gets_kvpress_s_header_repeat_prompts_and_footer(tokenizer):
    """SmolLM2 (24 header ids: system prompt and user header; 8 + 13 repeat-prompt ids; a 6-id
    footer, as docs/design_kvzip.md §1.3 counted them); the same ids for every prompt of a task,
    compress=context or not; the footer is the one the prompt itself ends its user turn with."""
    header, first, later, suffix = kvpress_inputs(tokenizer)
    assert (len(header), len(first), len(later), len(suffix)) == (24, 8, 13, 6)
    samples = synthetic.generate(seed=0, tasks=["key_retrieval", "record_listing"])
    for sample in samples:
        prompt = build_prompt(sample, task_spec(sample.task), tokenizer, 7500)
        assert prompt.reconstruction == {"prefix_tokens": 24, "first": first, "later": later, "suffix": suffix}
        assert prompt.token_ids[:24] == header, "the prompt begins with the header kvpress counts"
        assert prompt.reconstruction["prefix_tokens"] < prompt.context_tokens
        answer_prefix = tokenizer.encode(sample.meta.get("answer_prefix", ""), add_special_tokens=False)
        assert prompt.token_ids[len(prompt.token_ids) - len(answer_prefix) - 6:][:6] == suffix


def test_a_plain_prompt_gets_kvpress_s_rule_for_no_chat_template(tmp_path, tokenizer):
    """A prompt written without the chat template (lcc's code task; a tokenizer that has none):
    no header, a newline as footer; a BOS the tokenizer adds stays in what is repeated, as
    kvpress's pipeline puts it in the context's ids."""
    code = synthetic.generate(tasks=["code_completion"], samples_per_task=1)[0]
    prompt = build_prompt(code, task_spec(code.task), tokenizer, 7500)
    assert not prompt.text.startswith("<|im_start|>")
    _, first, later, _ = kvpress_inputs(tokenizer)
    assert prompt.reconstruction == {"prefix_tokens": 0, "first": first, "later": later,
                                     "suffix": tokenizer.encode("\n", add_special_tokens=False)}
    bos_tokenizer, bos_id = bos_writing_tokenizer(tmp_path)
    plain = build_prompt(code, task_spec(code.task), bos_tokenizer, 7500)
    assert plain.token_ids[0] == bos_id and plain.reconstruction["prefix_tokens"] == 0
    bos_tokenizer.chat_template = None
    assert kvpress_inputs(bos_tokenizer)[0] == [] and kvpress_inputs(bos_tokenizer)[3] == plain.reconstruction["suffix"]


def test_a_template_that_writes_bos_counts_it_in_the_header(tmp_path):
    """A Llama-3-like template writing BOS itself: the header is BOS + user header, as kvpress
    encodes the template's text before the message (its ``<|endoftext|>`` text is the special id)."""
    tokenizer, bos_id = bos_writing_tokenizer(tmp_path)
    qa = synthetic.generate(tasks=["key_retrieval"], samples_per_task=1)[0]
    prompt = build_prompt(qa, task_spec(qa.task), tokenizer, 7500)
    header, first, later, suffix = kvpress_inputs(tokenizer)
    assert header[0] == bos_id and prompt.token_ids[:len(header)] == header
    assert prompt.reconstruction == {"prefix_tokens": len(header), "first": first, "later": later, "suffix": suffix}


@pytest.mark.parametrize("lead", ["\n\n", "  x", " ", "\n"])
def test_a_header_token_merged_with_the_message_counts_by_its_characters(tokenizer, lead):
    """A message whose first characters merge with the header's last newline into one token
    ("\\n\\n\\n", "\\n  "): the prompt does not begin with the header's own ids, and the header is the
    tokens that start inside its text: as many as kvpress's count, the merged one included."""
    header, *_ = kvpress_inputs(tokenizer)
    sample = Sample("custom", "lead", lead + "Some words. " * 20, "Why?", [])
    prompt = build_prompt(sample, TaskSpec("custom", "{context}\n\nQuestion: {input}", 8, "qa_f1"), tokenizer, 7500)
    merged = prompt.token_ids[:len(header)] != header
    assert merged == (lead in ("\n\n", "  x"))
    assert prompt.reconstruction["prefix_tokens"] == len(header)
    assert prompt.token_ids[:len(header) - 1] == header[:-1]


def test_no_reconstruction_where_the_template_does_not_write_the_message_verbatim(tokenizer):
    sample = synthetic.generate(tasks=["key_retrieval"], samples_per_task=1)[0]
    before = replace_template(tokenizer, "{{ m['content'] }}{{ m['content'] }}")
    try:
        prompt = build_prompt(sample, task_spec(sample.task), tokenizer, 7500)
    finally:
        tokenizer.chat_template = before
    assert prompt.reconstruction is None and prompt.context_tokens is None


def replace_template(tokenizer, content: str) -> str:
    """Make the chat template write ``content`` for a message; returns the template it had."""
    before = tokenizer.chat_template
    tokenizer.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n" + content + "<|im_end|>\n"
                               "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return before


def cell(tmp_path, tokenizer, *overrides: str) -> CellWork:
    run = run_settings(compose_cfg(*overrides, "data.limit=1", f"output_dir={tmp_path}"))
    return prepare_cell(run, tokenizer)


def test_run_py_s_kvzip_cell_gives_every_request_its_ids(tmp_path, tokenizer):
    """``run.py policy=kvzip compress=context budget_ratio=0.5 data.limit=1`` up to the engine: the
    config admitted, each request's settings carrying its boundary and its prompt's ids on the wire,
    resolved against its prompt and admitted as the engine's frontend admits them; a policy that
    does not reconstruct gets no ids (it would refuse them), full cache no settings."""
    work = cell(tmp_path, tokenizer, *KVZIP)
    assert work.run.decode_eviction is False and len(work.prompts) > 1
    for index, prompt in enumerate(work.prompts):
        settings = work.eviction_for(index)
        assert settings.context_tokens == prompt.context_tokens
        assert settings.reconstruction.as_dict() == prompt.reconstruction
        wire = parse_settings(settings.as_extra_args()[CONFIG_KEY], "request")
        assert wire == settings
        own = wire.for_prompt(len(prompt.token_ids), work.run.block_size)
        (policy,) = admit(own, work.run.block_size, 30, 1, enforce_eager=True, async_scheduling=False)
        assert policy.reconstructs and own.budget < prompt.context_tokens
    paged = cell(tmp_path, tokenizer, "policy=paged", "compress=context", "budget_ratio=0.5")
    assert all(s.reconstruction is None and s.context_tokens for s in paged.eviction_settings)
    assert cell(tmp_path, tokenizer, "policy=full").eviction_settings == [None] * len(work.prompts)


def test_the_record_s_eviction_check_reads_each_request_s_own_settings(tmp_path, tokenizer):
    """After generation: a kvzip cell whose long prompts recorded no prefill eviction is refused,
    and one that recorded them passes (the check resolves each request's settings, ids included)."""
    work = cell(tmp_path, tokenizer, *KVZIP)
    rows = [{"prompt_tokens": len(p.token_ids), "context_tokens": p.context_tokens} for p in work.prompts]
    check_evictions_happened(work.run, rows, {"evictions": {"prefill": len(rows)}}, work.eviction_settings)
    with pytest.raises(Exception, match="was not running"):
        check_evictions_happened(work.run, rows, {"evictions": {"prefill": 0}}, work.eviction_settings)


def test_the_likelihood_passes_get_each_request_s_own_settings(tmp_path, tokenizer, monkeypatch):
    """The teacher-forced requests after generation carry the same per-request settings."""
    import harness.run.likelihood as likelihood

    works = [cell(tmp_path, tokenizer, *KVZIP), cell(tmp_path, tokenizer, "policy=full")]
    seen = {}
    monkeypatch.setattr(likelihood, "likelihood_passes", lambda *args: seen.setdefault("args", args))
    likelihood.cells_likelihood(None, works)
    per_prompt = seen["args"][-1]
    assert per_prompt == [[works[0].eviction_for(i), None] for i in range(len(works[0].prompts))]
    assert per_prompt[0][0].reconstruction is not None


def test_a_prompt_it_cannot_reconstruct_is_refused_before_the_engine(tmp_path, tokenizer):
    """One line naming the sample: no header found, or a header that leaves nothing to repeat."""
    work = cell(tmp_path, tokenizer, *KVZIP)
    check_reconstructions(work)
    first = work.prompts[0]
    lost = replace(work, prompts=[replace(first, reconstruction=None)] + work.prompts[1:])
    with pytest.raises(ConfigError, match=f"1 prompt.*no header the prompt builder could find.*{work.samples[0].id}"):
        check_reconstructions(lost)
    long_header = dict(first.reconstruction, prefix_tokens=first.context_tokens)
    empty = replace(work, prompts=[replace(first, reconstruction=long_header)] + work.prompts[1:])
    with pytest.raises(ConfigError, match=f"prompt {work.samples[0].id}: .*leaves nothing") as refused:
        check_reconstructions(empty)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("overrides, message", [
    (["compress=prompt"], "pass decode_eviction=false"),
    (["chain=true"], "reconstructs the pristine context"),
    (["engine.layer_groups=2", "budget_schedule=attention"], "budget_schedule=attention"),
    (["engine.enforce_eager=false"], "enforce_eager"),
])
def test_the_run_refuses_what_it_cannot_run_with_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as refused:
        run_settings(compose_cfg(*KVZIP, *overrides))
    assert "\n" not in str(refused.value)


def test_the_run_admits_it_at_both_scopes_and_granularities():
    for overrides in ([], ["policy.options.granularity=block"], ["compress=prompt", "decode_eviction=false"],
                      ["engine.layer_groups=2", "budget_schedule=pyramid"]):
        run = run_settings(compose_cfg(*KVZIP, *overrides))
        assert run.eviction.reconstructs and not run.decode_eviction


def test_a_sweep_naming_it_with_context_compression_shares_one_engine():
    """``run.py -m policy=kvzip,paged,full compress=context budget_ratio=0.5``: every cell admitted
    (the sweep's check before its first cell), one group (one engine, prompts prefilled once);
    ``${kv_policies:}`` still leaves kvzip out (those sweeps evict in decode)."""
    cells = expand_sweep(["policy=kvzip,paged,full", "compress=context", "budget_ratio=0.5"])
    runs = [run_settings(compose_cfg(*overrides)) for overrides in cells]
    assert [r.policy for r in runs] == ["kvzip", "paged", "full"] and len({group_key(r) for r in runs}) == 1
    assert "kvzip" not in sweep_policies().split(",")


@pytest.mark.parametrize("policies", [["policy=kvzip"], ["-m", "policy=kvzip,paged"]])
def test_run_py_refuses_it_with_decode_eviction_before_any_cell(tmp_path, policies):
    """A run, or a sweep (whose check stops it with the cell and the reason), before any engine
    starts. (A KV pool too small for any cell is the safety net: had kvzip been admitted, every
    cell would still be refused before a model loads, with another message.)"""
    done = subprocess.run([sys.executable, str(ROOT / "run.py"), *policies[:-1], f"output_dir={tmp_path / 'runs'}",
                           policies[-1], "budget_ratio=0.5", "engine.kv_cache_gib=0.05"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert "kvzip" in line and "pass decode_eviction=false" in line
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("*.json*"))
