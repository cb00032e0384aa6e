"""The worker's KVzip passes (``harness.engine.reconstruction``) without vLLM or a checkpoint: a
small random attention model whose attention layers are stand-ins for vLLM's ``Attention`` (the
passes replace their forward), its context K/V in a paged cache at scattered blocks. The scores the
passes leave in the request's state equal an independent computation: the model run over the
whole sequence ``context + pass`` with plain causal attention, and the plain reference's rule
(``tests/support/plain_reference.kvzip_chunk_scores``) on its queries and keys; chunks, pieces
smaller than a pass, one or two layer groups, and a hybrid model's sliding-window layers (read over
their window only, never scored). Nothing of the cache is written. The worker's kept
scores (``RecentScores``) are keyed as vLLM keys its prefix cache: a LoRA, a cache salt or a
multimodal item in the context makes another context, and a prefix-cache reset empties them."""
from __future__ import annotations

from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch

from harness.engine.backend_views import FlashAttnView
from harness.engine.reconstruction import Reconstruction, pass_attention
from harness.eviction.settings import EvictionSettings
from harness.eviction.shards import SINGLE
from harness.eviction.state import PolicyState
from policies import make_policy
from tests.support.plain_reference import Repeat, kvzip_chunk_scores

LAYERS, HEADS, KV_HEADS, DIM, VOCAB, BLOCK = 4, 4, 2, 8, 50, 8
SCALE = DIM ** -0.5


def cached_request(prompt: list[int], block_ids: tuple, computed: int = 0, lora=None, mm_features=(), embeds=None):
    """A request as vLLM's runner keeps it (``CachedRequestState``, vllm/v1/worker/gpu_input_batch.py:35):
    the passes read its ids, blocks and computed count; its LoRA, multimodal items and prompt
    embeddings decide the key of its kept scores."""
    from vllm.v1.worker.gpu_input_batch import CachedRequestState

    return CachedRequestState(req_id="r", prompt_token_ids=prompt, mm_features=list(mm_features), sampling_params=None,
                              generator=None, block_ids=block_ids, num_computed_tokens=computed, output_token_ids=[],
                              lora_request=lora, prompt_embeds=embeds)


