"""NVIDIA kvpress's presses on the harness's exact prompts: runs inside ``.venv-kvpress`` only.

Started by ``experiments/kvpress_parity.py`` (under ``flock /tmp/engine.lock``), never by hand:

    .venv-kvpress/bin/python experiments/kvpress_runner.py JOBS.json OUT.jsonl [RANKING.jsonl]
    .venv-kvpress/bin/python experiments/kvpress_runner.py --ranking JOBS.json RANKING.jsonl

``JOBS.json`` names the checkpoint (the embedded SmolLM2 the harness's vLLM loads), the samples (the
token ids the harness handed its engine, ``max_new_tokens``, stop strings, and under ``--compress
context`` the context boundary ``context_tokens`` the harness's cells evicted at) and the cells (a
press, its options, a nominal compression ratio, and per sample the number of prompt tokens, or
context tokens, to keep). It imports nothing of the harness: kvpress pins a transformers that the
harness's vLLM cannot use. It never retokenizes: both sides run the same token ids, split at the
same token.

A sample without a boundary (``--compress prompt``, the default): per cell it does what kvpress's
``KVPressTextGenerationPipeline._forward`` does with a context and an empty question, on the whole
prompt (the leaderboard's ``--query_aware`` loop): the prompt is prefilled with the press hooked
(its forward hooks compress each layer's cache after that layer's attention ran on the full
prompt, so the prefill itself and the first output token see the full cache), then greedy decoding
with the press removed and logical position ids (``generate_answer``: ``position_ids`` continue
from the prompt length, not from the compressed cache length). One difference from the pipeline:
it prefills the context with the LM head off and computes the first token from the question's
forward pass after compression; here the whole prompt is the compressed context (the harness
compresses its whole prompt), so the first token comes from the prefill's own logits, as in the
harness.

A sample with a boundary ``c`` (``--compress context``, the harness's ``compress=context``): what
the pipeline does with a context and a question, ``pipeline(context, question=...)``, the
leaderboard's main loop. Read in kvpress 0.5.5 as published (PyPI ``kvpress-0.5.5-py3-none-any.whl``,
sha256 900bdb17...; ``kvpress/pipeline.py``, line numbers below), which is NVIDIA/kvpress at commit
8bb29b9 (after tag v0.5.4, 6d96555) but for ``logits_to_keep=1``, spelled ``num_logits_to_keep`` in
both of those:

- ``_forward`` (lines 207-221): the context alone is prefilled with the press hooked, through the
  backbone without the LM head, ``self.model.model(input_ids=context_ids, past_key_values=cache)``:
  no position ids or cache positions given, so transformers numbers the context 0..c-1, and each
  layer's hook compresses that layer's cache once its attention ran (``BasePress.forward_hook``,
  ``presses/base_press.py`` lines 139-160, only while ``is_prefilling``: ``cache_position[-1] + 1
  == q_len``). Here ``Prefill(model, prompt[:c], lm_head=False)`` makes the same call.
- ``generate_answer`` (lines 289-302), given ``context_length = context_ids.shape[1]`` (line 208: the
  uncompressed length; only KeyRerotationPress, FinchPress with ``rerotate_keys`` and RestoreKVPress
  take the compressed one, lines 226-238, none of them run here): the question's ids (question,
  chat footer, answer prefix) run as one forward pass on the compressed cache,
  ``self.model(input_ids=question_ids, past_key_values=cache, position_ids=arange(c, c + q),
  logits_to_keep=1)``, the press no longer hooked (its ``with`` block closed at line 224; decoding
  compression only for DecodingPress, PrefillDecodingPress and DMSPress, lines 229-233). No
  ``cache_position`` is passed: transformers derives it from the cache's length, ``arange(kept,
  kept + q)``, where the question's keys are appended and what the causal mask compares (each
  question token sees the whole compressed context and the question up to itself). The first
  answer token is the argmax of that pass's last logits (line 302).
- Greedy decoding continues at logical positions ``c + q + i`` (lines 301, 308-313), cache positions
  again derived from the cache.
- After each question ``_remove_answer_from_cache`` (lines 240, 247, 252-256) cuts every layer back to
  its length before the question: the question's and the answer's keys and values are dropped, so
  several questions on one context each see the compressed context alone. Each sample here has one
  question, and every cell starts from its own copy of the compressed context.

``question_pass`` is that bookkeeping (a pure function, tested in
``tests/experiments/test_kvpress_parity.py``); ``ask`` runs the pass. The harness's engine does the
same at the boundary (its scheduler ends a prefill chunk at ``c``, evicts, then prefills the
question at positions ``c..n-1``).

Since no press changes the prefill's own computation, each sample (its context, with a boundary)
is prefilled once (per attention implementation) and every cell's cache is the press's own
``forward_hook`` applied to that prefill's recorded per-layer arguments (``Prefill``); on the first
sample, each press's cache is compared with kvpress's own hooked prefill before anything runs
(``check_shared_prefill``; the result is recorded in ``versions.json`` beside the output).

KVzip (``kvzip``, ``kvzip_uniform``; context samples only) cannot share that prefill: KVzipPress
records the context's ids and cache through its own context manager and, on leaving it, runs its
repeat passes and ``compress_post``. So each sample's context is prefilled and reconstructed once
through KVzipPress itself (``Reconstructed``; the ids it built its passes from are checked against
the harness's, ``check_reconstruction_ids``), and each KVzip cell's press selects on a copy of its
``score_val`` with its own ``compress_post`` (compared on the first sample with each press's own
whole run, ``check_reconstruction_shared``). KVzipPress masks what it prunes by fake keys
(``attention_patch.py``) and keeps every slot: what it kept is counted per (layer, KV head) from its
masks, and the masks are cleared after each cell. Given a third path (``JOBS OUT RANKING``), KVzip
cells write their ranking rows there as they run.

Decoding stops as the harness's vLLM requests do (``harness.engine.llm.sampling_params``): at the
model's EOS (kept in the output, as vLLM keeps it), at a stop string (the token completing it
kept), or at ``max_new_tokens``. Each position records its two best ``[token, logprob]`` pairs from
``log_softmax`` of the float32 logits: what the near-tie rule (``harness.analysis.regression.parting``) reads.
"""
from __future__ import annotations

