"""The serving benchmark's workloads (harness/serving/workloads.py): each request's context boundary
is exactly where its context ends, the per-request eviction settings are what the server parses,
the long answers are scored right on hand-made answers, and vLLM's prefix_repetition keeps its
shared prefixes' boundaries."""
from __future__ import annotations

import json
import random

import pytest

from harness.config.models import EMBEDDED_PREFIX, SMOLLM2, resolve_model_path
from harness.serving import workloads
from harness.serving.workloads import Item


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path(EMBEDDED_PREFIX + SMOLLM2))


@pytest.fixture(scope="module")
def built(tokenizer):
    return {"shared_context": workloads.build("shared_context", tokenizer, contexts=4, questions=3),
            "shared_context_long": workloads.build("shared_context_long", tokenizer, contexts=4, requests=3)}


def contexts_of(name: str) -> dict[str, str]:
    """Each context's text, drawn as the workload draws it."""
    if name == "shared_context":
        return {shared.id: shared.context for shared in workloads.shared_contexts(4, 0, 3)}
    rng = random.Random(0)
    return {f"registers-{index}": workloads.register_context(rng, 3)[0] for index in range(4)}


@pytest.mark.parametrize("name", ["shared_context", "shared_context_long"])
def test_each_context_ends_at_its_boundary_and_its_requests_share_it(built, tokenizer, name):
    """A context's requests begin with the same ``context_tokens`` ids, which decode to the chat
    header and the whole context (its last sentence included) and none of the question; the
    requests differ after it (each asks its own question)."""
    workload = built[name]
    by_context: dict[str, list[Item]] = {}
    for item in workload.items:
        by_context.setdefault(item.context, []).append(item)
    assert len(by_context) == 4 and all(len(items) == 3 for items in by_context.values())
    contexts = contexts_of(name)
    for context, items in by_context.items():
        boundary = items[0].context_tokens
        assert all(item.context_tokens == boundary for item in items)
        assert len({tuple(item.prompt[:boundary]) for item in items}) == 1
        assert len({tuple(item.prompt[boundary:]) for item in items}) == len(items)
        head = tokenizer.decode(items[0].prompt[:boundary])
        tail = tokenizer.decode(items[0].prompt[boundary:])
        last_sentence = contexts[context].rstrip().split("\n")[-1][-60:]
        assert last_sentence in head and last_sentence not in tail
        assert tail.lstrip().startswith(("Now, copy", "Answer the question", "Now, answer", "Question:")), tail[:80]


def test_each_long_request_copies_its_own_register_of_the_shared_context(built, tokenizer):
    """Request r asks for register r by its heading, its answer started with that heading; the
    reference is the register's lines as the context holds them (at least 128 tokens), and the
    answer stops at the register's end line."""
    items = sorted((item for item in built["shared_context_long"].items if item.context == "registers-1"),
                   key=lambda item: item.question)
    context = contexts_of("shared_context_long")["registers-1"]
    for item, label in zip(items, "ABC"):
        text = tokenizer.decode(item.prompt)
        assert f"copy register {label}:" in text and text.endswith(f"Register {label}:\n")
        (reference,) = item.answers
        assert f"Register {label}:\n{reference}\nEnd of register {label}." in context
        assert len(reference.splitlines()) == workloads.ENTRIES and len(tokenizer.encode(reference)) >= 128
        assert item.max_tokens >= len(tokenizer.encode(reference)) and item.stop == (f"End of register {label}",)
    assert len({item.answers for item in items}) == 3


