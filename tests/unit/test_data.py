"""Datasets: the embedded suite, LongBench-format JSONL, and LongBench's prompt rules."""
from __future__ import annotations

import json

import pytest
from harness.config import DataSettings

from harness.tasks import DataError, load_samples, task_spec
from harness.tasks.embedded import dataset as synthetic
from harness.tasks.prompts import build_prompt, middle_truncate
from harness.config.models import EMBEDDED_PREFIX, SMOLLM2, resolve_model_path


def data_cfg(**values):
    tasks = values.pop("tasks", None)
    return DataSettings(**{"name": "x", "source": "embedded", **values, "tasks": tuple(tasks) if tasks else None})


def test_embedded_suite_is_deterministic_and_in_longbench_format():
    first, again = synthetic.generate(seed=0), synthetic.generate(seed=0)
    assert first == again and synthetic.generate(seed=1) != first
    assert {s.task for s in first} == set(synthetic.DEFAULT_TASKS) == set(synthetic.TASKS) - {"record_listing"}
    for sample in first:
        assert sample.answers and sample.context and sample.length == len(sample.context.split())
        if sample.task in ("single_doc_qa", "multi_doc_qa", "key_retrieval"):
            assert sample.answers[0] in sample.context, "the answer is stated in the context"
    assert min(s.length for s in first) < 1000 and max(s.length for s in first) > 4000


def test_limit_takes_the_first_samples_of_each_task():
    samples = load_samples(data_cfg(limit=2, tasks=["key_retrieval", "code_completion"]))
    assert [s.id for s in samples] == ["key_retrieval-0-0", "key_retrieval-0-1", "code_completion-0-0", "code_completion-0-1"]


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))


def test_user_jsonl_in_longbench_format(tmp_path):
    record = {"input": "Q?", "context": "ctx", "answers": ["A"], "length": 1, "dataset": "hotpotqa", "_id": "a1",
              "all_classes": None, "language": "en"}
    path = tmp_path / "mine.jsonl"
    write_jsonl(path, [record, dict(record, _id="a2"), dict(record, _id="a3")])
    samples = load_samples(data_cfg(source="jsonl", path=str(path), limit=2))
    assert [s.id for s in samples] == ["a1", "a2"] and samples[0].task == "hotpotqa"
    assert task_spec("hotpotqa").metric == "qa_f1" and task_spec("gov_report_e").metric == "rouge"


@pytest.mark.parametrize(
    "line, message",
    [("{not json", "mine.jsonl:2: malformed JSON"),
     (json.dumps({"input": "q", "context": "c", "dataset": "hotpotqa"}), "mine.jsonl:2: record is missing required field(s) answers"),
     (json.dumps({"input": "q", "context": "c", "answers": ["a"]}), "mine.jsonl:2: record has no 'dataset' field")],
)
def test_bad_jsonl_names_file_and_line(tmp_path, line, message):
    path = tmp_path / "mine.jsonl"
    good = {"input": "q", "context": "c", "answers": ["a"], "dataset": "hotpotqa"}
    write_jsonl(path, [good, line])
    with pytest.raises(DataError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_samples(data_cfg(source="jsonl", path=str(path)))


def test_unknown_task_lists_valid_ones():
    with pytest.raises(DataError, match="unknown task.*nope.*valid: single_doc_qa"):
        load_samples(data_cfg(tasks=["nope"]))
    with pytest.raises(DataError, match="no rules for task 'mystery'"):
        task_spec("mystery")


def test_longbench_local_directory_layout(tmp_path):
    record = {"input": "q", "context": "c", "answers": ["a"], "length": 5000, "dataset": "qasper_e"}
    write_jsonl(tmp_path / "qasper_e.jsonl", [record])
    samples = load_samples(data_cfg(source="longbench_e", path=str(tmp_path), tasks=["qasper"]))
    assert samples[0].task == "qasper_e" and samples[0].length == 5000
    with pytest.raises(DataError, match="hotpotqa_e.jsonl"):
        load_samples(data_cfg(source="longbench_e", path=str(tmp_path), tasks=["hotpotqa"]))


def test_prompt_rules_truncate_the_middle_and_skip_chat_for_code():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(EMBEDDED_PREFIX + SMOLLM2))
    text = " ".join(f"word{i}" for i in range(3000))
    cut = middle_truncate(text, tokenizer, 200)
    assert cut.startswith("word0 word1") and cut.endswith("word2999")
    assert len(tokenizer(cut, add_special_tokens=False)["input_ids"]) <= 202
    code = [s for s in synthetic.generate(tasks=["code_completion"])][0]
    qa = [s for s in synthetic.generate(tasks=["key_retrieval"])][0]
    assert not build_prompt(code, task_spec(code.task), tokenizer, 7500).text.startswith("<|im_start|>")
    assert build_prompt(qa, task_spec(qa.task), tokenizer, 7500).text.startswith("<|im_start|>system")
    assert task_spec("samsum").stop == ("\n",) and task_spec("trec").chat is False