import functools
import json
import sys
import time
from importlib.metadata import version
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from transformers.utils import logging as transformers_logging

TOP_LOGPROBS = 2  # as harness.engine.llm.TOP_LOGPROBS

# The presses this experiment runs, by the name the jobs file uses (their kvpress class names;
# kvpress is imported where a press is made, so that the pure bookkeeping here can be tested
# without it); options are their fields.
PRESSES = {
    "no_press": None,
    "knorm": "KnormPress",
    "streaming_llm": "StreamingLLMPress",
    "snapkv": "SnapKVPress",
    "tova": "TOVAPress",
    "keydiff": "KeyDiffPress",
    "observed_attention": "ObservedAttentionPress",
    "kvzip": "KVzipPress",
    "kvzip_uniform": "KVzipPress",  # its scores, a selection per (layer, KV head): head_uniform_kvzip
}
# The presses that reconstruct the context (KVzip): run through their own context manager on a
# context prefill of their own (``Reconstructed``), not through ``Prefill.compressed_cache``.
RECONSTRUCTING = {"kvzip", "kvzip_uniform"}
# ObservedAttentionPress reads the attention weights the layer returns, which only the eager
# implementation computes (its docstring: 'Requires: attn_implementation="eager"').
EAGER_PRESSES = {"observed_attention"}


def press_ratio(kept: int, prompt_tokens: int) -> float:
    """The compression ratio under which kvpress keeps exactly ``kept`` of ``prompt_tokens``:
    ``kvpress.utils.compute_n_kept`` keeps ``int(prompt_tokens * (1 - ratio))``, so aim half a token
    above ``kept`` (robust to float rounding either way). 0 (no compression) when nothing is cut."""
    if kept >= prompt_tokens:
        return 0.0
    return 1.0 - (kept + 0.5) / prompt_tokens


def make_press(name: str, ratio: float, options: dict):
    import kvpress

    if name == "kvzip_uniform":
        return head_uniform_kvzip()(compression_ratio=ratio, **options)
    cls = PRESSES[name]
    return None if cls is None else getattr(kvpress, cls)(compression_ratio=ratio, **options)


def question_pass(prompt_tokens: int, context_tokens: int, cached: int) -> dict:
    """The bookkeeping of kvpress 0.5.5's question pass (``generate_answer``; module docstring) for a
    prompt of ``prompt_tokens`` whose first ``context_tokens`` were prefilled and compressed to
    ``cached``: the slice of the prompt fed (``[c, n)``), its position ids (logical: ``c..n-1``,
    from the uncompressed context's length), the cache positions transformers derives for it from
    the cache's length (``cached..cached + q - 1``: not passed, as kvpress passes none), and the
    position of the first decoding step (``n``; step i at ``n + i``)."""
    if not 0 < context_tokens < prompt_tokens:
        raise ValueError(f"a context of {context_tokens} tokens leaves no question in a prompt of {prompt_tokens}")
    if not 0 < cached <= context_tokens:
        raise ValueError(f"{cached} cached tokens after compressing a context of {context_tokens}")
    question = prompt_tokens - context_tokens
    return {"input": (context_tokens, prompt_tokens), "position_ids": list(range(context_tokens, prompt_tokens)),
            "cache_position": list(range(cached, cached + question)), "next_position": prompt_tokens}


def ask(model, cache: DynamicCache, prompt: list[int], context_tokens: int) -> tuple[torch.Tensor, int]:
    """kvpress's question pass on a compressed context (``generate_answer``, lines 289-302): the
    question's ids in one forward pass at their logical positions, the press unhooked; the logits of
    its last position (the first answer token's) and the first decoding step's position."""
    plan = question_pass(len(prompt), context_tokens, cache.get_seq_length())
    start, end = plan["input"]
    outputs = model(input_ids=torch.tensor([prompt[start:end]]), past_key_values=cache,
                    position_ids=torch.tensor([plan["position_ids"]]), logits_to_keep=1)
    if cache.get_seq_length() != plan["cache_position"][-1] + 1:  # the question appended after the compressed context
        raise RuntimeError(f"the question pass left {cache.get_seq_length()} cached tokens, expected "
                           f"{plan['cache_position'][-1] + 1}")
    return outputs.logits[0, -1], plan["next_position"]


def best_pairs(logits: torch.Tensor) -> list[list]:
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    values, tokens = logprobs.topk(TOP_LOGPROBS)
    return [[int(t), float(v)] for t, v in zip(tokens, values)]


