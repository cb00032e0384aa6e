"""KVzip through ``vllm serve`` without a model: a request naming ``kvzip`` (its own settings or the
server's default) and bringing no ``reconstruction`` ids gets, at admission, the ids ``run.py``'s
prompt builder makes for the same prompt, from the server's tokenizer
(``harness.engine.frontend.served_reconstruction``); ids a request brings are kept; a chat prompt
whose header the server cannot find is refused with one line (HTTP 400 from the server).

What runs is vLLM's own input processor, built as the server builds it (its config, its renderer,
its tokenizer: the embedded SmolLM2's; no weights are loaded) with the harness's patches installed
by vLLM's plugin hook, and its chat renderer writing a chat request's prompt: the path a served
request takes from the OpenAI server to the engine core (``tests/engine/test_serve.py`` serves one)."""
from __future__ import annotations

import pytest

from harness.engine.compatibility import SCHEDULER_CLS
from harness.eviction.settings import CONFIG_KEY, request_settings
from harness.tasks import task_spec
from harness.tasks.embedded import dataset as synthetic
from harness.tasks.prompts import build_prompt, chat_parts
from harness.tasks.sample import Sample
from harness.tasks.spec import TaskSpec
from tests.support.engine_support import BLOCK, model_path

pytestmark = pytest.mark.slow  # vLLM's config and input processor built (seconds)

QA = TaskSpec("qa", "{context}\n\nQuestion: {input}", 8, "qa_f1")
KVZIP = {"policy": "kvzip", "budget_ratio": 0.5, "decode_eviction": False}


@pytest.fixture(scope="module")
def processor():
    """vLLM's input processor for the embedded SmolLM2, as ``vllm serve --scheduler-cls ...
    --enforce-eager`` builds it; making its config loads vLLM's plugins, which install the harness's
    patches (``harness.engine.plugin``)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.input_processor import InputProcessor

    from harness.engine.patches import installed

    config = EngineArgs(model=model_path("smollm2"), dtype="float32", block_size=BLOCK, max_model_len=8192,
                        enforce_eager=True, scheduler_cls=SCHEDULER_CLS).create_engine_config()
    assert installed(InputProcessor, "process_inputs")
    return InputProcessor(config)


@pytest.fixture(scope="module")
def tokenizer():
    """The tokenizer ``run.py`` loads (Hugging Face's, not the server's copy of it)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path("smollm2"))


def admitted(processor, request_id: str, engine_input, settings: dict | None):
    """The request the server hands the engine core for one rendered prompt, its eviction
    settings as a client gives them (``vllm_xargs``: a JSON string)."""
    import json

    from vllm import SamplingParams

    extra = None if settings is None else {CONFIG_KEY: json.dumps(settings)}
    return processor.process_inputs(request_id, engine_input, SamplingParams(max_tokens=8, extra_args=extra),
                                    supported_tasks=("generate",))


def chat(processor, message: str, system: str | None = None):
    """A chat completion's prompt, rendered by vLLM's renderer with the chat parameters its chat
    endpoint takes from the request (``ChatCompletionRequest.build_chat_params``: the generation
    prompt added, by default)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": message}]
    params = ChatCompletionRequest(model="smollm2", messages=messages).build_chat_params(None, "auto")
    _, (engine_input,) = processor.renderer.render_chat([messages], params)
    return engine_input


def tokens(ids: list[int]):
    from vllm.inputs import tokens_input

    return tokens_input(list(ids))


def filled(request) -> dict:
    """The request's reconstruction ids, read as the scheduler reads its settings."""
    return request_settings(request.sampling_params.extra_args, None, BLOCK).reconstruction.as_dict()


def qa_sample(lead: str = "") -> Sample:
    key = synthetic.generate(seed=3, tasks=["key_retrieval"], samples_per_task=1)[0]
    return Sample("qa", "q", lead + key.context, key.input, [])