def bos_writing_tokenizer(directory):
    """The embedded tokenizer turned Llama-3-like: it adds a BOS to any text it encodes, and its
    chat template writes the BOS itself (as ``<|begin_of_text|>`` does in Llama-3's template)."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(EMBEDDED_PREFIX + SMOLLM2))
    bos = "<|endoftext|>"
    bos_id = tokenizer.convert_tokens_to_ids(bos)
    tokenizer._tokenizer.post_processor = TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, bos_id)])
    tokenizer.bos_token = bos
    tokenizer.chat_template = (
        "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tokenizer.save_pretrained(directory)
    return AutoTokenizer.from_pretrained(directory), bos_id


def test_prompt_ids_carry_exactly_the_special_tokens_the_template_wrote(tmp_path):
    """A template that writes BOS, and a tokenizer that adds one to text: rendering to text and
    letting the engine tokenize it (vLLM's text path) starts with BOS twice; the ids the harness
    sends start with it once. A plain (non-chat) prompt gets the tokenizer's BOS, once."""
    tokenizer, bos_id = bos_writing_tokenizer(tmp_path)
    qa = synthetic.generate(tasks=["key_retrieval"])[0]
    prompt = build_prompt(qa, task_spec(qa.task), tokenizer, 7500)
    assert tokenizer(prompt.text)["input_ids"][:2] == [bos_id, bos_id], "what vLLM would see from text"
    assert prompt.token_ids[0] == bos_id and prompt.token_ids[1] != bos_id
    assert prompt.token_ids.count(bos_id) == 1
    code = synthetic.generate(tasks=["code_completion"])[0]
    plain = build_prompt(code, task_spec(code.task), tokenizer, 7500)
    assert plain.token_ids[0] == bos_id and plain.token_ids.count(bos_id) == 1
    assert tokenizer.decode(plain.token_ids, skip_special_tokens=True) == plain.text


def test_longbench_from_a_hub_mirror_layout(tmp_path, capsys):
    """The hub path (datasets.load_dataset on a parquet mirror, one config per task), read from a
    local copy laid out like Xnhyacinth/LongBench: no network needed."""
    import pandas as pd

    records = [{"input": f"q{i}", "context": "c", "answers": [f"a{i}"], "length": 1, "dataset": "hotpotqa",
                "language": "en", "all_classes": None, "_id": f"id{i}"} for i in range(3)]
    (tmp_path / "hotpotqa").mkdir()
    pd.DataFrame(records).to_parquet(tmp_path / "hotpotqa" / "test-00000-of-00001.parquet")
    (tmp_path / "README.md").write_text(
        "---\nconfigs:\n- config_name: hotpotqa\n  data_files:\n  - split: test\n    path: hotpotqa/test-*.parquet\n---\n"
    )
    samples = load_samples(data_cfg(source="longbench", hub_id=str(tmp_path), tasks=["hotpotqa"], limit=2))
    assert [(s.task, s.input, s.answers) for s in samples] == [("hotpotqa", "q0", ["a0"]), ("hotpotqa", "q1", ["a1"])]
    assert f"longbench from {tmp_path}" in capsys.readouterr().out, "says which source is used"
    with pytest.raises(DataError, match="could not load .* config 'qasper'.*data.path=DIR"):
        load_samples(data_cfg(source="longbench", hub_id=str(tmp_path), tasks=["qasper"], limit=2))


def test_the_asked_fact_is_stated_once():
    """Retrieval tasks hide exactly one relevant sentence: evicting it loses the answer."""
    for sample in synthetic.generate(tasks=["single_doc_qa", "key_retrieval"]):
        answer, context = sample.answers[0], sample.context
        first, last = context.index(answer), context.rindex(answer)
        assert last - first < 40, f"{sample.id}: {answer!r} is stated in more than one place"


def test_answers_sit_early_middle_and_late_in_turn():
    """Needle depths are stratified, not drawn: any three consecutive samples of a task put the
    answer in the early, middle and late bands of the context, so a small limit sees every depth."""
    for task in ("single_doc_qa", "key_retrieval"):
        samples = synthetic.generate(tasks=[task], samples_per_task=6)
        depths = [s.context.index(s.answers[0]) / len(s.context) for s in samples]
        for index, depth in enumerate(depths):
            low, high = synthetic.DEPTHS[index % 3]
            assert low - 0.05 <= depth <= high + 0.05, (task, index, depth)
    passages = synthetic.generate(tasks=["multi_doc_qa"], samples_per_task=3)
    asked = [s.input.removeprefix("In which city was ").removesuffix(" born?") for s in passages]
    order = [s.context.index(f"\n{name}\n") / len(s.context) for s, name in zip(passages, asked)]
    assert order[0] < order[1] < order[2]


def listing_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path(EMBEDDED_PREFIX + SMOLLM2))