class StandIn(torch.nn.Module):
    """What the passes read of vLLM's ``Attention``: head counts and sizes; its own forward must
    never run during them."""

    def __init__(self, sliding_window: int | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_size, self.head_size_v = HEADS, KV_HEADS, DIM, DIM
        self.sliding_window = sliding_window  # (vLLM's Attention has it: attention.py:339)

    def forward(self, *args, **kwargs):
        raise AssertionError("the passes replace every attention layer's forward")


class TinyModel(torch.nn.Module):
    """Embedding plus a learned position embedding (positions matter), then per layer q/k/v
    projections, attention through the stand-in and a residual output projection."""

    def __init__(self, seed: int = 0, windows: tuple = (None,) * LAYERS):
        super().__init__()
        self.windows = windows  # each layer's sliding window (None: full attention)
        gen = torch.Generator().manual_seed(seed)
        hidden = HEADS * DIM
        self.embed = torch.randn(VOCAB, hidden, generator=gen) * 0.5
        self.position = torch.randn(256, hidden, generator=gen) * 0.5
        self.weights = [[torch.randn(hidden, n, generator=gen) * 0.3 for n in (HEADS * DIM, KV_HEADS * DIM,
                                                                             KV_HEADS * DIM, hidden)]
                        for _ in range(LAYERS)]
        self.attn = torch.nn.ModuleList(StandIn(window) for window in windows)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        x = self.embed[input_ids.long()] + self.position[positions]
        for layer, (wq, wk, wv, wo) in enumerate(self.weights):
            x = x + self.attn[layer](x @ wq, x @ wk, x @ wv) @ wo
        return x

    def whole(self, ids: list[int]):
        """The independent computation: every layer's queries ``[T, heads, dim]``, keys and values
        ``[kv heads, T, dim]`` of the whole sequence under plain causal attention (a sliding-window
        layer's: each query over the last ``window`` positions, its own included)."""
        t = len(ids)
        x = self.embed[torch.tensor(ids)] + self.position[torch.arange(t)]
        out = []
        for (wq, wk, wv, wo), window in zip(self.weights, self.windows):
            hidden = torch.ones(t, t, dtype=torch.bool).triu(1)
            if window is not None:
                hidden |= torch.ones(t, t, dtype=torch.bool).tril(-window)
            q = (x @ wq).view(t, HEADS, DIM)
            k = (x @ wk).view(t, KV_HEADS, DIM).transpose(0, 1)
            v = (x @ wv).view(t, KV_HEADS, DIM).transpose(0, 1)
            heads = []
            for h in range(HEADS):
                kv = h * KV_HEADS // HEADS
                logits = q[:, h] @ k[kv].T * SCALE
                logits = logits.masked_fill(hidden, float("-inf"))
                heads.append(torch.softmax(logits, dim=-1) @ v[kv])
            out.append((q, k, v))
            x = x + torch.stack(heads, dim=1).reshape(t, -1) @ wo
        return out


def test_pass_attention_equals_plain_causal_attention():
    """A pass's attention over a context of 9 and its own 6 tokens, given as its last 4 queries
    with all 6 own keys, equals plain causal attention over the 15 tokens (rows 11..14)."""
    gen = torch.Generator().manual_seed(1)
    keys, values = torch.randn(15, KV_HEADS, DIM, generator=gen), torch.randn(15, KV_HEADS, DIM, generator=gen)
    queries = torch.randn(15, HEADS, DIM, generator=gen)
    got = pass_attention(queries[11:], keys[:9], values[:9], keys[9:], values[9:], SCALE, tile=3)
    want = []
    for h in range(HEADS):
        kv = h * KV_HEADS // HEADS
        logits = queries[:, h] @ keys[:, kv].T * SCALE
        logits = logits.masked_fill(torch.ones(15, 15, dtype=torch.bool).triu(1), float("-inf"))
        want.append(torch.softmax(logits, dim=-1) @ values[:, kv])
    torch.testing.assert_close(got, torch.stack(want, dim=1)[11:], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("chunk, piece", [(2048, 64), (9, 64), (9, 5)], ids=["one_chunk", "chunks", "pieces"])
def test_the_passes_leave_the_scores_of_an_independent_computation(groups, chunk, piece):
    gen = torch.Generator().manual_seed(chunk + piece)
    prefix, first, later, suffix = 5, [1, 2, 3], [4, 5], [6, 7]
    context = torch.randint(8, VOCAB, (29,), generator=gen).tolist()
    c = len(context)
    model = TinyModel()
    # The context's K/V in a paged cache, its blocks scattered
    blocks = [6, 1, 4, 0]
    per_group = LAYERS // groups
    caches = [torch.zeros(8, KV_HEADS, BLOCK, 2 * DIM) for _ in range(LAYERS)]
    views = [FlashAttnView(caches[g * per_group:(g + 1) * per_group]) for g in range(groups)]
    table = torch.tensor(blocks)
    positions = torch.arange(c)
    for layer, (_, k, v) in enumerate(model.whole(context)):
        view = views[layer // per_group]
        view.write_layer(layer % per_group, table[positions // BLOCK], positions % BLOCK,
                         k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous())
    before = [cache.clone() for cache in caches]

    runner = SimpleNamespace(device=torch.device("cpu"), model=model, vllm_config=None,
                             scheduler_config=SimpleNamespace(max_num_batched_tokens=piece))
    passes = Reconstruction(runner, list(model.attn), [SCALE] * LAYERS, views,
                            [list(range(g * per_group, (g + 1) * per_group)) for g in range(groups)], SINGLE,
                            forward_context=lambda tokens: nullcontext())
    settings = EvictionSettings("kvzip", 16, decode_eviction=False, compress="context", context_tokens=c,
                                reconstruction={"prefix_tokens": prefix, "first": first, "later": later,
                                                "suffix": suffix})
    policies = (make_policy("kvzip", 16, BLOCK, chunk_size=chunk),) * groups
    states = [PolicyState() for _ in range(groups)]
    request = cached_request(context + [9, 10, 11], tuple([blocks] * groups))
    done = passes.run("r", request, settings, policies, states)

    want = torch.zeros(LAYERS, KV_HEADS, c)
    repeat = Repeat(prefix, first, later, suffix, chunk)
    for ids, start, end in repeat.passes(context):
        for layer, (q, k, _) in enumerate(model.whole(context + ids)):
            want[layer, :, start:end] = kvzip_chunk_scores(q[c:], k, start, end, SCALE)
    want[..., :4] = want.max() + 1
    got = torch.cat([states[g].scores["r"] for g in range(groups)])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert (got[..., 4:prefix] == 0).all()  # the header after the sinks is never repeated
    assert done.tokens == sum(len(ids) for ids, _, _ in repeat.passes(context))
    for cache, old in zip(caches, before):
        assert torch.equal(cache, old)  # the passes wrote nothing to the paged cache
    with pytest.raises(AssertionError, match="replace every"):
        model.attn[0](None, None, None)  # each layer's own forward is back


def test_the_worker_runs_the_passes_of_the_requests_due_and_fails_only_a_broken_one():
    """``worker_patch.reconstruct_due``: of three KVzip requests in a step, the one whose prefill
    reaches its eviction point runs its passes (its scores in the state, their tokens counted), the
    one still prefilling runs none, and one that evicted before its eviction point (which KVzip
    cannot reconstruct) fails alone, with the reason, leaving no scores."""
    from harness.engine.worker_patch import reconstruct_due
    from harness.eviction.messages import PLAN_ATTRIBUTE, EvictionPlan

    context = torch.randint(8, VOCAB, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    c = len(context)
    model = TinyModel()
    cache = [torch.zeros(8, KV_HEADS, BLOCK, 2 * DIM) for _ in range(LAYERS)]
    view = FlashAttnView(cache)
    runner = SimpleNamespace(device=torch.device("cpu"), model=model, vllm_config=None,
                             scheduler_config=SimpleNamespace(max_num_batched_tokens=64))
    settings = EvictionSettings("kvzip", 16, decode_eviction=False, compress="context", context_tokens=c,
                                reconstruction={"prefix_tokens": 2, "first": [1, 2], "later": [3], "suffix": [4]})
    policies = (make_policy("kvzip", 16, BLOCK, chunk_size=16),)
    state = SimpleNamespace(
        reconstruction=Reconstruction(runner, list(model.attn), [SCALE] * LAYERS, [view], [list(range(LAYERS))],
                                      SINGLE, forward_context=lambda tokens: nullcontext()),
        policy_for=lambda s: policies, settings_of=lambda rid, s: s, groups=1, policy_states=[PolicyState()])
    requests = {rid: cached_request(context + [5, 6], ([0, 1, 2, 3, 4],), done)
                for rid, done in (("due", 20), ("early", 0), ("broken", 20))}
    plan = EvictionPlan(None, {rid: settings for rid in requests}, evicted_tokens={"broken": (8,)})
    step = SimpleNamespace(num_scheduled_tokens={"due": c - 20, "early": 10, "broken": c - 20})
    step.__dict__[PLAN_ATTRIBUTE] = plan
    failures = {}
    done = reconstruct_due(SimpleNamespace(requests=requests), state, step, failures)
    assert set(state.policy_states[0].scores) == {"due"}
    assert state.policy_states[0].scores["due"].shape == (LAYERS, KV_HEADS, c)
    assert done.tokens == sum(len(ids) for ids, _, _ in Repeat(2, [1, 2], [3], [4], 16).passes(context))
    assert set(failures) == {"broken"} and "8 of its tokens were evicted" in str(failures["broken"])


def test_a_context_scored_before_takes_its_scores_and_runs_no_pass():
    """The worker keeps recent contexts' scores (``RecentScores``): a second request about the same
    context, with the same reconstruction ids and chunk size, gets equal scores (its own copy) and runs
    no pass; another chunk size runs its passes; the oldest context goes when the bytes run out."""
    from harness.engine.reconstruction import RecentScores

    worker, context, blocks, settings = written_context()

    def run(request_id: str, question: list[int], chunk: int):
        request = cached_request(context + question, (blocks,))
        states = [PolicyState()]
        done = worker.run(request_id, request, settings, (make_policy("kvzip", 16, BLOCK, chunk_size=chunk),), states)
        return done, states[0].scores[request_id]

    first, scores = run("a", [9, 10], 9)
    again, same = run("b", [11, 12, 13], 9)
    assert first.tokens > 0 and first.reused == 0
    assert again.tokens == 0 and again.reused == 1
    assert torch.equal(same, scores) and same.data_ptr() != scores.data_ptr()
    other, _ = run("c", [9, 10], 2048)
    assert other.tokens > 0 and other.reused == 0

    recent = RecentScores(limit=2 * 4 * 10)  # two entries of ten float32s
    for key in "xyz":
        recent.put(key, [torch.zeros(10)])
    assert list(recent.entries) == ["y", "z"] and recent.held == 80
    assert recent.get("x", "cpu") is None and torch.equal(recent.get("y", "cpu")[0], torch.zeros(10))
    recent.put("big", [torch.zeros(100)])  # larger than the whole limit: not kept
    assert list(recent.entries) == ["z", "y"]


def written_context(seed: int = 5):
    """A worker (its passes' ``Reconstruction``) whose paged cache holds a 29-token context's K/V,
    the context, its blocks and KVzip settings over it."""
    context = torch.randint(8, VOCAB, (29,), generator=torch.Generator().manual_seed(seed)).tolist()
    c, blocks = len(context), [3, 0, 2, 1]
    model = TinyModel()
    view = FlashAttnView([torch.zeros(8, KV_HEADS, BLOCK, 2 * DIM) for _ in range(LAYERS)])
    table, positions = torch.tensor(blocks), torch.arange(c)
    for layer, (_, k, v) in enumerate(model.whole(context)):
        view.write_layer(layer, table[positions // BLOCK], positions % BLOCK, k.transpose(0, 1).contiguous(),
                         v.transpose(0, 1).contiguous())
    runner = SimpleNamespace(device=torch.device("cpu"), model=model, vllm_config=None,
                             scheduler_config=SimpleNamespace(max_num_batched_tokens=64))
    worker = Reconstruction(runner, list(model.attn), [SCALE] * LAYERS, [view], [list(range(LAYERS))], SINGLE,
                            forward_context=lambda tokens: nullcontext())
    settings = EvictionSettings("kvzip", 16, decode_eviction=False, compress="context", context_tokens=c,
                                reconstruction={"prefix_tokens": 5, "first": [1, 2, 3], "later": [4, 5],
                                                "suffix": [6, 7]})
    return worker, context, blocks, settings


def test_a_lora_a_cache_salt_or_an_image_in_the_context_never_shares_another_context_s_scores():
    """Two requests share kept scores only where vLLM would give their contexts the same cached
    blocks (``score_key``): same ids and no LoRA, salt or image share; a LoRA request with the same
    context ids as a base request runs its own passes (and a second request with the same adapter
    takes those), as does another adapter, a cache salt, or an image inside the context; an image
    after the context, in the question, changes nothing of it."""
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    from harness.engine.reconstruction import score_key

    worker, context, blocks, settings = written_context()
    c = len(context)
    policies = (make_policy("kvzip", 16, BLOCK, chunk_size=9),)
    lora, other_lora = LoRARequest("adapter", 1, "/adapters/a"), LoRARequest("adapter-b", 2, "/adapters/b")

    def image(offset: int, identifier: str = "image-hash"):
        return MultiModalFeatureSpec(data=None, modality="image", identifier=identifier,
                                     mm_position=PlaceholderRange(offset=offset, length=4))

    def run(salt=None, **inputs):
        request = cached_request(context + [9, 10, 11, 12, 13, 14], (blocks,), **inputs)
        states = [PolicyState()]
        done = worker.run("r", request, settings, policies, states, cache_salt=salt)
        return done.reused, score_key(request, c, settings.reconstruction, policies[0].score, salt), states[0].scores["r"]

    base_reused, base_key, base_scores = run()
    assert not base_reused
    assert run()[0] == 1
    lora_reused, lora_key, lora_scores = run(lora=lora)
    assert not lora_reused and lora_key != base_key
    assert run(lora=LoRARequest("adapter", 1, "/adapters/a"))[0] == 1  # the same adapter: its own entry
    assert not run(lora=other_lora)[0]
    assert not run(salt="tenant-a")[0] and run(salt="tenant-a")[0] == 1 and not run(salt="tenant-b")[0]
    assert not run(mm_features=[image(3)])[0]
    assert not run(mm_features=[image(3, "another-image")])[0]
    assert run(mm_features=[image(c + 1)])[0] == 1  # after the context: the base request's scores
    # the tiny model has no adapter: the LoRA request's passes computed the base's scores again
    torch.testing.assert_close(lora_scores, base_scores)
    assert len(worker.recent.entries) == 7


def test_a_prompt_given_as_embeddings_is_refused_its_passes():
    """The passes repeat the context by its ids; a prompt given as embeddings has none: the request
    fails with the reason (``reconstruct_due`` ends it, not the step)."""
    worker, context, blocks, settings = written_context()
    request = cached_request(None, (blocks,), embeds=torch.zeros(len(context) + 4, HEADS * DIM))
    with pytest.raises(ValueError, match="given as embeddings"):
        worker.run("r", request, settings, (make_policy("kvzip", 16, BLOCK, chunk_size=9),), [PolicyState()])


def test_a_prefix_cache_reset_empties_the_kept_scores_before_the_next_request_reads_them():
    """The scheduler counts its prefix-cache resets in the plan (``EvictionPlan.prefix_cache_resets``,
    weights may have changed with one) and its requests' cache salts (``cache_salts``, which the
    worker's request state lacks); ``reconstruct_due`` drops every kept score once the count moves,
    so the request after a reset runs its passes again, and it keys scores by the plan's salt."""
    from harness.engine.worker_patch import reconstruct_due
    from harness.eviction.messages import PLAN_ATTRIBUTE, EvictionPlan

    worker, context, blocks, settings = written_context()
    c = len(context)
    policies = (make_policy("kvzip", 16, BLOCK, chunk_size=9),)
    state = SimpleNamespace(reconstruction=worker, policy_for=lambda s: policies, settings_of=lambda rid, s: s,
                            groups=1, policy_states=[PolicyState()])

    def step(resets: int, salt: str | None = None):
        request = cached_request(context + [9, 10], (blocks,), 20)
        plan = EvictionPlan(None, {"r": settings}, cache_salts={"r": salt} if salt else {}, prefix_cache_resets=resets)
        output = SimpleNamespace(num_scheduled_tokens={"r": c - 20})
        output.__dict__[PLAN_ATTRIBUTE] = plan
        failures = {}
        done = reconstruct_due(SimpleNamespace(requests={"r": request}), state, output, failures)
        assert not failures
        state.policy_states[0].forget(["r"])
        return done

    assert step(0).tokens > 0
    assert step(0).reused == 1 and len(worker.recent.entries) == 1
    assert step(0, salt="tenant").reused == 0 and len(worker.recent.entries) == 2
    again = step(1)  # after a reset: nothing kept from before it is read
    assert again.reused == 0 and again.tokens > 0 and len(worker.recent.entries) == 1
    assert step(1).reused == 1
    worker.forget_before(2)
    assert not worker.recent.entries and worker.recent.held == 0


WINDOW = 12  # past the context's first blocks, shorter than every later pass


@pytest.mark.parametrize("chunk, piece", [(9, 64), (9, 5)], ids=["chunks", "pieces"])
def test_on_a_hybrid_model_the_windows_read_their_last_tokens_and_only_the_global_layers_are_scored(chunk, piece):
    """Layers 0-1 a sliding-window KV cache group (window 12), layers 2-3 the global one (KVzip):
    the scores equal the independent computation whose window layers attend over the last 12
    positions. The window group's blocks before its window hold NaN (vLLM has freed them: a null
    block, ``SlidingWindowManager.remove_skipped_blocks``): were the passes to read them, the scores
    would not be finite. The window group keeps no scores."""
    gen = torch.Generator().manual_seed(chunk + piece)
    prefix, first, later, suffix = 5, [1, 2, 3], [4, 5], [6, 7]
    context = torch.randint(8, VOCAB, (29,), generator=gen).tolist()
    c = len(context)
    model = TinyModel(windows=(WINDOW, WINDOW, None, None))
    blocks = [6, 1, 4, 0]
    caches = [torch.zeros(8, KV_HEADS, BLOCK, 2 * DIM) for _ in range(LAYERS)]
    views = [FlashAttnView(caches[:2]), FlashAttnView(caches[2:])]
    table = torch.tensor(blocks)
    positions = torch.arange(c)
    for layer, (_, k, v) in enumerate(model.whole(context)):
        views[layer // 2].write_layer(layer % 2, table[positions // BLOCK], positions % BLOCK,
                                      k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous())
    freed = (c - WINDOW + 1) // BLOCK  # whole blocks before the first pass query's window: 2
    for cache in caches[:2]:
        cache[blocks[:freed]] = float("nan")
    window_table = [7] * freed + blocks[freed:]  # 7: the null block, NaN too
    for cache in caches[:2]:
        cache[7] = float("nan")

    runner = SimpleNamespace(device=torch.device("cpu"), model=model, vllm_config=None,
                             scheduler_config=SimpleNamespace(max_num_batched_tokens=piece))
    passes = Reconstruction(runner, list(model.attn), [SCALE] * LAYERS, views, [[0, 1], [2, 3]], SINGLE,
                            forward_context=lambda tokens: nullcontext())
    settings = EvictionSettings("kvzip", 16, decode_eviction=False, compress="context", context_tokens=c,
                                reconstruction={"prefix_tokens": prefix, "first": first, "later": later,
                                                "suffix": suffix})
    policies = (make_policy("full", 16, BLOCK), make_policy("kvzip", 16, BLOCK, chunk_size=chunk))
    states = [PolicyState(), PolicyState()]
    passes.run("r", cached_request(context + [9, 10, 11], (window_table, blocks)), settings, policies, states)

    want = torch.zeros(2, KV_HEADS, c)
    for ids, start, end in Repeat(prefix, first, later, suffix, chunk).passes(context):
        assert len(ids) > WINDOW or start == prefix  # the later passes slide past the window
        for layer, (q, k, _) in list(enumerate(model.whole(context + ids)))[2:]:
            want[layer - 2, :, start:end] = kvzip_chunk_scores(q[c:], k, start, end, SCALE)
    want[..., :4] = want.max() + 1
    assert "r" not in states[0].scores
    torch.testing.assert_close(states[1].scores["r"], want, rtol=1e-4, atol=1e-6)