@pytest.mark.parametrize("lead", ["", "\n\n"])
def test_a_chat_request_gets_the_ids_run_py_s_prompt_builder_makes(processor, tokenizer, lead):
    """A chat completion (its message rendered by the server's chat template) with kvzip and its
    context boundary, no ids: it gets the prompt builder's for the same prompt (SmolLM2: 24 header
    ids). A message starting with "\\n\\n" merges with the header's last newline into one token:
    the header is then counted by its characters, by the server as by the builder."""
    sample = qa_sample(lead)
    prompt = build_prompt(sample, QA, tokenizer, 7500)
    request = admitted(processor, "chatcmpl-1", chat(processor, QA.template.format(context=sample.context,
                                                                                   input=sample.input)),
                       dict(KVZIP, compress="context", context_tokens=prompt.context_tokens))
    assert request.prompt_token_ids == prompt.token_ids, "the server's prompt is the builder's"
    assert filled(request) == prompt.reconstruction and prompt.reconstruction["prefix_tokens"] == 24
    header = tokenizer.encode(chat_parts(tokenizer)[0], add_special_tokens=False)
    assert (prompt.token_ids[:24] != header) == (lead == "\n\n"), "the merged token is the case meant"


def test_a_plain_prompt_and_a_prompt_written_with_the_template_get_the_builder_s_ids(processor, tokenizer):
    """A completion of token ids: a plain prompt (lcc's code task, no chat template: no header, a
    newline as footer) and a chat prompt the client rendered itself (as ``run.py`` sends them),
    each gets the ids the builder made for it."""
    code = synthetic.generate(tasks=["code_completion"], samples_per_task=1)[0]
    plain = build_prompt(code, task_spec(code.task), tokenizer, 7500)
    written = build_prompt(qa_sample(), QA, tokenizer, 7500)
    for prompt in (plain, written):
        request = admitted(processor, "cmpl-2-0", tokens(prompt.token_ids), dict(KVZIP, compress="prompt"))
        assert filled(request) == prompt.reconstruction
    assert plain.reconstruction["prefix_tokens"] == 0 and written.reconstruction["prefix_tokens"] == 24


def test_the_server_s_default_kvzip_fills_them_too_and_given_ids_are_kept(processor, tokenizer, monkeypatch):
    """``--additional-config '{"kv_eviction": {"policy": "kvzip", ...}}'``: a request with no
    settings gets the default's, with its prompt's ids, as its own (the scheduler reads them
    there). A request bringing its own ids keeps them; another policy gets none."""
    prompt = build_prompt(qa_sample(), QA, tokenizer, 7500)
    monkeypatch.setattr(processor.vllm_config, "additional_config", {CONFIG_KEY: dict(KVZIP)})
    request = admitted(processor, "cmpl-3-0", tokens(prompt.token_ids), None)
    assert request.sampling_params.extra_args[CONFIG_KEY] == {"policy": "kvzip", "budget": None, "options": {},
                                                              **KVZIP, "reconstruction": prompt.reconstruction}
    own = dict(prompt.reconstruction, prefix_tokens=5, suffix=[])
    request = admitted(processor, "chatcmpl-4", chat(processor, "Some words. " * 50), dict(KVZIP, reconstruction=own))
    assert filled(request) == own
    request = admitted(processor, "chatcmpl-5", chat(processor, "Some words. " * 50), {"policy": "paged", "budget": 64})
    assert request_settings(request.sampling_params.extra_args, None, BLOCK).reconstruction is None


def test_a_chat_prompt_whose_header_it_cannot_find_is_refused_with_one_line(processor):
    """A system message of the request's own: its prompt does not begin with the header the
    template writes before one user message, so what is chat header and what is context is not
    known; refused at admission (HTTP 400), with what to do. The same prompt as a completion is
    plain text to the server (it does not begin with the header): kvpress's rule for it."""
    from vllm.exceptions import VLLMValidationError

    engine_input = chat(processor, "Some words. " * 50, system="Answer in one word.")
    with pytest.raises(VLLMValidationError, match="kvzip reconstructs the request's context after its chat header") \
            as refused:
        admitted(processor, "chatcmpl-6", engine_input, dict(KVZIP, compress="prompt"))
    assert "\n" not in str(refused.value) and "give them as reconstruction" in str(refused.value)
    request = admitted(processor, "cmpl-7-0", tokens(engine_input["prompt_token_ids"]), dict(KVZIP, compress="prompt"))
    assert filled(request)["prefix_tokens"] == 0