def test_record_listing_is_a_long_copy_of_one_register():
    """The long-output task: the reference is the context's register, entry by entry, after the
    heading the answer prefix repeats; 256-512 tokens of answer (decode eviction mid-answer), every
    code distinct, the register early / middle / late in turn, four context sizes."""
    tokenizer = listing_tokenizer()
    samples = synthetic.generate(tasks=["record_listing"], samples_per_task=6)
    assert samples == synthetic.generate(tasks=["record_listing"], samples_per_task=6)
    spec = task_spec("record_listing")
    assert spec.metric == "rouge" and spec.max_new_tokens == 512 and spec.stop == ("Entry 17:",)
    for index, sample in enumerate(samples):
        reference = sample.answers[0]
        lines = reference.split("\n")
        assert [line.split(":")[0] for line in lines] == [f"Entry {k}" for k in range(1, 17)]
        assert len({line.rsplit(" ", 1)[1] for line in lines}) == 16, "every entry has its own code"
        assert sample.meta["answer_prefix"] + reference in sample.context, "copied verbatim from the context"
        assert sample.context.count("Entry 1:") == 1
        assert 256 <= len(tokenizer(reference, add_special_tokens=False)["input_ids"]) <= 512
        low, high = synthetic.DEPTHS[index % 3]
        depth = sample.context.index("Entry 1:") / len(sample.context)
        assert low - 0.05 <= depth <= high + 0.05 and low * 100 - 5 <= sample.meta["depth"] <= high * 100 + 5
        words = synthetic.CONTEXT_WORDS[index % 4]
        assert abs(sample.length - words) < 0.05 * words
        prompt = build_prompt(sample, spec, tokenizer, 7500)
        assert prompt.text.endswith("<|im_start|>assistant\nRegister:\n"), "the answer starts where the copy starts"


def test_record_listing_is_opt_in():
    """Not in the default suite (``tasks: null``); ``data=synthetic_long`` and ``data.tasks`` run it."""
    import yaml

    from tests.support import ROOT

    assert "record_listing" not in {s.task for s in load_samples(data_cfg(limit=1))}
    config = yaml.safe_load((ROOT / "conf" / "data" / "synthetic_long.yaml").read_text())
    samples = load_samples(data_cfg(**config))
    assert [s.id for s in samples] == [f"record_listing-0-{i}" for i in range(4)]