def test_full_cache_needs_each_context_once_and_each_request_its_own_blocks(built):
    """The default pool is half of this: one where full cache queues."""
    workload = built["shared_context_long"]
    shared = {item.context: item.context_tokens // 32 for item in workload.items}
    own = sum(-(-(len(item.prompt) + item.max_tokens) // 32) - item.context_tokens // 32 for item in workload.items)
    assert workloads.blocks_at_once(workload, 32) == sum(shared.values()) + own
    assert workloads.blocks_at_once(workload, 32) < sum(-(-(len(i.prompt) + i.max_tokens) // 32) for i in workload.items)


def test_the_shared_context_generator_is_the_one_experiments_used():
    """The contexts are the draws ``experiments/shared_context.py`` made (first context's first
    question and answer, pinned: a change to the generator changes every committed result)."""
    first, second = workloads.shared_contexts(2)
    assert (first.id, first.task, second.id, second.task) == ("codes-0", "key_retrieval", "births-1", "multi_doc_qa")
    assert [q for q, _ in first.questions][0].startswith("What is the access code of ")
    assert dict(first.people)[first.questions[0][0].split(" of ")[1].split("?")[0]] == first.questions[0][1][0]
    assert all(value in second.context for _, value in second.people)


@pytest.mark.parametrize("configuration", ["full", "paged context", "snapkv context unshared", "streaming prompt",
                                           "kvzip context"])
def test_each_request_carries_settings_the_server_accepts(built, configuration):
    """The override is vllm_xargs' JSON string (vllm_xargs values may only be strings and numbers),
    read by the same parse the server's requests go through (``request_settings``), with the
    request's own boundary."""
    from harness.eviction.settings import request_settings

    workload = built["shared_context"]
    requests = workloads.sample_requests(workload, configuration, 0.5)
    assert len(requests) == len(workload.items)
    for request, item in zip(requests, workload.items):
        assert request.prompt == item.prompt and request.prompt_len == len(item.prompt)
        assert request.expected_output_len == item.max_tokens
        wire = request.request_overrides["vllm_xargs"]["kv_eviction"]
        assert isinstance(wire, str)
        settings = request_settings({"kv_eviction": json.loads(wire)}, None, 32)
        if configuration == "full":
            assert settings is None
            continue
        policy, mode = workloads.parse_configuration(configuration)
        assert settings.policy == policy and settings.budget_ratio == 0.5
        assert (settings.context_tokens == item.context_tokens) == mode.startswith("context")
        # unset: shared wherever the prefix cache reaches the request (the server's default)
        assert settings.share_context == (False if mode == "context unshared" else None)


def test_a_bad_configuration_gets_one_line():
    with pytest.raises(ValueError, match="no policy 'nope'"):
        workloads.check_configurations(["full", "nope context"])
    with pytest.raises(ValueError, match="must include 'full'"):
        workloads.check_configurations(["paged context"])
    with pytest.raises(ValueError, match="mode one of"):
        workloads.parse_configuration("paged everything")


def test_items_are_scored_by_their_own_rule():
    register = "Ada Brandt, baker, Ely, code 23205.\nHugo Pike, mason, Selby, code 51234."
    copy = Item("registers-0", 0, workloads.REGISTER_TASK, [1], 1, 256, (register,))
    # ROUGE-L as the suite scores record_listing: a whole copy 1, half of it less, a wrong line less again
    half = workloads.score(copy, register.splitlines()[0])
    assert workloads.score(copy, register) == pytest.approx(1.0) and 0.4 < half < 0.8
    assert workloads.score(copy, register.replace("51234", "99999").replace("Hugo Pike", "Wim Dorn")) < 1.0
    code = Item("codes-0", 0, "key_retrieval", [1], 1, 16, ("23205",))
    assert workloads.score(code, "The code is 23205.") == 1.0 and workloads.score(code, "12345") == 0.0
    assert workloads.score(Item("prefix-0", 0, "", [1], 1, 16), "anything") is None


def test_prefix_repetition_is_vllms_dataset_with_each_prefix_boundary_measured(tokenizer):
    workload = workloads.build("prefix_repetition", tokenizer, num_requests=8, prefix_len=256, suffix_len=64,
                               num_prefixes=2, output_len=32)
    assert workload.ignore_eos and not workload.scored and len(workload.items) == 8
    groups: dict[str, list[Item]] = {}
    for item in workload.items:
        groups.setdefault(item.context, []).append(item)
    assert sorted(len(g) for g in groups.values()) == [4, 4]
    for items in groups.values():
        boundary = items[0].context_tokens
        assert abs(boundary - 256) <= 2  # vLLM's prefix, up to a merge at its junction with the suffix
        assert len({tuple(item.prompt[:boundary]) for item in items}) == 1
        assert len({item.prompt[boundary] for item in items}) > 1  # the shared part ends there
        assert all(item.max_tokens == 32 for item in items)


@pytest.fixture(scope="module")
def talks(tokenizer):
    return workloads.build("multi_turn", tokenizer, conversations=2, turns=3, max_prompt_tokens=3500)


def test_a_conversations_later_turn_continues_its_last_prompt_and_answer_as_the_chat_template_renders(talks, tokenizer):
    """Turn 1 is shared_context's first question; a later turn is the last prompt, the answer's own
    token ids and the next question in a new user message, as the chat template renders the
    conversation; its boundary is the history (everything before the new question), and no answer
    at its limit makes a prompt longer than the bound the pool and max_model_len are sized by."""
    assert talks.turns == 3 and [item.question for item in talks.items] == [0, 1, 2] * 2
    for c in range(2):
        first, second, third = workloads.conversation_of(talks, c)
        shared = next(s for s in workloads.shared_contexts(2, 0, 3) if s.id == first.context)
        assert first.prompt == workloads.prompts_of(shared, tokenizer, 3500)[0].token_ids
        assert first.follow_up is None and second.prompt == [] and shared.questions[1][0] in second.follow_up
        user_message = tokenizer.decode(first.prompt).split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
        answer_text = "The access code is 12345."
        answer = tokenizer(answer_text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        made = workloads.next_turn(tokenizer, second, first.prompt, answer)
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": user_message}, {"role": "assistant", "content": answer_text},
             {"role": "user", "content": second.follow_up}], tokenize=False, add_generation_prompt=True)
        assert tokenizer.decode(made.prompt) == rendered
        assert made.context_tokens == len(first.prompt) + len(answer) and made.prompt[:made.context_tokens] == first.prompt + answer
        longest = [7] * first.max_tokens  # answers at their limit, no end of turn
        two = workloads.next_turn(tokenizer, second, first.prompt, longest)
        three = workloads.next_turn(tokenizer, third, two.prompt, longest)
        assert len(two.prompt) == second.prompt_bound and len(three.prompt) == third.prompt_bound
    # full cache at once: each conversation's last turn at its longest
    assert workloads.blocks_at_once(talks, 32) == sum(-(-(item.prompt_bound + item.max_tokens) // 32)
                                                      for item in talks.items if item.question == 2)


def test_a_run_sends_first_turns_and_its_later_turns_rebuild_from_the_answers(talks, tokenizer):
    from harness.eviction.settings import request_settings

    firsts = workloads.sample_requests(talks, "paged context chained", 0.5)
    assert [request.prompt for request in firsts] == [item.prompt for item in talks.items if item.question == 0]
    answers = [[100 + i, 200 + i] for i in range(len(talks.items))]
    sent = workloads.turn_items(talks, tokenizer, answers)
    follow = workloads.next_request(talks, tokenizer, "paged context chained", 0.5)
    for c in range(2):
        turns = sent[3 * c:3 * c + 3]
        for turn in (1, 2):
            request = follow(c, turn, turns[turn - 1].prompt, answers[3 * c + turn - 1])
            assert request.prompt == turns[turn].prompt
            settings = request_settings({"kv_eviction": json.loads(request.request_overrides["vllm_xargs"]["kv_eviction"])},
                                        None, 32)
            assert settings.chain is True and settings.compress == "context"
            assert settings.context_tokens == len(turns[turn - 1].prompt) + 2
    assert workloads.turn_items(talks, tokenizer, answers)[0] is talks.items[0]


def test_a_chain_is_refused_where_it_cannot_follow_the_answers(talks, built):
    """Before any server starts: a chain needs a conversation, answers not cut by stop strings, a
    policy scoring by kept keys and values (the frontend refuses the others' chains) and its
    recompressing twin beside it; no policy that reconstructs runs conversations (later turns bring
    no reconstruction ids)."""
    chained = ["full", "paged context", "paged context chained"]
    workloads.check_configurations(chained, talks)
    with pytest.raises(ValueError, match="a chain continues a conversation"):
        workloads.check_configurations(chained, built["shared_context"])
    from dataclasses import replace

    stopped = replace(talks, items=[replace(item, stop=("\n",)) for item in talks.items])
    with pytest.raises(ValueError, match="stop strings"):
        workloads.check_configurations(chained, stopped)
    with pytest.raises(ValueError, match="not the queries or running totals snapkv"):
        workloads.check_configurations(["full", "snapkv context", "snapkv context chained"], talks)
    with pytest.raises(ValueError, match="list its recompressing twin 'paged context'"):
        workloads.check_configurations(["full", "paged context chained"], talks)
    with pytest.raises(ValueError, match="later turns have none"):
        workloads.check_configurations(["full", "kvzip context"], talks)
    workloads.check_configurations(["full", "kvzip context"], built["shared_context"])


def test_a_model_without_a_chat_template_gets_one_line_for_conversations(tokenizer):
    from copy import copy

    plain = copy(tokenizer)
    plain.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        workloads.build("multi_turn", plain, conversations=2, turns=2)


def test_the_streamed_answer_is_read_back_from_the_bytes_vllms_request_function_saw():
    """``bench_client._KeptStream``: the token ids of every chunk and the final usage's cached
    tokens, from SSE bytes split anywhere (a chunk boundary inside a message)."""
    from harness.engine.bench_client import _KeptStream

    messages = [{"choices": [{"text": "The", "token_ids": [504]}]}, {"choices": [{"text": " code", "token_ids": [2012, 5]}]},
                {"choices": [], "usage": {"prompt_tokens": 90, "completion_tokens": 3,
                                          "prompt_tokens_details": {"cached_tokens": 64}}}]
    stream = "".join(f"data: {json.dumps(m)}\n\n" for m in messages) + ": ping\n\ndata: [DONE]\n\n"
    kept = _KeptStream(None)
    raw = stream.encode()
    kept.chunks = [raw[:17], raw[17:60], raw[60:]]
    assert kept.answer() == ([504, 2012, 5], 64)