class Prefill:
    """One prompt (or, with a boundary, a sample's context: ``lm_head=False``, through the backbone
    as kvpress's pipeline prefills it) prefilled once, with what each attention layer's press hook
    would have been handed: the layer's keyword arguments (its input ``hidden_states``,
    ``position_embeddings``, ``cache_position``, ...) and its output (attention weights included
    under eager attention).

    kvpress compresses inside forward hooks on the attention layers, after each layer's attention
    ran on the full prompt (``BasePress.forward_hook``): nothing of the prefill's own computation
    depends on the press. So one prefill serves every press, and ``compressed_cache`` calls the
    press's own ``forward_hook`` on each layer with exactly the arguments the hooked forward pass
    would have passed it, on a fresh copy of the full cache.
    """

    def __init__(self, model, prompt: list[int], lm_head: bool = True):
        self.model = model
        self.prompt = prompt
        self.calls: dict[int, tuple[dict, tuple]] = {}
        layers = model.model.layers
        hooks = [layer.self_attn.register_forward_hook(self._record, with_kwargs=True) for layer in layers]
        self.cache = DynamicCache()
        try:
            outputs = prefill_pass(model, prompt, self.cache, lm_head)
        finally:
            for hook in hooks:
                hook.remove()
        self.first_logits = outputs.logits[0, -1] if lm_head else None
        self.keys = [layer.keys for layer in self.cache.layers]
        self.values = [layer.values for layer in self.cache.layers]

    def _record(self, module, args, kwargs, output):
        kept = {name: value for name, value in kwargs.items() if name != "past_key_values"}
        self.calls[module.layer_idx] = (kept, output)

    def compressed_cache(self, press) -> DynamicCache:
        cache = DynamicCache()
        for index, (keys, values) in enumerate(zip(self.keys, self.values)):
            cache.update(keys.clone(), values.clone(), index)
        if press is None:
            return cache
        with press(self.model):  # what the press sets up on the model (post_init_from_model, rotary_emb)
            for index, layer in enumerate(self.model.model.layers):
                kwargs, output = self.calls[index]
                press.forward_hook(layer.self_attn, (), {**kwargs, "past_key_values": cache}, output)
        return cache


def prefill_pass(model, tokens: list[int], cache: DynamicCache, lm_head: bool = True):
    """One prefill of ``tokens`` into ``cache``: the whole prompt with the LM head on its last
    position (a prompt-mode sample: its first output token), or a context through the backbone
    alone, as kvpress 0.5.5's pipeline prefills it (``self.model.model(input_ids=context_ids,
    past_key_values=cache)``, ``pipeline.py`` lines 218-221)."""
    if lm_head:
        return model(input_ids=torch.tensor([tokens]), past_key_values=cache, logits_to_keep=1)
    return model.model(input_ids=torch.tensor([tokens]), past_key_values=cache)


def check_shared_prefill(model, prompt: list[int], press, lm_head: bool = True) -> str:
    """How the shared prefill's cache compares with kvpress's own hooked prefill (``with
    press(model): model(...)``, as its pipeline runs it; ``lm_head=False``: a context, through the
    backbone), the premise of sharing it: "exact", "within 1e-4" or what differs. Two forward passes
    of one prompt on this CPU build are not always bit-identical (the first run of this experiment
    saw layer 0's keys, a plain projection, differ in the last bits: GEMM results depend on memory
    alignment), so rounding is reported, not fatal."""
    live = DynamicCache()
    with press(model):
        prefill_pass(model, prompt, live, lm_head)
    shared = Prefill(model, prompt, lm_head).compressed_cache(press)
    worst = 0.0
    for index, (a, b) in enumerate(zip(live.layers, shared.layers)):
        if a.keys.shape != b.keys.shape:
            return f"layer {index}: shapes {tuple(a.keys.shape)} / {tuple(b.keys.shape)}"
        worst = max(worst, (a.keys - b.keys).abs().max().item(), (a.values - b.values).abs().max().item())
    if worst == 0:
        return "exact"
    return "within 1e-4" if worst <= 1e-4 else f"max |difference| {worst:.3g}"


def decode(model, tokenizer, logits: torch.Tensor, position: int, kept: int, cache: DynamicCache,
           max_new_tokens: int, stops: list[str], eos: set[int]) -> dict:
    """Greedy decoding on a (compressed) cache as kvpress's ``generate_answer`` does it, from the
    ``logits`` of the prompt's last position: logical position ids continuing from the prompt's
    length (``position``), the press no longer hooked. ``kept``: the tokens the press left."""
    tokens, tops = [], []
    finish = "length"
    for step in range(max_new_tokens):
        token = int(logits.argmax())
        tokens.append(token)
        tops.append(best_pairs(logits))
        if token in eos:
            finish = "stop"
            break
        if stops and any(stop in tokenizer.decode(tokens, skip_special_tokens=True) for stop in stops):
            finish = "stop"
            break
        if step == max_new_tokens - 1:
            break
        outputs = model(input_ids=torch.tensor([[token]]), past_key_values=cache,
                        position_ids=torch.tensor([[position]]))
        position += 1
        logits = outputs.logits[0, -1]
    return {"output_token_ids": tokens, "top_logprobs": tops, "finish_reason": finish, "kept_tokens": kept,
            "prediction": tokenizer.decode(tokens, skip_special_tokens=True)}


def load_model(path: str, attn_implementation: str):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn_implementation)
    return model.eval()


SCORE_BITS = 11  # the harness's ranking precision (policies/base.py SCORE_BITS); not imported: no harness here


