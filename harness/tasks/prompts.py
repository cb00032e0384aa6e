"""LongBench's generation rules: template, middle truncation, chat template where it applies,
and the token ids the engine is given, with where in them the context ends (``context_boundary``),
the ids a policy that reconstructs the context (KVzip) repeats it with (``reconstruction``) and the
strings its answer stops at (``answer_stops``)."""
from __future__ import annotations

from dataclasses import dataclass

from harness.tasks.sample import Sample
from harness.tasks.spec import TaskSpec


@dataclass(frozen=True)
class Prompt:
    text: str               # what is recorded in predictions.jsonl
    token_ids: list[int]    # exactly what the model sees
    # How many leading token_ids are context (``build_prompt`` says what counts); None where the
    # question part was not found (truncation cut into it, a template with no {context}) or the
    # tokenizer gives no character offsets.
    context_tokens: int | None = None
    # KVzip's inputs for this prompt (``reconstruction``), in the wire form of
    # ``harness.eviction.settings.Reconstruction``; None where its chat header cannot be found.
    reconstruction: dict | None = None
    # The strings its answer stops at (``answer_stops``): its task's, and the end of the answer's
    # line where a base model answers a one-line task.
    stop: tuple[str, ...] = ()

    @property
    def question_tokens(self) -> int | None:
        """The token ids after the context: question, chat footer, answer prefix."""
        return None if self.context_tokens is None else len(self.token_ids) - self.context_tokens