def harness_rule(scores: torch.Tensor, count: int) -> torch.Tensor:
    """The harness's ranking rule, written again here: scores rounded to ``SCORE_BITS`` significant
    bits, the ``count`` best kept, ties to the earlier token; ascending positions."""
    mantissa, exponent = torch.frexp(scores.float())
    rounded = torch.ldexp(torch.round(mantissa * 2**SCORE_BITS) / 2**SCORE_BITS, exponent)
    return torch.sort(-rounded, dim=-1, stable=True).indices[..., :count].sort(dim=-1).values


def kept_sets(press, module, kwargs: dict, output, keys, values, kept: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per KV head, the positions the press keeps (``ScorerPress.compress``: ``topk`` of its scores)
    and those the harness's rule keeps from the same scores; for ObservedAttention the rule ranks
    H2O's sum (the press's mean times the number of queries that saw the token)."""
    import kvpress

    scores = press.score(module, kwargs["hidden_states"], keys, values, output[1], kwargs)[0]
    ours = scores
    if isinstance(press, kvpress.ObservedAttentionPress):
        tokens = keys.shape[2]
        ours = scores * torch.arange(tokens, 0, -1, dtype=scores.dtype)
    theirs = scores.topk(kept, dim=-1).indices.sort(dim=-1).values
    return theirs, harness_rule(ours, kept)


def ranking(jobs: dict, out_file: Path) -> int:
    """The ranking diagnostic (no decoding): per compressed cell and sample that was cut, how many
    (layer, KV head) kept sets the harness's rule would choose differently from kvpress's scores;
    on the prefill of what the press compresses (the prompt, or the sample's context)."""
    done = set()
    if out_file.exists():
        done = {(row["cell"], row["id"]) for row in map(json.loads, out_file.read_text().splitlines())}
    implementations = sorted({"eager" if cell["press"] in EAGER_PRESSES else "sdpa" for cell in jobs["cells"]})
    models = {name: load_model(jobs["model_path"], name) for name in implementations}
    started = time.perf_counter()
    with out_file.open("a") as out, torch.inference_mode():
        for number, sample in enumerate(jobs["samples"], 1):
            prompt, whole = compressed_part(sample)
            for implementation, model in models.items():
                cells = [cell for cell in jobs["cells"] if cell.get("kept") and cell["kept"][sample["id"]] < len(prompt)
                         and (cell["name"], sample["id"]) not in done
                         and ("eager" if cell["press"] in EAGER_PRESSES else "sdpa") == implementation]
                if not cells:
                    continue
                kvzip = [cell for cell in cells if cell["press"] in RECONSTRUCTING]
                if kvzip:  # KVzip: kvpress's kept sets come from its own masks on the shared reconstruction
                    shared = reconstructions_for(model, require_boundary(sample, kvzip), kvzip)
                    for cell in kvzip:
                        press = make_press(cell["press"], cell["press_ratio"][sample["id"]], cell.get("options", {}))
                        try:
                            _, masks = shared[options_key(cell)].compressed_cache(press)
                        finally:
                            clear_masks(model)
                        row = kvzip_ranking_row(shared[options_key(cell)].scores, masks, cell["kept"][sample["id"]],
                                                press.n_sink)
                        out.write(json.dumps({"cell": cell["name"], "id": sample["id"], **row}) + "\n")
                        out.flush()
                    cells = [cell for cell in cells if cell["press"] not in RECONSTRUCTING]
                    if not cells:
                        continue
                prefill = Prefill(model, prompt, lm_head=whole)
                for cell in cells:
                    kept = cell["kept"][sample["id"]]
                    press = make_press(cell["press"], cell["press_ratio"][sample["id"]], cell.get("options", {}))
                    heads = differing_heads = differing_tokens = 0
                    with press(model):
                        for index, layer in enumerate(model.model.layers):
                            kwargs, output = prefill.calls[index]
                            theirs, ours = kept_sets(press, layer.self_attn, kwargs, output, prefill.keys[index],
                                                     prefill.values[index], kept)
                            for a, b in zip(theirs, ours):
                                heads += 1
                                shared = len(set(a.tolist()) & set(b.tolist()))
                                differing_heads += shared != kept
                                differing_tokens += kept - shared
                    out.write(json.dumps({"cell": cell["name"], "id": sample["id"], "heads": heads,
                                          "heads_differing": differing_heads, "tokens_differing": differing_tokens}) + "\n")
                    out.flush()
                del prefill
            print(f"[kvpress ranking] sample {number}/{len(jobs['samples'])}: {time.perf_counter() - started:.0f}s so far",
                  flush=True)
    return 0


# --- KVzip (issue 50): KVzipPress on the harness's ids ------------------------------------------------

KVZIP_POSTFIX = 8  # ids of the previous chunk a later pass's repeat prompt ends with (``prepare``'s prev_postfix_size)


def head_pruned(context_tokens: int, ratio: float) -> int:
    """How many of each (layer, KV head)'s ``context_tokens`` the head-uniform KVzip prunes at
    ``ratio``: all but what kvpress keeps of ``context_tokens`` at that ratio (``compute_n_kept``,
    ``max(1, int(n * (1 - ratio)))``), so the driver's per-head ``press_ratio`` gives every head the
    harness's count. 0 when nothing is cut."""
    if ratio <= 0:
        return 0
    return context_tokens - max(1, int(context_tokens * (1 - ratio)))


@functools.cache
def head_uniform_kvzip():
    """``KVzipPress`` with every (layer, KV head) keeping the same number of context tokens: the
    harness's level (the authors' ``pair-uniform``). kvpress 0.5.5 has no such option: its default
    (``layerwise=False``) prunes the lowest scores over every layer, head and token at once, and
    ``layerwise=True`` the lowest of each layer over its heads together, so either way the count per
    head is free. Everything but the selection is ``KVzipPress``'s own (chat header and footer,
    repeat prompts, passes, ``score_val``, the sinks' score, masking by fake keys); only
    ``compress_post`` differs: each head's ``head_pruned`` lowest scores are masked."""
    import kvpress

    class HeadUniformKVzipPress(kvpress.KVzipPress):
        def compress_post(self, model):
            if self.compression_ratio <= 0:
                return
            scores = self.score_val  # [layers, batch, kv_heads, context]
            # the sinks: above every score, as KVzipPress.compress_post sets them
            scores[..., :self.n_sink] = scores.amax() + 1.0
            _, batch, heads, context = scores.shape
            pruned = head_pruned(context, self.compression_ratio)
            for layer in model.model.layers:
                module = layer.self_attn
                if module.config._attn_implementation == "eager":
                    raise RuntimeError("KVzipPress masks by fake keys, which eager attention does not read")
                lowest = torch.topk(-scores[int(module.layer_idx)], pruned, dim=-1).indices  # [batch, heads, pruned]
                batches = torch.arange(batch).view(batch, 1, 1).expand_as(lowest).reshape(-1)
                head_ids = torch.arange(heads).view(1, heads, 1).expand_as(lowest).reshape(-1)
                module.masked_key_indices = (batches, head_ids, lowest.reshape(-1))

    return HeadUniformKVzipPress


def repeat_inputs(context: list[int], reconstruction: dict, chunk_size: int,
                  postfix: int = KVZIP_POSTFIX) -> list[tuple[int, int, list[int]]]:
    """Each reconstruction pass of ``context`` from the harness's reconstruction ids
    (``prefix_tokens``, ``first``, ``later``, ``suffix``; ``harness.tasks.prompts.reconstruction``):
    the ``[start, end)`` it repeats and its input ids, as KVzipPress 0.5.5 builds them (``prepare``,
    ``kvzip_press.py`` lines 227-264): the context after its first ``prefix_tokens`` in
    ``chunk_size`` pieces; the first after ``first + suffix``, every later one after ``later``, the
    previous piece's last ``postfix`` ids and ``suffix``. What the press's own ids must equal
    (``check_reconstruction_ids``)."""
    prefix = reconstruction["prefix_tokens"]
    passes, previous = [], None
    for start in range(prefix, len(context), chunk_size):
        end = min(start + chunk_size, len(context))
        piece = list(context[start:end])
        lead = (list(reconstruction["first"]) if previous is None
                else list(reconstruction["later"]) + (previous[-postfix:] if postfix else []))
        passes.append((start, end, lead + list(reconstruction["suffix"]) + piece))
        previous = piece
    return passes


def check_reconstruction_ids(seen: dict, context: list[int], reconstruction: dict, chunk_size: int) -> None:
    """The ids KVzipPress built its passes from (``seen``: its ``prefix_length``, its footer ids and
    each pass's input, read while it ran) against the harness's (``reconstruction``): refused unless
    equal, so both sides repeat the same ids after the same header."""
    expected = repeat_inputs(context, reconstruction, chunk_size)
    problems = []
    if seen["prefix"] != reconstruction["prefix_tokens"]:
        problems.append(f"chat header of {seen['prefix']} tokens, the harness's {reconstruction['prefix_tokens']}")
    if seen["suffix"] != list(reconstruction["suffix"]):
        problems.append(f"footer {seen['suffix']}, the harness's {list(reconstruction['suffix'])}")
    if seen["passes"] != [ids for _, _, ids in expected]:
        problems.append(f"{len(seen['passes'])} pass(es) whose ids differ from the harness's {len(expected)}")
    if problems:
        raise RuntimeError("KVzipPress built other reconstruction ids than the harness: " + "; ".join(problems))


def clear_masks(model) -> None:
    """Drop every layer's ``masked_key_indices`` (kvpress's fake-key masking, ``attention_patch.py``):
    they stay on the module until a prefill-shaped call, so the next cell's question pass on the
    same model would otherwise be masked by this cell's choice."""
    for layer in model.model.layers:
        layer.self_attn.masked_key_indices = None


def kept_mask(masked, heads: int, context: int) -> torch.Tensor:
    """``[heads, context]`` True where a (KV head, position) is kept: not among a layer's
    ``masked_key_indices`` (batch, head, position; None: nothing masked)."""
    keep = torch.ones(heads, context, dtype=torch.bool)
    if masked is not None:
        _, head, position = masked
        keep[head.long(), position.long()] = False
    return keep


def kept_per_head(masked: list, heads: int, context: int) -> torch.Tensor:
    """``[layers, heads]``: the context tokens each (layer, KV head) keeps after a masking press
    (``masked``: each layer's ``masked_key_indices``). The cache still holds all ``context`` slots
    (kvpress's fake compression); these are the ones attention can read."""
    return torch.stack([kept_mask(indices, heads, context).sum(-1) for indices in masked])


def with_sinks(scores: torch.Tensor, n_sink: int) -> torch.Tensor:
    """A copy of ``score_val`` with its first ``n_sink`` tokens above every score (kvpress's and
    the harness's sinks rule: ``amax + 1``)."""
    scores = scores.clone()
    if n_sink:
        scores[..., :n_sink] = scores.amax() + 1.0
    return scores


def kvzip_ranking_row(scores: torch.Tensor, masked: list, kept: int, n_sink: int) -> dict:
    """The ranking diagnostic for a KVzip cell: per (layer, KV head), the context tokens the press
    kept (its ``masked_key_indices``' complement) against the ``kept`` the harness's rule keeps from
    the same ``score_val`` (``[layers, 1, heads, context]``, as ``compress_post`` received it; sinks
    raised first, as both do); with the spread of the press's kept counts per head (the default
    KVzipPress chooses them globally; the head-uniform one keeps ``kept`` everywhere)."""
    scores = with_sinks(scores, n_sink)
    layers, _, heads, context = scores.shape
    counted = differing_heads = differing_tokens = 0
    counts = []
    for layer in range(layers):
        keep = kept_mask(masked[layer], heads, context)
        ours = harness_rule(scores[layer, 0], kept)
        for head in range(heads):
            theirs = set(keep[head].nonzero().flatten().tolist())
            mine = set(ours[head].tolist())
            counted += 1
            differing_heads += theirs != mine
            differing_tokens += len(mine - theirs)
            counts.append(len(theirs))
    return {"heads": counted, "heads_differing": differing_heads, "tokens_differing": differing_tokens,
            "kept_min": min(counts), "kept_max": max(counts)}


class Reconstructed:
    """One sample's context prefilled and reconstructed once by a KVzip press, as kvpress's
    pipeline runs it (``with press(model):`` the context through the backbone; on leaving, KVzipPress
    runs its repeat passes on that cache, each layer's hook scoring and cutting the pass's own K/V
    off, then ``compress_post``): the context's cache and the press's ``score_val`` as
    ``compress_post`` received it. The ids the press built its passes from are read while it runs
    and checked against the harness's (``check_reconstruction_ids``).

    A cell's press then selects through its own ``compress_post`` on a copy of those scores
    (``compressed_cache``): the scores depend on the context and the options (n_sink, chunk_size)
    alone, the ratio and the selection only on ``compress_post``. So every KVzip cell of a sample
    with the same options shares one reconstruction, as the other presses share one ``Prefill``;
    ``check_reconstruction_shared`` compares that with each press's own whole run on the first
    sample."""

    def __init__(self, model, context: list[int], press, reconstruction: dict | None = None):
        self.model = model
        self.context = context
        seen = {}
        prepare, compress_post = press.prepare, press.compress_post

        def reading_prepare(model_, tokenizer, *args, **kwargs):
            pairs = prepare(model_, tokenizer, *args, **kwargs)
            seen.update(prefix=int(press.prefix_length), suffix=press._suffix_ids[0].tolist(),
                        passes=[ids[0].tolist() for _, ids in pairs])
            return pairs

        def reading_compress_post(model_):
            seen["scores"] = press.score_val.clone()
            return compress_post(model_)

        press.prepare, press.compress_post = reading_prepare, reading_compress_post
        cache = DynamicCache()
        try:
            with press(model):
                prefill_pass(model, context, cache, lm_head=False)
            self.own_masks = [getattr(layer.self_attn, "masked_key_indices", None) for layer in model.model.layers]
        finally:
            clear_masks(model)
            del press.prepare, press.compress_post
        if "scores" not in seen:
            raise RuntimeError("KVzipPress ran no reconstruction (a compression ratio of 0?)")
        self.scores = seen["scores"]
        self.keys = [layer.keys for layer in cache.layers]
        self.values = [layer.values for layer in cache.layers]
        if any(keys.shape[2] != len(context) for keys in self.keys):
            raise RuntimeError("KVzipPress left the repeat passes' K/V in the cache")
        if reconstruction is not None:
            check_reconstruction_ids(seen, context, reconstruction, press.chunk_size)
        self.passes = len(seen["passes"])

    def compressed_cache(self, press) -> tuple[DynamicCache, list]:
        """A fresh copy of the context's cache, and ``press``'s choice on it: its ``compress_post`` on a
        copy of the scores leaves each layer's ``masked_key_indices`` on the model (returned too;
        ``clear_masks`` after the cell)."""
        cache = DynamicCache()
        for index, (keys, values) in enumerate(zip(self.keys, self.values)):
            cache.update(keys.clone(), values.clone(), index)
        press.score_val = self.scores.clone()
        press.compress_post(self.model)
        return cache, [getattr(layer.self_attn, "masked_key_indices", None) for layer in self.model.model.layers]


def check_reconstruction_shared(model, context: list[int], cell: dict, ratio: float, shared: Reconstructed) -> str:
    """A KVzip cell's choice from the shared reconstruction against its press's own whole run on the
    same context (``Reconstructed`` with that press): "exact" when every (layer, KV head) keeps the
    same tokens and the caches are equal, else what differs."""
    own = Reconstructed(model, context, make_press(cell["press"], ratio, cell.get("options", {})))
    try:
        _, masks = shared.compressed_cache(make_press(cell["press"], ratio, cell.get("options", {})))
        heads, size = shared.scores.shape[2], len(context)
        differ = sum(int((kept_mask(a, heads, size) != kept_mask(b, heads, size)).any())
                     for a, b in zip(own.own_masks, masks))
    finally:
        clear_masks(model)
    worst = max(max((a - b).abs().max().item() for a, b in zip(own.keys, shared.keys)),
                max((a - b).abs().max().item() for a, b in zip(own.values, shared.values)))
    if differ:
        return f"{differ} layer(s) keep other tokens (cache max |difference| {worst:.3g})"
    return "exact" if worst == 0 else f"same kept sets, cache within {worst:.3g}"


def kvzip_cell(model, tokenizer, sample: dict, cell: dict, ratio: float, shared: Reconstructed, eos: set[int],
               kept: int) -> tuple[dict, dict]:
    """One KVzip cell on one sample: the press's choice on the shared reconstruction, kvpress's
    question pass and greedy decoding on the masked cache, the masks cleared after. The press keeps
    every cache slot and hides the pruned ones from attention (fake keys), so what it kept is counted
    per (layer, KV head) from its masks: the head-uniform press must keep ``kept`` in every head, the
    default one ``kept`` per head on average (its ratio is of the whole cache: the driver's
    ``cache_ratio``). Returns the decoded row's fields and the ranking diagnostic's row."""
    prompt, context = sample["prompt_token_ids"], sample["context_tokens"]
    press = make_press(cell["press"], ratio, cell.get("options", {}))
    try:
        cache, masks = shared.compressed_cache(press)
        heads = shared.scores.shape[2]
        per_head = kept_per_head(masks, heads, context)
        if cell["press"] == "kvzip_uniform" and not bool((per_head == kept).all()):
            raise RuntimeError(f"{cell['name']} {sample['id']}: heads keep {per_head.min()}..{per_head.max()} tokens, "
                               f"asked for {kept} in each")
        if int(per_head.sum()) != kept * per_head.numel():
            raise RuntimeError(f"{cell['name']} {sample['id']}: kvpress kept {int(per_head.sum())} (layer, head, token) "
                               f"entries, asked for {kept} x {per_head.numel()} (ratio {ratio})")
        logits, position = ask(model, cache, prompt, context)
        result = decode(model, tokenizer, logits, position, kept, cache, sample["max_new_tokens"], sample["stops"], eos)
    finally:
        clear_masks(model)
    result["kept_per_head"] = [int(per_head.min()), int(per_head.max())]
    rank = kvzip_ranking_row(shared.scores, masks, kept, getattr(press, "n_sink", 0))
    return result, rank


def reconstructions_for(model, sample: dict, cells: list[dict]) -> dict[str, Reconstructed]:
    """One ``Reconstructed`` per distinct press options among a sample's KVzip ``cells`` (keyed by
    ``options_key``), each run by the first such cell's press and checked against its ids."""
    shared = {}
    for cell in cells:
        key = options_key(cell)
        if key not in shared:
            ratio = cell["press_ratio"][sample["id"]]
            shared[key] = Reconstructed(model, sample["prompt_token_ids"][:sample["context_tokens"]],
                                        make_press(cell["press"], ratio, cell.get("options", {})),
                                        cell["reconstruction"][sample["id"]])
    return shared


def options_key(cell: dict) -> str:
    return json.dumps(cell.get("options", {}), sort_keys=True)


def compressed_part(sample: dict) -> tuple[list[int], bool]:
    """The token ids a sample's press compresses (its context where it has a boundary, else its
    whole prompt) and whether that is the whole prompt."""
    prompt, boundary = sample["prompt_token_ids"], sample.get("context_tokens")
    return (prompt, True) if boundary is None else (prompt[:boundary], False)


def require_boundary(sample: dict, cells: list[dict]) -> dict:
    """KVzip reconstructs a context before its question (kvpress's default pipeline): refused for a
    sample without a boundary (``--compress prompt``)."""
    if sample.get("context_tokens") is None:
        raise RuntimeError(f"{sample['id']}: {[cell['name'] for cell in cells]} reconstruct a context before its "
                           "question; this sample has no boundary (run them with --compress context)")
    for cell in cells:
        if not cell["press_ratio"][sample["id"]] > 0:
            raise RuntimeError(f"{cell['name']} {sample['id']}: nothing to cut (kept {cell['kept'][sample['id']]} of "
                               f"{sample['context_tokens']} context tokens); a KVzip cell must compress")
    return sample


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--ranking":
        transformers_logging.disable_progress_bar()
        return ranking(json.loads(Path(argv[1]).read_text()), Path(argv[2]))
    # JOBS OUT [RANKING]: KVzip cells write their ranking rows (their kept sets come with decoding) to RANKING.
    jobs_file, out_file, *rest = map(Path, argv)
    ranking_file = rest[0] if rest else None
    jobs = json.loads(jobs_file.read_text())
    torch.manual_seed(0)
    transformers_logging.disable_progress_bar()
    if jobs.get("threads"):
        torch.set_num_threads(int(jobs["threads"]))
    tokenizer = AutoTokenizer.from_pretrained(jobs["model_path"])
    eos = {int(t) for t in ([jobs["eos_token_id"]] if isinstance(jobs["eos_token_id"], int) else jobs["eos_token_id"])}
    done = set()
    if out_file.exists():  # resume: cells x samples already written stay
        for line in out_file.read_text().splitlines():
            row = json.loads(line)
            done.add((row["cell"], row["id"]))
    ranked = set()
    if ranking_file is not None and ranking_file.exists():
        ranked = {(row["cell"], row["id"]) for row in map(json.loads, ranking_file.read_text().splitlines())}
    versions_file = out_file.parent / "versions.json"
    previous = json.loads(versions_file.read_text()) if versions_file.exists() else {}
    versions = {"kvpress": version("kvpress"), "transformers": version("transformers"), "torch": torch.__version__}
    versions_file.write_text(json.dumps(versions, indent=1))
    started = time.perf_counter()
    implementations = sorted({"eager" if cell["press"] in EAGER_PRESSES else "sdpa" for cell in jobs["cells"]})
    models = {name: load_model(jobs["model_path"], name) for name in implementations}
    checks = {}
    if jobs.get("check_shared_prefill", True) and jobs["samples"]:
        first, whole = compressed_part(jobs["samples"][0])
        pending = {cell["press"]: cell for cell in jobs["cells"] if cell["press"] != "no_press"
                   and any((cell["name"], s["id"]) not in done for s in jobs["samples"])}
        # presses with nothing left to run keep the check their run recorded
        checks = {press: check for press, check in (previous.get("shared_prefill_check") or {}).items()
                  if press not in pending and any(cell["press"] == press for cell in jobs["cells"])}
        for cell in pending.values():
            model = models["eager" if cell["press"] in EAGER_PRESSES else "sdpa"]
            if cell["press"] in RECONSTRUCTING:
                sample = require_boundary(jobs["samples"][0], [cell])
                ratio = cell["press_ratio"][sample["id"]]
                shared = reconstructions_for(model, sample, [cell])[options_key(cell)]
                checks[cell["press"]] = check_reconstruction_shared(model, first, cell, ratio, shared)
                continue
            checks[cell["press"]] = check_shared_prefill(model, first, make_press(cell["press"], 0.5,
                                                                                  cell.get("options", {})), whole)
        print(f"[kvpress] shared prefill vs kvpress's hooked prefill, per press: {checks} "
              f"({time.perf_counter() - started:.0f}s)", flush=True)
        versions["shared_prefill_check"] = checks
        versions_file.write_text(json.dumps(versions, indent=1))
    ranks = ranking_file.open("a") if ranking_file is not None else None
    try:
        with out_file.open("a") as out, torch.inference_mode():
            for number, sample in enumerate(jobs["samples"], 1):
                run_sample(models, tokenizer, sample, jobs["cells"], done, ranked, eos, out, ranks)
                print(f"[kvpress] sample {number}/{len(jobs['samples'])} ({len(sample['prompt_token_ids'])} tokens): "
                      f"{time.perf_counter() - started:.0f}s so far", flush=True)
    finally:
        if ranks is not None:
            ranks.close()
    return 0


def run_sample(models: dict, tokenizer, sample: dict, all_cells: list[dict], done: set, ranked: set, eos: set[int],
               out, ranks) -> None:
    """Every cell of one sample not yet written: the shared prefill's presses, then the KVzip ones
    on their shared reconstruction (their ranking rows to ``ranks`` where given)."""
    prompt = sample["prompt_token_ids"]
    compressed, whole = compressed_part(sample)  # with a boundary: the context, then the question
    for implementation, model in models.items():
        cells = [cell for cell in all_cells if (cell["name"], sample["id"]) not in done
                 and ("eager" if cell["press"] in EAGER_PRESSES else "sdpa") == implementation]
        if not cells:
            continue
        boundary = {} if whole else {"context_tokens": len(compressed)}
        shared_cells = [cell for cell in cells if cell["press"] not in RECONSTRUCTING]
        prefill = Prefill(model, compressed, lm_head=whole) if shared_cells else None
        for cell in shared_cells:
            kept = cell["kept"][sample["id"]] if cell.get("kept") else len(compressed)
            # The driver's ratio for this sample (experiments/kvpress_parity.press_ratio), else ours.
            ratio = (cell["press_ratio"][sample["id"]] if cell.get("press_ratio")
                     else press_ratio(kept, len(compressed)))
            press = make_press(cell["press"], ratio, cell.get("options", {})) if ratio > 0 else None
            cache = prefill.compressed_cache(press)
            cached = cache.get_seq_length()
            logits, position = ((prefill.first_logits, len(prompt)) if whole
                                else ask(model, cache, prompt, len(compressed)))
            result = decode(model, tokenizer, logits, position, cached, cache, sample["max_new_tokens"],
                            sample["stops"], eos)
            if result["kept_tokens"] != kept:
                raise RuntimeError(f"{cell['name']} {sample['id']}: kvpress kept {result['kept_tokens']} "
                                   f"tokens, asked for {kept} (ratio {ratio})")
            write_row(out, cell, sample, ratio, implementation, boundary, result)
        del prefill
        kvzip = [cell for cell in cells if cell["press"] in RECONSTRUCTING]
        if not kvzip:
            continue
        shared = reconstructions_for(model, require_boundary(sample, kvzip), kvzip)
        for cell in kvzip:
            ratio = cell["press_ratio"][sample["id"]]
            result, rank = kvzip_cell(model, tokenizer, sample, cell, ratio, shared[options_key(cell)], eos,
                                      cell["kept"][sample["id"]])
            write_row(out, cell, sample, ratio, implementation, boundary,
                      {**result, "reconstruction_passes": shared[options_key(cell)].passes})
            if ranks is not None and (cell["name"], sample["id"]) not in ranked:
                ranks.write(json.dumps({"cell": cell["name"], "id": sample["id"], **rank}) + "\n")
                ranks.flush()
        del shared


def write_row(out, cell: dict, sample: dict, ratio: float, implementation: str, boundary: dict, result: dict) -> None:
    row = {"cell": cell["name"], "press": cell["press"], "ratio": cell["ratio"], "id": sample["id"],
           "task": sample["task"], "prompt_tokens": len(sample["prompt_token_ids"]), **boundary, "press_ratio": ratio,
           "attn_implementation": implementation, **result}
    out.write(json.dumps(row) + "\n")
    out.flush()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