def middle_truncate(text: str, tokenizer, max_tokens: int) -> str:
    """Keep the first and last ``max_tokens // 2`` tokens of an over-long prompt (LongBench's rule)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) <= max_tokens:
        return text
    half = max_tokens // 2
    return tokenizer.decode(ids[:half], skip_special_tokens=True) + tokenizer.decode(
        ids[-half:], skip_special_tokens=True
    )


CONTEXT = "{context}"


def question_text(sample: Sample, spec: TaskSpec) -> str | None:
    """The question part of the user message: the template's text after ``{context}``, formatted,
    from its first non-whitespace character (the whitespace after the context is context, as
    kvpress's RULER split has it). '' where that text is only whitespace; None where the template
    has no ``{context}``."""
    if CONTEXT not in spec.template:
        return None
    tail = spec.template[spec.template.rindex(CONTEXT) + len(CONTEXT):]
    return tail.format(context=sample.context, input=sample.input).lstrip()


def chat_parts(tokenizer) -> tuple[str, str] | None:
    """What the chat template writes before and after the user message's content: its header
    (system prompt, user header) and its footer (end of turn, assistant header), from a rendering
    around a marker; None if the template does not write the content once and verbatim."""
    marker = "\x00context-boundary\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False,
                                         add_generation_prompt=True)
    return tuple(text.split(marker)) if text.count(marker) == 1 else None


def chat_footer(tokenizer) -> str | None:
    """What the chat template writes after the user message's content (``chat_parts``)."""
    parts = chat_parts(tokenizer)
    return None if parts is None else parts[1]


# KVzip's repeat prompts (kvpress 0.5.5, presses/kvzip_press.py:254 and :257, the authors' text),
# each encoded alone with no special tokens (:255, :258), and the footer kvpress gives a tokenizer
# with no chat template (:103-105).
REPEAT_FIRST = "\n\nRepeat the previous context exactly."
REPEAT_LATER = "\n\nRepeat the part of the previous context exactly, starting with"
PLAIN_PARTS = ("", "\n")


def header_tokens(text: str, token_ids: list[int], offsets: list[tuple[int, int]] | None, header: str,
                  header_ids: list[int]) -> int | None:
    """How many leading ``token_ids`` are the chat header ``header`` (the text ``text`` begins with):
    its own ids' count, as kvpress counts its ``prefix_length`` (kvzip_press.py:120), where the
    prompt's ids begin with them; otherwise (the header's last token merged with the message's
    first characters) the tokens that start inside it, by their character ``offsets``. None
    where ``text`` does not begin with ``header``, or neither rule applies (no offsets)."""
    if not text.startswith(header):
        return None
    if token_ids[:len(header_ids)] == header_ids:
        return len(header_ids)
    if offsets is None:
        return None
    return next((index for index, (start, _) in enumerate(offsets) if start >= len(header)), len(offsets))


def reconstruction(tokenizer, text: str, token_ids: list[int], offsets: list[tuple[int, int]] | None,
                   parts: tuple[str, str] | None) -> dict | None:
    """The ids KVzip repeats a prompt's context with (``policies.kvzip.passes``), as kvpress's
    ``KVzipPress`` makes them (kvzip_press.py:102-121, 253-262): ``prefix_tokens``, the chat header
    (template text before the user message: BOS, system prompt, user header), never repeated;
    ``first`` and ``later``, the repeat prompts; ``suffix``, the chat footer that closes the user
    turn and opens the assistant's (what follows the content in the prompt itself). ``parts``: the
    chat template's header and footer (``chat_parts``) for a chat prompt; ``PLAIN_PARTS`` for a
    plain one, kvpress's rule for a tokenizer without a chat template: no header (a BOS the
    tokenizer added is repeated with the context, as kvpress's pipeline puts it in the context's
    ids) and a newline as footer. None where the template's parts were not found (``parts`` None)."""
    if parts is None:
        return None
    header, footer = parts

    def encode(part: str) -> list[int]:
        return list(tokenizer(part, add_special_tokens=False)["input_ids"])

    prefix = header_tokens(text, token_ids, offsets, header, encode(header)) if header else 0
    if prefix is None:
        return None
    return {"prefix_tokens": prefix, "first": encode(REPEAT_FIRST), "later": encode(REPEAT_LATER),
            "suffix": encode(footer)}


def ids_reconstruction(tokenizer, token_ids: list[int], chat: bool = False) -> dict | None:
    """``reconstruction`` for a prompt known only by its token ids (a request ``vllm serve`` got),
    the same ids ``build_prompt`` makes for the same prompt. Its text is its ids decoded; its
    character offsets are that text's, encoded again with no special tokens as ``build_prompt``
    encodes a chat prompt, where that gives back its ids (otherwise none: the prompt must then
    begin with the header's own ids). It is a chat prompt where ``chat`` says so (the server's
    chat template wrote it) or where its text begins with the chat template's header (a prompt
    written with the template, as ``build_prompt``'s chat prompts are); a plain prompt otherwise.
    None where a chat prompt's header is not found (``reconstruction``)."""
    text = tokenizer.decode(token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    parts = chat_parts(tokenizer) if getattr(tokenizer, "chat_template", None) else None
    if not chat and not (parts and parts[0] and text.startswith(parts[0])):
        parts = PLAIN_PARTS
    offsets = None
    if parts is not PLAIN_PARTS and getattr(tokenizer, "is_fast", False):  # a plain prompt has no header to count
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        if list(encoded["input_ids"]) == list(token_ids):
            offsets = encoded["offset_mapping"]
    return reconstruction(tokenizer, text, token_ids, offsets, parts)


def context_boundary(text: str, question: str | None, suffix: str | None) -> int | None:
    """Where the question part begins in the final ``text``, in characters: the user message ends
    where ``suffix`` (chat footer and answer prefix) begins, and must end with ``question``, found
    from the end, so a question text that also occurs in the context cannot be taken for it.

    ``question`` empty (nothing but whitespace after ``{context}``): the whole user message is
    context, the question part is the chat footer and answer prefix (nothing without either).
    None where ``question`` is None or not at the end of the user message: middle truncation cut
    into the question part, or a chat template changed the message beyond trailing whitespace."""
    if question is None or suffix is None or not text.endswith(suffix):
        return None
    user = text[: len(text) - len(suffix)]
    if not question:
        return len(user)
    user = user.rstrip()  # a template may trim the message (Llama-3's does); question is stripped too
    question = question.rstrip()
    return len(user) - len(question) if user.endswith(question) else None


# Metrics that score a one-line answer (a phrase, a label, a paragraph's number, a count, the next
# line of code), which text after that line lowers. Not ROUGE (summaries and the suite's register
# copy span lines) nor RULER's string matches (a list of needles may span lines, and text after
# them costs nothing).
ONE_LINE_METRICS = ("qa_f1", "classification", "retrieval", "count", "code_sim")


def answer_stops(spec: TaskSpec, tokenizer) -> tuple[str, ...]:
    """The strings an answer to ``spec``'s task stops at: the task's own, and "\n" where the model
    is a base model (its tokenizer has no chat template: it never learned to end a turn, so only
    the token limit ends its answer, and after the answer it writes the next question) and the
    task's answer is one line (``spec.first_line``, or a metric in ``ONE_LINE_METRICS``), as
    LongBench ends samsum's answers at the line's end. A model with a chat template keeps its
    task's stops, on plain prompts too (LongBench's few-shot and code tasks), so its runs are what
    they were. An answer that begins with a newline ends there, empty: the templates put a one-line
    answer on the answer's own line (after "Answer:", after "Next line of code:\n")."""
    stops = tuple(spec.stop)
    base = not getattr(tokenizer, "chat_template", None)
    one_line = spec.first_line or spec.metric in ONE_LINE_METRICS
    return stops + ("\n",) if base and one_line and "\n" not in stops else stops


def context_tokens(text: str, offsets: list[tuple[int, int]], boundary: int) -> int:
    """How many leading tokens are context, given each token's character span in ``text``: up to
    the first token that starts at or after ``boundary``. A token straddling it counts as context,
    unless all it has before the boundary is whitespace (byte-level BPE spans of " Answer" start at
    the space; that token is the question's first word). Special tokens a tokenizer adds (empty
    spans) go with the token after them: a leading BOS is context."""
    for index, (start, end) in enumerate(offsets):
        if end > start and (start >= boundary or (end > boundary and not text[start:boundary].strip())):
            return index
    return len(offsets)


def build_prompt(sample: Sample, spec: TaskSpec, tokenizer, max_prompt_tokens: int) -> Prompt:
    """The exact text and token ids handed to the engine for one sample.

    The engine gets token ids, never text: given text, vLLM tokenizes with the tokenizer's special
    tokens added, so a chat template that already writes ``<|begin_of_text|>`` (Llama-3) would start
    with two BOS tokens. A chat prompt is therefore encoded with no extra special tokens (the
    template wrote all it wants); a plain prompt gets the tokenizer's own, as LongBench's
    ``tokenizer(prompt)`` and vLLM's text path give it.

    ``context_tokens`` (for query-agnostic compression, ``compress=context``) splits the ids where
    the question part begins, the same rule for every family: the context part is everything before
    it (BOS, chat header, a preamble, the template's instruction before ``{context}``, the context,
    the whitespace after it); the question part is the template's text after ``{context}`` from its
    first non-whitespace character (the question with any instruction around it), the chat footer
    and the answer prefix. So for:

    * LongBench and any LongBench-format JSONL: the record's ``context`` and the template up to it
      are context; the template's rest, ``input`` inside it, is the question part: "Now, answer the
      question based on the above text ... Question: {input}\\nAnswer:". (kvpress's LongBench
      dataset, evaluation/benchmarks/longbench/create_huggingface_dataset.py, counts that fixed
      instruction after the context as context; here all of the template's text after the context
      is question, as it is for RULER.) lcc: "Next line of code:" is the question part, its
      ``input`` being empty; gov_report and multi_news, with no ``{input}``: "Now, write a one-page
      summary ... Summary:".
    * The embedded suite: its tasks use LongBench's templates (code_completion lcc's, so its
      question part is "Next line of code:\\n"); record_listing's is "Now, {input}" and the answer
      prefix "Register:\\n".
    * RULER: as kvpress splits a RULER prompt (NVIDIA/kvpress,
      evaluation/benchmarks/ruler/create_huggingface_dataset.py at 8bb29b9: the context is the text before
      the last match of the task's question pattern, e.g. "What are all the special magic" or
      "Question: Find all variables", and the answer prefix is split off after it): the preamble
      (cwe's worked example, with its own question and answer), the instruction before the
      haystack, the haystack and the newline(s) after it are context; the question ("What are all
      the special magic numbers for ...?", "Question: ...", qa's repeated "Answer the question
      based on the given documents ... Question: ...") and the answer prefix are the question
      part. Each task's question pattern is exactly the start of its template's text after
      ``{context}``, so this rule and kvpress's give the same split.

    A template whose text after ``{context}`` is only whitespace has the whole user message as
    context. ``context_tokens`` is None where the question part is not found (``context_boundary``)
    or the tokenizer gives no character offsets (not a fast tokenizer).

    ``reconstruction`` (for a policy that reconstructs the context, KVzip) is the prompt's chat
    header length, KVzip's repeat prompts and the chat footer (``reconstruction``): the same for
    ``compress=context`` and ``compress=prompt`` (what is repeated is everything before the
    eviction point after the header).

    ``stop``: the strings the answer stops at (``answer_stops``).
    """
    text = sample.meta.get("preamble", "") + spec.template.format(context=sample.context, input=sample.input)
    text = middle_truncate(text, tokenizer, max_prompt_tokens)
    chat = bool(spec.chat and getattr(tokenizer, "chat_template", None))
    footer, parts = "", PLAIN_PARTS
    if chat:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        parts = chat_parts(tokenizer)
        footer = None if parts is None else parts[1]
    # A generated task may start the answer for the model (RULER's answer prefix), after the
    # assistant's header, as its authors append it to the prompt.
    answer_prefix = sample.meta.get("answer_prefix", "")
    text += answer_prefix
    fast = bool(getattr(tokenizer, "is_fast", False))  # only fast tokenizers give offsets
    encoded = tokenizer(text, add_special_tokens=not chat, return_offsets_mapping=fast)
    token_ids = list(encoded["input_ids"])
    offsets = encoded["offset_mapping"] if fast else None
    suffix = None if footer is None else footer + answer_prefix
    boundary = context_boundary(text, question_text(sample, spec), suffix)
    count = None if boundary is None or not fast else context_tokens(text, offsets, boundary)
    return Prompt(text, token_ids, count, reconstruction(tokenizer, text, token_ids, offsets, parts),
                  answer_stops(spec, tokenizer))
